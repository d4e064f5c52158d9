"""A memory timeline of one training step on any device (MemTracker, as measure_memory), exported in the format of
``torch.cuda.memory._snapshot()`` so PyTorch's memory viewer draws it."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
from torch import nn
from torch.distributed._tools.mem_tracker import _UpdateType  # private API: tests pin what is used of it

from .memory import _TRACKER_TO_CATEGORY, CATEGORIES, _check_args, _MultiStepMemTracker, _params, _state_tensors
from .models import _is_fake
from .units import GIB, KIB, MIB

_category = lambda reftype: _TRACKER_TO_CATEGORY.get(getattr(reftype, "value", None), "other")  # noqa: E731
_SHADES = {"start": "#f2f2f2", "forward": "#e8f0fb", "backward": "#fbeee8", "optimizer": "#eaf6ea"}


class _Recorder(_MultiStepMemTracker):
    """MemTracker that writes down every change to its running total, with category, phase and device."""

    def __init__(self):
        super().__init__()
        self.events, self.recording, self._serial, self._last = [], True, itertools.count(), "forward"

    def _phase(self) -> str:
        """Inside optimizer.step(), backward() or a module's forward, that phase; between them (the loss,
        zero_grad) the one that came last; before tracking starts, 'start'."""
        if self._depth == 0:
            return "start"
        if self._in_opt or self._mod_tracker.is_bw or len(self._mod_tracker.parents) > 1:
            self._last = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
        return self._last

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if not self.recording:
            return
        key = winfo.__dict__.setdefault("course_key", next(self._serial))
        cat = _category(winfo.reftype)
        row = (key, winfo.mem_consumed, cat, cat, self._phase(), str(winfo.device))
        if u_type == _UpdateType.REF:  # same bytes, new category (a backward temporary becomes a gradient)
            self.events.append(("move", *row[:3], _category(old_reftype), *row[4:]))
        if u_type == _UpdateType.SIZE:  # a resized storage: the old size freed, the new one allocated
            self.events.append(("free", key, old_mem_consumed, *row[2:]))
        if u_type in (_UpdateType.ADD, _UpdateType.DEL, _UpdateType.SIZE):
            self.events.append(("free" if u_type == _UpdateType.DEL else "alloc", *row))


@dataclass
class Timeline:
    """One row per event in ``events`` (a DataFrame): ``action`` (alloc, free, or move: same bytes to a new
    category), ``key`` (a tensor storage), ``bytes``, ``category``, ``from_category``, ``phase`` and ``total``
    (bytes alive after it)."""

    events: object
    device: str
    fake: bool = False

    peak_bytes = property(lambda self: int(self.events["total"].max()) if len(self.events) else 0)
    peak_index = property(lambda self: int(self.events["total"].idxmax()) if len(self.events) else 0)

    def curve(self):
        """Bytes alive per category after each event (a DataFrame, one column per category)."""
        import pandas as pd

        ev = self.events
        one_hot = lambda column: pd.get_dummies(column).reindex(columns=list(CATEGORIES), fill_value=0).astype("int64")
        signed = np.where(ev["action"] == "free", -ev["bytes"], ev["bytes"])
        moved_out = one_hot(ev["from_category"].where(ev["action"] == "move")).mul(ev["bytes"], axis=0)
        return (one_hot(ev["category"]).mul(signed, axis=0) - moved_out).cumsum()

    def at_peak(self) -> dict[str, int]:
        """Bytes per category at the peak."""
        return {k: int(v) for k, v in self.curve().loc[self.peak_index].items()} if len(self.events) else {}

    def trace(self) -> list[tuple[str, int, int]]:
        """What the allocator sees: (action, key, bytes), action 'alloc' or 'free' (for allocator.replay)."""
        rows = self.events[self.events["action"] != "move"]
        return [(a, int(k), int(b)) for a, k, b in rows[["action", "key", "bytes"]].itertuples(index=False)]


def record_timeline(fn, *, model: nn.Module | None = None, optimizer=None) -> Timeline:
    """Run ``fn()`` and record every allocation and free, by category and phase."""
    _check_args(fn, model, optimizer)
    import pandas as pd

    recorder = _Recorder()
    recorder.track_external(*(obj for obj in (model, optimizer) if obj is not None))
    with recorder:
        fn()
    recorder.recording = False
    ev = pd.DataFrame(recorder.events, columns=["action", "key", "bytes", "category", "from_category", "phase", "device"])
    params = _params(model, optimizer)
    device = str(params[0].device) if params else (ev["device"].mode().iloc[0] if len(ev) else "cpu")
    ev = ev[ev["device"] == device].drop(columns="device").reset_index(drop=True)
    if optimizer is not None:  # as measure_memory: what optimizer.step() makes and does not keep is 'other'
        winfos = [recorder._WINFO.get(t.untyped_storage(), (None,))[0] for t in _state_tensors(optimizer)]
        temporary = ~ev["key"].isin([w.course_key for w in winfos if hasattr(w, "course_key")])
        for column in ("category", "from_category"):
            ev.loc[temporary & (ev[column] == "optimizer"), column] = "other"
    ev["bytes"] = ev["bytes"].astype("int64")
    ev["total"] = np.where(ev["action"] == "alloc", ev["bytes"], np.where(ev["action"] == "free", -ev["bytes"], 0)).cumsum()
    return Timeline(events=ev, device=device, fake=any(_is_fake(p) for p in params))


def plot_timeline(timeline: Timeline, *, ax=None, reserved=None, title: str | None = None, unit: str = "MiB"):
    """Memory over time stacked by category, the peak marked, the phases shaded; ``reserved`` (one value per
    alloc/free, as ``allocator.replay`` gives) as a dashed line."""
    import matplotlib.pyplot as plt

    from .plots import CATEGORY_COLORS

    if not isinstance(timeline, Timeline):
        raise TypeError(f"plot_timeline takes a Timeline from record_timeline(), not {type(timeline).__name__}.")
    scale = {"KiB": KIB, "MiB": MIB, "GiB": GIB}.get(unit)
    if scale is None:
        raise ValueError(f"unit must be 'KiB', 'MiB' or 'GiB', not {unit!r}.")
    ax = ax or plt.subplots(figsize=(9, 3.5))[1]
    curve, x = timeline.curve() / scale, np.arange(len(timeline.events))
    ax.stackplot(x, *curve.T.values, labels=list(CATEGORIES), colors=[CATEGORY_COLORS.get(c) for c in CATEGORIES], alpha=0.85)
    phases = timeline.events["phase"]
    for _, run in phases.groupby((phases != phases.shift()).cumsum()):  # each run of events in one phase
        ax.axvspan(run.index[0] - 0.5, run.index[-1] + 0.5, color=_SHADES[run.iloc[0]], zorder=-1, lw=0)
    top = timeline.peak_bytes / scale
    if reserved is not None:
        reserved = np.asarray(reserved) / scale
        xr = np.flatnonzero(timeline.events["action"] != "move")
        if len(xr) != len(reserved):
            raise ValueError(f"reserved has {len(reserved)} values; pass one per alloc/free ({len(xr)}), as replay() gives.")
        ax.plot(xr, reserved, color="black", lw=1.2, ls="--", label="reserved (simulated)")
        top = max(top, reserved.max())
    peak = timeline.peak_index
    ax.plot([peak], [timeline.peak_bytes / scale], "k^", ms=8)
    ax.annotate(f"peak {timeline.peak_bytes / scale:,.1f} {unit} ({timeline.events['phase'].iloc[peak]})",
                (peak, timeline.peak_bytes / scale), textcoords="offset points", xytext=(8, 2), fontsize="small")
    ax.set(ylim=(0, 1.2 * top), ylabel=unit, xlabel="allocation or free, in order (shading: start, forward, backward, optimizer)",
           title=title or f"Memory over one step on {timeline.device}{' (fake tensors)' if timeline.fake else ''}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return ax


def to_snapshot(timeline: Timeline, **allocator_options) -> dict:
    """The timeline as a memory snapshot (torch.cuda.memory._snapshot()'s format), with the addresses and segments
    of the allocator simulator (``allocator_options``, e.g. ``expandable_segments=True``). Each block's stack frame
    names its category and phase. Pickle it and drop the file on https://pytorch.org/memory_viz."""
    from .allocator import CachingAllocator

    if not isinstance(timeline, Timeline):
        raise TypeError(f"to_snapshot takes a Timeline from record_timeline(), not {type(timeline).__name__}.")
    sim, trace = CachingAllocator(**allocator_options), []
    for action, key, nbytes, category, _, phase, _ in timeline.events.itertuples(index=False):
        if action != "move":
            first = len(sim.events)
            sim.malloc(int(nbytes), key) if action == "alloc" else sim.free(key)
            trace += [{"action": kind, "addr": addr, "size": size, "stream": 0, "time_us": len(trace) + i,
                       "frames": [{"filename": phase, "line": 0, "name": category}]}
                      for i, (kind, addr, size) in enumerate(sim.events[first:])]
    return {"segments": sim.segments_snapshot(), "device_traces": [trace],
            "allocator_settings": {"expandable_segments": sim.expandable_segments}}


def check_snapshot(snapshot: dict) -> str:
    """Read a snapshot with PyTorch's viewer code (``torch.cuda._memory_viz``: ``trace_plot`` and ``segment_plot``,
    the HTML of pytorch.org/memory_viz; ``trace``; ``segsum``, which checks every segment adds up). Returns the
    segment summary; raises ValueError saying why it cannot be read."""
    from torch.cuda import _memory_viz as viz

    if not isinstance(snapshot, dict) or not {"segments", "device_traces"} <= set(snapshot):
        raise ValueError("A snapshot is a dict with 'segments' and 'device_traces' (to_snapshot(), torch.cuda.memory._snapshot()).")
    try:
        if not all("snapshot.pickle" in html for html in (viz.trace_plot(snapshot), viz.segment_plot(snapshot))):
            raise AssertionError("the viewer's HTML does not embed the snapshot")
        viz.trace(snapshot)
        return viz.segsum(snapshot)
    except (KeyError, TypeError, AssertionError, AttributeError) as err:
        raise ValueError(f"PyTorch's memory viewer cannot read this snapshot: {type(err).__name__}: {err}") from err


def snapshot_frame(snapshot: dict, device: int = 0):
    """Allocated (tensor bytes) and reserved (segment bytes) after each event of a snapshot's trace: backwards
    from the final state in ``snapshot['segments']``, as PyTorch's viewer does, so a recording begun mid-run
    (``torch.cuda.memory._record_memory_history``) reads right."""
    import pandas as pd

    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ValueError("snapshot_frame takes a snapshot dict (to_snapshot(), torch.cuda.memory._snapshot()).")
    if not 0 <= device < len(snapshot["device_traces"]):
        raise ValueError(f"device {device} has no trace; this snapshot has {len(snapshot['device_traces'])}.")
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    allocated = sum(b.get("requested_size", b["size"]) for s in segments for b in s["blocks"] if b["state"] == "active_allocated")
    reserved = sum(s["total_size"] for s in segments)
    effect = {"alloc": (1, 0), "free_completed": (-1, 0), "segment_alloc": (0, 1), "segment_map": (0, 1),
              "segment_free": (0, -1), "segment_unmap": (0, -1)}
    rows = []
    for event in reversed(snapshot["device_traces"][device]):
        rows.append((event["action"], allocated, reserved))
        da, dr = effect.get(event["action"], (0, 0))
        allocated, reserved = allocated - da * event["size"], reserved - dr * event["size"]
    return pd.DataFrame(rows[::-1], columns=["action", "allocated", "reserved"])


class _PhaseRecorder(_Recorder):
    """The timeline's recorder, each event also labelled with the named step phase running (``step_phase``)."""

    def __init__(self):
        super().__init__()
        self.running = []

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        first = len(self.events)
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        label = self.running[0] if self.running else None  # the outermost named phase
        self.events[first:] = [(*event, label) for event in self.events[first:]]

    # a model called inside a method of another (a trainer's fused head) can reach backward unseen: skip its stats
    def _pre_bw_hook(self, module, args) -> None:
        if module in self.memory_tracking:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module, args) -> None:
        if module in self.memory_tracking:
            super()._post_bw_hook(module, args)


