"""How the planner's activation coefficients are measured (the numbers in ``presets.json``).

A forward pass runs with saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``): every
tensor autograd keeps for backward is counted once, by storage, and attributed to the block that
was running. Transformers are measured with 2 of their (identical) blocks at sequence lengths 64
and 128 and fitted as ``lin * T + quad * T**2`` per block; CNNs at their reference image size,
block by block. Fake tensors (shapes, no memory) make GPT-2-XL's blocks cost nothing.

Each preset is measured for each ``pricing``, i.e. whose kernels run:

- ``'cpu'``: fake CPU tensors, the CPU's kernels: math attention (transformers' 'eager'),
  dropout masks in the activations' dtype, CPU autocast (bf16) for the 'amp' kind.
- ``'cuda-math'``, ``'cuda-fused'`` (transformers) and ``'cuda'`` (the rest): fake CUDA tensors.
  A forward pass on fake CUDA tensors runs without a GPU, with CUDA's own dropout (a bool mask)
  and, for the 'amp' kind, CUDA's autocast rules in fp16 (switched on directly:
  ``torch.autocast('cuda')`` turns itself off without a GPU); bf16 autocast keeps the same byte
  widths. Fused attention runs the kernel op a GPU picks (``course_utils.models.as_on_cuda``):
  flash attention for fp16/bf16, the memory-efficient kernel for fp32. So every CUDA figure is
  measured on fake CUDA tensors, none derived by hand.
"""
from __future__ import annotations

import contextlib

from ..memory import iter_tensors
from ..validation import positive_int
from .specs import ModelSpec, model_presets, spec_from_data

KINDS = ("fp32", "amp", "half")
TRANSFORMER_PRICINGS = ("cpu", "cuda-math", "cuda-fused")
OTHER_PRICINGS = ("cpu", "cuda")
# family -> (unit, the two sizes measured, has a sequence-length-squared term)
_UNITS = {"gpt2": ("token", (64, 128), True), "bert": ("token", (64, 128), True),
          "mlp": ("sample", (1, 1), False), "small-cnn": ("sample", (1, 1), False),
          "resnet18": ("image area", (1, 1), False), "resnet50": ("image area", (1, 1), False),
          "efficientnet_b0": ("image area", (1, 1), False)}


def profile_activations(model, blocks, inputs=(), kwargs=None, *, autocast_dtype=None) -> dict:
    """Saved-tensor bytes of one forward pass, split by block; works on real and fake tensors.

    Returns ``{"block": [...], "boundary": [...], "largest": [...], "stem": int, "head": int,
    "output": int}`` in bytes (stem: saved before the first block runs; head: after; output: what
    forward returns that autograd does not keep, such as the logits). Parameters are not
    activations; under autocast (``autocast_dtype``: the dtype of an autocast already switched on
    around this call), the half copies of the weights it saves are left out too: the planner
    counts them apart. Run the call inside the autocast context you measure.
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
    out = {"block": [0] * n, "boundary": [0] * n, "sizes": [[] for _ in range(n)], "stem": 0, "head": 0, "output": 0}
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
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = model(*inputs, **kwargs)
        for t in iter_tensors(result):  # returned but not saved: the logits
            key = t.untyped_storage()._cdata
            if key not in seen and key not in param_keys:
                seen[key] = t
                out["output"] += t.untyped_storage().nbytes()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out["largest"] = [max(sizes, default=0) for sizes in out["sizes"]]
    return out


@contextlib.contextmanager
def _cuda_autocast(dtype):
    """CUDA's autocast rules for (fake) CUDA tensors, with or without a GPU."""
    import torch

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


def _autocast(device: str, kind: str):
    """(context, dtype) of the autocast a 'amp' measurement runs under on ``device``."""
    import torch

    if kind != "amp":
        return contextlib.nullcontext(), None
    if device == "cuda":
        return _cuda_autocast(torch.float16), torch.float16
    return torch.autocast("cpu", dtype=torch.bfloat16), torch.bfloat16


