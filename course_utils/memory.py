"""Measure the peak memory of training code, by category (params, grads, optimizer, activations, other).

The peak is the model's and optimizer's state plus what ``fn`` allocated above the memory live when it started.
Tensors are tracked with PyTorch's private ``MemTracker`` (CPU, CUDA, fake tensors; tests pin its behaviour);
on CUDA the peak comes from the caching allocator's counters, plus the reserved peak and the CUDA context.

On CUDA the tracker counts every storage rounded up to the allocator's 512-byte blocks (a 4-byte loss is 512 bytes).
:func:`cuda_rounding` (or ``COURSE_CUDA_ROUNDING=1``) makes it count so on any device, so that a CPU run shows what a
GPU's counting does to an exact-byte claim; :func:`block_bytes` counts tensors the way the tracker does.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed._tools import mem_tracker as _mem_tracker
from torch.distributed._tools.mem_tracker import MemTracker  # private API: tests pin what is used of it
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .hardware import cuda_context_from_counters
from .models import _is_fake
from .validation import callable_arg
from .units import GIB, MIB  # noqa: F401 - re-exported: notebooks import them from here

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
_TRACKER_TO_CATEGORY = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations",
                        "Temp": "other", "Buffer": "other", "Other": "other"}


CUDA_BLOCK_BYTES = 512  # the caching allocator's smallest block (kMinBlockSize): every storage is a multiple


def _rounding_from(environ) -> bool:
    return environ.get("COURSE_CUDA_ROUNDING", "").strip() == "1"


_ROUNDING = {"on": _rounding_from(os.environ)}   # make test's notebook kernels start with it set


def rounding_to_blocks(device) -> bool:
    """Whether storages on ``device`` count in 512-byte blocks: on CUDA always, elsewhere in :func:`cuda_rounding`."""
    return torch.device(device).type == "cuda" or _ROUNDING["on"]


@contextlib.contextmanager
def cuda_rounding(on: bool = True):
    """Inside ``with cuda_rounding():`` the tracker (and :func:`block_bytes`) count every storage rounded up to 512
    bytes on any device, as CUDA's caching allocator and the tracker on a GPU do."""
    before = _ROUNDING["on"]
    _ROUNDING["on"] = bool(on)
    try:
        yield
    finally:
        _ROUNDING["on"] = before


def _consumed(self) -> int:  # MemTracker's storage size, rounded as CUDA's allocator rounds where it applies
    mem = self.size * self.element_size
    return math.ceil(mem / CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if rounding_to_blocks(self.device) else mem


_mem_tracker._WeakRefInfo._calculate_mem_consumed = _consumed  # private API: tests/test_memory.py pins it


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as GPU tools report."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage: shared by views, distinct for fake tensors (whose data_ptr() is 0)."""
    return t.untyped_storage()._cdata


def _storages(tensors, caller: str):
    """(bytes, device) of each distinct storage behind ``tensors``; a subclass that wraps tensors (torchao's 4-bit
    optimizer state: codes, scales, a map) holds theirs, not its shape's."""
    seen, tensors = set(), list(tensors)
    while tensors:
        t = tensors.pop()
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller} takes tensors, not {type(t).__name__}.")
        if is_traceable_wrapper_subclass(t):
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])  # FSDP2's may name its device mesh
            tensors += [x for x in inner if isinstance(x, torch.Tensor)]
            continue
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            yield t.untyped_storage().nbytes(), t.device


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the given tensors' storages, each storage counted once (numel x element size, exactly)."""
    return sum(n for n, _ in _storages(tensors, "tensor_bytes"))


def block_bytes(*tensors: torch.Tensor, as_cuda: bool = False) -> int:
    """Bytes of the tensors' storages as the tracker counts them: each storage once, rounded up to 512-byte blocks
    on CUDA (or in :func:`cuda_rounding`, or with ``as_cuda``: meta tensors priced as a GPU keeps them), exact
    elsewhere. An exact-byte claim about what the tracker measured compares with this, like with like."""
    return sum(math.ceil(n / CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if as_cuda or rounding_to_blocks(device) else n
               for n, device in _storages(tensors, "block_bytes"))


def iter_tensors(obj):
    """Every tensor inside ``obj`` (a tensor, or lists, tuples, dicts and model outputs of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
    elif callable(getattr(obj, "values", None)):  # dicts, model outputs
        for v in obj.values():
            yield from iter_tensors(v)


def _state_tensors(optimizer) -> list[torch.Tensor]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (bitsandbytes' optimizers are), not "
                        f"{type(optimizer).__name__}.")
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes held by an optimizer's state tensors now, each storage counted once."""
    return tensor_bytes(*_state_tensors(optimizer))


def _params(model, optimizer) -> list[torch.Tensor]:
    """The model's parameters, then the optimizer's (a parameter may come twice)."""
    params = list(model.parameters()) if model is not None else []
    return params + ([p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else [])


def _on(device: torch.device, tensors) -> list[torch.Tensor]:
    return [t for t in tensors if t.device.type == device.type and device.index in (None, t.device.index)]


def state_bytes(model: nn.Module | None = None, optimizer=None, device=None) -> int:
    """Bytes of parameters, buffers, gradients present and optimizer state on ``device`` (default: the parameters'),
    each storage once, counted as the tracker and the allocator count (:func:`block_bytes`): what measure_memory counts
    as the state. For CUDA parameters Adam keeps its ``step`` counters on the CPU: they are not on the GPU."""
    _check_state(model, optimizer)
    params = _params(model, optimizer)
    state = params + [p.grad for p in params if p.grad is not None] + list(model.buffers() if model is not None else ())
    state += _state_tensors(optimizer) if optimizer is not None else []
    return block_bytes(*_on(torch.device(device or params[0].device), state)) if params else 0


# torch.cuda's functions that measure_memory reads; a counter source (CudaCounters, a fake one in tests) has them all
_COUNTER_METHODS = ("synchronize", "empty_cache", "reset_peak_memory_stats", "memory_allocated",
                    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "mem_get_info")


class CudaCounters:
    """The CUDA caching allocator's counters for one device: torch.cuda's functions of the same names."""

    def __init__(self, device="cuda"):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaCounters reads a CUDA device, not {self.device}; on a CPU tensors are tracked instead.")
        if not torch.cuda.is_available():
            raise ValueError("No CUDA GPU here: there is no caching allocator to read (pass a fake counter source in tests).")
        for name in _COUNTER_METHODS:  # empty_cache() is the only one that takes no device
            method = getattr(torch.cuda, name)
            setattr(self, name, method if name == "empty_cache" else functools.partial(method, self.device))


@dataclass
class MemoryReport:
    """What :func:`measure_memory` found. Byte counts are ints; the CUDA-only fields are None elsewhere."""

    peak_bytes: int
    by_category: dict[str, int]
    device: str
    optimizer_state_bytes: int = 0  # state the optimizer held on the device when fn returned
    tracked_peak_bytes: int = 0  # peak seen by tensor tracking (== peak_bytes off CUDA)
    fake: bool = False
    notes: list[str] = field(default_factory=list)
    reserved_peak_bytes: int | None = None  # the caching allocator's reserved peak for fn (CUDA)
    cuda_context_bytes: int | None = None  # the card's use outside the allocator (CUDA; hardware.cuda_context_bytes)
    allocator_readings: dict[str, int] | None = None  # the raw counters the CUDA figures come from

    peak_mib = property(lambda self: self.peak_bytes / MIB)
    peak_gib = property(lambda self: self.peak_bytes / GIB)

    @property
    def card_bytes(self) -> int | None:
        """Reserved peak + CUDA context: what nvidia-smi would show were fn alone on the card (CUDA only)."""
        return None if self.reserved_peak_bytes is None else self.reserved_peak_bytes + self.cuda_context_bytes

    def to_frame(self):
        """A pandas DataFrame (category, bytes, MiB, share) for tables and seaborn plots."""
        import pandas as pd

        frame = pd.DataFrame({"category": list(self.by_category), "bytes": list(self.by_category.values())})
        return frame.assign(MiB=frame["bytes"] / MIB, share=frame["bytes"] / max(frame["bytes"].sum(), 1))

    def __str__(self) -> str:
        lines = [f"Peak memory on {self.device}{' (fake tensors)' if self.fake else ''}: {format_bytes(self.peak_bytes)}"]
        lines += [f"  {r.category:<11}  {format_bytes(r.bytes):>12}  {r.share:6.1%}"
                  for r in self.to_frame().itertuples()]
        if self.reserved_peak_bytes is not None:
            lines.append(f"  reserved by the allocator at the peak: {format_bytes(self.reserved_peak_bytes)}")
        if self.cuda_context_bytes is not None:
            lines.append(f"  CUDA context (outside the allocator): {format_bytes(self.cuda_context_bytes)}")
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])

    __repr__ = __str__


class _MultiStepMemTracker(MemTracker):
    """MemTracker that accepts several training steps in one context (stock MemTracker raises at a second root
    forward; the per-module statistics it would keep are cleared instead: the course reads only the global peak)."""

    def _pre_fw_hook(self, module, inputs):  # noqa: D401 - overrides a private hook
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        # Stock MemTracker hooks every parameter's gradient, and a frozen parameter (LoRA's base
        # weights) refuses hooks: mark the frozen ones as hooked, with handles that remove nothing.
        no_hook = type("NoHook", (), {"remove": lambda self: None})()
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (no_hook, no_hook)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        # Stock MemTracker also updates the peak of every active module on every op, which costs
        # O(#modules) per op (a 256-layer MLP: ~40 s per measurement). The course reads only the
        # global peak, so keep just that part.
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap["Total"]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)


def _check_args(fn, model, optimizer, counters=None) -> None:
    callable_arg(fn, "fn", "a zero-argument callable (e.g. `lambda: train_step(batch)` or a def): wrap the code "
                 "you want to measure in a function")
    _check_state(model, optimizer)
    _check_counters(counters)


def _check_state(model, optimizer) -> None:
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (or None), not {type(model).__name__}.")
    if optimizer is not None:
        _state_tensors(optimizer)


def _check_counters(counters) -> None:
    missing = [m for m in _COUNTER_METHODS if not callable(getattr(counters, m, None))] if counters is not None else []
    if missing:
        raise TypeError(f"counters must be a counter source such as memory.CudaCounters('cuda'); "
                        f"{type(counters).__name__} lacks {', '.join(missing)}.")


def measure_memory(fn, *, model: nn.Module | None = None, optimizer=None, counters=None) -> MemoryReport:
    """Run ``fn()`` and report its peak memory and what filled it, on the device of the model's (or optimizer's)
    parameters, else on the device where fn's tensors peaked highest. ``counters``: the caching allocator's
    (default: torch.cuda's when that device is a real GPU; tests pass a fake source)."""
    _check_args(fn, model, optimizer, counters)
    params = _params(model, optimizer)
    fake = any(_is_fake(p) for p in params) if params else detect_fake_mode() is not None
    tracker = _MultiStepMemTracker()
    tracker.track_external(*(obj for obj in (model, optimizer) if obj is not None))
    guessed = counters is None and not params  # without parameters, fn's device is known only once it ran
    if counters is None and not fake and torch.cuda.is_available() and (guessed or params[0].device.type == "cuda"):
        counters = CudaCounters(params[0].device if params else "cuda")

    state_at_start = state_bytes(model, optimizer)
    if counters is not None:
        counters.synchronize()
        counters.empty_cache()  # cached free blocks from earlier code must not serve fn
        counters.reset_peak_memory_stats()
        allocated_at_start = counters.memory_allocated()
        reserved_at_start = counters.memory_reserved()

    with tracker:
        fn()
    snapshots = {torch.device(dev): snap for dev, snap in tracker.get_tracker_snapshot("peak").items()}
    busiest = max(snapshots, key=lambda dev: snapshots[dev].get("Total", 0), default=torch.device("cpu"))
    device = params[0].device if params else busiest
    counters = None if guessed and device.type != "cuda" else counters
    # fn worked on another device than the model's: take the busiest one
    dev_snap = next((snap for dev, snap in snapshots.items() if dev.type == device.type), snapshots.get(busiest, {}))
    by_category = dict.fromkeys(CATEGORIES, 0)
    for key, value in dev_snap.items():
        if getattr(key, "value", key) in _TRACKER_TO_CATEGORY:
            by_category[_TRACKER_TO_CATEGORY[getattr(key, "value", key)]] += int(value)
    tracked_peak = int(dev_snap.get("Total", sum(by_category.values())))

    # MemTracker tags all that optimizer.step() allocates as optimizer state, the step's temporaries included
    # (foreach Adam's whole-model scratch): keep as "optimizer" only the state the optimizer holds.
    held = block_bytes(*_on(device, _state_tensors(optimizer))) if optimizer is not None else 0  # as tracked
    notes = []
    if optimizer is not None and by_category["optimizer"] > held:
        extra = by_category["optimizer"] - held
        by_category["optimizer"], by_category["other"] = held, by_category["other"] + extra
        notes.append(f"{format_bytes(extra)} of optimizer-step temporaries counted as 'other'")

    report = MemoryReport(peak_bytes=tracked_peak, by_category=by_category, device=str(device),
                          optimizer_state_bytes=held, tracked_peak_bytes=tracked_peak, fake=fake, notes=notes)
    if counters is not None:
        counters.synchronize()
        free, total = counters.mem_get_info()
        report.allocator_readings = readings = {
            "allocated_at_start": allocated_at_start, "max_allocated": counters.max_memory_allocated(),
            "reserved_at_start": reserved_at_start, "max_reserved": counters.max_memory_reserved()}
        # tensors alive before fn (earlier cells' leftovers) are in both allocated readings and cancel out
        report.peak_bytes = state_at_start + readings["max_allocated"] - allocated_at_start
        # free room in a segment that also holds older tensors can serve fn: the growth alone may read low
        reserved_growth = readings["max_reserved"] - reserved_at_start
        report.reserved_peak_bytes = max(report.peak_bytes, state_at_start + reserved_growth)
        report.cuda_context_bytes = cuda_context_from_counters(free, total, counters.memory_reserved())
        notes.append(f"peak from the caching allocator's counters (state + what fn added); "
                     f"tensor tracking saw {format_bytes(tracked_peak)}")
    return report

