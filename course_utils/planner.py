"""Will it fit, and what should I turn on? A GPU memory planner for training.

``plan(model, gpu, micro_batch=..., ...)`` predicts the peak GPU memory of one training step, by
category (params, grads, optimizer, activations, other = temporaries, overhead = CUDA context +
allocator), for a model preset (real configs) or your own sizes, and says whether it fits the GPU.
``cheapest_fit(...)`` searches the course's techniques and returns the set that fits at the lowest
predicted time per optimizer step, with the notebook that teaches each technique.

How the peak is predicted (every rule here is tested against ``course_utils.memory.measure_memory``)
-------------------------------------------------------------------------------------------------
A model is a *head* (embeddings, classifier, loss) around ``n`` *blocks* (transformer layers,
CNN stages, MLP layers). For each block we know, per sample, the bytes autograd saves (measured
once with saved-tensor hooks on a real or fake forward pass: linear in sequence length or image
area, plus a sequence-length-squared term for attention scores), the bytes of its input (what a
checkpoint keeps) and its largest saved tensor. A training step then has three high points; the
peak is the largest:

* **start of backward**: everything forward saved + the loss's temporaries (2 fp32 copies of the
  logits) + the gradients already there (with accumulation they live across micro-batches);
* **during backward, block by block** (from the last block to the first): activations of the
  blocks not yet processed (with checkpointing: their inputs, plus the block being recomputed)
  + gradients of the blocks done + 2 x the block's largest saved tensor (backward temporaries);
* **optimizer step**: all gradients + the step's scratch (PyTorch's foreach Adam on CUDA: one
  copy of the model; on CPU: two copies of the largest tensor; 8-bit Adam and SGD: none).

Then ``overhead`` = the CUDA context (``CUDA_CONTEXT_BYTES``, ~0.5 GiB: kernels, cuBLAS/cuDNN
workspaces; not in PyTorch's allocator but in ``nvidia-smi``) + the caching allocator's rounding
and fragmentation (``ALLOCATOR_OVERHEAD`` = 5% of the peak). Both are stated assumptions.

Time-cost model (the planner's own; stated, approximate)
--------------------------------------------------------
Seconds per optimizer step = compute + optimizer step + PCIe traffic:

* compute = training FLOPs (6 x params x tokens for transformers, 3 x the measured forward FLOPs
  for CNNs/MLPs) / (GPU peak TFLOPS for the precision x ``MFU`` = 40%); fp16/bf16 use the tensor
  core rate (a GTX 1080 Ti has none: its fp16 is 1/64 rate);
* gradient checkpointing: compute x 4/3 (one extra forward: forward is ~1/3 of forward+backward);
* gradient accumulation: the same samples in smaller micro-batches; each halving of the
  micro-batch costs ``SMALL_BATCH_PENALTY`` = 10% of compute (a busy GPU needs big matrices);
* optimizer step on the GPU: bytes it reads and writes / GPU memory bandwidth;
* optimizer (and fp32 master weights) on the CPU: gradients down and weights up over PCIe once
  per step, plus ``CPU_STEP_NS_PER_PARAM`` = 2 ns per parameter for the CPU's update;
* streaming gradients to the CPU: gradients cross PCIe once per *micro-batch* (counted in full:
  an upper bound, copies can overlap with backward, notebook 06).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from .estimate import OPTIMIZERS, optimizer_state_bytes
from .memory import CATEGORIES as MEMORY_CATEGORIES
from .units import GIB, MIB
from .validation import positive_int, positive_number


from .hardware import ALLOCATOR_RESERVE_FRACTION as ALLOCATOR_OVERHEAD  # one copy: hardware
from .hardware import CUDA_CONTEXT_BYTES
MFU = 0.40
SMALL_BATCH_PENALTY = 0.10
CHECKPOINT_COMPUTE_FACTOR = 4 / 3
CPU_STEP_NS_PER_PARAM = 2.0

CATEGORIES = MEMORY_CATEGORIES + ("overhead",)  # what measure_memory reports, plus CUDA context
CHECKPOINTING = ("none", "block", "sqrt")
PRECISIONS = ("fp32", "fp16_amp", "bf16_amp", "fp16", "bf16")
PLANNER_OPTIMIZERS = OPTIMIZERS

# Each technique the search can turn on, and the notebook that teaches it.
NOTEBOOKS = {
    "memory accounting": "01_memory_accounting.ipynb",
    "gradient accumulation": "02_gradient_accumulation.ipynb",
    "gradient checkpointing": "03_gradient_checkpointing.ipynb",
    "mixed precision": "04_mixed_precision.ipynb",
    "8-bit Adam": "05_8bit_adam.ipynb",
    "fp16 weights + fp32 master weights on CPU": "06_capstone_gpt2_xl.ipynb",
    "stream gradients to CPU": "06_capstone_gpt2_xl.ipynb",
    "beyond one GPU": "07_beyond_one_gpu.ipynb",
}


# --------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPUSpec:
    """A GPU: memory as nvidia-smi reports it, and the speeds the time model uses."""

    name: str
    memory_bytes: int
    fp32_tflops: float = 12.7
    half_tflops: float = 25.0  # fp16/bf16 on tensor cores, fp32 accumulate
    bf16: bool = True  # native bf16 (compute capability >= 8.0)
    mem_bandwidth_gbs: float = 360.0
    pcie_gbs: float = 12.0  # measured-class host<->device copy speed (pinned), not the bus's peak

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


# memory: nvidia-smi "total" of each card; speeds: vendor datasheets (dense), PCIe: typical pinned copies.
GPU_PRESETS = {
    "GTX 1080 Ti (11 GB)": GPUSpec("GTX 1080 Ti (11 GB)", 11264 * MIB, 11.3, 0.18, False, 484, 12),
    "RTX 3060 (12 GB)": GPUSpec("RTX 3060 (12 GB)", 12288 * MIB, 12.7, 25.0, True, 360, 24),
    "T4 (16 GB)": GPUSpec("T4 (16 GB)", 15360 * MIB, 8.1, 65.0, False, 320, 12),
    "RTX 3090 (24 GB)": GPUSpec("RTX 3090 (24 GB)", 24576 * MIB, 35.6, 71.0, True, 936, 24),
    "RTX 4090 (24 GB)": GPUSpec("RTX 4090 (24 GB)", 24564 * MIB, 82.6, 165.0, True, 1008, 24),
    "A100 (40 GB)": GPUSpec("A100 (40 GB)", 40960 * MIB, 19.5, 312.0, True, 1555, 24),
    "A100 (80 GB)": GPUSpec("A100 (80 GB)", 81920 * MIB, 19.5, 312.0, True, 2039, 24),
    "H100 (80 GB)": GPUSpec("H100 (80 GB)", 81559 * MIB, 67.0, 989.0, True, 3350, 48),
}
_GPU_ALIASES = {"1080ti": "GTX 1080 Ti (11 GB)", "gtx1080ti": "GTX 1080 Ti (11 GB)", "3060": "RTX 3060 (12 GB)",
                "rtx3060": "RTX 3060 (12 GB)", "t4": "T4 (16 GB)", "3090": "RTX 3090 (24 GB)",
                "rtx3090": "RTX 3090 (24 GB)", "4090": "RTX 4090 (24 GB)", "rtx4090": "RTX 4090 (24 GB)",
                "a100": "A100 (40 GB)", "a10040gb": "A100 (40 GB)", "a10080gb": "A100 (80 GB)",
                "h100": "H100 (80 GB)", "h10080gb": "H100 (80 GB)"}


def custom_gpu(memory_gib: float, *, name: str = "custom GPU", **speeds) -> GPUSpec:
    """A GPU you describe: its memory in GiB (speeds default to an RTX 3060's)."""
    positive_number(memory_gib, "memory_gib", "e.g. custom_gpu(6) for a 6 GiB card")
    for key, value in speeds.items():
        if key not in ("fp32_tflops", "half_tflops", "bf16", "mem_bandwidth_gbs", "pcie_gbs"):
            raise ValueError(f"Unknown GPU field {key!r}; use fp32_tflops, half_tflops, bf16, mem_bandwidth_gbs, pcie_gbs.")
        if key != "bf16":
            positive_number(value, key, "speeds are positive numbers")
    return GPUSpec(name, int(memory_gib * GIB), **speeds)


def get_gpu(gpu) -> GPUSpec:
    """A GPUSpec from a preset name ('RTX 3060 (12 GB)', '3060', 'T4', ...), a number of GiB, or a GPUSpec."""
    if isinstance(gpu, GPUSpec):
        return gpu
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        return custom_gpu(gpu, name=f"custom GPU ({gpu:g} GiB)")
    if isinstance(gpu, str):
        if gpu in GPU_PRESETS:
            return GPU_PRESETS[gpu]
        key = "".join(ch for ch in gpu.lower() if ch.isalnum())
        if key in _GPU_ALIASES:
            return GPU_PRESETS[_GPU_ALIASES[key]]
        raise ValueError(f"Unknown GPU {gpu!r}; choose one of {list(GPU_PRESETS)}, or pass its memory in GiB (e.g. 6).")
    raise TypeError(f"gpu must be a preset name, a memory size in GiB or a GPUSpec, not {type(gpu).__name__}.")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActCoeffs:
    """Activation bytes per sample at one precision, as ``lin * u + quad * u**2``.

    ``u`` is the sequence length (transformers), (image size / reference size)**2 (CNNs) or 1.
    Per block: ``block`` (saved by the block), ``boundary`` (the block's input: what a
    checkpoint keeps), ``largest`` (its largest saved tensor). ``stem``: saved before the first
    block (embeddings, a CNN's first convolution); ``head``: saved after (classifier, loss, output).
    """

    block: tuple  # tuple of (lin, quad) per block
    boundary: tuple  # tuple of lin per block
    largest: tuple  # tuple of (lin, quad) per block
    head: tuple  # (lin, quad), saved after the first block started (classifier, loss, output)
    stem: tuple = (0.0, 0.0)  # (lin, quad), saved before the first block (kept until backward ends)


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model."""

    name: str
    family: str  # 'transformer', 'vision', 'mlp' or 'custom'
    n_params: int
    block_params: tuple  # parameters of each block
    largest_tensor: int  # numel of the largest parameter tensor
    acts: dict  # precision kind ('fp32', 'half', 'amp') -> ActCoeffs
    output_per_unit: float  # elements of the model's output (logits) per sample per unit u
    fwd_flops_per_unit: float  # forward FLOPs per sample per unit u (transformers: per token)
    unit: str = "sample"  # what u is: 'token', 'image area' or 'sample'
    ref_size: int = 1  # reference image size for vision models (u = (size/ref)**2)
    default_size: int = 1  # default sequence length or image size
    notes: str = ""

    @property
    def n_blocks(self) -> int:
        return len(self.block_params)

    @property
    def head_params(self) -> int:
        return self.n_params - sum(self.block_params)


def _uniform(n, value):
    return tuple(value for _ in range(n))


def custom_model(n_params: int, activation_bytes_per_sample: float, *, n_blocks: int = 12,
                 name: str = "custom model") -> ModelSpec:
    """A model you describe by its parameter count and its fp32 activation bytes per sample.

    The activations are spread evenly over ``n_blocks`` blocks (inputs = 1/8 of a block's
    activations, largest saved tensor = 1/4: typical of a transformer layer); under mixed
    precision or pure half they are assumed to halve (measured: 0.55-0.6 for GPT-2).
    """
    n_params = positive_int(n_params, "n_params", "e.g. 350_000_000", whole_floats=True)
    positive_number(activation_bytes_per_sample, "activation_bytes_per_sample",
                           "measure it with course_utils.estimate.activation_bytes(model, one_sample)")
    n_blocks = positive_int(n_blocks, "n_blocks", "e.g. 12", whole_floats=True)
    per_block = activation_bytes_per_sample / n_blocks

    def coeffs(scale):
        a = per_block * scale
        return ActCoeffs(block=_uniform(n_blocks, (a, 0.0)), boundary=_uniform(n_blocks, a / 8),
                         largest=_uniform(n_blocks, (a / 4, 0.0)), head=(0.0, 0.0))

    return ModelSpec(name=name, family="custom", n_params=n_params,
                     block_params=_uniform(n_blocks, n_params // n_blocks), largest_tensor=max(n_params // n_blocks, 1),
                     acts={"fp32": coeffs(1.0), "amp": coeffs(0.5), "half": coeffs(0.5)},
                     output_per_unit=0.0, fwd_flops_per_unit=2.0 * n_params, unit="sample")


# Coefficients measured by ``measure_spec`` (saved-tensor hooks on a real or fake forward pass;
# tests/test_planner.py re-measures them). Built lazily from _PRESET_DATA.
_PRESET_DATA: dict = {}  # filled at the end of this module
_PRESET_CACHE: dict = {}


def model_presets() -> list[str]:
    """Names of the model presets."""
    return list(_PRESET_DATA)


def get_model(model) -> ModelSpec:
    """A ModelSpec from a preset name ('gpt2-xl', 'bert-base', 'efficientnet_b0', ...) or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a preset name or a ModelSpec (custom_model(...)), not {type(model).__name__}.")
    if model not in _PRESET_DATA:
        raise ValueError(f"Unknown model {model!r}; choose one of {model_presets()}, "
                         "or describe yours with custom_model(n_params, activation_bytes_per_sample).")
    if model not in _PRESET_CACHE:
        _PRESET_CACHE[model] = _spec_from_data(model, _PRESET_DATA[model])
    return _PRESET_CACHE[model]


def _spec_from_data(name, d) -> ModelSpec:
    n = d["n_blocks"]
    acts = {}
    for kind, c in d["acts"].items():
        if d.get("uniform", True):
            acts[kind] = ActCoeffs(block=_uniform(n, tuple(c["block"])), boundary=_uniform(n, c["boundary"]),
                                   largest=_uniform(n, tuple(c["largest"])), head=tuple(c["head"]),
                                   stem=tuple(c.get("stem", (0.0, 0.0))))
        else:
            acts[kind] = ActCoeffs(block=tuple(tuple(x) for x in c["block"]), boundary=tuple(c["boundary"]),
                                   largest=tuple(tuple(x) for x in c["largest"]), head=tuple(c["head"]),
                                   stem=tuple(c.get("stem", (0.0, 0.0))))
    bp = d["block_params"]
    block_params = _uniform(n, bp) if isinstance(bp, int) else tuple(bp)
    return ModelSpec(name=name, family=d["family"], n_params=d["n_params"], block_params=block_params,
                     largest_tensor=d["largest_tensor"], acts=acts, output_per_unit=d["output_per_unit"],
                     fwd_flops_per_unit=d["fwd_flops_per_unit"], unit=d["unit"], ref_size=d.get("ref_size", 1),
                     default_size=d.get("default_size", 1), notes=d.get("notes", ""))


# --------------------------------------------------------------------------------------------
# Measuring a model's coefficients (used to build the presets; tests re-measure them)
# --------------------------------------------------------------------------------------------
def profile_activations(model, blocks, inputs=(), kwargs=None, *, autocast_dtype=None) -> dict:
    """Saved-tensor bytes of one forward pass, split by block; works on real and fake tensors.

    Returns ``{"block": [...], "boundary": [...], "largest": [...], "stem": int, "head": int}`` in
    bytes (stem: saved before the first block runs; head: after).
    Parameters are not activations; under autocast, the half copies of the weights it saves
    (one per weight, whatever the batch) are left out too: the planner counts them apart.
    """
    import torch

    kwargs = kwargs or {}
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty: pass the model's repeated modules (e.g. model.transformer.h).")
    params = list(model.parameters())
    param_keys = {p.untyped_storage()._cdata for p in params}
    param_shapes = {tuple(sorted(p.shape)) for p in params if p.dim() >= 2}
    seen: dict = {}
    current = [None]
    n = len(blocks)
    out = {"block": [0] * n, "boundary": [0] * n, "sizes": [[] for _ in range(n)], "stem": 0, "head": 0}
    started = [False]

    def pre_hook(index):
        def hook(module, args, kw):
            current[0] = index
            started[0] = True
            first = args[0] if args else next((v for v in kw.values() if isinstance(v, torch.Tensor)), None)
            if isinstance(first, torch.Tensor):
                out["boundary"][index] += first.untyped_storage().nbytes()
        return hook

    def post_hook(module, args, result):
        current[0] = None

    def pack(t):
        key = t.untyped_storage()._cdata
        if key in param_keys or key in seen:
            return t
        if autocast_dtype is not None and t.dtype == autocast_dtype and tuple(sorted(t.shape)) in param_shapes:
            return t  # autocast's half copy of a weight (or its transpose)
        size = t.untyped_storage().nbytes()
        seen[key] = t
        if current[0] is None:
            out["head" if started[0] else "stem"] += size
        else:
            out["block"][current[0]] += size
            out["sizes"][current[0]].append(size)
        return t

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(block.register_forward_hook(post_hook))
    was_training = model.training
    model.train()
    try:
        ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else _nullcontext()
        with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = model(*inputs, **kwargs)
        for t in _tensors(result):  # the output (logits, loss) is held too
            key = t.untyped_storage()._cdata
            if key not in seen and key not in param_keys:
                seen[key] = t
                out["head"] += t.untyped_storage().nbytes()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out["largest"] = [max(sizes, default=0) for sizes in out["sizes"]]
    return out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict) or hasattr(obj, "values") and callable(getattr(obj, "values")):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _fit(p1, p2, u1, u2, quad: bool):
    """Per-sample (lin, quad) from measurements at u1 and u2 (batch of 1)."""
    if not quad:
        return (p2 / u2, 0.0) if u2 else (p2, 0.0)
    q = (p2 / u2 - p1 / u1) / (u2 - u1)
    lin = p1 / u1 - q * u1
    return (lin, max(q, 0.0))


