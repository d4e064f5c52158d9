"""Tests of course_utils.planner: presets, attention as each device runs it, validation against measure_memory (every
setting, the whole optimizer step, and the capstone's fake-tensor step: tests/test_protocol.py), the search, bad
input."""
import dataclasses
import json
import math
import warnings

import pytest
import torch

from course_tools import measure_presets
from course_utils import hardware, models, planner, results

GIB = 1024**3
SMALL_GPT2 = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1024, n_positions=256, bos_token_id=1023, eos_token_id=1023)
TRANSFORMERS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base", "bert-large")
warnings.filterwarnings("ignore", message=".*FakeTensor.*")


# ---------------------------------------------------------------- presets
def test_gpu_presets_carry_what_pytorch_can_allocate_with_its_source():
    # the memory PyTorch can allocate (torch.cuda.get_device_properties(0).total_memory), not the box's size
    assert planner.get_gpu("t4").memory_bytes == round(14.56 * GIB)  # Colab's T4 in 2026: 14.56 GiB, not 15
    assert planner.get_gpu("RTX 3060 (12 GB)").memory_bytes == 11931 * 2**20
    assert planner.get_gpu("A100 (40 GB)").memory_bytes == 42_298_834_944
    for name, gpu in planner.gpu_presets().items():
        assert gpu.memory_bytes < gpu.advertised_bytes, name  # no preset claims more than CUDA gives
        assert gpu.advertised_bytes - gpu.memory_bytes < 1.2 * GIB, name
        assert "total" in gpu.memory_source and "context" in gpu.memory_source, name
        assert 0.1 * GIB < gpu.context_bytes <= hardware.CUDA_CONTEXT_BYTES, name
    assert planner.get_gpu("T4").context_bytes == round(0.13 * 1024) * 2**20  # measured from T4 OOM messages
    assert planner.get_gpu("3060") is planner.gpu_presets()["RTX 3060 (12 GB)"]
    assert planner.get_gpu(6).memory_bytes == 6 * GIB
    assert not planner.get_gpu("T4").bf16 and planner.get_gpu("A100 (40 GB)").bf16
    assert len(planner.gpu_presets()) == 11
    # one PCIe table: the course's, scaled by the efficiency of pinned copies
    t4 = planner.get_gpu("T4")
    assert t4.pcie == "PCIe 3.0 x16"
    assert all(g.pcie in hardware.PCIE_GB_PER_S for g in planner.gpu_presets().values())
    # the time model's copies take the course's one formula: only the link differs between these two cards
    slow, fast = (planner.custom_gpu(12, pcie=link) for link in ("PCIe 3.0 x16", "PCIe 4.0 x16"))
    step = dict(micro_batch=1, size=1024, master_on_cpu=True)
    moved = 2 * planner.get_model("gpt2-xl").n_params * 4   # fp32 gradients down, weights up
    assert (planner.predict("gpt2-xl", slow, **step).step_seconds - planner.predict("gpt2-xl", fast, **step).step_seconds
            == pytest.approx(hardware.pcie_seconds(moved, "PCIe 3.0 x16") - hardware.pcie_seconds(moved, "PCIe 4.0 x16")))


def test_presets_ship_as_package_data():
    from importlib import resources

    assert resources.files("course_utils.planner").joinpath("presets.json").is_file()
    assert set(planner.presets()) >= {"gpus", "models"}


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


@pytest.mark.parametrize("name,fake,kinds,pricings", [
    ("mlp", False, ("fp32", "half"), ("cpu",)),
    ("small-cnn", False, ("fp32",), ("cpu",)),
    ("gpt2-xl", True, ("half",), ("cpu", "cuda-math", "cuda-fused")),
    ("gpt2", True, ("amp",), ("cuda-fused",)),
    ("bert-base", True, ("fp32",), ("cpu", "cuda-fused")),
])
def test_stored_coefficients_match_a_fresh_measurement(name, fake, kinds, pricings):
    fresh = measure_presets.measure_spec_data(name, fake=fake, kinds=kinds, pricings=pricings)
    stored = planner.presets()["models"][name]
    assert fresh["n_params"] == stored["n_params"]
    for pricing in pricings:
        for kind in kinds:
            for key in ("block", "boundary", "largest", "head", "stem", "output"):
                a = torch.tensor(fresh["acts"][pricing][kind][key], dtype=torch.float64).flatten()
                b = torch.tensor(stored["acts"][pricing][kind][key], dtype=torch.float64).flatten()
                assert torch.allclose(a, b, rtol=0.01, atol=1.0), (name, pricing, kind, key, a, b)


