"""Memory accounting helpers (notebook 01): the GPU monitors and the largest batch that fits a budget. The measuring
itself is :mod:`course_utils.memory`."""
from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from .units import MIB
from .validation import callable_arg, positive_int


# tool -> (command, or None for an interactive tool that is only located; what it shows)
MONITOR_TOOLS = {
    "nvidia-smi": (["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total,utilization.gpu", "--format=csv"],
                   "nvidia-smi (ships with the NVIDIA driver) lists each GPU with its memory used / total and "
                   "utilization, and the processes holding memory. Its 'used' is what the driver handed out: "
                   "PyTorch's caching allocator's reserved blocks plus the CUDA context (a few hundred MiB), "
                   "so it reads higher than torch.cuda.memory_allocated()."),
    "gpustat": (["gpustat", "-cpu", "--no-color"],
                "gpustat (pip install gpustat) prints one line per GPU: temperature, utilization, memory used/total, "
                "and with -cpu each process's command, PID and user. `watch --color -n1 gpustat -cpu` refreshes it "
                "every second while you train."),
    "nvtop": (None, "nvtop (apt install nvtop) is an interactive, htop-like terminal monitor: live plots of GPU "
                    "utilization and memory per device and a process list. Run it in a terminal, not in a notebook."),
}
MAX_BATCH = 1 << 20  # largest_batch_that_fits doubles up to this at most


def gpu_monitor(tools: Iterable[str] = ("nvidia-smi", "gpustat", "nvtop")) -> list[str]:
    """Run the GPU monitors that are installed; for the others, say what they would show. One text per tool:
    ``$ tool  (found)`` or ``(not installed here)``, then what it printed or would show."""
    tools = [tools] if isinstance(tools, str) else list(tools)
    unknown = [t for t in tools if t not in MONITOR_TOOLS]
    if unknown or not tools:
        raise ValueError(f"Unknown or no monitoring tool(s) {unknown}; choose from {sorted(MONITOR_TOOLS)}.")
    reports = []
    for tool in tools:
        command, explains = MONITOR_TOOLS[tool]
        if shutil.which(tool) is None:
            reports.append(f"$ {tool}  (not installed here)\nWould show: {explains}")
            continue
        text = f"Installed. {explains}"  # an interactive tool (no command) is only located
        try:
            if command is not None:
                done = subprocess.run(command, capture_output=True, text=True, timeout=10)
                text = (done.stdout or "").strip()
                if done.returncode != 0:
                    text = (f"exited with status {done.returncode}: {(done.stderr or text).strip()[:500]}\n"
                            f"Would show: {explains}")
        except (OSError, subprocess.SubprocessError) as err:
            text = f"could not run ({type(err).__name__}: {err}).\nWould show: {explains}"
        reports.append(f"$ {tool}  (found)\n{text}")
    return reports


@dataclass
class BatchSearch:
    """Result of :func:`largest_batch_that_fits`."""

    batch: int
    peak_bytes: int
    budget_bytes: int
    tried: dict[int, int | None] = field(default_factory=dict)  # batch -> peak (None: out of memory)

    def frame(self):
        import pandas as pd

        rows = [{"batch": b, "peak_MiB": (p / MIB if p is not None else math.nan),
                 "fits": p is not None and p <= self.budget_bytes} for b, p in sorted(self.tried.items())]
        return pd.DataFrame(rows)


def largest_batch_that_fits(peak: Callable[[int], object], budget_bytes: int, *, start: int = 1) -> BatchSearch:
    """Largest batch size whose measured peak (``peak(batch)``: a MemoryReport or bytes; OOM = does not fit) stays
    within ``budget_bytes``: doubling, then bisection (the peak grows with the batch)."""
    callable_arg(peak, "peak", "a function batch -> MemoryReport or bytes")
    for name, value in (("budget_bytes", budget_bytes), ("start", start)):
        positive_int(value, name)
    tried: dict[int, int | None] = {}

    def fits(b: int) -> bool:
        if b not in tried:
            try:
                result = peak(b)
            except torch.OutOfMemoryError:
                tried[b] = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            else:
                result = getattr(result, "peak_bytes", result)
                if isinstance(result, bool) or not isinstance(result, (int, float)) or result < 0:
                    raise TypeError(f"peak(batch) must return a MemoryReport or a number of bytes >= 0, "
                                    f"not {result!r}.")
                tried[b] = int(result)
        return tried[b] is not None and tried[b] <= budget_bytes

    if not fits(start):
        needs = "more than the device has" if tried[start] is None else f"{tried[start] / MIB:.1f} MiB"
        raise ValueError(f"Even batch {start} does not fit in {budget_bytes / MIB:.1f} MiB (it needs {needs}): "
                         "raise the budget, or shrink the model (fewer/narrower layers, a smaller dtype).")
    good, bad = start, None
    while bad is None and good < MAX_BATCH:
        nxt = min(good * 2, MAX_BATCH)
        good, bad = (nxt, None) if fits(nxt) else (good, nxt)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return BatchSearch(batch=good, peak_bytes=tried[good], budget_bytes=budget_bytes, tried=tried)