def _fit(p1, p2, u1, u2, quad: bool):
    """Per-sample (lin, quad) from measurements at u1 and u2 (batch of 1)."""
    if not quad:
        return (p2 / u2, 0.0) if u2 else (p2, 0.0)
    q = (p2 / u2 - p1 / u1) / (u2 - u1)
    lin = p1 / u1 - q * u1
    return (lin, max(q, 0.0))


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


def small_cnn():
    """The course's small CNN for 28x28 digits: two conv blocks, a hidden linear layer, a classifier."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def _with_loss(model):
    """Wrap a classifier so forward returns its cross-entropy loss (as the training step does)."""
    from torch import nn

    class WithLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.inner(x).float(), y)

    return WithLoss(model)


def _build(name: str, kind: str, overrides: dict | None = None, *, full_depth: bool = False,
           attention: str = "math"):
    """Build preset ``name`` in the kind's dtype; returns (model, blocks, make_inputs(u, size=None)).

    Transformers train without a KV cache (``use_cache=False``, as checkpointing forces anyway).
    """
    import torch

    from .. import models

    dtype = torch.float16 if kind == "half" else torch.float32
    if name.startswith("gpt2"):
        cfg = {"use_cache": False, **(overrides or {})}
        if not full_depth:
            cfg["n_layer"] = 2  # blocks are identical: 2 suffice
        model = models.build_gpt2(name, dtype=dtype, attention=attention, **cfg)
        vocab = model.config.vocab_size

        def make(u, size=None):
            x = torch.randint(0, vocab, (1, u))
            return (), {"input_ids": x, "labels": x}
        return model, list(model.transformer.h), make
    if name.startswith("bert"):
        from transformers import BertConfig, BertForSequenceClassification

        size = {} if name == "bert-base" else dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096)
        cfg = BertConfig(num_hidden_layers=2, **size)
        cfg._attn_implementation = models.ATTENTION[attention]
        with models.default_dtype(dtype):
            model = BertForSequenceClassification(cfg)

        def make(u, size=None):
            x = torch.randint(0, cfg.vocab_size, (1, u))
            return (), {"input_ids": x, "labels": torch.zeros(1, dtype=torch.long)}
        return model, list(model.bert.encoder.layer), make
    if name in ("mlp", "small-cnn"):
        with models.default_dtype(dtype):
            model = models.mlp() if name == "mlp" else small_cnn()

        def make(u, size=None):
            size = size or 28
            return (torch.randn(1, 1, size, size, dtype=dtype), torch.zeros(1, dtype=torch.long)), {}
        return _with_loss(model), list(model.children()), make
    if name in ("resnet18", "resnet50", "efficientnet_b0"):
        import timm

        with models.default_dtype(dtype):
            model = timm.create_model(name, pretrained=False)
        if name.startswith("resnet"):
            blocks = [b for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for b in stage]
        else:
            blocks = [b for stage in model.blocks for b in stage]

        def make(u, size=None):
            size = size or 224
            return (torch.randn(1, 3, size, size, dtype=dtype), torch.zeros(1, dtype=torch.long)), {}
        return _with_loss(model), blocks, make
    raise ValueError(f"No builder for {name!r}.")


def _family(name: str) -> str:
    return "gpt2" if name.startswith("gpt2") else "bert" if name.startswith("bert") else name


def measure_spec_data(name: str, *, fake: bool = True, kinds=KINDS, pricings=None, **overrides) -> dict:
    """Measure a preset's coefficients from scratch (the numbers stored in ``presets.json``).

    ``kinds``: 'fp32' (fp32 weights), 'amp' (fp32 weights under autocast), 'half' (fp16
    weights). ``pricings``: whose kernels (see the module docstring); by default every one the
    model has (``fake=False`` can only measure 'cpu'). ``overrides`` change a GPT-2 config
    (``n_layer=2, n_embd=128, n_head=4``) for small GPT-2s.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from .. import models

    if not isinstance(name, str):
        raise TypeError(f"name must be a preset name, not {type(name).__name__}.")
    family = _family(name)
    if overrides and family != "gpt2":
        raise ValueError(f"Config overrides work for GPT-2 sizes only, not {name!r}.")
    if family not in _UNITS or (family == "gpt2" and name not in models.GPT2_SIZES) or (
            family == "bert" and name not in ("bert-base", "bert-large")):
        raise ValueError(f"Unknown preset {name!r}; choose one of {model_presets()}.")
    unit, (u1, u2), quad = _UNITS[family]
    transformer = unit == "token"
    allowed = TRANSFORMER_PRICINGS if transformer else OTHER_PRICINGS
    pricings = tuple(pricings or (allowed if fake else ("cpu",)))
    for pricing in pricings:
        if pricing not in allowed:
            raise ValueError(f"pricing {pricing!r} does not apply to {name}; choose from {allowed}.")
        if pricing != "cpu" and not fake:
            raise ValueError(f"pricing {pricing!r} runs on fake CUDA tensors: pass fake=True.")
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"Unknown kind {kind!r}; choose from {KINDS}.")
    data: dict = {"family": "transformer" if transformer else ("vision" if unit == "image area" else "mlp"),
                  "unit": unit, "acts": {}}
    for pricing in pricings:
        device = "cpu" if pricing == "cpu" else "cuda"
        attention = "fused" if pricing == "cuda-fused" else "math"
        data["acts"][pricing] = {}
        for kind in kinds:
            fake_ctx = models.fake_mode() if fake else contextlib.nullcontext()
            cuda_ctx = models.as_on_cuda() if device == "cuda" else contextlib.nullcontext()
            autocast, autocast_dtype = _autocast(device, kind)
            with fake_ctx, torch.device(device), cuda_ctx:
                model, blocks, make = _build(name, kind, overrides, attention=attention)
                with autocast:
                    p1 = profile_activations(model, blocks, *make(u1), autocast_dtype=autocast_dtype)
                    p2 = profile_activations(model, blocks, *make(u2), autocast_dtype=autocast_dtype) if quad else p1
                if "n_params" not in data:
                    _describe(data, name, model, blocks, make, u1, overrides, FlopCounterMode)
            uu1, uu2 = (u1, u2) if transformer else (1, 1)
            idx = [1] if transformer else range(len(blocks))  # transformers: the second block (the first's twin)
            acts = {
                "block": [_fit(p1["block"][i], p2["block"][i], uu1, uu2, quad) for i in idx],
                "boundary": [p2["boundary"][i] / uu2 for i in idx],
                "largest": [_largest(p1, p2, i, uu1, uu2, quad) for i in idx],
                "stem": _fit(p1["stem"], p2["stem"], uu1, uu2, quad),
                "head": _fit(p1["head"], p2["head"], uu1, uu2, quad),
                "output": _fit(p1["output"], p2["output"], uu1, uu2, quad),
            }
            if transformer:
                acts = {k: (v[0] if k in ("block", "boundary", "largest") else v) for k, v in acts.items()}
            data["acts"][pricing][kind] = acts
    data["uniform"] = transformer
    return data