def record_phases(fn, *, model, phases: dict, state=()) -> Timeline:
    """Run ``fn()`` and record its memory timeline (as :func:`record_timeline`) on the model's device, each event
    labelled in ``step_phase`` by the outermost of ``phases`` ({label: (object, method name)}) running, else by the
    forward / backward / optimizer phase. ``state``: more modules and optimizers alive from the start (a reference
    model, the optimizer), counted from the first event."""
    _check_args(fn, model, None)
    if not isinstance(phases, dict) or not all(isinstance(v, tuple) and len(v) == 2 and callable(getattr(*v, None))
                                              for v in phases.values()):
        raise ValueError("phases maps a label to (object, method name), e.g. {'generation': (trainer, '_generate')}.")
    import pandas as pd

    recorder = _PhaseRecorder()
    recorder.track_external(model, *state)
    patched = []

    def named(label, method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            recorder.running.append(label)
            try:
                return method(*args, **kwargs)
            finally:
                recorder.running.pop()
        return run

    try:
        for label, (obj, name) in phases.items():
            patched.append((obj, name, vars(obj).get(name)))
            setattr(obj, name, named(label, getattr(obj, name)))
        with recorder:
            fn()
    finally:
        for obj, name, before in reversed(patched):  # the instance as it was: its own attribute, or the class's
            delattr(obj, name)
            if before is not None:
                setattr(obj, name, before)
    recorder.recording = False
    columns = ["action", "key", "bytes", "category", "from_category", "phase", "device", "step_phase"]
    ev = pd.DataFrame(recorder.events, columns=columns)
    device = str(next(model.parameters()).device)
    ev = ev[ev["device"] == device].drop(columns="device").reset_index(drop=True)
    ev["step_phase"] = ev["step_phase"].fillna(ev["phase"])
    ev["bytes"] = ev["bytes"].astype("int64")
    ev["total"] = np.where(ev["action"] == "alloc", ev["bytes"], np.where(ev["action"] == "free", -ev["bytes"], 0)).cumsum()
    return Timeline(events=ev, device=device)
