"""The planner for today's open LLMs: the shipped configs (parameter counts as published), predictions in seconds, and
for a tiny twin of each family (Llama, Qwen2, Mistral, Gemma-2, Phi-3: 2 layers, width 64) the whole optimizer step
(second step, 2 micro-batches) three ways, as tests/test_protocol.py does for GPT-2: ``planner.predict(hf_spec(cfg),
device='cpu')``, the same step on fake tensors, and ``memory.measure_memory`` of the real step. Full fine-tuning
(AdamW), LoRA (peft, rank 8, all linear layers) and QLoRA (peft on bitsandbytes' NF4 layers, on the CPU) agree within
5%, and the prediction without the setting does not.
"""
import contextlib
import functools
import math
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_utils import memory, models, planner
from course_utils.planner import llm
from course_utils.planner.adapters import nf4_bytes
from test_protocol import (ROWS, Host, make_update, offload_hooks, print_the_table,  # noqa: F401 (the table)
                           whole_step, with_master)

TOLERANCE = 0.05
pytestmark = [pytest.mark.filterwarnings("ignore:.*FakeTensor.*"),
              pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, max_position_embeddings=256, use_cache=False)


def twin(family):
    """A 2-layer, width-64 config of each family, as its large models are shaped (tied or not, biases, head_dim)."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    return {"llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
            "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
            "mistral": lambda: MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=None),
            "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, tie_word_embeddings=True, sliding_window=16),
            "phi3": lambda: Phi3Config(**dict(TINY, num_key_value_heads=4), tie_word_embeddings=False,
                                       pad_token_id=0)}[family]()


FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "phi3")
STEP = dict(micro_batch=4, size=32, accumulation=2)


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a rank-r update, as peft computes it (``base(x) + B(A(x)) * alpha / r``): peft itself
    is not built on fake tensors."""

    def __init__(self, base, rank, alpha=16):
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), alpha / rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def to_nf4(net, double):
    """The blocks' linear layers as bitsandbytes' Linear4bit (NF4, computing in the weights' dtype), as transformers'
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')`` makes them; the quantization state (absmax,
    code maps), which lives outside the parameters, returned as frozen parameters to count with the weights."""
    import bitsandbytes as bnb

    def quantize(linear):
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=linear.weight.dtype, quant_type="nf4", compress_statistics=double)
        q.load_state_dict(linear.state_dict())
        return q.to("cpu")  # .to() quantizes
    llm.replace_linears(net, quantize)
    state = nn.ParameterList()
    for m in net.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            extra = (qs.offset, qs.state2.absmax, qs.state2.code) if qs.nested else ()
            state.extend(nn.Parameter(t, requires_grad=False) for t in (qs.absmax, qs.code, *extra))
    return state


def llm_step(host, *, config, micro_batch, size, accumulation=1, precision="fp32", optimizer="adam",
             checkpointing="none", lora_rank=None, quantize_base=None, peft=True, master_on_cpu=False,
             stream_grads=False, fused_update=False, offload_activations=False, chunked_loss=False,
             lora_targets=None, adapter_dtype="fp32", lora_dropout=0.0, master_weights=True, set_to_none=True,
             keep_outputs=True):
    """The whole optimizer step of a tiny transformers causal LM: ``(step, model, optimizer)``; LoRA by peft (the
    blocks' linear layers in ``lora_targets``, all by default; fp32 adapters as peft makes them over 16-bit weights,
    or in the weights' dtype for ``adapter_dtype='bf16'``; ``lora_dropout``) or, on fake tensors, by
    :class:`LoRALinear`; QLoRA on bitsandbytes' NF4 layers."""
    torch.manual_seed(0)
    # a CPU computes in bf16: fp16's bytes
    net = llm.build_causal_lm(config, attention="math", n_layers=None,
                              dtype=torch.bfloat16 if precision in ("fp16", "bf16") else torch.float32)
    held = None
    if quantize_base:
        held = to_nf4(net, quantize_base == "nf4_double")
    if lora_rank and peft:
        import peft as peft_lib

        net = peft_lib.get_peft_model(net, peft_lib.LoraConfig(
            r=lora_rank, lora_alpha=16, lora_dropout=lora_dropout,
            target_modules=list(lora_targets) if lora_targets else "all-linear"),
            autocast_adapter_dtype=adapter_dtype == "fp32")
    elif lora_rank:
        net.requires_grad_(False)
        llm.replace_linears(net, functools.partial(LoRALinear, rank=lora_rank))
    if checkpointing == "block":
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    x = torch.randint(0, config.vocab_size, (micro_batch, size))
    params = [p for p in net.parameters() if p.requires_grad]
    update, opt = make_update(params, host, precision=precision, optimizer=optimizer, master_on_cpu=master_on_cpu,
                              stream_grads=stream_grads, fused_update=fused_update, set_to_none=set_to_none,
                              # 16-bit adapters step as they are (torchtune's), as pure 16-bit weights without a master
                              master_weights=master_weights and not (lora_rank and adapter_dtype != "fp32"))
    forward = functools.partial(net, input_ids=x, labels=x)
    if chunked_loss:
        net = Chunked(net)
        forward = functools.partial(net, x)
    step = whole_step(forward, update, accumulation=accumulation, precision=precision, keep_outputs=keep_outputs,
                      offload=offload_hooks(net, host) if offload_activations else None)
    model = with_master(net, opt)
    return step, (nn.ModuleDict(dict(model=model, held=held)) if held is not None else model), opt