def _build(name: str, kind: str, fake: bool, overrides: dict | None = None, full_depth: bool = False):
    """Build preset ``name`` (with the precision kind's dtype); returns (model, blocks, make_inputs, unit info)."""
    import torch

    from . import models

    dtype = torch.float16 if kind == "half" else torch.float32
    if name.startswith("gpt2"):
        cfg = {**(overrides or {})}
        if not full_depth:
            cfg["n_layer"] = 2  # blocks are identical: 2 suffice
        model = models.build_gpt2(name, dtype=dtype, **cfg)
        vocab = model.config.vocab_size

        def make(u):
            x = torch.randint(0, vocab, (1, u))
            return (), {"input_ids": x, "labels": x}
        return model, list(model.transformer.h), make
    if name.startswith("bert"):
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(num_hidden_layers=2) if name == "bert-base" else BertConfig(
            hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, intermediate_size=4096)
        with models.default_dtype(dtype):
            model = BertForSequenceClassification(cfg)

        def make(u):
            x = torch.randint(0, cfg.vocab_size, (1, u))
            return (), {"input_ids": x, "labels": torch.zeros(1, dtype=torch.long)}
        return model, list(model.bert.encoder.layer), make
    if name in ("mlp", "small-cnn"):
        with models.default_dtype(dtype):
            model = models.mlp() if name == "mlp" else small_cnn()
        blocks = list(model.children())

        def make(u, size=28):
            return (torch.randn(1, 1, size, size, dtype=dtype), torch.zeros(1, dtype=torch.long)), {}
        return _WithLoss(model), blocks, make
    if name in ("resnet18", "resnet50", "efficientnet_b0"):
        import timm

        with models.default_dtype(dtype):
            model = timm.create_model(name, pretrained=False)
        if name.startswith("resnet"):
            blocks = [b for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for b in stage]
        else:
            blocks = [b for stage in model.blocks for b in stage]

        def make(u, size=224):
            return (torch.randn(1, 3, size, size, dtype=dtype), torch.zeros(1, dtype=torch.long)), {}
        return _WithLoss(model), blocks, make
    raise ValueError(f"No builder for {name!r}.")


