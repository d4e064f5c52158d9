"""Measure the peak memory of training code, by category, with or without a GPU.

``measure_memory(fn, model=model, optimizer=opt)`` runs ``fn()`` (one or more training steps)
and reports the peak and what filled it::

    params, grads, optimizer, activations, other

How it measures
---------------
Tensors are tracked as they are created and freed, with PyTorch's own ``MemTracker``
(``torch.distributed._tools.mem_tracker``): it tags each tensor as a parameter, gradient,
optimizer state, activation (made in forward) or temporary (made in backward). That works
on the CPU, on CUDA, and under ``FakeTensorMode``, where a model too big for the machine
(GPT-2-XL) is "run" without allocating its memory. On CUDA the report's ``peak_bytes`` is
the caching allocator's own ``max_memory_allocated`` (what counts for an out-of-memory
error); the categories still come from tensor tracking.

``MemTracker`` is a private API; everything the course uses of it lives in this file and
``tests/test_memory.py`` pins its behaviour.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .units import GIB, MIB  # noqa: F401 - re-exported: notebooks import them from here

try:  # private API: wrapped here so a change upstream breaks one file, with a clear message
    from torch.distributed._tools.mem_tracker import MemTracker
except ImportError as _err:  # pragma: no cover
    MemTracker = None
    _IMPORT_ERROR = _err
else:
    _IMPORT_ERROR = None

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
_TRACKER_TO_CATEGORY = {
    "Parameter": "params",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "other",
    "Buffer": "other",
    "Other": "other",
}


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as GPU tools report."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


@dataclass
class MemoryReport:
    """What :func:`measure_memory` found. Byte counts are ints."""

    peak_bytes: int
    by_category: dict[str, int]
    device: str
    seconds: float = 0.0
    optimizer_state_bytes: int = 0  # state held by the optimizer when fn returned
    tracked_peak_bytes: int = 0  # peak seen by tensor tracking (== peak_bytes off CUDA)
    fake: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def to_frame(self):
        """A pandas DataFrame (category, bytes, MiB, share) for tables and seaborn plots."""
        import pandas as pd

        total = max(sum(self.by_category.values()), 1)
        rows = [
            {"category": k, "bytes": v, "MiB": v / MIB, "share": v / total}
            for k, v in self.by_category.items()
        ]
        return pd.DataFrame(rows)

    def __str__(self) -> str:
        width = max(len(c) for c in CATEGORIES)
        total = max(sum(self.by_category.values()), 1)
        lines = [f"Peak memory on {self.device}{' (fake tensors)' if self.fake else ''}: {format_bytes(self.peak_bytes)}"]
        for cat in CATEGORIES:
            value = self.by_category.get(cat, 0)
            lines.append(f"  {cat:<{width}}  {format_bytes(value):>12}  {value / total:6.1%}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{c}</td><td style='text-align:right'>{format_bytes(self.by_category.get(c, 0))}</td></tr>"
            for c in CATEGORIES
        )
        return (
            f"<b>Peak memory on {self.device}{' (fake tensors)' if self.fake else ''}: "
            f"{format_bytes(self.peak_bytes)}</b><table>{rows}</table>"
        )


class _MultiStepMemTracker(MemTracker if MemTracker is not None else object):
    """MemTracker that accepts several training steps in one context.

    Stock MemTracker raises NotImplementedError when the root module runs forward a second
    time ("multiple iterative calls"); its per-module statistics are all it would lose, and
    the course only reads the global peak, so we clear them at each new root forward.
    """

    def _pre_fw_hook(self, module, inputs):  # noqa: D401 - overrides a private hook
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        # Stock MemTracker also updates the peak of every active module on every op, which costs
        # O(#modules) per op (a 256-layer MLP: ~40 s per measurement). The course reads only the
        # global peak, so keep just that part.
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap["Total"]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)


def _optimizer_state_bytes(optimizer) -> int:
    if optimizer is None:
        return 0
    return tensor_bytes(*(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)))


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage: shared by views, distinct for fake tensors (whose data_ptr() is 0)."""
    return t.untyped_storage()._cdata


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _check_args(fn, model, optimizer) -> None:
    if not callable(fn):
        raise TypeError(
            f"fn must be a zero-argument callable (e.g. `lambda: train_step(batch)` or a def), "
            f"not {type(fn).__name__}. Wrap the code you want to measure in a function."
        )
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (or None), not {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (bitsandbytes' optimizers are), not {type(optimizer).__name__}."
        )


def _model_device(model, optimizer) -> torch.device:
    for params in ([p for p in model.parameters()] if model is not None else [],
                   [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []):
        if params:
            return params[0].device
    return torch.device("cpu")


def measure_memory(fn, *, model: nn.Module | None = None, optimizer=None) -> MemoryReport:
    """Run ``fn()`` and report its peak memory and what filled it.

    Args:
        fn: a zero-argument callable: one or more training steps.
        model: the model ``fn`` trains; its parameters (and gradients already present) count
            from the start, even though they were created before ``fn``.
        optimizer: its state counts from the start too (after a first step it already exists).

    Tensors created before the call and not reachable from ``model``/``optimizer`` (a batch
    you built outside ``fn``, say) are not counted: build inputs inside ``fn`` to count them.
    """
    _check_args(fn, model, optimizer)
    if MemTracker is None:  # pragma: no cover
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no torch.distributed._tools.mem_tracker ({_IMPORT_ERROR}); "
            "install the course's torch (requirements.txt)."
        )
    device = _model_device(model, optimizer)
    tracker = _MultiStepMemTracker()
    tracker.track_external(*(obj for obj in (model, optimizer) if obj is not None))
    fake = any(_is_fake(p) for p in (model.parameters() if model is not None else []))

    use_cuda_allocator = device.type == "cuda" and not fake and torch.cuda.is_available()
    if use_cuda_allocator:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    start = time.perf_counter()
    with tracker:
        fn()
    if use_cuda_allocator:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    snapshots = tracker.get_tracker_snapshot("peak")
    dev_snap = _pick_device_snapshot(snapshots, device)
    by_category = dict.fromkeys(CATEGORIES, 0)
    for key, value in dev_snap.items():
        name = getattr(key, "value", key)
        if name in _TRACKER_TO_CATEGORY:
            by_category[_TRACKER_TO_CATEGORY[name]] += int(value)
    tracked_peak = int(dev_snap.get("Total", sum(by_category.values())))

    # Tensors allocated inside optimizer.step() are tagged as optimizer state by MemTracker,
    # including the step's temporaries (foreach Adam builds whole-model scratch tensors).
    # Keep as "optimizer" no more than the state the optimizer really holds; the rest is "other".
    state_bytes = _optimizer_state_bytes(optimizer)
    notes = []
    if optimizer is not None and by_category["optimizer"] > state_bytes:
        extra = by_category["optimizer"] - state_bytes
        by_category["optimizer"] = state_bytes
        by_category["other"] += extra
        notes.append(f"{format_bytes(extra)} of optimizer-step temporaries counted as 'other'")

    peak = tracked_peak
    if use_cuda_allocator:
        peak = int(torch.cuda.max_memory_allocated())
        notes.append(
            f"peak from the CUDA caching allocator; tensor tracking saw {format_bytes(tracked_peak)}"
        )
    return MemoryReport(
        peak_bytes=peak,
        by_category=by_category,
        device=str(device),
        seconds=seconds,
        optimizer_state_bytes=state_bytes,
        tracked_peak_bytes=tracked_peak,
        fake=fake,
        notes=notes,
    )


def _pick_device_snapshot(snapshots: dict, device: torch.device) -> dict:
    if not snapshots:
        return {}
    for dev, snap in snapshots.items():
        if torch.device(dev).type == device.type:
            return snap
    # fn worked on another device than the model's (or no model): take the busiest one
    return max(snapshots.values(), key=lambda s: s.get("Total", 0))


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the given tensors' storages, each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor_bytes takes tensors, not {type(t).__name__}.")
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