def test_the_preset_tool_writes_presets_json_as_it_is():
    from importlib import resources

    text = resources.files("course_utils.planner").joinpath("presets.json").read_text(encoding="utf-8")
    assert measure_presets.dumps(json.loads(text)) + "\n" == text
    assert measure_presets.tidy({"a": [(4016128.0, 0.0), 207188.28125]}) == {"a": [[4016128, 0], 207188.281]}
    with pytest.raises(ValueError, match="Unknown preset"):
        measure_presets.measure_spec_data("gpt5")


# ---------------------------------------------------------------- attention as each device runs it
@pytest.mark.parametrize("name", TRANSFORMERS)
def test_fused_attention_has_no_sequence_squared_term_math_does(name):
    spec = planner.get_model(name)
    for kind in ("fp32", "amp", "half"):
        fused = spec.coeffs("cuda", "fused", kind)
        assert all(q == 0 for _, q in fused.block) and all(q == 0 for _, q in fused.largest), (name, kind)
        for device in ("cuda", "cpu"):
            math_path = spec.coeffs(device, "math", kind)
            assert all(q > 0 for _, q in math_path.block), (name, device, kind)


def test_math_attention_keeps_probabilities_mask_and_dropped_probabilities():
    # bytes per attention element x 25 heads: softmax output + dropout mask + dropped probabilities
    xl = planner.get_model("gpt2-xl")
    heads = models.GPT2_SIZES["gpt2-xl"]["n_head"]
    expected = {("cpu", "fp32"): 4 + 4 + 4,    # the CPU's dropout keeps a float mask
                ("cuda", "fp32"): 4 + 1 + 4,   # CUDA's keeps a bool mask
                ("cuda", "half"): 2 + 1 + 2,
                ("cuda", "amp"): 4 + 1 + 2}    # CUDA autocast runs softmax in fp32
    for (device, kind), per_element in expected.items():
        assert xl.coeffs(device, "math", kind).block[0][1] == heads * per_element, (device, kind)
    # the fused kernel keeps a log-sum-exp per row and head (fp32) beyond what math keeps linearly
    extra = xl.coeffs("cuda", "fused", "fp32").block[0][0] - xl.coeffs("cuda", "math", "fp32").block[0][0]
    assert extra == pytest.approx(4 * heads, abs=1)


def test_gpt2_xl_naive_activations_math_vs_fused_differ_by_the_squared_terms():
    kw = dict(micro_batch=4, size=1024, accumulation=8)
    math_gpu = planner.predict("gpt2-xl", attention="math", **kw)
    fused = planner.predict("gpt2-xl", **kw)  # fused is the default on CUDA
    math_cpu = planner.predict("gpt2-xl", device="cpu", **kw)
    assert fused.settings.attention == "fused" and math_cpu.settings.attention == "math"
    xl = planner.get_model("gpt2-xl")
    squared = {d: xl.n_blocks * 4 * xl.coeffs(d, "math", "fp32").block[0][1] * 1024**2 for d in ("cuda", "cpu")}
    gap = math_gpu.by_category["activations"] - fused.by_category["activations"]
    assert gap == pytest.approx(squared["cuda"], rel=0.01)
    # priced as the CPU runs it: about 56 GiB of the 93 GiB are the T x T tensors
    assert math_cpu.by_category["activations"] / GIB == pytest.approx(93, abs=1)
    assert squared["cpu"] / GIB == pytest.approx(56, abs=1)
    assert fused.by_category["activations"] < 0.4 * math_cpu.by_category["activations"]


def test_a_cpu_runs_math_attention_only():
    with pytest.raises(ValueError, match="math path"):
        planner.predict("gpt2", micro_batch=2, size=64, device="cpu", attention="fused")
    with pytest.raises(ValueError, match="Unknown attention"):
        planner.predict("gpt2", micro_batch=2, attention="flashy")
    assert planner.predict("gpt2", micro_batch=2, attention="fused").settings.attention == "fused"


# ---------------------------------------------------------------- a GPT-2 of your own shape
def test_gpt2_spec_plans_what_it_measured_only():
    # measured against measure_memory for every setting in tests/test_protocol.py
    spec = planner.gpt2_spec("gpt2", kinds=("fp32",), fake=False, **SMALL_GPT2)
    assert spec.n_params == sum(p.numel() for p in models.build_gpt2("gpt2", **SMALL_GPT2).parameters())
    with pytest.raises(ValueError, match="measured for"):
        planner.predict(spec, micro_batch=2, size=64, precision="fp16", device="cpu")
    with pytest.raises(ValueError, match="measured for"):
        planner.predict(spec, micro_batch=2, size=64)  # CUDA was not measured