def _WithLoss(model):
    """Wrap a classifier so forward returns its cross-entropy loss (as the training step does)."""
    from torch import nn

    class WithLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.inner(x).float(), y)

    return WithLoss(model)


def small_cnn():
    """The course's small CNN for 28x28 digits: two conv blocks, a hidden linear layer, a classifier."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


_UNITS = {"gpt2": ("token", (64, 128), True), "bert": ("token", (64, 128), True),
          "mlp": ("sample", (1, 1), False), "small-cnn": ("sample", (1, 1), False),
          "resnet18": ("image area", (1, 1), False), "resnet50": ("image area", (1, 1), False),
          "efficientnet_b0": ("image area", (1, 1), False)}


def _largest(p1, p2, i, u1, u2, quad):
    """(lin, quad) of the block's largest saved tensor: tensors growing 2x from u1 to u2 = 2 u1 are
    linear in u, those growing 4x are quadratic (attention scores)."""
    if not quad:
        return (max(p2["sizes"][i], default=0) / u2, 0.0)
    lin = q = 0.0
    for a, b in zip(p1["sizes"][i], p2["sizes"][i]):
        if a and b / a > 3:
            q = max(q, b / u2**2)
        else:
            lin = max(lin, b / u2)
    return (lin, q)


def measure_spec_data(name: str, *, fake: bool = True, kinds=("fp32", "amp", "half"), **overrides) -> dict:
    """Measure a preset's coefficients from scratch (the numbers cached in ``_PRESET_DATA``).

    Transformers are measured with 2 of their (identical) blocks at sequence lengths 64 and 128
    (batch 1) and fitted as ``lin * T + quad * T**2`` per block; CNNs at 224 x 224 (28 x 28 for
    the course's small models), block by block. ``kinds``: 'fp32' (fp32 weights), 'amp' (fp32
    weights under bf16 autocast on the CPU: the same byte widths as fp16 autocast), 'half'
    (fp16 weights). ``fake=True`` uses fake tensors (no memory, same shapes). ``overrides``
    change a GPT-2 config (``n_layer=2, n_embd=128, n_head=4``) for small GPT-2s.
    """
    import contextlib

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from . import models

    if not isinstance(name, str):
        raise TypeError(f"name must be a preset name, not {type(name).__name__}.")
    family_key = "gpt2" if name.startswith("gpt2") else "bert" if name.startswith("bert") else name
    if overrides and family_key != "gpt2":
        raise ValueError(f"Config overrides work for GPT-2 sizes only, not {name!r}.")
    if family_key not in _UNITS or (family_key == "gpt2" and name not in models.GPT2_SIZES) or (
            family_key == "bert" and name not in ("bert-base", "bert-large")):
        raise ValueError(f"Unknown preset {name!r}; choose one of {model_presets()}.")
    unit, (u1, u2), quad = _UNITS[family_key]
    transformer = unit == "token"
    ctx = models.fake_mode if fake else contextlib.nullcontext
    data: dict = {"family": "transformer" if transformer else ("vision" if unit == "image area" else "mlp"),
                  "unit": unit, "acts": {}}
    for kind in kinds:
        with ctx():
            model, blocks, make = _build(name, kind, fake, overrides)
            autocast = torch.bfloat16 if kind == "amp" else None
            p1 = profile_activations(model, blocks, *make(u1), autocast_dtype=autocast)
            p2 = profile_activations(model, blocks, *make(u2), autocast_dtype=autocast) if quad else p1
            if "n_params" not in data:  # counts and FLOPs from the first precision measured
                params = list(model.parameters())
                ids = {id(p) for b in blocks for p in b.parameters()}
                block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
                head_params = sum(p.numel() for p in params if id(p) not in ids)
                data["largest_tensor"] = max(p.numel() for p in params)
                if transformer:
                    full = {**models.GPT2_SIZES[name], **overrides}["n_layer"] if family_key == "gpt2" else (
                        12 if name == "bert-base" else 24)
                    data["n_blocks"] = full
                    data["block_params"] = block_params[0]
                    data["n_params"] = head_params + full * block_params[0]
                    data["fwd_flops_per_unit"] = 2.0 * data["n_params"]
                    data["output_per_unit"] = model.config.vocab_size if family_key == "gpt2" else 0.0
                    data["default_size"] = 1024 if family_key == "gpt2" else 512
                else:
                    data["n_blocks"] = len(blocks)
                    data["block_params"] = block_params
                    data["n_params"] = head_params + sum(block_params)
                    with FlopCounterMode(display=False) as counter:
                        model(*make(u1)[0])
                    data["fwd_flops_per_unit"] = float(counter.get_total_flops())
                    data["output_per_unit"] = 0.0  # classifier logits: a few numbers per sample
                    data["ref_size"] = 224 if unit == "image area" else 28
                    data["default_size"] = data["ref_size"]
        uu1, uu2 = (u1, u2) if transformer else (1, 1)
        idx = [1] if transformer else range(len(blocks))  # transformers: the second block (the first's twin)
        acts = {
            "block": [_fit(p1["block"][i], p2["block"][i], uu1, uu2, quad) for i in idx],
            "boundary": [p2["boundary"][i] / uu2 for i in idx],
            "largest": [_largest(p1, p2, i, uu1, uu2, quad) for i in idx],
            # outside the blocks: before them (stem) and after them (head)
            "stem": _fit(p1["stem"], p2["stem"], uu1, uu2, quad),
            "head": _fit(p1["head"], p2["head"], uu1, uu2, quad),
        }
        if transformer:
            acts = {k: (v[0] if k not in ("head", "stem") else v) for k, v in acts.items()}
        data["acts"][kind] = acts
    data["uniform"] = transformer
    return data


def gpt2_spec(size: str = "gpt2", *, kinds=("fp32", "amp", "half"), fake: bool = True, **overrides) -> ModelSpec:
    """A GPT-2 of your own shape (``gpt2_spec(n_layer=2, n_embd=128, n_head=4)``), measured now
    with fake tensors (a few seconds). ``kinds``: the precisions to measure (fewer = faster);
    planning with another precision then raises ValueError. ``fake=False`` runs real tensors
    (faster for tiny models)."""
    from . import models

    if not isinstance(size, str) or size not in models.GPT2_SIZES:
        raise ValueError(f"Unknown GPT-2 size {size!r}; choose one of {list(models.GPT2_SIZES)}.")
    models.gpt2_config(size, **overrides)  # checks the overrides
    label = size + "".join(f", {k}={v}" for k, v in overrides.items())
    return _spec_from_data(label, measure_spec_data(size, kinds=kinds, fake=fake, **overrides))


def measure_on_cpu(model, *, micro_batch: int, size=None, optimizer: str = "adam", gpt2_overrides=None):
    """Train two real steps on the CPU and measure the second with ``memory.measure_memory``.

    ``model``: 'mlp', 'small-cnn', 'resnet18', 'efficientnet_b0', or a GPT-2 size with
    ``gpt2_overrides`` (keep it small). Returns the MemoryReport (fp32, no checkpointing).
    """
    import torch

    from . import memory

    if not isinstance(model, str):
        raise TypeError(f"model must be a preset name, not {type(model).__name__}.")
    micro_batch = positive_int(micro_batch, "micro_batch", "e.g. 8", whole_floats=True)
    if model.startswith("bert") or (model.startswith("gpt2") and not gpt2_overrides) or model == "resnet50":
        raise ValueError(f"{model!r} is too big to train on a CPU here: use 'mlp', 'small-cnn', 'resnet18' "
                         "or a small GPT-2 (gpt2_overrides=dict(n_layer=2, n_embd=128, n_head=4)).")
    net, _, make = _build(model, "fp32", False, gpt2_overrides, full_depth=True)
    opt_name = _normalize_optimizer(optimizer)
    if opt_name == "adam8bit":
        raise ValueError("measure_on_cpu supports torch's optimizers: 'sgd', 'sgd_momentum', 'adam', 'adamw'.")
    params = net.parameters()
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=1e-3), "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=1e-4), "adamw": lambda: torch.optim.AdamW(params, lr=1e-4)}[opt_name]()

    def batch():
        if model.startswith("gpt2"):
            seq = positive_int(size or 64, "sequence length", "e.g. 64", whole_floats=True)
            x = torch.randint(0, net.config.vocab_size, (micro_batch, seq))
            return (), {"input_ids": x, "labels": x}
        args, _ = make(1, size) if size else make(1)
        x = args[0].expand(micro_batch, *args[0].shape[1:]).clone()
        return (x, torch.zeros(micro_batch, dtype=torch.long)), {}

    def step():
        args, kw = batch()
        out = net(*args, **kw)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from the first step on
    return memory.measure_memory(step, model=net, optimizer=opt)


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """The knobs of one training setup."""

    micro_batch: int
    size: int  # sequence length (transformers), image size (CNNs); ignored otherwise
    accumulation: int = 1
    checkpointing: str = "none"
    precision: str = "fp32"
    optimizer: str = "adam"
    master_on_cpu: bool = False
    stream_grads: bool = False

    def techniques(self, base: "Settings | None" = None) -> list[str]:
        """The course's techniques this setup uses (relative to ``base`` where given)."""
        out = []
        if self.accumulation > 1 and (base is None or self.micro_batch < base.micro_batch):
            out.append("gradient accumulation")
        if self.checkpointing != "none":
            out.append("gradient checkpointing" + (" (sqrt(n) segments)" if self.checkpointing == "sqrt" else " (per block)"))
        if self.precision.endswith("_amp"):
            out.append(f"mixed precision ({self.precision.split('_')[0]} AMP)")
        elif self.precision in ("fp16", "bf16"):
            out.append(f"pure {self.precision} weights" + (" + fp32 master weights on CPU" if self.master_on_cpu else " + fp32 master weights"))
        elif self.master_on_cpu:
            out.append("optimizer on CPU")
        if self.optimizer == "adam8bit":
            out.append("8-bit Adam")
        if self.stream_grads:
            out.append("stream gradients to CPU")
        return out