class Chunked(nn.Module):
    """The causal LM whose loss never holds the whole logits: chunks of tokens, each under checkpoint (notebook 08)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        hidden = self.net.model(input_ids=x).last_hidden_state[:, :-1].flatten(0, 1)
        targets = x[:, 1:].flatten()
        size = math.ceil(targets.numel() / planner.model.LOSS_CHUNKS)

        def chunk_loss(h, y):
            return nn.functional.cross_entropy(self.net.lm_head(h).float(), y, reduction="sum")
        return sum(checkpoint(chunk_loss, h, y, use_reentrant=False)
                   for h, y in zip(hidden.split(size), targets.split(size))) / targets.numel()


def step_peak(fake, **settings):
    """Peak bytes of the second whole step, on real or fake tensors."""
    with models.fake_mode() if fake else contextlib.nullcontext():
        step, model, optimizer = llm_step(Host(fake), peft=not fake, **settings)
        step()
        return memory.measure_memory(step, model=model, optimizer=optimizer).peak_bytes


@functools.lru_cache(maxsize=None)
def twin_spec(family):
    return planner.hf_spec(twin(family), name=f"{family} twin", fake=False)


def check(family, name, toggle, without, fake=True, **settings):
    """The step with ``toggle``: measured, on fake tensors (where they run) and predicted, within 5%; the prediction
    with ``without`` instead of the toggle more than 5% off the measurement."""
    spec, config = twin_spec(family), twin(family)
    measured = step_peak(False, config=config, **toggle, **settings)
    faked = step_peak(True, config=config, **toggle, **settings) if fake else None
    on = planner.predict(spec, device="cpu", **toggle, **settings).tensor_peak_bytes
    off = planner.predict(spec, device="cpu", **without, **settings).tensor_peak_bytes
    ROWS.append({"setting": f"{family}: {name}", "planner MiB": on / 2**20, "fake MiB": (faked or math.nan) / 2**20,
                 "measured MiB": measured / 2**20, "planner err %": 100 * (on - measured) / measured,
                 "fake err %": 100 * ((faked or math.nan) - measured) / measured,
                 "without it, err %": 100 * (off - measured) / measured})
    row = ROWS[-1]
    assert faked is None or abs(faked - measured) <= TOLERANCE * measured, row
    assert abs(on - measured) <= TOLERANCE * measured, row
    assert abs(off - measured) > TOLERANCE * measured, ("the setting must matter", row)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_fine_tuning_of_each_family(family):
    check(family, "full fine-tuning, AdamW, 2 micro-batches", dict(accumulation=2), dict(accumulation=1),
          micro_batch=4, size=32)


@pytest.mark.parametrize("family,name,toggle,rest", [
    ("llama", "checkpointing per block", dict(checkpointing="block"), STEP),
    ("gemma2", "pure bf16, fp32 master weights", dict(precision="bf16"), STEP),
    pytest.param("llama", "bf16 autocast (AMP)", dict(precision="bf16_amp"), STEP, marks=pytest.mark.slow),
    pytest.param("phi3", "8-bit Adam", dict(optimizer="adam8bit"), STEP, marks=pytest.mark.slow),
    pytest.param("qwen2", "fp32 master + Adam on the CPU", dict(master_on_cpu=True), dict(STEP, precision="bf16"),
                 marks=pytest.mark.slow),
    pytest.param("mistral", "gradients streamed to the CPU", dict(stream_grads=True),
                 dict(STEP, precision="bf16", master_on_cpu=True), marks=pytest.mark.slow),
    pytest.param("gemma2", "activations offloaded", dict(offload_activations=True), STEP, marks=pytest.mark.slow),
    pytest.param("llama", "chunked loss", dict(chunked_loss=True), STEP, marks=pytest.mark.slow),
    pytest.param("llama", "update fused into backward", dict(fused_update=True), dict(micro_batch=1, size=16),
                 marks=pytest.mark.slow),
])
def test_full_fine_tuning_settings(family, name, toggle, rest):
    check(family, name, toggle, {}, **rest)


@pytest.mark.parametrize("family,name,toggle,rest", [
    # only an adapted layer saves its input for the adapter (peft casts it to fp32: a copy per adapted layer)
    ("llama", "LoRA on q_proj and v_proj only", dict(lora_targets=("q_proj", "v_proj")),
     dict(STEP, precision="bf16", lora_rank=8)),
    ("qwen2", "LoRA on the MLP only", dict(lora_targets=("gate_proj", "up_proj", "down_proj")),
     dict(STEP, precision="bf16", lora_rank=8)),
    # bf16 adapters over bf16 weights (torchtune's): no fp32 copy of any input, bf16 state
    ("mistral", "bf16 adapters", dict(adapter_dtype="bf16"), dict(STEP, precision="bf16", lora_rank=8)),
    # dropout on each adapter's input keeps a mask and the dropped input
    pytest.param("gemma2", "LoRA dropout 0.1", dict(lora_dropout=0.1), dict(STEP, precision="bf16", lora_rank=8),
                 marks=pytest.mark.slow),
    # pure bf16 without an fp32 master: weights, gradients and AdamW's state all in bf16 (torchtune's, PEFT's)
    ("phi3", "pure bf16, no master copy", dict(master_weights=False), dict(STEP, precision="bf16")),
    # zero_grad(set_to_none=False): last step's gradients, zeroed, are there when backward starts
    ("llama", "gradients kept as zeros", dict(set_to_none=False), dict(micro_batch=2, size=64)),
])
def test_the_settings_practitioners_use(family, name, toggle, rest):
    check(family, name, toggle, {}, fake=False, **rest)


def test_fused_adamw_keeps_no_foreach_copy_of_the_state():
    spec, config = twin_spec("llama"), twin("llama")
    settings = dict(micro_batch=1, size=8, precision="bf16", master_weights=False)
    measured = step_peak(False, config=config, optimizer="adamw_fused", **settings)
    fused = planner.predict(spec, device="cpu", optimizer="adamw_fused", **settings)
    assert abs(fused.tensor_peak_bytes - measured) <= TOLERANCE * measured, (fused.tensor_peak_bytes, measured)
    # on a GPU, foreach AdamW's step holds one more copy of the state (torch._foreach_sqrt of v); fused holds none
    gpu = dict(settings, size=1024)
    foreach = planner.predict("llama-3.2-3b", "A100 (80 GB)", optimizer="adamw", **gpu)
    fused = planner.predict("llama-3.2-3b", "A100 (80 GB)", optimizer="adamw_fused", **gpu)
    n = foreach.model.n_params
    assert foreach.phase == "in optimizer.step()" and foreach.by_category["other"] == 2 * n  # v's copy, in bf16
    assert fused.tensor_peak_bytes < foreach.tensor_peak_bytes - 1.9 * n


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_all_linear_layers(family):
    check(family, "LoRA rank 8, all linear layers", dict(lora_rank=8), {}, **STEP)


@pytest.mark.parametrize("family,quantize,precision", [(f, "nf4", "fp32") for f in FAMILIES] + [
    pytest.param("llama", "nf4_double", "fp32", marks=pytest.mark.slow),  # the absmax values in 8 bits too
    pytest.param("gemma2", "nf4", "bf16", marks=pytest.mark.slow)])  # computing in bf16, the rest of the model in it
def test_qlora_nf4(family, quantize, precision):
    pytest.importorskip("bitsandbytes")  # bitsandbytes' layers are not built on fake tensors: measured vs planned
    # in bf16 the weights are a smaller share of the step: one sample per micro-batch keeps them the larger part
    check(family, f"QLoRA rank 8, {quantize}, {precision}", dict(lora_rank=8, quantize_base=quantize),
          dict(lora_rank=8), fake=False, **dict(STEP, precision=precision, micro_batch=4 if precision == "fp32" else 1))


def test_shipped_configs_have_the_published_parameter_counts():
    for name, entry in llm.llm_data()["configs"].items():
        spec = planner.get_model(name)
        assert spec.n_params == pytest.approx(entry["params"], rel=0.01), name
        with models.fake_mode():  # every layer built, not extrapolated from two
            model = llm.build_causal_lm(llm.hf_config(name), n_layers=None)
        assert sum(p.numel() for p in model.parameters()) == spec.n_params, name
        assert planner.get_model(entry["repo"]).n_params == spec.n_params


def test_an_8b_model_is_planned_in_seconds():
    start = time.perf_counter()
    lora = planner.predict("llama-3.1-8b", "T4 (16 GB)", micro_batch=1, size=1024, precision="fp16", lora_rank=16,
                           checkpointing="block")
    qlora = planner.predict("meta-llama/Llama-3.1-8B", "T4", micro_batch=1, size=1024, precision="fp16",
                            lora_rank=16, quantize_base="nf4", checkpointing="block")
    assert time.perf_counter() - start < 60
    assert not lora.fits and qlora.fits, (str(lora), str(qlora))
    # 7 linear layers per block, rank 16: r (in + out) each
    assert planner.lora_params(planner.get_model("llama-3.1-8b"), 16) == 32 * 16 * (
        (4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)


def test_nf4_bytes_follow_bitsandbytes_layout():
    bnb = pytest.importorskip("bitsandbytes")
    for double in (False, True):
        q = bnb.nn.Linear4bit(192, 64, bias=False, quant_type="nf4", compress_statistics=double).to("cpu")
        qs = q.weight.quant_state
        extra = (qs.offset, qs.state2.absmax, qs.state2.code) if qs.nested else ()
        assert nf4_bytes(192 * 64, double) == memory.tensor_bytes(q.weight, qs.absmax, qs.code, *extra)


def test_settings_say_what_to_change():
    spec = twin_spec("llama")
    with pytest.raises(ValueError, match="lora_rank"):
        planner.make_settings(spec, micro_batch=1, quantize_base="nf4")
    with pytest.raises(ValueError, match="quantize_base"):
        planner.make_settings(spec, micro_batch=1, lora_rank=8, quantize_base="int3")
    with pytest.raises(ValueError, match="match none"):
        planner.make_settings(spec, micro_batch=1, lora_rank=8, lora_targets=("c_attn",))
    s = planner.make_settings(spec, micro_batch=1, lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert planner.lora_params(spec, 8, s.lora_targets) == 2 * 8 * (64 + 64 + 64 + 32)
    assert any("QLoRA" in t for t in planner.make_settings(spec, micro_batch=1, lora_rank=8,
                                                            quantize_base="nf4").techniques())
    with pytest.raises(ValueError, match="transformers of GPT-2's and BERT's shapes"):
        planner.make_settings(spec, micro_batch=1, optimizer="galore")
    with pytest.raises(ValueError, match="compute dtype"):
        planner.make_settings(spec, micro_batch=1, lora_rank=8, quantize_base="nf4", precision="bf16_amp")


def test_stored_llm_measurements_match_a_fresh_one():
    """course_tools/measure_presets.py wrote llms.json's measurements; one of them measured again now."""
    fresh = llm.hf_data("qwen2.5-0.5b", kinds=("half",), pricings=("cuda-fused",))
    stored = llm.llm_data()["measured"]["qwen2.5-0.5b"]
    assert {k: fresh[k] for k in ("n_params", "hidden", "tied", "linears")} == {
        k: stored[k] for k in ("n_params", "hidden", "tied", "linears")}
    for acts in ("acts", "lora_acts"):
        for key, value in fresh[acts]["cuda-fused"]["half"].items():
            a = torch.tensor(value, dtype=torch.float64).flatten()
            b = torch.tensor(stored[acts]["cuda-fused"]["half"][key], dtype=torch.float64).flatten()
            assert torch.allclose(a, b, rtol=0.01, atol=1.0), (acts, key, a, b)