# ---------------------------------------------------------------- the model's rules
def test_a_verdict_counts_the_allocator_reserve_and_the_cuda_context():
    plan = planner.predict("gpt2-medium", micro_batch=4, size=1024)  # an RTX 3060: compute capability 8.6
    needed = hardware.gpu_bytes_needed(plan.tensor_peak_bytes, (8, 6))
    assert plan.by_category["overhead"] == needed - plan.tensor_peak_bytes and plan.peak_bytes == needed
    # a card that holds the tensors but not the context and reserve: does not fit
    between = (plan.tensor_peak_bytes + plan.peak_bytes) / 2 / GIB
    tight = planner.predict("gpt2-medium", planner.custom_gpu(between), micro_batch=4, size=1024)
    assert tight.tensor_peak_bytes < tight.gpu.memory_bytes and not tight.fits
    assert "does NOT fit" in str(tight)
    assert planner.predict("gpt2-medium", micro_batch=4, size=1024, device="cpu").by_category["overhead"] == 0


def test_techniques_lower_memory_in_the_expected_order():
    kw = dict(micro_batch=4, size=1024, attention="math")
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
    # accumulation keeps the gradients alive during the next forward
    acc = planner.predict("gpt2-medium", accumulation=4, **kw)
    assert acc.peak_bytes >= naive.peak_bytes


def test_stream_grads_keeps_about_one_block_of_gradients():
    base = dict(micro_batch=4, size=1024, accumulation=8, precision="fp16", checkpointing="block", master_on_cpu=True)
    recipe = planner.predict("gpt2-xl", **base)
    streamed = planner.predict("gpt2-xl", stream_grads=True, **base)
    spec = planner.get_model("gpt2-xl")
    one_block = max(max(spec.block_params), spec.largest_tensor) * 2
    assert streamed.by_category["grads"] <= one_block
    # the recipe's accumulated fp16 gradients (2.9 GiB) stay on the GPU through every forward
    assert recipe.tensor_peak_bytes - streamed.tensor_peak_bytes > 2.5 * GIB
    # more PCIe traffic: gradients cross once per micro-batch
    assert streamed.step_seconds > recipe.step_seconds


def test_time_model_checkpointing_costs_one_third_of_compute():
    spec, gpu = planner.get_model("gpt2"), planner.get_gpu("A100 (80 GB)")
    s0 = planner.make_settings(spec, micro_batch=8, size=512, optimizer="sgd")
    s1 = planner.make_settings(spec, micro_batch=8, size=512, optimizer="sgd", checkpointing="block")
    opt = spec.n_params * 8 / (gpu.mem_bandwidth_gbs * 1e9)
    ratio = (planner.step_seconds(spec, gpu, s1) - opt) / (planner.step_seconds(spec, gpu, s0) - opt)
    assert ratio == pytest.approx(4 / 3)


@pytest.mark.parametrize("attention", ["fused", "math"])
def test_cheapest_fit_for_gpt2_xl_on_rtx_3060(attention):
    rec = planner.cheapest_fit("gpt2-xl", "RTX 3060 (12 GB)", micro_batch=4, size=1024, accumulation=8,
                               attention=attention)
    assert not rec.baseline.fits and rec.plan.fits
    assert rec.plan.peak_bytes <= 12 * GIB
    assert rec.plan.settings.attention == attention  # the search keeps how the run executes
    assert all(nb.endswith(".ipynb") and nb[:2].isdigit() for nb in rec.notebooks.values())
    assert rec.plan.settings.micro_batch * rec.plan.settings.accumulation == 32  # effective batch kept
    if attention == "math":  # T x T tensors at 1024 tokens: only checkpointing gets them off the card
        assert any("checkpointing" in t or "offload" in t for t in rec.techniques)


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
    (dict(micro_batch=4, optimizer="shampoo"), "Unknown optimizer"),
    (dict(micro_batch=4, stream_grads=True), "master_on_cpu=True"),
    (dict(micro_batch=4, device="tpu"), "Unknown device 'tpu'"),
    (dict(micro_batch=4, accumulation=4, fused_update=True), "set accumulation=1"),
    (dict(micro_batch=4, master_on_cpu=True, fused_update=True), "stream_grads=True"),
    (dict(micro_batch=4, precision="fp16_amp", fused_update=True), "loss scaling.*fused_update=False"),
    (dict(micro_batch=4, precision="fp16", fused_update=True), "loss scaling.*fused_update=False"),
    (dict(micro_batch=4, stream_weights=True), "master_on_cpu=True"),
    (dict(micro_batch=4, lora_rank=8, master_on_cpu=True), "master_on_cpu=False"),
    (dict(micro_batch=4, lora_rank=0), "lora_rank must be positive"),
])
def test_bad_settings_raise_value_error_saying_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        planner.predict("gpt2", "T4", **kwargs)


def test_toggles_that_need_a_language_model_say_so():
    with pytest.raises(ValueError, match="has none: set chunked_loss=False"):
        planner.predict("mlp", micro_batch=4, chunked_loss=True)
    with pytest.raises(ValueError, match="not a GPT-2"):
        planner.predict("bert-base", micro_batch=4, lora_rank=8)
    with pytest.raises(TypeError, match="offload_activations must be True or False"):
        planner.predict("gpt2", micro_batch=4, offload_activations="yes")


def test_bad_names_and_sizes():
    with pytest.raises(ValueError, match="Unknown model 'gpt5'; choose one of"):
        planner.get_model("gpt5")
    with pytest.raises(ValueError, match="Unknown GPU"):
        planner.get_gpu("RTX 9090")
    with pytest.raises(ValueError, match="memory_gib must be a positive"):
        planner.get_gpu(0)
    with pytest.raises(ValueError, match="Unknown PCIe link"):
        planner.custom_gpu(8, pcie="PCIe 9.0")
    with pytest.raises(ValueError, match="n_params must be positive"):
        planner.custom_model(0, 1e6)
    with pytest.raises(ValueError, match="activation_bytes_per_sample must be a positive"):
        planner.custom_model(1000, -5)
    with pytest.raises(TypeError):
        planner.predict("gpt2", micro_batch=2.5)
    with pytest.raises(TypeError, match="keep_outputs must be True or False"):
        planner.predict("gpt2", micro_batch=2, keep_outputs="yes")
    with pytest.raises(ValueError, match="Unknown GPT-2 size"):
        planner.gpt2_spec("gpt3")
    with pytest.raises(ValueError, match="pass fake=True"):
        measure_presets.measure_spec_data("mlp", fake=False, pricings=("cuda",))


def test_a_budget_nothing_fits_raises_with_what_to_change():
    with pytest.raises(ValueError, match="Nothing fits.*GPU with more memory"):
        planner.cheapest_fit("gpt2-xl", 1, micro_batch=4, size=1024)


def test_custom_model_and_frame():
    spec = planner.custom_model(350_000_000, 20 * 1024**2, n_blocks=24)
    plan = planner.predict(spec, "T4", micro_batch=8)
    assert plan.by_category["params"] == 350_000_000 * 4
    frame = planner.plan_frame({"custom": plan})
    assert list(frame.columns)[:6] == list(planner.CATEGORIES)
    assert math.isclose(frame.loc["custom", "gpu_GiB"], planner.get_gpu("T4").memory_gib)
    with pytest.raises(ValueError, match="plans is empty"):
        planner.plan_frame({})