def technique_notebook(technique: str) -> str:
    """The course notebook that teaches a technique named by :meth:`Settings.techniques`."""
    t = technique.lower()
    for key, nb in (("accumulation", "02_gradient_accumulation.ipynb"), ("checkpointing", "03_gradient_checkpointing.ipynb"),
                    ("mixed precision", "04_mixed_precision.ipynb"), ("8-bit", "05_8bit_adam.ipynb"),
                    ("stream", "06_capstone_gpt2_xl.ipynb"), ("pure", "06_capstone_gpt2_xl.ipynb"),
                    ("optimizer on cpu", "06_capstone_gpt2_xl.ipynb")):
        if key in t:
            return nb
    raise ValueError(f"No notebook for technique {technique!r}.")


@dataclass
class Plan:
    """Predicted peak GPU memory of one training step, by category, and the time model's verdict."""

    model: ModelSpec
    gpu: GPUSpec
    settings: Settings
    by_category: dict
    phase: str
    step_seconds: float
    notes: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """Everything on the GPU at the peak, overhead included."""
        return int(sum(self.by_category.values()))

    @property
    def tensor_peak_bytes(self) -> int:
        """The peak of PyTorch's tensors (what measure_memory / max_memory_allocated report)."""
        return int(sum(v for k, v in self.by_category.items() if k != "overhead"))

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu.memory_bytes

    @property
    def techniques(self) -> list[str]:
        return self.settings.techniques()

    def as_gib(self) -> dict:
        return {k: v / GIB for k, v in self.by_category.items()}

    def summary(self) -> str:
        s = self.settings
        verdict = "fits" if self.fits else "does NOT fit"
        lines = [f"{self.model.name} on {self.gpu.name}: {self.peak_bytes / GIB:.2f} GiB of {self.gpu.memory_gib:.1f} GiB "
                 f"-> {verdict} (micro-batch {s.micro_batch} x {s.accumulation} accumulation steps, {s.precision}, "
                 f"{s.optimizer}, checkpointing {s.checkpointing}; peak {self.phase})"]
        for k, v in self.by_category.items():
            lines.append(f"  {k:<12}{v / GIB:8.2f} GiB")
        lines.append(f"  predicted time per optimizer step: {self.step_seconds:.2f} s")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    __str__ = summary


def _normalize_precision(p) -> str:
    if not isinstance(p, str):
        raise TypeError(f"precision must be a name such as 'fp16_amp', not {type(p).__name__}.")
    key = p.lower().replace(" ", "_").replace("-", "_")
    key = {"fp16amp": "fp16_amp", "amp": "fp16_amp", "fp16_autocast": "fp16_amp", "bf16amp": "bf16_amp",
           "pure_fp16": "fp16", "pure_bf16": "bf16", "half": "fp16", "float32": "fp32", "float16": "fp16",
           "bfloat16": "bf16", "pure_half": "fp16"}.get(key, key)
    if key not in PRECISIONS:
        raise ValueError(f"Unknown precision {p!r}; choose one of {PRECISIONS} (fp16/bf16 = pure half weights).")
    return key


def _normalize_ckpt(c) -> str:
    if not isinstance(c, str):
        raise TypeError(f"checkpointing must be 'none', 'block' or 'sqrt', not {type(c).__name__}.")
    key = c.lower().replace(" ", "").replace("-", "_")
    key = {"per_block": "block", "perblock": "block", "sqrt(n)": "sqrt", "sqrtn": "sqrt", "off": "none",
           "no": "none"}.get(key, key)
    if key not in CHECKPOINTING:
        raise ValueError(f"Unknown checkpointing {c!r}; choose 'none', 'block' (every block) or 'sqrt' (sqrt(n) segments).")
    return key


def _normalize_optimizer(o) -> str:
    from .estimate import normalize_optimizer

    return normalize_optimizer(o)


def make_settings(model: ModelSpec, *, micro_batch, size=None, accumulation=1, checkpointing="none",
                  precision="fp32", optimizer="adam", master_on_cpu=False, stream_grads=False) -> Settings:
    """Check and normalize the knobs; raises ValueError/TypeError saying what to change."""
    micro_batch = positive_int(micro_batch, "micro_batch", "e.g. 8", whole_floats=True)
    accumulation = positive_int(accumulation, "accumulation", "1 means no accumulation", whole_floats=True)
    if size is None:
        size = model.default_size
    what = "sequence length" if model.unit == "token" else "image size"
    size = positive_int(size, what, "e.g. 1024 tokens or 224 pixels", whole_floats=True)
    if model.unit == "token" and model.name.startswith("gpt2") and size > 1024:
        raise ValueError(f"GPT-2 reads at most 1024 tokens; set the sequence length to 1024 or less (got {size}).")
    if model.unit == "token" and model.name.startswith("bert") and size > 512:
        raise ValueError(f"BERT reads at most 512 tokens; set the sequence length to 512 or less (got {size}).")
    for flag, label in ((master_on_cpu, "master_on_cpu"), (stream_grads, "stream_grads")):
        if not isinstance(flag, bool):
            raise TypeError(f"{label} must be True or False, not {flag!r}.")
    if stream_grads and not master_on_cpu:
        raise ValueError("stream_grads=True accumulates gradients on the CPU and steps there: "
                         "turn on master_on_cpu=True as well.")
    return Settings(micro_batch=micro_batch, size=size, accumulation=accumulation,
                    checkpointing=_normalize_ckpt(checkpointing), precision=_normalize_precision(precision),
                    optimizer=_normalize_optimizer(optimizer), master_on_cpu=master_on_cpu, stream_grads=stream_grads)


def _units(model: ModelSpec, size: int) -> float:
    if model.unit == "token":
        return float(size)
    if model.unit == "image area":
        return (size / model.ref_size) ** 2
    return 1.0


def _at(c, u):
    lin, quad = c
    return lin * u + quad * u * u


def predict(model, gpu="RTX 3060 (12 GB)", *, micro_batch, size=None, accumulation=1, checkpointing="none",
            precision="fp32", optimizer="adam", master_on_cpu=False, stream_grads=False,
            device: str = "cuda") -> Plan:
    """Predict one training step's peak GPU memory by category; see the module docstring.

    ``device='cpu'`` predicts for a CPU run instead (no overhead, per-tensor Adam scratch): the
    validation against ``measure_memory`` on this machine uses it.
    """
    model = get_model(model)
    gpu = get_gpu(gpu)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}.")
    s = make_settings(model, micro_batch=micro_batch, size=size, accumulation=accumulation,
                      checkpointing=checkpointing, precision=precision, optimizer=optimizer,
                      master_on_cpu=master_on_cpu, stream_grads=stream_grads)
    return _predict(model, gpu, s, device)