def _describe(data, name, model, blocks, make, u1, overrides, FlopCounterMode):
    """Parameter counts, FLOPs and sizes of a preset (from its first build)."""
    from .. import models

    family = _family(name)
    params = list(model.parameters())
    ids = {id(p) for b in blocks for p in b.parameters()}
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    block_largest = [max((p.numel() for p in b.parameters()), default=0) for b in blocks]
    head_params = sum(p.numel() for p in params if id(p) not in ids)
    data["largest_tensor"] = max(p.numel() for p in params)
    if data["unit"] == "token":
        config = {**models.GPT2_SIZES[name], **overrides} if family == "gpt2" else {}
        full = config["n_layer"] if family == "gpt2" else (12 if name == "bert-base" else 24)
        data["n_blocks"] = full
        data["block_params"] = block_params[0]
        data["block_largest"] = block_largest[0]
        data["n_params"] = head_params + full * block_params[0]
        data["fwd_flops_per_unit"] = 2.0 * data["n_params"]
        data["output_per_unit"] = model.config.vocab_size if family == "gpt2" else 0.0
        data["default_size"] = 1024 if family == "gpt2" else 512
        data["max_size"] = model.config.max_position_embeddings
    else:
        data["n_blocks"] = len(blocks)
        data["block_params"] = block_params
        data["block_largest"] = block_largest
        data["n_params"] = head_params + sum(block_params)
        with FlopCounterMode(display=False) as counter:
            model(*make(u1)[0])
        data["fwd_flops_per_unit"] = float(counter.get_total_flops())
        data["output_per_unit"] = 0.0  # classifier logits: a few numbers per sample
        data["ref_size"] = 224 if data["unit"] == "image area" else 28
        data["default_size"] = data["ref_size"]