def test_no_planner_module_is_over_600_lines():
    from pathlib import Path

    folder = Path(planner.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert max(sizes.values()) <= 600, sizes


# ---------------------------------------------------------------- the CPU step, and the cheapest set
def test_cpu_step_uses_the_learners_measurement_when_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RESULTS_DIR", str(tmp_path))
    kw = dict(micro_batch=4, size=1024, precision="fp16", checkpointing="block", master_on_cpu=True)
    for optimizer, name in (("adam", "adamw_fused"), ("adam8bit", "bnb_adam8bit")):
        reference = planner.predict("gpt2-xl", optimizer=optimizer, **kw)
        assert planner.cpu_step_ns(name) == (planner.CPU_STEP_REFERENCE[name],
                                             "reference: 2 cores of the course's CI machine")
        assert any("reference: 2 cores" in note and name in note for note in reference.notes)
    results.record("cpu_bnb8bit_ns_per_param", 3.2, "ns", notebook="08_current_toolbox")
    ns, source = planner.cpu_step_ns("bnb_adam8bit")
    assert ns == 3.2 and "measured on this machine" in source
    measured = planner.predict("gpt2-xl", optimizer="adam8bit", **kw)
    assert any("measured on this machine" in note for note in measured.notes)
    n = planner.get_model("gpt2-xl").n_params
    monkeypatch.setenv("COURSE_RESULTS_DIR", str(tmp_path / "nothing recorded"))
    back = planner.predict("gpt2-xl", optimizer="adam8bit", **kw)
    bnb_ns = planner.CPU_STEP_REFERENCE["bnb_adam8bit"]
    assert measured.step_seconds - back.step_seconds == pytest.approx(n * (3.2 - bnb_ns) * 1e-9)


def test_toggles_change_the_time_model():
    kw = dict(micro_batch=4, size=1024, precision="bf16", checkpointing="block", master_on_cpu=True)
    base = planner.predict("gpt2-xl", "RTX 3060 (12 GB)", **kw)
    chunked = planner.predict("gpt2-xl", "RTX 3060 (12 GB)", chunked_loss=True, **kw)
    spec, gpu = base.model, base.gpu
    head = 2 * spec.output_per_unit * spec.hidden_size * 4 * 1024 / (gpu.half_tflops * 1e12 * planner.model.MFU)
    assert chunked.step_seconds - base.step_seconds == pytest.approx(head)  # one more head matmul
    assert spec.hidden_size == 1600
    # copies beside compute: hidden while compute is longer; on a slow link they show
    streamed = planner.predict("gpt2-xl", "RTX 3060 (12 GB)", stream_weights=True, **kw)
    assert streamed.step_seconds == pytest.approx(base.step_seconds)
    slow = planner.custom_gpu(12, pcie="PCIe 3.0 x16", half_tflops=400.0)
    assert planner.predict("gpt2-xl", slow, stream_weights=True, **kw).step_seconds > planner.predict(
        "gpt2-xl", slow, **kw).step_seconds
    full, lora = (planner.predict("gpt2-xl", micro_batch=4, size=1024, **k) for k in ({}, dict(lora_rank=8)))
    assert lora.step_seconds < 0.7 * full.step_seconds  # no weight gradients: 4/6 of the FLOPs


GPT2_XL_SMALL_CARDS = {}


@pytest.mark.parametrize("gib", [2, 4, 6])
def test_cheapest_set_for_gpt2_xl_on_small_cards(gib):
    rec = planner.cheapest_fit("gpt2-xl", gib, micro_batch=4, size=1024, host_gib=math.inf)
    GPT2_XL_SMALL_CARDS[gib] = rec
    print(f"{gib} GiB: {rec.techniques}, {rec.plan.peak_bytes / GIB:.2f} GiB, {rec.plan.step_seconds:.2f} s")
    assert rec.plan.fits and rec.plan.peak_bytes == hardware.gpu_bytes_needed(rec.plan.tensor_peak_bytes)
    assert rec.plan.settings.micro_batch * rec.plan.settings.accumulation == 4
    # on every one of these cards the weights cannot all stay on the GPU with their gradients
    assert "stream weights from CPU" in rec.techniques
    if gib == 2:
        assert rec.plan.peak_bytes <= 2 * GIB
    # the host holds what left the card: the fp32 master weights and Adam state, the streamed weights, offloads
    assert rec.plan.host_bytes >= 16 * planner.get_model("gpt2-xl").n_params
    assert any("host RAM" in note for note in rec.plan.notes)
    with pytest.raises(ValueError, match="Nothing fits"):
        planner.cheapest_fit("gpt2-xl", 0.5, micro_batch=4, size=1024, host_gib=math.inf)


def test_the_search_never_fuses_the_update_with_fp16s_loss_scaling():
    from course_utils.planner.search import candidate_settings

    spec, t4 = planner.get_model("gpt2-xl"), planner.get_gpu("T4")   # no bf16: every half plan is fp16
    tried = list(candidate_settings(planner.make_settings(spec, micro_batch=4, size=1024), t4, spec))
    assert any(s.fused_update for s in tried) and any(s.precision.startswith("fp16") for s in tried)
    assert not [s for s in tried if s.fused_update and s.precision.startswith("fp16")]


def test_cheapest_fit_within_a_host_ram_budget():
    free = planner.cheapest_fit("gpt2-xl", 2, micro_batch=4, size=1024, host_gib=math.inf)
    within = planner.cheapest_fit("gpt2-xl", 2, micro_batch=4, size=1024, host_gib=32)
    assert free.plan.host_bytes > 32 * GIB >= within.plan.host_bytes and within.plan.fits
    # when the card could hold a plan but the host cannot, the message names host RAM, not the card
    with pytest.raises(ValueError, match=r"Nothing fits in 1.0 GiB of host RAM.*fits only with the host holding"):
        planner.cheapest_fit("gpt2-xl", 2, micro_batch=4, size=1024, host_gib=1)
    assert within.plan.step_seconds >= free.plan.step_seconds
    with pytest.raises(ValueError, match="allow more host RAM than 8.0 GiB"):
        planner.cheapest_fit("gpt2-xl", 2, micro_batch=4, size=1024, host_gib=8)
    with pytest.raises(ValueError, match="host_gib must be a positive"):
        planner.cheapest_fit("gpt2-xl", 2, micro_batch=4, size=1024, host_gib=-1)


def test_the_overhead_counts_cublas_workspaces_of_the_gpu_planned_for():
    settings = dict(micro_batch=2, size=512)
    t4, h100 = planner.predict("gpt2", "T4", **settings), planner.predict("gpt2", "H100 (80 GB)", **settings)
    assert t4.tensor_peak_bytes == h100.tensor_peak_bytes
    assert t4.by_category["overhead"] == hardware.gpu_bytes_needed(
        t4.tensor_peak_bytes, (7, 5), t4.gpu.context_bytes) - t4.tensor_peak_bytes
    # cuBLAS keeps 32 MiB per handle from compute capability 9.0, 8 MiB + 128 KiB before: 2 handles; each card its context
    assert h100.by_category["overhead"] - t4.by_category["overhead"] == 2 * (32 * 2**20 - (8 * 2**20 + 128 * 2**10)) + (
        h100.gpu.context_bytes - t4.gpu.context_bytes)
    assert t4.overhead_parts["workspaces"] == hardware.cublas_workspace_bytes((7, 5))
    assert t4.overhead_parts["context"] == t4.gpu.context_bytes
    assert sum(t4.overhead_parts.values()) == t4.by_category["overhead"]
    assert planner.custom_gpu(6, compute_capability=(8, 6)).compute_capability == (8, 6)
    with pytest.raises((TypeError, ValueError)):
        planner.custom_gpu(6, compute_capability=(8,))


# ---------------------------------------------------------------- notebook 10's optimizers as settings
XL_PURE_BF16 = dict(micro_batch=4, size=1024, checkpointing="block", precision="bf16")


def test_notebook_10s_optimizers_price_their_state_for_gpt2_xl():
    n = planner.get_model("gpt2-xl").n_params
    state = {o: planner.predict("gpt2-xl", optimizer=o, **XL_PURE_BF16).by_category["optimizer"]
             for o in ("adam", *planner.BEYOND_ADAM)}
    master = 4 * n  # pure bf16 weights step an fp32 master copy, except with stochastic rounding
    assert state["adam"] == pytest.approx(master + 8 * n, rel=1e-3)
    assert state["lion"] - master == state["adamw_bf16_sr"] == 4 * n  # m in fp32; m and v in bf16, no master
    assert (state["adam_mini"] - master) / n == pytest.approx(4.0, abs=0.01)  # m + one v per row or tensor
    assert (state["adafactor"] - master) / n < 0.01  # a row and a column mean per matrix
    assert 2 < (state["galore"] - master) / n < 4 and 2 < (state["apollo"] - master) / n < (state["galore"] - master) / n
    rec = planner.predict("gpt2-xl", optimizer="adamw_bf16_sr", **XL_PURE_BF16)
    assert "pure bf16 weights, no master copy" in rec.settings.techniques()
    assert "bf16 AdamW with stochastic rounding" in rec.settings.techniques()


@pytest.mark.parametrize("knobs, match", [
    (dict(optimizer="adamw_bf16_sr"), "precision='bf16'"),  # fp32 weights: nothing to round stochastically
    (dict(optimizer="adamw_bf16_sr", precision="bf16", master_on_cpu=True), "no fp32 master"),
    (dict(optimizer="galore", lora_rank=8), "full fine-tuning"),
    (dict(optimizer="shampoo"), "adafactor"),  # the message lists notebook 10's optimizers too
])
def test_notebook_10s_optimizers_refuse_what_they_cannot_price(knobs, match):
    with pytest.raises(ValueError, match=match):
        planner.predict("gpt2", micro_batch=2, **knobs)
    with pytest.raises(ValueError, match="transformers"):
        planner.predict("small-cnn", micro_batch=2, optimizer="lion")


def test_cheapest_fit_chooses_notebook_10s_optimizers_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RESULTS_DIR", str(tmp_path))
    kw = dict(micro_batch=8, size=1024, host_gib=16)
    usual = planner.cheapest_fit("gpt2-xl", "RTX 3060 (12 GB)", **kw)
    wider = planner.cheapest_fit("gpt2-xl", "RTX 3060 (12 GB)", optimizers=("adam8bit", *planner.BEYOND_ADAM), **kw)
    assert usual.plan.settings.optimizer in ("adam", "adam8bit")  # the default search is 02-09's
    assert wider.plan.settings.optimizer in planner.BEYOND_ADAM and wider.plan.fits
    assert wider.plan.step_seconds < usual.plan.step_seconds
    assert "notebooks/10_beyond_adam.ipynb" in str(wider)
    with pytest.raises(ValueError, match="optimizers must be a tuple"):
        planner.cheapest_fit("gpt2-xl", "RTX 3060 (12 GB)", optimizers=("sophia",), **kw)
    # the CPU step of notebook 10's optimizers: its reference, until notebook 10 records the learner's own
    host = dict(XL_PURE_BF16, master_on_cpu=True, optimizer="lion")
    assert planner.cpu_step_ns("lion")[0] == planner.CPU_STEP_REFERENCE["lion"]
    results.record("cpu_lion_ns_per_param", 123.0, "ns", notebook="10_beyond_adam")
    ns, source = planner.cpu_step_ns("lion")
    assert ns == 123.0 and "measured on this machine by notebook 10_beyond_adam" in source
    assert any("lion, 123.00 ns/parameter" in note for note in planner.predict("gpt2-xl", **host).notes)


# ---------------------------------------------------------------- held to the world: ranges, verdicts, counters, host
def test_a_plan_carries_a_range_and_fits_only_when_its_high_end_fits():
    low_frac, high_frac = planner.plan_spread()
    assert low_frac < 0 < high_frac
    plan = planner.predict("gpt2-xl", "RTX 3060 (12 GB)", micro_batch=4, size=1024, precision="bf16",
                           checkpointing="block", master_on_cpu=True)
    low, expected, high = plan.range_bytes
    assert low < expected == plan.peak_bytes < high and high == round(expected * (1 + high_frac))
    # a card between the expected peak and the high end: tight, not fitting, and the text says by how much
    tight = dataclasses.replace(plan.gpu, memory_bytes=(expected + high) // 2)
    plan = planner.predict("gpt2-xl", tight, micro_batch=4, size=1024, precision="bf16", checkpointing="block",
                           master_on_cpu=True)
    assert plan.verdict == "tight" and not plan.fits and "TIGHT (the high end is" in str(plan)
    roomy = dataclasses.replace(plan.gpu, memory_bytes=high + 1)
    assert planner.predict("gpt2-xl", roomy, micro_batch=4, size=1024, precision="bf16", checkpointing="block",
                           master_on_cpu=True).verdict == "fits"
    assert planner.predict("gpt2-xl", 2, micro_batch=4, size=1024).verdict == "does not fit"


def test_a_plan_says_what_each_counter_would_show():
    plan = planner.predict("llama-3.2-3b", "A100 (80 GB)", micro_batch=2, size=1024, precision="bf16",
                           master_weights=False)
    f = plan.figures
    assert f["max_memory_allocated"] == plan.tensor_peak_bytes + hardware.cublas_workspace_bytes((8, 0))
    assert f["max_memory_reserved"] == f["max_memory_allocated"] + plan.overhead_parts["reserve"]
    assert f["nvidia-smi"] == f["max_memory_reserved"] + plan.gpu.context_bytes == plan.peak_bytes
    assert "max_memory_reserved" in str(plan) and "host RAM it needs: 0.0 GiB" in str(plan)
    assert set(planner.predict("gpt2", device="cpu", micro_batch=1).figures) == {"max_memory_allocated"}


def test_pure_16_bit_without_a_master_keeps_the_state_in_16_bits():
    n = planner.get_model("llama-3.2-3b").n_params
    kw = dict(micro_batch=1, size=256, precision="bf16")
    master, bare = (planner.predict("llama-3.2-3b", "A100 (80 GB)", master_weights=m, **kw) for m in (True, False))
    assert master.by_category["optimizer"] == pytest.approx(12 * n, rel=1e-3)  # fp32 master + fp32 m and v
    assert bare.by_category["optimizer"] == pytest.approx(4 * n, rel=1e-3)  # bf16 m and v, no master
    assert "pure bf16 weights, no master copy" in bare.settings.techniques()
    with pytest.raises(ValueError, match="precision='bf16' or 'fp16'"):
        planner.predict("gpt2", micro_batch=1, master_weights=False)
    with pytest.raises(ValueError, match="master_on_cpu"):
        planner.predict("gpt2", micro_batch=1, precision="bf16", master_weights=False, master_on_cpu=True)


def test_a_paged_optimizers_state_is_outside_the_allocator():
    n = planner.get_model("llama-2-7b").n_params
    kw = dict(micro_batch=2, size=512, precision="bf16", master_weights=False, checkpointing="block")
    plain = planner.predict("llama-2-7b", "A100 (80 GB)", optimizer="adam8bit", **kw)
    paged = planner.predict("llama-2-7b", "A100 (80 GB)", optimizer="adam8bit", paged_optimizer=True, **kw)
    # bitsandbytes pages m and v of every tensor of 100,000 values or more; their absmax stay ordinary tensors
    sizes = planner.model.tensor_sizes(paged.model)
    assert paged.paged_bytes == 2 * sum(x for x in sizes if x >= 100_000) > 1.9 * n
    assert plain.by_category["optimizer"] - paged.by_category["optimizer"] == paged.paged_bytes
    assert paged.figures["max_memory_allocated"] == plain.figures["max_memory_allocated"] - paged.paged_bytes
    assert paged.figures["nvidia-smi"] == paged.peak_bytes + paged.paged_bytes  # the card holds it all here
    # on a card too small for the state beside the rest, it pages to the host and back each step
    kw.update(micro_batch=1, size=256, fused_update=True)  # torchtune's low-memory recipe: the step in backward
    small = planner.predict("llama-2-7b", "RTX 4090 (24 GB)", optimizer="adamw", paged_optimizer=True, **kw)
    assert small.paged_bytes == 8 * sum(x for x in sizes if x >= 100_000)  # 32-bit state: fp32 m and v
    assert small.host_bytes > 0 and any("pages to the host" in note for note in small.notes)
    assert small.figures["nvidia-smi"] <= small.gpu.memory_bytes
    assert small.step_seconds > planner.predict("llama-2-7b", "A100 (80 GB)", optimizer="adamw",
                                                paged_optimizer=True, **kw).step_seconds
    with pytest.raises(ValueError, match="CUDA unified memory"):
        planner.predict("llama-2-7b", micro_batch=1, precision="bf16", master_weights=False, paged_optimizer=True,
                        device="cpu", attention="math")
    with pytest.raises(ValueError, match="PagedAdamW"):
        planner.predict("gpt2", micro_batch=1, optimizer="sgd", paged_optimizer=True)


def test_adapters_say_what_to_change():
    with pytest.raises(ValueError, match="adapter_dtype"):
        planner.predict("llama-3.2-1b", micro_batch=1, lora_rank=8, adapter_dtype="int8")
    with pytest.raises(ValueError, match="lora_dropout is a probability"):
        planner.predict("llama-3.2-1b", micro_batch=1, lora_rank=8, lora_dropout=1.5)
    with pytest.raises(ValueError, match="set lora_rank too"):
        planner.predict("llama-3.2-1b", micro_batch=1, adapter_dtype="bf16")
    with pytest.raises(ValueError, match="carries no transformers config"):
        planner.predict("gpt2", micro_batch=1, lora_rank=8, adapter_dtype="bf16")


def test_lora_targets_change_the_activations_not_only_the_adapters():
    kw = dict(micro_batch=4, size=768, precision="bf16", lora_rank=8)
    every = planner.predict("llama-3.2-3b", "L40S", **kw)
    qv = planner.predict("llama-3.2-3b", "L40S", lora_targets=("q_proj", "v_proj"), **kw)
    # q and v alone: no fp32 copy of the inputs of k, o and the MLP's three; about 6.5 GiB less at 4 x 768
    saved = (every.by_category["activations"] - qv.by_category["activations"]) / GIB
    assert 5.5 < saved < 7.5, saved


def test_host_ram_defaults_to_this_machine_and_colab_is_named():
    assert hardware.host_ram_bytes() > 0
    assert planner.search.host_limit_bytes() == hardware.host_ram_bytes()
    assert planner.search.host_limit_bytes(math.inf) == math.inf
    assert hardware.COLAB_HOST_BYTES / GIB == pytest.approx(12.68, abs=0.01)  # Colab's "12.7 GB"
    with pytest.raises(ValueError, match="host_gib"):
        planner.search.host_limit_bytes(0)


def test_the_search_weighs_micro_batches_of_1_and_2():
    from course_utils.planner.search import candidate_settings

    spec = planner.get_model("llama-3.1-8b")
    tried = list(candidate_settings(planner.make_settings(spec, micro_batch=6, size=1024, lora_rank=16), planner.get_gpu(
        "T4"), spec))
    assert {s.micro_batch for s in tried} == {1, 2, 3, 6}
    assert {(s.micro_batch, s.accumulation) for s in tried} >= {(1, 6), (2, 3)}


def test_a_card_without_flash_runs_grouped_query_attention_in_the_math_kernel():
    """A T4 (compute capability 7.5) has no flash attention, and the memory-efficient kernel takes no grouped key/value
    heads: SDPA falls back to its math kernel, which keeps T x T probabilities. Models with as many key/value heads
    as query heads (Llama 2, GPT-2) keep the memory-efficient kernel there."""
    kw = dict(micro_batch=1, size=1024, precision="fp16", lora_rank=16, quantize_base="nf4")
    from course_utils.planner.model import attention_kernel

    for model, kernel in (("llama-3.1-8b", "math"), ("llama-2-7b", "fused"), ("gpt2-xl", "fused")):
        spec = planner.get_model(model)
        knobs = kw if spec.linears else dict(micro_batch=1, size=1024, precision="fp16")
        s = planner.make_settings(spec, **knobs)
        assert attention_kernel(spec, planner.get_gpu("T4"), s) == kernel, model
        assert attention_kernel(spec, planner.get_gpu("A100 (40 GB)"), s) == "fused", model
    t4, a100 = (planner.predict("llama-3.1-8b", g, **kw) for g in ("T4", "A100 (40 GB)"))
    assert t4.by_category["activations"] > 1.3 * a100.by_category["activations"]
    assert "math kernel" in t4.notes[0] and "flash" in a100.notes[0]
    assert planner.get_model("llama-3.1-8b").grouped_query and not planner.get_model("llama-2-7b").grouped_query


def test_a_card_without_flash_keeps_what_flash_keeps_in_the_memory_efficient_kernel():
    """A T4 (compute capability 7.5) runs SDPA's memory-efficient kernel where an A100 runs flash: 'fused' prices
    both, because their outputs for backward are the same bytes (the logsumexp padded to 32 tokens)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode():
        for tokens in (1024, 1000):
            q = torch.empty(2, 4, tokens, 64, dtype=torch.float16, requires_grad=True)
            flash = aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True, False)[:2]
            efficient = aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True)[:2]
            nbytes = [sum(t.numel() * t.element_size() for t in out) for out in (flash, efficient)]
            padding = 2 * 4 * (-tokens % 32) * 4   # B x H x the tokens to the next multiple of 32, fp32
            assert nbytes[1] - nbytes[0] == padding, (tokens, nbytes)