def _predict(model: ModelSpec, gpu: GPUSpec, s: Settings, device: str = "cuda") -> Plan:
    n = model.n_params
    half = s.precision in ("fp16", "bf16")
    amp = s.precision.endswith("_amp")
    kind = "half" if half else "amp" if amp else "fp32"
    if kind not in model.acts:
        raise ValueError(f"{model.name} was measured for {sorted(model.acts)} only, not {kind!r}: "
                         f"measure it with kinds including {kind!r}, or choose another precision.")
    w = 2 if half else 4  # bytes per parameter and per gradient on the GPU
    B, u = s.micro_batch, _units(model, s.size)
    c = model.acts[kind]
    nb = model.n_blocks

    # persistent state
    params = n * w
    if s.master_on_cpu:
        optimizer = 0
    else:
        state_dtype = "fp32" if (half or w == 4) else "fp16"
        sizes = [model.largest_tensor] + [max(1, (n - model.largest_tensor) // max(nb, 1))] * max(nb, 1)
        optimizer = optimizer_state_bytes(n, s.optimizer, param_dtype=state_dtype, tensor_sizes=sizes)
        if half:
            optimizer += 4 * n  # fp32 master weights on the GPU
    weight_copies = 2 * n if amp else 0  # autocast's fp16/bf16 copies of the weights (kept for backward)

    grads_of = [bp * w for bp in model.block_params]
    g_head = model.head_params * w
    g_all = n * w
    if s.stream_grads:  # each gradient leaves for the CPU as soon as backward makes it
        g_live = max(max(grads_of, default=0), model.largest_tensor * w)
    acts_block = [B * _at(c.block[i], u) for i in range(nb)]
    bnd = [B * c.boundary[i] * u for i in range(nb)]
    largest = [B * max(c.largest[i][0] * u, c.largest[i][1] * u * u) for i in range(nb)]
    head = B * _at(c.head, u)
    stem = B * _at(c.stem, u)  # saved before the first block: alive until backward ends
    loss_temps = B * 8 * model.output_per_unit * u  # d(loss)/d(logits) in fp32, twice

    # what forward keeps, block by block, depending on checkpointing
    if s.checkpointing == "none":
        segments = [[i] for i in range(nb)]
        kept = list(acts_block)
    else:
        size_seg = 1 if s.checkpointing == "block" else max(1, math.ceil(nb / max(1, math.ceil(math.sqrt(nb)))))
        segments = [list(range(i, min(nb, i + size_seg))) for i in range(0, nb, size_seg)]
        kept = [0.0] * nb
        for seg in segments:
            kept[seg[0]] = bnd[seg[0]]
    grads_before = 0 if (s.stream_grads or s.accumulation == 1) else g_all

    phases = {}
    # 1. start of backward
    phases["at the start of backward"] = dict(grads=grads_before, activations=stem + head + sum(kept),
                                             other=loss_temps + weight_copies)
    # 2. block by block, last to first
    done_grads = g_head if not s.stream_grads else 0
    for seg in reversed(segments):
        first = seg[0]
        alive_before = sum(kept[:first])
        for i in reversed(seg):
            g_now = done_grads + grads_of[i] if not s.stream_grads else g_live
            if grads_before:
                g_now = g_all
            live_acts = stem + (alive_before + sum(acts_block[j] for j in seg if j <= i) if s.checkpointing != "none"
                                else sum(acts_block[: i + 1]))
            phases.setdefault("in backward", dict(grads=0, activations=0, other=0))
            cand = dict(grads=g_now, activations=live_acts, other=2 * largest[i] + weight_copies)
            if sum(cand.values()) > sum(phases["in backward"].values()):
                phases["in backward"] = cand
            if not s.stream_grads:
                done_grads += grads_of[i]
    # 3. optimizer step
    if s.master_on_cpu:
        scratch = 0
    elif s.optimizer in ("adam", "adamw"):
        scratch = n * (4 if half else w) if device == "cuda" else 2 * model.largest_tensor * (4 if half else w)
    else:
        scratch = 0
    if not s.stream_grads:
        phases["in optimizer.step()"] = dict(grads=g_all, activations=0, other=scratch)
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    dyn = phases[phase]
    by_cat = {"params": params, "grads": dyn["grads"], "optimizer": optimizer,
              "activations": dyn["activations"], "other": dyn["other"]}
    by_cat = {k: int(round(v)) for k, v in by_cat.items()}
    tensor_peak = sum(by_cat.values())
    by_cat["overhead"] = int(CUDA_CONTEXT_BYTES + ALLOCATOR_OVERHEAD * tensor_peak) if device == "cuda" else 0
    notes = []
    if model.unit == "token" and device == "cuda":
        notes.append("attention measured with PyTorch's math path (scores kept: T^2 bytes); "
                     "flash attention on a GPU keeps less")
    return Plan(model=model, gpu=gpu, settings=s, by_category=by_cat, phase=phase,
                step_seconds=step_seconds(model, gpu, s), notes=notes)


def step_seconds(model: ModelSpec, gpu: GPUSpec, s: Settings) -> float:
    """The planner's time-cost model: predicted seconds per optimizer step (see the module docstring)."""
    samples = s.micro_batch * s.accumulation
    u = _units(model, s.size)
    if model.unit == "token":
        flops = 6.0 * model.n_params * u * samples
    else:
        flops = 3.0 * model.fwd_flops_per_unit * u * samples
    half = s.precision != "fp32"
    if s.precision.startswith("bf16") and not gpu.bf16:
        tflops = gpu.fp32_tflops / 4  # emulated bf16 (a T4 says it supports bf16: slowly)
    else:
        tflops = gpu.half_tflops if half else gpu.fp32_tflops
    compute = flops / (tflops * 1e12 * MFU)
    if s.checkpointing != "none":
        compute *= CHECKPOINT_COMPUTE_FACTOR
    compute *= 1 + SMALL_BATCH_PENALTY * max(0.0, math.log2(max(1, s.accumulation)))
    n = model.n_params
    w = 2 if s.precision in ("fp16", "bf16") else 4
    if s.master_on_cpu:
        grad_trips = s.accumulation if s.stream_grads else 1
        pcie = (n * w * grad_trips + n * w) / (gpu.pcie_gbs * 1e9)
        opt = pcie + n * CPU_STEP_NS_PER_PARAM * 1e-9
    else:
        state = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8, "adam8bit": 2}[s.optimizer]
        touched = n * (2 * w + 2 * state + (8 if w == 2 else 0))
        opt = touched / (gpu.mem_bandwidth_gbs * 1e9)
    return compute + opt


# --------------------------------------------------------------------------------------------
# The search: the cheapest set of techniques that fits
# --------------------------------------------------------------------------------------------
@dataclass
class Recommendation:
    """The plan the search picked, what it turns on, and the notebooks that teach it."""

    plan: Plan
    baseline: Plan
    techniques: list
    notebooks: dict
    slowdown: float  # predicted step time / the baseline's
    candidates: int

    def summary(self) -> str:
        if not self.techniques:
            head = f"{self.baseline.model.name} fits {self.baseline.gpu.name} as it is: nothing to turn on."
        else:
            head = (f"Cheapest set that fits (by the planner's time model, {self.slowdown:.2f}x the baseline's "
                    f"predicted step time):")
        lines = [head]
        for t in self.techniques:
            lines.append(f"  - {t}  ->  notebooks/{self.notebooks[t]}")
        lines.append(f"  predicted peak {self.plan.peak_bytes / GIB:.2f} GiB of {self.plan.gpu.memory_gib:.1f} GiB "
                     f"(baseline {self.baseline.peak_bytes / GIB:.2f} GiB)")
        return "\n".join(lines)

    __str__ = summary


def candidate_settings(base: Settings, gpu: GPUSpec):
    """Every combination the search tries, from the user's ``base`` settings."""
    splits = [f for f in (1, 2, 4, 8, 16, 32, 64, 128) if f <= base.micro_batch and base.micro_batch % f == 0]
    precisions = [base.precision]
    for p in (("bf16_amp", "bf16") if gpu.bf16 else ("fp16_amp", "fp16")):
        if base.precision == "fp32" or (base.precision.endswith("_amp") and p in ("fp16", "bf16")):
            precisions.append(p)
    optimizers = [base.optimizer] + (["adam8bit"] if base.optimizer in ("adam", "adamw") else [])
    ckpts = [base.checkpointing] if base.checkpointing != "none" else list(CHECKPOINTING)
    offloads = [(base.master_on_cpu, base.stream_grads)] + [
        o for o in ((True, False), (True, True)) if o != (base.master_on_cpu, base.stream_grads) and
        (not base.master_on_cpu or o[0]) and (not base.stream_grads or o[1])]
    for f, p, o, c, (m, st) in itertools.product(splits, precisions, optimizers, ckpts, offloads):
        yield replace(base, micro_batch=base.micro_batch // f, accumulation=base.accumulation * f,
                      precision=p, optimizer=o, checkpointing=c, master_on_cpu=m, stream_grads=st)


def cheapest_fit(model, gpu="RTX 3060 (12 GB)", *, micro_batch, size=None, accumulation=1, checkpointing="none",
                 precision="fp32", optimizer="adam", master_on_cpu=False, stream_grads=False) -> Recommendation:
    """The set of the course's techniques that fits ``gpu`` at the lowest predicted step time.

    The effective batch (micro_batch x accumulation) is kept; the search may split the
    micro-batch (more accumulation steps), checkpoint, lower the precision, switch Adam to 8-bit
    Adam, move the optimizer and fp32 master weights to the CPU and stream gradients there.
    Ties go to fewer techniques. Raises ValueError when nothing fits, saying what to change.
    """
    model = get_model(model)
    gpu = get_gpu(gpu)
    base = make_settings(model, micro_batch=micro_batch, size=size, accumulation=accumulation,
                         checkpointing=checkpointing, precision=precision, optimizer=optimizer,
                         master_on_cpu=master_on_cpu, stream_grads=stream_grads)
    baseline = _predict(model, gpu, base)
    if baseline.fits:  # nothing to turn on; faster options are the learner's choice
        return Recommendation(plan=baseline, baseline=baseline, techniques=[], notebooks={}, slowdown=1.0,
                              candidates=1)
    best, count, smallest = None, 0, None
    for s in candidate_settings(base, gpu):
        count += 1
        p = _predict(model, gpu, s)
        if smallest is None or p.peak_bytes < smallest.peak_bytes:
            smallest = p
        if not p.fits:
            continue
        key = (round(p.step_seconds, 6), len(s.techniques(base)), p.peak_bytes)
        if best is None or key < best[0]:
            best = (key, p)
    if best is None:
        raise ValueError(
            f"Nothing fits: {model.name} needs at least {smallest.peak_bytes / GIB:.2f} GiB even with every technique "
            f"({', '.join(smallest.settings.techniques(base))}) and micro-batch {smallest.settings.micro_batch}, "
            f"but {gpu.name} has {gpu.memory_gib:.1f} GiB. Choose a GPU with more memory, a shorter sequence / "
            f"smaller image, or a smaller model; or shard across GPUs (notebooks/07_beyond_one_gpu.ipynb).")
    plan = best[1]
    techniques = plan.settings.techniques(base)
    return Recommendation(plan=plan, baseline=baseline, techniques=techniques,
                          notebooks={t: technique_notebook(t) for t in techniques},
                          slowdown=plan.step_seconds / baseline.step_seconds, candidates=count)


def plan_frame(plans: dict):
    """A pandas table (scenario x category, GiB) of several plans, with total, capacity and fit."""
    import pandas as pd

    if not plans:
        raise ValueError("plans is empty: pass {'scenario': plan, ...}.")
    rows = []
    for name, p in plans.items():
        if not isinstance(p, Plan):
            raise TypeError(f"{name!r} is a {type(p).__name__}, not a Plan (from predict()).")
        row = {"scenario": name, **{k: round(v / GIB, 2) for k, v in p.by_category.items()}}
        row.update(total=round(p.peak_bytes / GIB, 2), gpu_GiB=round(p.gpu.memory_gib, 1), fits=p.fits)
        rows.append(row)
    return pd.DataFrame(rows).set_index("scenario")


def plot_plans(plans: dict, *, ax=None, title=None):
    """Stacked bars of several plans against the (first plan's) GPU capacity."""
    from .plots import plot_ledger

    if not plans:
        raise ValueError("plans is empty: pass {'scenario': plan, ...}.")
    first = next(iter(plans.values()))
    for name, p in plans.items():
        if not isinstance(p, Plan):
            raise TypeError(f"{name!r} is a {type(p).__name__}, not a Plan (from predict()).")
    items = {name: dict(p.by_category) for name, p in plans.items()}
    ax = plot_ledger(items, budget_bytes=first.gpu.memory_bytes, budget_label=first.gpu.name, ax=ax, title=title)
    for container in ax.containers:  # the ledger's palette has no colour for the GPU's own overhead
        if container.get_label() == "overhead":
            for bar in container:
                bar.set_facecolor("#BBBBBB")
                bar.set_hatch("//")
    ax.legend(loc="lower right", fontsize="small")
    return ax


# --------------------------------------------------------------------------------------------
# Preset data: measured with measure_spec_data(name) (see tests/test_planner.py)
# --------------------------------------------------------------------------------------------
_PRESET_DATA.update(
{'gpt2': {'family': 'transformer',
          'unit': 'token',
          'acts': {'fp32': {'block': (92176, 144),
                            'boundary': 3072,
                            'largest': (12288, 48),
                            'stem': (3088, 0),
                            'head': (408216.4, 0)},
                   'amp': {'block': (53776, 144),
                           'boundary': 3072,
                           'largest': (6144, 48),
                           'stem': (3088, 0),
                           'head': (306166.4, 0)},
                   'half': {'block': (50696, 144),
                            'boundary': 1536,
                            'largest': (6144, 48),
                            'stem': (1552, 0),
                            'head': (304626.4, 0)}},
          'largest_tensor': 38597376,
          'n_blocks': 12,
          'block_params': 7087872,
          'n_params': 124439808,
          'fwd_flops_per_unit': 248879616,
          'output_per_unit': 50257,
          'default_size': 1024,
          'uniform': True},
 'gpt2-medium': {'family': 'transformer',
                 'unit': 'token',
                 'acts': {'fp32': {'block': (122896, 192),
                                   'boundary': 4096,
                                   'largest': (16384, 64),
                                   'stem': (4112, 0),
                                   'head': (410264.4, 0)},
                          'amp': {'block': (71696, 192),
                                  'boundary': 4096,
                                  'largest': (8192, 64),
                                  'stem': (4112, 0),
                                  'head': (307702.4, 0)},
                          'half': {'block': (67592, 192),
                                   'boundary': 2048,
                                   'largest': (8192, 64),
                                   'stem': (2064, 0),
                                   'head': (305650.4, 0)}},
                 'largest_tensor': 51463168,
                 'n_blocks': 24,
                 'block_params': 12596224,
                 'n_params': 354823168,
                 'fwd_flops_per_unit': 709646336,
                 'output_per_unit': 50257,
                 'default_size': 1024,
                 'uniform': True},
 'gpt2-large': {'family': 'transformer',
                'unit': 'token',
                'acts': {'fp32': {'block': (153616, 240),
                                  'boundary': 5120,
                                  'largest': (20480, 80),
                                  'stem': (5136, 0),
                                  'head': (412312.4, 0)},
                         'amp': {'block': (89616, 240),
                                 'boundary': 5120,
                                 'largest': (10240, 80),
                                 'stem': (5136, 0),
                                 'head': (309238.4, 0)},
                         'half': {'block': (84488, 240),
                                  'boundary': 2560,
                                  'largest': (10240, 80),
                                  'stem': (2576, 0),
                                  'head': (306674.4, 0)}},
                'largest_tensor': 64328960,
                'n_blocks': 36,
                'block_params': 19677440,
                'n_params': 774030080,
                'fwd_flops_per_unit': 1548060160,
                'output_per_unit': 50257,
                'default_size': 1024,
                'uniform': True},
 'gpt2-xl': {'family': 'transformer',
             'unit': 'token',
             'acts': {'fp32': {'block': (192016, 300),
                               'boundary': 6400,
                               'largest': (25600, 100),
                               'stem': (6416, 0),
                               'head': (414872.4, 0)},
                      'amp': {'block': (112016, 300),
                              'boundary': 6400,
                              'largest': (12800, 100),
                              'stem': (6416, 0),
                              'head': (311158.4, 0)},
                      'half': {'block': (105608, 300),
                               'boundary': 3200,
                               'largest': (12800, 100),
                               'stem': (3216, 0),
                               'head': (307954.4, 0)}},
             'largest_tensor': 80411200,
             'n_blocks': 48,
             'block_params': 30740800,
             'n_params': 1557611200,
             'fwd_flops_per_unit': 3115222400,
             'output_per_unit': 50257,
             'default_size': 1024,
             'uniform': True},
 'bert-base': {'family': 'transformer',
               'unit': 'token',
               'acts': {'fp32': {'block': (55312, 144),
                                 'boundary': 3072,
                                 'largest': (12288, 48),
                                 'stem': (6264, 0),
                                 'head': (3288.8, 0)},
                        'amp': {'block': (38416, 144),
                                'boundary': 3072,
                                'largest': (6144, 48),
                                'stem': (6264, 0),
                                'head': (144.7, 0)},
                        'half': {'block': (32264, 144),
                                 'boundary': 1536,
                                 'largest': (6144, 48),
                                 'stem': (3188, 0),
                                 'head': (1644.5, 0)}},
               'largest_tensor': 23440896,
               'n_blocks': 12,
               'block_params': 7087872,
               'n_params': 109483778,
               'fwd_flops_per_unit': 218967556,
               'output_per_unit': 0,
               'default_size': 512,
               'uniform': True},
 'bert-large': {'family': 'transformer',
                'unit': 'token',
                'acts': {'fp32': {'block': (73744, 192),
                                  'boundary': 4096,
                                  'largest': (16384, 64),
                                  'stem': (8312, 0),
                                  'head': (4384.8, 0)},
                         'amp': {'block': (51216, 192),
                                 'boundary': 4096,
                                 'largest': (8192, 64),
                                 'stem': (8312, 0),
                                 'head': (192.7, 0)},
                         'half': {'block': (43016, 192),
                                  'boundary': 2048,
                                  'largest': (8192, 64),
                                  'stem': (4212, 0),
                                  'head': (2192.5, 0)}},
                'largest_tensor': 31254528,
                'n_blocks': 24,
                'block_params': 12596224,
                'n_params': 335143938,
                'fwd_flops_per_unit': 670287876,
                'output_per_unit': 0,
                'default_size': 512,
                'uniform': True},
 'mlp': {'family': 'mlp',
         'unit': 'sample',
         'acts': {'fp32': {'block': ((0, 0), (3136, 0), (2048, 0), (0, 0), (2048, 0), (0, 0), (2048, 0), (0, 0),
                                     (2048, 0), (0, 0)),
                           'boundary': (3136, 3136, 2048, 2048, 2048, 2048, 2048, 2048, 2048, 2048),
                           'largest': ((0, 0), (3136, 0), (2048, 0), (0, 0), (2048, 0), (0, 0), (2048, 0), (0, 0),
                                       (2048, 0), (0, 0)),
                           'stem': (0, 0),
                           'head': (56, 0)},
                  'amp': {'block': ((0, 0), (1568, 0), (1024, 0), (0, 0), (1024, 0), (0, 0), (1024, 0), (0, 0),
                                    (1024, 0), (0, 0)),
                          'boundary': (3136, 3136, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024),
                          'largest': ((0, 0), (1568, 0), (1024, 0), (0, 0), (1024, 0), (0, 0), (1024, 0), (0, 0),
                                      (1024, 0), (0, 0)),
                          'stem': (0, 0),
                          'head': (56, 0)},
                  'half': {'block': ((0, 0), (1568, 0), (1024, 0), (0, 0), (1024, 0), (0, 0), (1024, 0), (0, 0),
                                     (1024, 0), (0, 0)),
                           'boundary': (1568, 1568, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024),
                           'largest': ((0, 0), (1568, 0), (1024, 0), (0, 0), (1024, 0), (0, 0), (1024, 0), (0, 0),
                                       (1024, 0), (0, 0)),
                           'stem': (0, 0),
                           'head': (56, 0)}},
         'largest_tensor': 401408,
         'n_blocks': 10,
         'block_params': (0, 401920, 0, 262656, 0, 262656, 0, 262656, 0, 5130),
         'n_params': 1195018,
         'fwd_flops_per_unit': 2385920,
         'output_per_unit': 0,
         'ref_size': 28,
         'default_size': 28,
         'uniform': False},
 'small-cnn': {'family': 'mlp',
               'unit': 'sample',
               'acts': {'fp32': {'block': ((3136, 0), (100352, 0), (50176, 0), (25088, 0), (50176, 0), (25088, 0),
                                           (0, 0), (12544, 0), (512, 0), (0, 0)),
                                 'boundary': (3136, 100352, 100352, 25088, 50176, 50176, 12544, 12544, 512, 512),
                                 'largest': ((3136, 0), (100352, 0), (50176, 0), (25088, 0), (50176, 0),
                                             (25088, 0), (0, 0), (12544, 0), (512, 0), (0, 0)),
                                 'stem': (0, 0),
                                 'head': (56, 0)},
                        'amp': {'block': ((1568, 0), (50176, 0), (50176, 0), (12544, 0), (25088, 0), (25088, 0),
                                          (0, 0), (6272, 0), (256, 0), (0, 0)),
                                'boundary': (3136, 50176, 50176, 12544, 25088, 25088, 6272, 6272, 256, 256),
                                'largest': ((1568, 0), (50176, 0), (50176, 0), (12544, 0), (25088, 0), (25088, 0),
                                            (0, 0), (6272, 0), (256, 0), (0, 0)),
                                'stem': (0, 0),
                                'head': (56, 0)},
                        'half': {'block': ((1568, 0), (50176, 0), (50176, 0), (12544, 0), (25088, 0), (25088, 0),
                                           (0, 0), (6272, 0), (256, 0), (0, 0)),
                                 'boundary': (1568, 50176, 50176, 12544, 25088, 25088, 6272, 6272, 256, 256),
                                 'largest': ((1568, 0), (50176, 0), (50176, 0), (12544, 0), (25088, 0), (25088, 0),
                                             (0, 0), (6272, 0), (256, 0), (0, 0)),
                                 'stem': (0, 0),
                                 'head': (56, 0)}},
               'largest_tensor': 401408,
               'n_blocks': 10,
               'block_params': (320, 0, 0, 18496, 0, 0, 0, 401536, 0, 1290),
               'n_params': 421642,
               'fwd_flops_per_unit': 8482304,
               'output_per_unit': 0,
               'ref_size': 28,
               'default_size': 28,
               'uniform': False},
 'resnet18': {'family': 'vision',
              'unit': 'image area',
              'acts': {'fp32': {'block': ((4016128, 0), (3213312, 0), (2013184, 0), (1609728, 0), (1015808, 0),
                                          (811008, 0), (526336, 0), (417792, 0)),
                                'boundary': (802816, 802816, 802816, 401408, 401408, 200704, 200704, 100352),
                                'largest': ((802816, 0), (802816, 0), (401408, 0), (401408, 0), (200704, 0),
                                            (200704, 0), (100352, 0), (100352, 0)),
                                'stem': (8631296, 0),
                                'head': (6064, 0)},
                       'amp': {'block': ((2008576, 0), (1607168, 0), (1008128, 0), (805888, 0), (510976, 0),
                                         (407552, 0), (269312, 0), (212992, 0)),
                               'boundary': (401408, 401408, 401408, 200704, 200704, 100352, 100352, 50176),
                               'largest': ((401408, 0), (401408, 0), (200704, 0), (200704, 0), (100352, 0),
                                           (100352, 0), (50176, 0), (50176, 0)),
                               'stem': (5118720, 0),
                               'head': (5040, 0)},
                       'half': {'block': ((2008064, 0), (1606656, 0), (1006592, 0), (804864, 0), (507904, 0),
                                          (405504, 0), (263168, 0), (208896, 0)),
                                'boundary': (401408, 401408, 401408, 200704, 200704, 100352, 100352, 50176),
                                'largest': ((401408, 0), (401408, 0), (200704, 0), (200704, 0), (100352, 0),
                                            (100352, 0), (50176, 0), (50176, 0)),
                                'stem': (5118464, 0),
                                'head': (5040, 0)}},
              'largest_tensor': 2359296,
              'n_blocks': 8,
              'block_params': (73984, 73984, 230144, 295424, 919040, 1180672, 3673088, 4720640),
              'n_params': 11689512,
              'fwd_flops_per_unit': 3628146688,
              'output_per_unit': 0,
              'ref_size': 224,
              'default_size': 224,
              'uniform': False},
 'resnet50': {'family': 'vision',
              'unit': 'image area',
              'acts': {'fp32': {'block': ((13658112, 0), (9639936, 0), (9639936, 0), (8851456, 0), (4829184, 0),
                                          (4829184, 0), (4829184, 0), (4456448, 0), (2433024, 0), (2433024, 0),
                                          (2433024, 0), (2433024, 0), (2433024, 0), (2289664, 0), (1253376, 0),
                                          (1253376, 0)),
                                'boundary': (802816, 3211264, 3211264, 3211264, 1605632, 1605632, 1605632, 1605632,
                                             802816, 802816, 802816, 802816, 802816, 802816, 401408, 401408),
                                'largest': ((3211264, 0), (3211264, 0), (3211264, 0), (1605632, 0), (1605632, 0),
                                            (1605632, 0), (1605632, 0), (802816, 0), (802816, 0), (802816, 0),
                                            (802816, 0), (802816, 0), (802816, 0), (401408, 0), (401408, 0),
                                            (401408, 0)),
                                'stem': (8631296, 0),
                                'head': (12208, 0)},
                       'amp': {'block': ((6831616, 0), (4821504, 0), (4821504, 0), (4430848, 0), (2417664, 0),
                                         (2417664, 0), (2417664, 0), (2238464, 0), (1222656, 0), (1222656, 0),
                                         (1222656, 0), (1222656, 0), (1222656, 0), (1165312, 0), (638976, 0),
                                         (638976, 0)),
                               'boundary': (401408, 1605632, 1605632, 1605632, 802816, 802816, 802816, 802816,
                                            401408, 401408, 401408, 401408, 401408, 401408, 200704, 200704),
                               'largest': ((1605632, 0), (1605632, 0), (1605632, 0), (802816, 0), (802816, 0),
                                           (802816, 0), (802816, 0), (401408, 0), (401408, 0), (401408, 0),
                                           (401408, 0), (401408, 0), (401408, 0), (200704, 0), (200704, 0),
                                           (200704, 0)),
                               'stem': (5118720, 0),
                               'head': (8112, 0)},
                       'half': {'block': ((6829056, 0), (4819968, 0), (4819968, 0), (4425728, 0), (2414592, 0),
                                          (2414592, 0), (2414592, 0), (2228224, 0), (1216512, 0), (1216512, 0),
                                          (1216512, 0), (1216512, 0), (1216512, 0), (1144832, 0), (626688, 0),
                                          (626688, 0)),
                                'boundary': (401408, 1605632, 1605632, 1605632, 802816, 802816, 802816, 802816,
                                             401408, 401408, 401408, 401408, 401408, 401408, 200704, 200704),
                                'largest': ((1605632, 0), (1605632, 0), (1605632, 0), (802816, 0), (802816, 0),
                                            (802816, 0), (802816, 0), (401408, 0), (401408, 0), (401408, 0),
                                            (401408, 0), (401408, 0), (401408, 0), (200704, 0), (200704, 0),
                                            (200704, 0)),
                                'stem': (5118464, 0),
                                'head': (8112, 0)}},
              'largest_tensor': 2359296,
              'n_blocks': 16,
              'block_params': (75008, 70400, 70400, 379392, 280064, 280064, 280064, 1512448, 1117184, 1117184,
                               1117184, 1117184, 1117184, 6039552, 4462592, 4462592),
              'n_params': 25557032,
              'fwd_flops_per_unit': 8178368512,
              'output_per_unit': 0,
              'ref_size': 224,
              'default_size': 224,
              'uniform': False},
 'efficientnet_b0': {'family': 'vision',
                     'unit': 'image area',
                     'acts': {'fp32': {'block': ((8832064, 0), (20375712, 0), (13252656, 0), (7658288, 0),
                                                 (5529680, 0), (3209680, 0), (2780320, 0), (2780320, 0),
                                                 (2805920, 0), (3892448, 0), (3892448, 0), (2263008, 0),
                                                 (1705344, 0), (1705344, 0), (1705344, 0), (1732480, 0)),
                                       'boundary': (1605632, 802816, 301056, 301056, 125440, 125440, 62720, 62720,
                                                    62720, 87808, 87808, 87808, 37632, 37632, 37632, 37632),
                                       'largest': ((1605632, 0), (4816896, 0), (1806336, 0), (1806336, 0),
                                                   (752640, 0), (752640, 0), (376320, 0), (376320, 0), (376320, 0),
                                                   (526848, 0), (526848, 0), (526848, 0), (225792, 0), (225792, 0),
                                                   (225792, 0), (225792, 0)),
                                       'stem': (3813888, 0),
                                       'head': (594096, 0)},
                              'amp': {'block': ((4416224, 0), (10188720, 0), (6627576, 0), (3830456, 0),
                                                (2766920, 0), (1607080, 0), (1394320, 0), (1394320, 0),
                                                (1407248, 0), (1952048, 0), (1952048, 0), (1137648, 0),
                                                (862656, 0), (862656, 0), (862656, 0), (876736, 0)),
                                      'boundary': (802816, 401408, 150528, 150528, 62720, 62720, 31360, 31360,
                                                   31360, 43904, 43904, 43904, 18816, 18816, 18816, 18816),
                                      'largest': ((802816, 0), (2408448, 0), (903168, 0), (903168, 0), (376320, 0),
                                                  (376320, 0), (188160, 0), (188160, 0), (188160, 0), (263424, 0),
                                                  (263424, 0), (263424, 0), (112896, 0), (112896, 0), (112896, 0),
                                                  (112896, 0)),
                                      'stem': (1907072, 0),
                                      'head': (304176, 0)},
                              'half': {'block': ((4416032, 0), (10187856, 0), (6626328, 0), (3829144, 0),
                                                 (2764840, 0), (1604840, 0), (1390160, 0), (1390160, 0),
                                                 (1402960, 0), (1946224, 0), (1946224, 0), (1131504, 0),
                                                 (852672, 0), (852672, 0), (852672, 0), (866240, 0)),
                                       'boundary': (802816, 401408, 150528, 150528, 62720, 62720, 31360, 31360,
                                                    31360, 43904, 43904, 43904, 18816, 18816, 18816, 18816),
                                       'largest': ((802816, 0), (2408448, 0), (903168, 0), (903168, 0),
                                                   (376320, 0), (376320, 0), (188160, 0), (188160, 0), (188160, 0),
                                                   (263424, 0), (263424, 0), (263424, 0), (112896, 0), (112896, 0),
                                                   (112896, 0), (112896, 0)),
                                       'stem': (1906944, 0),
                                       'head': (299056, 0)}},
                     'largest_tensor': 1280000,
                     'n_blocks': 16,
                     'block_params': (1448, 6004, 10710, 15350, 31290, 37130, 102900, 102900, 126004, 208572,
                                      208572, 262492, 587952, 587952, 587952, 717232),
                     'n_params': 5288548,
                     'fwd_flops_per_unit': 771629504,
                     'output_per_unit': 0,
                     'ref_size': 224,
                     'default_size': 224,
                     'uniform': False}}
)
