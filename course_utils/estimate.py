"""The memory arithmetic: parameters, gradients, optimizer state (Adam: m and v; 8-bit Adam: 2 bytes plus one fp32
absmax per block), activations (what autograd saves, via saved_tensors_hooks) and the optimizer step's scratch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .memory import CATEGORIES, format_bytes, iter_tensors, storage_key, tensor_bytes
from .validation import positive_int


# the course's short names; any other name is looked up in torch ("float16", "half", "int8", ...)
_SHORT_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp64": "float64"}

# state tensors per parameter, in units of the parameter's dtype (8-bit Adam handled apart)
# (adamw_fused: torch.optim.AdamW(fused=True), the same state, stepped in one kernel without foreach's scratch)
_STATE_COPIES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2, "adamw_fused": 2}
OPTIMIZERS = (*_STATE_COPIES, "adam8bit")
BNB_BLOCKSIZE = 256  # bitsandbytes' block size for 8-bit optimizer state since 0.44
BNB_MIN_8BIT_SIZE = 4096  # smaller tensors keep 32-bit state


def dtype_of(dtype) -> torch.dtype:
    """'fp16' / 'bf16' / torch.float16 ... -> torch.dtype, with a clear error for anything else."""
    found = dtype
    if isinstance(dtype, str):
        found = getattr(torch, _SHORT_NAMES.get(dtype.lower(), dtype.lower()), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_SHORT_NAMES)}, 'int8', or a torch.dtype.")
    return found


def normalize_optimizer(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"optimizer must be a name such as 'adam', not {type(name).__name__}.")
    key = name.lower().replace("-", "_").replace(" ", "_").replace("+", "_")  # "SGD+momentum" -> "sgd_momentum"
    if key not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {name!r}; choose one of {OPTIMIZERS}.")
    return key


def count_params(model: nn.Module) -> int:
    """Number of parameters, each shared (tied) parameter counted once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"count_params needs a torch.nn.Module, not {type(model).__name__}.")
    return sum(p.numel() for p in model.parameters())