def test_host_ram_of_the_offloaded_plans():
    """The CPU keeps the fp32 master weights, their gradients and the optimizer's state; streamed weights keep their
    16-bit copy there too; 8B parameters make it tens of GiB."""
    spec = planner.get_model("llama-3.1-8b")
    n = spec.n_params
    base = dict(micro_batch=1, size=1024, precision="bf16", checkpointing="block", master_on_cpu=True)
    assert planner.predict(spec, "4090", **base).host_bytes == 8 * n + 8 * n  # master + grads, AdamW's m and v
    streamed = planner.predict(spec, "4090", stream_grads=True, stream_weights=True, **base)
    assert streamed.host_bytes == 16 * n + 2 * n
    assert streamed.by_category["params"] < 0.2 * 2 * n  # the card keeps the embeddings, the head and 2 blocks
    rec = planner.cheapest_fit(spec, "T4 (16 GB)", host_gib=200, micro_batch=8, size=1024)
    assert rec.plan.fits and rec.plan.host_bytes > 8 * n, str(rec)


def test_cheapest_fit_offers_qlora_and_the_widget_lists_the_llms():
    from course_utils.planner import widget

    rec = planner.cheapest_fit("llama-3.1-8b", "RTX 3060 (12 GB)", micro_batch=1, size=512, lora_rank=16)
    assert rec.plan.fits and rec.plan.settings.quantize_base, str(rec)  # 16-bit weights alone need 15 GiB
    assert all(rec.notebooks[t] for t in rec.techniques)
    assert {"Llama-3.1-8B", "Gemma-2-2B", "Phi-3-mini (4k)"} <= set(widget.MODEL_CHOICES)
    shown = widget.render(model="Llama-3.1-8B", gpu="T4 (16 GB)", micro_batch=1, size=1024, lora_rank=16, qlora=True,
                          precision="fp16", checkpointing="block", search=False)
    assert shown.ok and shown.plan.fits and "QLoRA" in " ".join(shown.plan.settings.techniques()), shown.message
    refused = widget.render(model="Llama-3.1-8B", micro_batch=1, qlora=True, search=False)
    assert not refused.ok and "lora_rank" in refused.message