def gpt2_spec(size: str = "gpt2", *, kinds=KINDS, fake: bool = True, pricings=None, **overrides) -> ModelSpec:
    """A GPT-2 of your own shape (``gpt2_spec(n_layer=2, n_embd=128, n_head=4)``), measured now
    with fake tensors (a few seconds). ``kinds`` and ``pricings``: what to measure (fewer =
    faster); planning for another then raises ValueError. ``fake=False`` runs real tensors
    (faster for tiny models; the CPU's pricing only)."""
    from .. import models

    if not isinstance(size, str) or size not in models.GPT2_SIZES:
        raise ValueError(f"Unknown GPT-2 size {size!r}; choose one of {list(models.GPT2_SIZES)}.")
    models.gpt2_config(size, **overrides)  # checks the overrides
    label = size + "".join(f", {k}={v}" for k, v in overrides.items())
    return spec_from_data(label, measure_spec_data(size, kinds=kinds, fake=fake, pricings=pricings, **overrides))


def measure_on_cpu(model, *, micro_batch: int, size=None, optimizer: str = "adam", gpt2_overrides=None):
    """Train two real steps on the CPU and measure the second with ``memory.measure_memory``.

    ``model``: 'mlp', 'small-cnn', 'resnet18', 'efficientnet_b0', or a GPT-2 size with
    ``gpt2_overrides`` (keep it small; math attention, no KV cache, as the planner's 'cpu'
    pricing). Returns the MemoryReport (fp32, no checkpointing).
    """
    import torch

    from .. import memory
    from ..estimate import normalize_optimizer

    if not isinstance(model, str):
        raise TypeError(f"model must be a preset name, not {type(model).__name__}.")
    micro_batch = positive_int(micro_batch, "micro_batch", "e.g. 8", whole_floats=True)
    if model.startswith("bert") or (model.startswith("gpt2") and not gpt2_overrides) or model == "resnet50":
        raise ValueError(f"{model!r} is too big to train on a CPU here: use 'mlp', 'small-cnn', 'resnet18' "
                         "or a small GPT-2 (gpt2_overrides=dict(n_layer=2, n_embd=128, n_head=4)).")
    net, _, make = _build(model, "fp32", gpt2_overrides, full_depth=True)
    opt_name = normalize_optimizer(optimizer)
    if opt_name == "adam8bit":
        raise ValueError("measure_on_cpu supports torch's optimizers: 'sgd', 'sgd_momentum', 'adam', 'adamw'.")
    params = net.parameters()
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=1e-3),
           "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=1e-4), "adamw": lambda: torch.optim.AdamW(params, lr=1e-4)}[opt_name]()

    def batch():
        if model.startswith("gpt2"):
            seq = positive_int(size or 64, "sequence length", "e.g. 64", whole_floats=True)
            x = torch.randint(0, net.config.vocab_size, (micro_batch, seq))
            return (), {"input_ids": x, "labels": x}
        args, _ = make(1, size)
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