def optimizer_state_bytes(n_params: int, optimizer: str = "adam", *, param_dtype="fp32",
                          tensor_sizes: list[int] | None = None) -> int:
    """Bytes of optimizer state for ``n_params`` parameters; for 8-bit Adam, ``tensor_sizes`` applies bitsandbytes'
    rule that tensors under 4096 elements keep 32-bit state."""
    n_params = positive_int(n_params, "n_params", whole_floats=True)
    opt = normalize_optimizer(optimizer)
    if opt != "adam8bit":
        return _STATE_COPIES[opt] * n_params * dtype_of(param_dtype).itemsize
    sizes = [n_params] if tensor_sizes is None else [positive_int(s, "tensor size", whole_floats=True) for s in tensor_sizes]
    # small tensors: two fp32 states; others: two uint8 states + one fp32 absmax per block each
    return sum(2 * 4 * s if s < BNB_MIN_8BIT_SIZE else 2 * s + 2 * 4 * -(-s // BNB_BLOCKSIZE) for s in sizes)


@dataclass
class TrainingBytes:
    """Bytes of the persistent training state (everything but activations)."""

    params: int
    grads: int
    optimizer: int
    master_weights: int = 0

    total = property(lambda self: self.params + self.grads + self.optimizer + self.master_weights)


def training_state_bytes(n_params: int, *, optimizer: str = "adam", param_dtype="fp32",
                         master_weights: bool = False, tensor_sizes: list[int] | None = None) -> TrainingBytes:
    """Bytes of parameters + gradients + optimizer state (+ fp32 master weights, whose optimizer state is then fp32)."""
    n_params = positive_int(n_params, "n_params", whole_floats=True)
    width, state_dtype = dtype_of(param_dtype).itemsize, "fp32" if master_weights else param_dtype
    optimizer = optimizer_state_bytes(n_params, optimizer, param_dtype=state_dtype, tensor_sizes=tensor_sizes)
    return TrainingBytes(n_params * width, n_params * width, optimizer, n_params * 4 if master_weights else 0)


def _grad_bytes(obj) -> int:
    """Bytes of the gradients backward makes for the tensors in ``obj`` that require one."""
    tensors = [t for t in iter_tensors(obj) if t.requires_grad]
    return tensor_bytes(*tensors) if tensors else 0


def _held_tensors(obj, seen=None):
    """Every tensor ``obj`` holds, also inside other objects' attributes (a returned key/value cache)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        yield obj
    elif id(obj) not in seen and not isinstance(obj, (str, bytes, int, float, bool, type(None), nn.Module)):
        seen.add(id(obj))
        items = (obj if isinstance(obj, (list, tuple, set)) else obj.values() if isinstance(obj, dict)
                 else vars(obj).values() if hasattr(obj, "__dict__") else ())
        for item in items:
            yield from _held_tensors(item, seen)


def _forward_profile(model: nn.Module, inputs, kwargs, keep_outputs: bool = True) -> dict:
    """One forward pass in train mode, recording what autograd saves and when; ``keep_outputs``: the step holds what
    the model returned through backward and the optimizer step (else only its loss)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expected a torch.nn.Module, not {type(model).__name__}.")
    if not inputs and not kwargs:
        raise ValueError("Pass an example input, e.g. activation_bytes(model, torch.randn(8, 1, 28, 28)).")
    params, seen, last_use = {storage_key(p) for p in model.parameters()}, {}, {}  # seen: storage -> segment
    leaf_modules = {id(m): name for name, m in model.named_modules() if not list(m.children())}
    # each call of a leaf module opens a segment, and its return another (same name: ops outside modules join the
    # module called last), so that backward reaches the ops after a module (the loss) before the module's weights
    segments: list[dict] = [{"saved": 0, "largest": 0, "module": "(before any module)"}]

    def pre_hook(module, args):
        if id(module) in leaf_modules:
            # backward through a module holds the gradient of its output and makes its inputs'
            segments.append({"saved": 0, "largest": 0, "module": leaf_modules[id(module)],
                             "grad_in": _grad_bytes(args)})
            for p in module.parameters(recurse=False):
                if id(p) in last_use:  # a tied weight, used again: see the walk below
                    earlier, nbytes = last_use[id(p)]
                    segments[earlier]["reused"] = segments[earlier].get("reused", 0) + nbytes
                last_use[id(p)] = (len(segments) - 1, p.numel() * p.element_size())

    def post_hook(module, args, output):
        if id(module) in leaf_modules:
            segments[-1]["grad_out"] = _grad_bytes(output)
            segments.append({"saved": 0, "largest": 0, "module": leaf_modules[id(module)]})

    def pack(t: torch.Tensor):
        if storage_key(t) not in params and storage_key(t) not in seen:
            seen[storage_key(t)] = len(segments) - 1
            segments[-1]["saved"] += t.untyped_storage().nbytes()
            segments[-1]["largest"] = max(segments[-1]["largest"], t.untyped_storage().nbytes())
        return t

    was_training = model.training
    model.train()
    handles = (torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
               torch.nn.modules.module.register_module_forward_hook(post_hook))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    # the outputs the training step holds (logits, loss, a cache), each storage once and not again if autograd saved it
    held = list(_held_tensors(out))
    outs = {storage_key(t): t.untyped_storage().nbytes() for t in held}
    del out
    # the loop that frees the outputs (`loss_fn(model(x)).backward()`, `model(**batch).loss.backward()`) keeps the
    # loss alone: a returned tensor of one element; what autograd saved stays either way
    kept = outs if keep_outputs else {k: v for k, v in outs.items() if v <= 8}
    held = [t for t in held if storage_key(t) in kept]
    output_bytes = sum(v for k, v in kept.items() if k not in seen)
    for k, v in kept.items():  # saved and returned (a cache's keys and values): not freed by backward
        if k in seen:
            segments[seen[k]]["kept"] = segments[seen[k]].get("kept", 0) + v
    largest_output = max(outs.values(), default=0)
    # the batch the step holds: what autograd did not save of it (labels, masks) is alive too
    in_tensors = list(iter_tensors((inputs, kwargs)))
    unsaved_inputs = tensor_bytes(*[t for t in in_tensors if storage_key(t) not in seen]) if in_tensors else 0
    saved = sum(seg["saved"] for seg in segments)

    # Walk backward through the segments: the activations of segment s are freed once backward
    # has passed it; the gradients of parameters last used in segments >= s exist by then.
    grads_at = [0] * len(segments)
    for seg_index, nbytes in last_use.values():
        grads_at[seg_index] += nbytes
    # backward starts after the last module: at the loss (the model's own, or one taken outside it), whose
    # temporaries are the gradients of its input and of the logits (2 x the largest output); a module's backward
    # holds the gradient of its output and makes its inputs'; ops between modules, about their largest saved tensor
    live, grads, peak, last = saved + output_bytes + unsaved_inputs, 0, (-1, 0, 0, 0), len(segments) - 1
    for s in range(last, -1, -1):
        grads += grads_at[s]
        seg = segments[s]
        temps = (2 * largest_output if s == last else
                 seg["grad_in"] + seg["grad_out"] if "grad_out" in seg else seg["largest"])
        # a weight used again later in forward (tied embeddings) already has its gradient in backward's buffer
        # here: this use's contribution and their sum (made out of place) are two more of its size
        temps += 2 * seg.get("reused", 0)
        if live + grads + temps > peak[0]:
            peak = (live + grads + temps, live, grads, temps)
        live -= seg["saved"] - seg.get("kept", 0)
    by_module: dict[str, int] = {}
    for seg in segments:
        if seg["saved"]:
            by_module[seg["module"]] = by_module.get(seg["module"], 0) + seg["saved"]
    # what is left of the forward pass in optimizer.step(): the batch and the outputs, still held by the step
    return {"activations": saved + output_bytes, "held": tensor_bytes(*in_tensors, *held) if in_tensors + held else 0,
            "backward_peak": peak, "by_module": by_module}


def activation_bytes(model: nn.Module, *inputs, **kwargs) -> int:
    """Bytes autograd keeps from one forward pass of ``model(*inputs, **kwargs)`` in train mode."""
    return _forward_profile(model, inputs, kwargs)["activations"]


def saved_bytes_by_module(model: nn.Module, *inputs, **kwargs) -> dict[str, int]:
    """Bytes autograd saves during one forward pass, by the leaf module that was running."""
    return _forward_profile(model, inputs, kwargs)["by_module"]


@dataclass
class MemoryEstimate:
    """Predicted peak of one training step, by category (bytes)."""

    by_category: dict[str, int]
    n_params: int
    notes: list[str] = field(default_factory=list)

    peak_bytes = property(lambda self: sum(self.by_category.values()))

    def __str__(self) -> str:
        return "\n".join([f"Estimated peak: {format_bytes(self.peak_bytes)} for {self.n_params:,} parameters"]
                         + [f"  {k:<12} {format_bytes(v):>12}" for k, v in self.by_category.items()]
                         + [f"  note: {n}" for n in self.notes])

    __repr__ = __str__


def estimate_training_memory(model: nn.Module, *inputs, optimizer: str = "adam", keep_outputs: bool = True,
                             **kwargs) -> MemoryEstimate:
    """Predict the peak of one training step of ``model`` on ``inputs`` (kwargs go to the model: labels, so that it
    computes its loss, as it trains): the state plus the larger of backward's highest point (a walk back through
    what one forward pass saved) and the optimizer step (grads + step scratch). ``keep_outputs``: the loop holds the
    model's outputs through the step (``out = model(x); loss_fn(out).backward()``, the usual loop); False: it frees
    them before backward (``loss_fn(model(x)).backward()``, ``model(**batch).loss.backward()``), keeping only the
    loss."""
    opt = normalize_optimizer(optimizer)
    if not isinstance(keep_outputs, bool):
        raise TypeError(f"keep_outputs must be True or False, not {keep_outputs!r}.")
    profile = _forward_profile(model, inputs, kwargs, keep_outputs)
    params = list(model.parameters())
    if not params:
        raise ValueError("The model has no parameters; nothing to train.")
    n, sizes = count_params(model), [p.numel() for p in params]
    state = training_state_bytes(n, optimizer=opt, param_dtype=params[0].dtype, tensor_sizes=sizes)
    # optimizer.step()'s temporaries: foreach Adam (CUDA) about one copy of the model, per-tensor Adam (CPU) two of
    # the largest tensor; SGD works in place
    on_cuda = params[0].device.type == "cuda"
    scratch = (n if on_cuda else 2 * max(sizes)) * params[0].element_size() if opt in ("adam", "adamw") else 0
    # backward's highest point: activations not yet freed + gradients made so far + temporaries
    total, live, grads, temps = profile["backward_peak"]
    step_transient = state.grads + scratch + profile["held"]
    if total >= step_transient:
        activations, other, where = live, temps, "during backward"
    else:
        grads, activations, other, where = state.grads, profile["held"], scratch, "in optimizer.step()"
    by_category = dict(zip(CATEGORIES, (state.params, grads, state.optimizer, activations, other)))
    return MemoryEstimate(by_category=by_category, n_params=n,
                          notes=[f"peak predicted {where}; activations measured from one forward pass"])
