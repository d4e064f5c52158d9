"""How the planner's activation coefficients are measured: for a GPT-2 of your own shape now (:func:`gpt2_spec`), and
for the presets in ``presets.json`` (``course_tools/measure_presets.py`` runs the same functions).

A forward pass runs with saved-tensor hooks: every tensor autograd keeps for backward is counted once, by storage, and
attributed to the block that was running. Transformers are measured with 2 of their (identical) blocks at 64 and 128
tokens and fitted as ``lin * T + quad * T**2`` per block; CNNs at their reference image size, block by block. Fake
tensors (shapes, no memory) make GPT-2-XL's blocks cost nothing. Each ``pricing`` says whose kernels run: ``'cpu'``
(math attention, dropout masks in the activations' dtype, bf16 autocast for the 'amp' kind), or fake CUDA tensors for
``'cuda-math'``, ``'cuda-fused'`` (transformers) and ``'cuda'`` (the rest). These run without a GPU, with CUDA's
dropout (a bool mask), CUDA's fp16 autocast rules for 'amp' (switched on directly: ``torch.autocast('cuda')`` turns
itself off without a GPU; bf16 keeps the same byte widths) and the attention kernel a GPU picks
(``models.as_on_cuda``: flash for fp16/bf16, memory-efficient for fp32). So every CUDA figure is measured.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from .. import models
from ..memory import iter_tensors, storage_key
from .specs import ModelSpec, spec_from_data

KINDS = ("fp32", "amp", "half")  # fp32 weights, fp32 weights under autocast, fp16 weights
TOKENS = (64, 128)  # the two sequence lengths a transformer is measured at


def profile_activations(model, blocks, inputs=(), kwargs=None, *, autocast_dtype=None) -> dict:
    """Saved-tensor bytes of one forward pass of a model in training mode, split by block; real or fake tensors.

    Returns ``{"block": [...], "boundary": [...], "largest": [...], "sizes": [[...]], "stem": int, "head": int,
    "output": int}`` in bytes (stem: saved before the first block runs; head: after; output: what forward returns that
    autograd does not keep, such as the logits). Parameters are not activations; under autocast (``autocast_dtype``:
    the dtype of an autocast already switched on around this call), the half copies of the weights it saves are left
    out too: the planner counts them apart.
    """
    blocks = list(blocks)
    params = list(model.parameters())
    param_keys = {storage_key(p) for p in params}
    param_shapes = {tuple(sorted(p.shape)) for p in params if p.dim() >= 2}
    seen: dict = {}
    n = len(blocks)
    out = {"block": [0] * n, "boundary": [0] * n, "sizes": [[] for _ in range(n)], "stem": 0, "head": 0, "output": 0}
    current, started = [None], [False]

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
        key = storage_key(t)
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
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = model(*inputs, **(kwargs or {}))
        for t in iter_tensors(result):  # returned but not saved: the logits
            if storage_key(t) not in seen and storage_key(t) not in param_keys:
                seen[storage_key(t)] = t
                out["output"] += t.untyped_storage().nbytes()
    finally:
        for h in handles:
            h.remove()
    out["largest"] = [max(sizes, default=0) for sizes in out["sizes"]]
    return out


@contextlib.contextmanager
def _cuda_autocast(dtype):
    """CUDA's autocast rules for (fake) CUDA tensors, with or without a GPU."""
    enabled, old = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", old)


def _coefficients(p1, p2, transformer: bool, first_block: bool = False) -> dict:
    """Per-sample (lin, quad) coefficients from the profiles at TOKENS (a transformer: its second block, the first's
    twin, stands for all; ``first_block``: the first block's own as ``first``, which saves less when only some layers
    train: nothing before its first adapter), or from one profile (p1 is p2) with every block at u = 1."""
    if not transformer:
        return {"block": [(b, 0.0) for b in p1["block"]], "boundary": p1["boundary"],
                "largest": [(x, 0.0) for x in p1["largest"]], "stem": (p1["stem"], 0.0), "head": (p1["head"], 0.0),
                "output": (p1["output"], 0.0)}
    u1, u2 = TOKENS

    def fit(a, b):  # lin * u + quad * u**2 through both measurements
        quad = (b / u2 - a / u1) / (u2 - u1)
        return (a / u1 - quad * u1, max(quad, 0.0))

    lin = quad = 0.0
    for a, b in zip(p1["sizes"][1], p2["sizes"][1]):  # saved tensors growing 4x from u1 to 2 u1 are T x T
        if a and b / a > 3:
            quad = max(quad, b / u2**2)
        else:
            lin = max(lin, b / u2)
    first = {"first": fit(p1["block"][0], p2["block"][0])} if first_block else {}
    return {"block": fit(p1["block"][1], p2["block"][1]), "boundary": p2["boundary"][1] / u2, "largest": (lin, quad),
            "stem": fit(p1["stem"], p2["stem"]), "head": fit(p1["head"], p2["head"]),
            "output": fit(p1["output"], p2["output"]), **first}


