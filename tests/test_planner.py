"""Tests of course_utils.planner: presets, validation against measure_memory, the search, bad input."""
import math
import warnings

import pytest
import torch

from course_utils import memory, models, planner

GIB = 1024**3
SMALL_GPT2 = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1024, n_positions=256, bos_token_id=1023, eos_token_id=1023)
warnings.filterwarnings("ignore", message=".*FakeTensor.*")


# ---------------------------------------------------------------- presets
def test_gpu_presets_memory_and_aliases():
    assert planner.get_gpu("RTX 3060 (12 GB)").memory_bytes == 12 * GIB
    assert planner.get_gpu("3060") is planner.GPU_PRESETS["RTX 3060 (12 GB)"]
    assert planner.get_gpu("t4").memory_bytes == 15 * GIB
    assert planner.get_gpu("GTX 1080 Ti (11 GB)").memory_bytes == 11 * GIB
    assert planner.get_gpu("A100 (80 GB)").memory_bytes == 80 * GIB
    assert planner.get_gpu(6).memory_bytes == 6 * GIB
    assert not planner.get_gpu("T4").bf16 and planner.get_gpu("A100 (40 GB)").bf16
    assert len(planner.GPU_PRESETS) == 8


def test_model_presets_have_the_real_parameter_counts():
    assert planner.get_model("gpt2-xl").n_params == models.GPT2_XL_PARAMS == 1_557_611_200
    assert planner.get_model("gpt2").n_params == 124_439_808
    assert 105e6 < planner.get_model("bert-base").n_params < 115e6
    assert 330e6 < planner.get_model("bert-large").n_params < 345e6
    assert planner.get_model("mlp").n_params == sum(p.numel() for p in models.mlp().parameters())
    assert planner.get_model("small-cnn").n_params == sum(p.numel() for p in planner.small_cnn().parameters())
    assert planner.get_model("efficientnet_b0").n_params == 5_288_548
    assert planner.get_model("gpt2-xl").n_blocks == 48
    assert set(planner.model_presets()) >= {"mlp", "small-cnn", "efficientnet_b0", "bert-base", "bert-large",
                                            "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}


@pytest.mark.parametrize("name,fake,kinds", [
    ("mlp", False, ("fp32", "half")),
    ("small-cnn", False, ("fp32",)),
    ("gpt2-xl", True, ("half",)),
    ("bert-base", True, ("fp32",)),
])
def test_cached_coefficients_match_a_fresh_measurement(name, fake, kinds):
    fresh = planner.measure_spec_data(name, fake=fake, kinds=kinds)
    cached = planner._PRESET_DATA[name]
    assert fresh["n_params"] == cached["n_params"]
    for kind in kinds:
        for key in ("block", "boundary", "largest", "head"):
            a = torch.tensor(fresh["acts"][kind][key], dtype=torch.float64).flatten()
            b = torch.tensor(cached["acts"][kind][key], dtype=torch.float64).flatten()
            assert torch.allclose(a, b, rtol=0.01, atol=1.0), (name, kind, key, a, b)


# ---------------------------------------------------------------- validation against measurement
@pytest.mark.parametrize("name,batch", [("mlp", 32), ("mlp", 256), ("small-cnn", 16), ("small-cnn", 64)])
def test_prediction_within_10_percent_of_measure_memory(name, batch):
    measured = planner.measure_on_cpu(name, micro_batch=batch)
    predicted = planner.predict(name, micro_batch=batch, device="cpu")
    error = abs(predicted.tensor_peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert error <= 0.10, (name, batch, predicted.by_category, measured.by_category)


def test_small_gpt2_within_10_percent_at_two_batch_sizes():
    spec = planner.gpt2_spec("gpt2", kinds=("fp32",), fake=False, **SMALL_GPT2)
    assert spec.n_params == sum(p.numel() for p in models.build_gpt2("gpt2", **SMALL_GPT2).parameters())
    for batch, seq in ((2, 64), (8, 64)):
        measured = planner.measure_on_cpu("gpt2", micro_batch=batch, size=seq, gpt2_overrides=SMALL_GPT2)
        predicted = planner.predict(spec, micro_batch=batch, size=seq, device="cpu")
        error = abs(predicted.tensor_peak_bytes - measured.peak_bytes) / measured.peak_bytes
        assert error <= 0.10, (batch, seq, predicted.by_category, measured.by_category)
    with pytest.raises(ValueError, match="measured for"):
        planner.predict(spec, micro_batch=2, size=64, precision="fp16")


CAPSTONE = dict(micro_batch=4, size=1024, precision="fp16", checkpointing="block", optimizer="adam8bit",
                master_on_cpu=True, device="cpu")


def test_gpt2_xl_capstone_recipe_matches_the_fake_tensor_measurement():
    # COURSE_DESIGN.md: fake GPT-2-XL, fp16, checkpointing, 4 x 1024 tokens, forward+backward
    # measured about 7.9 GiB (params 2.9, grads 2.7, activations 1.7, temp 0.6).
    plan = planner.predict("gpt2-xl", **CAPSTONE)
    assert abs(plan.tensor_peak_bytes / GIB - 7.9) / 7.9 <= 0.10
    assert abs(plan.by_category["params"] / GIB - 2.9) <= 0.05
    assert abs(plan.by_category["grads"] / GIB - 2.7) / 2.7 <= 0.10
    assert plan.by_category["optimizer"] == 0  # 8-bit Adam and the fp32 master weights live on the CPU


def test_capstone_recipe_on_a_fake_gpt2_medium_within_10_percent():
    # Same recipe, same code path, real medium widths and vocabulary; two blocks keep the test fast.
    spec = planner.gpt2_spec("gpt2-medium", kinds=("half",), n_layer=2)
    with models.fake_mode():
        model = models.build_gpt2("gpt2-medium", dtype=torch.float16, n_layer=2)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()

        def step():
            x = torch.randint(0, 50257, (4, 1024))
            outputs = model(input_ids=x, labels=x)  # the usual loop: outputs (logits) live through backward
            outputs.loss.backward()

        report = memory.measure_memory(step, model=model)
    plan = planner.predict(spec, **CAPSTONE)
    assert report.fake
    assert abs(plan.tensor_peak_bytes - report.peak_bytes) / report.peak_bytes <= 0.10, (plan.by_category,
                                                                                        report.by_category)


# ---------------------------------------------------------------- the model's rules
def test_techniques_lower_memory_in_the_expected_order():
    kw = dict(micro_batch=4, size=1024)
    naive = planner.predict("gpt2-medium", **kw)
    ckpt = planner.predict("gpt2-medium", checkpointing="block", **kw)
    sqrt = planner.predict("gpt2-medium", checkpointing="sqrt", **kw)
    amp = planner.predict("gpt2-medium", precision="bf16_amp", **kw)
    eight = planner.predict("gpt2-medium", optimizer="adam8bit", **kw)
    assert ckpt.by_category["activations"] < sqrt.by_category["activations"] < naive.by_category["activations"]
    assert amp.by_category["activations"] < naive.by_category["activations"]
    n = naive.model.n_params
    assert naive.by_category["optimizer"] == 8 * n  # Adam: m and v in fp32
    assert abs(eight.by_category["optimizer"] - 2 * n) / (2 * n) < 0.02  # 8-bit: 2 bytes + absmax
    assert naive.by_category["overhead"] == pytest.approx(
        planner.CUDA_CONTEXT_BYTES + planner.ALLOCATOR_OVERHEAD * naive.tensor_peak_bytes, abs=1)
    # accumulation keeps the gradients alive during the next forward
    acc = planner.predict("gpt2-medium", accumulation=4, **kw)
    assert acc.peak_bytes >= naive.peak_bytes


def test_stream_grads_keeps_about_one_block_of_gradients():
    base = dict(micro_batch=4, size=1024, precision="fp16", checkpointing="block", master_on_cpu=True)
    recipe = planner.predict("gpt2-xl", **base)
    streamed = planner.predict("gpt2-xl", stream_grads=True, **base)
    spec = planner.get_model("gpt2-xl")
    one_block = max(max(spec.block_params), spec.largest_tensor) * 2
    assert streamed.by_category["grads"] <= one_block
    assert recipe.tensor_peak_bytes - streamed.tensor_peak_bytes > 1.5 * GIB
    # more PCIe traffic: gradients cross once per micro-batch
    s1 = planner.predict("gpt2-xl", accumulation=8, **base).step_seconds
    s2 = planner.predict("gpt2-xl", accumulation=8, stream_grads=True, **base).step_seconds
    assert s2 > s1


def test_time_model_checkpointing_costs_one_third_of_compute():
    spec, gpu = planner.get_model("gpt2"), planner.get_gpu("A100 (80 GB)")
    s0 = planner.make_settings(spec, micro_batch=8, size=512, optimizer="sgd")
    s1 = planner.make_settings(spec, micro_batch=8, size=512, optimizer="sgd", checkpointing="block")
    opt = spec.n_params * 8 / (gpu.mem_bandwidth_gbs * 1e9)
    ratio = (planner.step_seconds(spec, gpu, s1) - opt) / (planner.step_seconds(spec, gpu, s0) - opt)
    assert ratio == pytest.approx(4 / 3)


def test_cheapest_fit_for_gpt2_xl_on_rtx_3060():
    rec = planner.cheapest_fit("gpt2-xl", "RTX 3060 (12 GB)", micro_batch=4, size=1024, accumulation=8)
    assert not rec.baseline.fits and rec.plan.fits
    assert rec.plan.peak_bytes <= 12 * GIB
    assert any("checkpointing" in t for t in rec.techniques)
    assert all(nb.endswith(".ipynb") and nb[:2].isdigit() for nb in rec.notebooks.values())
    assert rec.plan.settings.micro_batch * rec.plan.settings.accumulation == 32  # effective batch kept


def test_cheapest_fit_returns_nothing_when_it_already_fits():
    rec = planner.cheapest_fit("mlp", "T4", micro_batch=64)
    assert rec.techniques == [] and rec.plan.fits


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(micro_batch=0), "micro_batch must be positive"),
    (dict(micro_batch=-3), "micro_batch must be positive"),
    (dict(micro_batch=4, size=0), "sequence length must be positive"),
    (dict(micro_batch=4, size=4096), "at most 1024 tokens"),
    (dict(micro_batch=4, accumulation=0), "accumulation must be positive"),
    (dict(micro_batch=4, precision="fp8"), "Unknown precision"),
    (dict(micro_batch=4, checkpointing="half"), "Unknown checkpointing"),
    (dict(micro_batch=4, optimizer="lion"), "Unknown optimizer"),
    (dict(micro_batch=4, stream_grads=True), "master_on_cpu=True"),
])
def test_bad_settings_raise_value_error_saying_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        planner.predict("gpt2", "T4", **kwargs)


def test_bad_names_and_sizes():
    with pytest.raises(ValueError, match="Unknown model 'gpt5'; choose one of"):
        planner.get_model("gpt5")
    with pytest.raises(ValueError, match="Unknown GPU"):
        planner.get_gpu("RTX 9090")
    with pytest.raises(ValueError, match="memory_gib must be a positive"):
        planner.get_gpu(0)
    with pytest.raises(ValueError, match="n_params must be positive"):
        planner.custom_model(0, 1e6)
    with pytest.raises(ValueError, match="activation_bytes_per_sample must be a positive"):
        planner.custom_model(1000, -5)
    with pytest.raises(TypeError):
        planner.predict("gpt2", micro_batch=2.5)
    with pytest.raises(ValueError, match="Unknown GPT-2 size"):
        planner.gpt2_spec("gpt3")
    with pytest.raises(ValueError, match="too big to train on a CPU"):
        planner.measure_on_cpu("gpt2-xl", micro_batch=1)


def test_a_budget_nothing_fits_raises_with_what_to_change():
    with pytest.raises(ValueError, match="Nothing fits.*GPU with more memory"):
        planner.cheapest_fit("gpt2-xl", 1, micro_batch=4, size=1024)


def test_custom_model_and_frame():
    spec = planner.custom_model(350_000_000, 20 * 1024**2, n_blocks=24)
    plan = planner.predict(spec, "T4", micro_batch=8)
    assert plan.by_category["params"] == 350_000_000 * 4
    frame = planner.plan_frame({"custom": plan})
    assert list(frame.columns)[:6] == list(planner.CATEGORIES)
    assert math.isclose(frame.loc["custom", "gpu_GiB"], 15.0)
    with pytest.raises(ValueError, match="plans is empty"):
        planner.plan_frame({})