def test_hf_spec_reads_a_config_json_a_dict_or_a_config(tmp_path):
    config = twin("qwen2")
    path = tmp_path / "config.json"
    config.to_json_file(path)
    spec = planner.hf_spec(str(path), fake=False, kinds=("fp32",), pricings=("cpu",))
    built = llm.build_causal_lm(config)
    assert spec.n_params == twin_spec("qwen2").n_params == sum(p.numel() for p in built.parameters())
    assert spec.tied and spec.hidden_size == 64 and len(spec.linears) == 7
    assert planner.hf_spec(config.to_dict(), fake=False, kinds=("fp32",), pricings=("cpu",)).n_params == spec.n_params
    with pytest.raises(ValueError, match="model_type"):
        planner.hf_spec({"hidden_size": 64})
    with pytest.raises(ValueError, match="Unknown model"):
        planner.hf_spec("no-such-model")


@pytest.mark.parametrize("vary,values,settings", [
    ("size", (64, 80), dict(micro_batch=4, precision="fp32")),
    ("micro_batch", (4, 5), dict(size=32, precision="fp32")),
    ("lora_rank", (16, 24), dict(micro_batch=4, size=32, precision="fp32")),
])
def test_largest_fit_finds_the_step_that_fits_on_the_cpu_twin(vary, values, settings):
    """A budget between the planner's peaks at two values: the largest that fits is the smaller, and the measured
    step at it fits the budget while the measured step one step more does not."""
    spec, config = twin_spec("llama"), twin("llama")
    step = values[1] - values[0]
    small, large = (planner.predict(spec, device="cpu", **settings, **{vary: v}).tensor_peak_bytes for v in values)
    budget = (small + large) // 2
    found = planner.largest_fit(spec, planner.custom_gpu(budget / 2**30), vary, step=step, device="cpu",
                                host_gib=math.inf, **settings)
    assert found.expected == values[0], str(found)
    assert found.value <= found.expected <= found.optimistic
    measured = [step_peak(False, config=config, **settings, **{vary: v}) for v in values]
    assert measured[0] <= budget < measured[1], (measured, budget)


def test_largest_fit_says_what_to_change():
    with pytest.raises(ValueError, match="vary must be one of"):
        planner.largest_fit("llama-3.2-1b", "T4", "depth", micro_batch=1)
    with pytest.raises(ValueError, match="leave it out"):
        planner.largest_fit("llama-3.2-1b", "T4", "size", micro_batch=1, size=1024)
    with pytest.raises(ValueError, match="step must be"):
        planner.largest_fit("llama-3.2-1b", "T4", "size", micro_batch=1, step=0)
    nothing = planner.largest_fit("llama-3.1-8b", 4, "size", micro_batch=1, precision="bf16")  # 16 GB of weights
    assert nothing.value is nothing.expected is nothing.optimistic is None and "nothing fits" in str(nothing)
    found = planner.largest_fit("llama-3.1-8b", "RTX 4090", "size", step=256, micro_batch=1, precision="bf16",
                                lora_rank=16, quantize_base="nf4", checkpointing="block")
    assert found.plan.fits and found.value % 256 == 0 and "the largest" in str(found)