def measure_acts(build, *, transformer: bool, fake: bool = True, kinds=KINDS, pricings=None,
                 first_block: bool = False) -> dict:
    """``acts[pricing][kind]`` (see the module docstring) of a model, measured now. ``build(kind, attention)`` returns
    (model, blocks, make_inputs(u)); it runs inside each pricing's device (and fake mode with ``fake``). ``pricings``:
    by default every one the model has (``fake=False`` measures 'cpu' only); ``first_block``: the first block's own
    coefficients too (``first``)."""
    allowed = (("cpu", "cuda-math", "cuda-fused") if transformer else ("cpu", "cuda")) if fake else ("cpu",)
    pricings = pricings or allowed
    if not set(pricings) <= set(allowed) or not set(kinds) <= set(KINDS):
        raise ValueError(f"Choose kinds from {KINDS} and pricings from {allowed}, not {kinds} and {pricings} (the CUDA "
                         "pricings run on fake CUDA tensors: pass fake=True).")
    acts: dict = {}
    for pricing in pricings:
        device = "cpu" if pricing == "cpu" else "cuda"
        acts[pricing] = {}
        for kind in kinds:
            dtype, autocast = None, contextlib.nullcontext()
            if kind == "amp":
                dtype = torch.float16 if device == "cuda" else torch.bfloat16
                autocast = _cuda_autocast(dtype) if device == "cuda" else torch.autocast("cpu", dtype=dtype)
            fake_ctx = models.fake_mode() if fake else contextlib.nullcontext()
            cuda_ctx = models.as_on_cuda() if device == "cuda" else contextlib.nullcontext()
            with fake_ctx, torch.device(device), cuda_ctx:
                model, blocks, make = build(kind, "fused" if pricing == "cuda-fused" else "math")
                with autocast:
                    profiles = [profile_activations(model, blocks, *make(u), autocast_dtype=dtype)
                                for u in (TOKENS if transformer else (1,))]
            acts[pricing][kind] = _coefficients(profiles[0], profiles[-1], transformer, first_block)
    return acts


def transformer_data(model, blocks, n_layer: int, acts: dict, **sizes) -> dict:
    """``presets.json``'s entry for a transformer of ``n_layer`` identical blocks, built with ``blocks`` of them.
    ``sizes``: output_per_unit (the vocabulary of its logits), default_size, max_size."""
    per_block = sum(p.numel() for p in blocks[0].parameters())
    n_params = sum(p.numel() for p in model.parameters()) + (n_layer - len(blocks)) * per_block
    return {"family": "transformer", "unit": "token", "acts": acts,
            "largest_tensor": max(p.numel() for p in model.parameters()), "n_blocks": n_layer,
            "block_params": per_block, "block_largest": max(p.numel() for p in blocks[0].parameters()),
            "n_params": n_params, "fwd_flops_per_unit": 2.0 * n_params, **sizes, "uniform": True}


def _build_gpt2(size: str, overrides: dict, kind: str, attention: str):
    """GPT-2 ``size`` (2 blocks: they are identical) as :func:`measure_acts` builds it. It trains without a KV cache
    (``use_cache=False``, as checkpointing forces anyway)."""
    model = models.build_gpt2(size, dtype=torch.float16 if kind == "half" else torch.float32, attention=attention,
                              **{"use_cache": False, **overrides, "n_layer": 2})

    def make(u):
        x = torch.randint(0, model.config.vocab_size, (1, u))
        return (), {"input_ids": x, "labels": x}
    return model, list(model.transformer.h), make


def gpt2_data(size: str, *, kinds=KINDS, fake: bool = True, pricings=None, **overrides) -> dict:
    """``presets.json``'s entry for GPT-2 ``size``, measured now; ``overrides`` change its config (n_layer=2, ...)."""
    build = functools.partial(_build_gpt2, size, overrides)
    acts = measure_acts(build, transformer=True, fake=fake, kinds=kinds, pricings=pricings)
    with models.fake_mode():
        model, blocks, _ = build("fp32", "math")
    return transformer_data(model, blocks, {**models.GPT2_SIZES[size], **overrides}["n_layer"], acts,
                            output_per_unit=model.config.vocab_size, default_size=1024,
                            max_size=model.config.max_position_embeddings)


def gpt2_spec(size: str = "gpt2", *, kinds=KINDS, fake: bool = True, pricings=None, **overrides) -> ModelSpec:
    """A GPT-2 of your own shape (``gpt2_spec(n_layer=2, n_embd=128, n_head=4)``), measured now with fake tensors (a
    few seconds). ``kinds`` and ``pricings``: what to measure (fewer = faster); planning for another then raises
    ValueError. ``fake=False`` runs real tensors (faster for tiny models; the CPU's pricing only)."""
    models.gpt2_config(size, **overrides)  # checks the size and the overrides
    label = size + "".join(f", {k}={v}" for k, v in overrides.items())
    return spec_from_data(label, gpt2_data(size, kinds=kinds, fake=fake, pricings=pricings, **overrides))


def small_cnn():
    """The course's small CNN for 28x28 digits: two conv blocks, a hidden linear layer, a classifier."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )
