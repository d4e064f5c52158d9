"""Memory accounting helpers (notebook 01): GPU monitors, the article's modelsize(), the largest batch that
fits, the quick-wins table. The measuring itself is :mod:`course_utils.memory`."""
from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from .memory import iter_tensors
from .units import MIB
from .validation import callable_arg, positive_int, positive_number


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


@dataclass
class ToolReport:
    """What one monitoring tool said (or would say) on this machine."""

    tool: str
    available: bool
    output: str

    def __str__(self) -> str:
        state = "found" if self.available else "not installed here"
        return f"$ {self.tool}  ({state})\n{self.output}"


def gpu_monitor(tools: Iterable[str] = ("nvidia-smi", "gpustat", "nvtop"), *, timeout_s: float = 10.0,
                run: bool = True) -> list[ToolReport]:
    """Run the GPU monitors that are installed; for the others, say what they would show."""
    tools = [tools] if isinstance(tools, str) else list(tools)
    unknown = [t for t in tools if t not in MONITOR_TOOLS]
    if unknown or not tools:
        raise ValueError(f"Unknown or no monitoring tool(s) {unknown}; choose from {sorted(MONITOR_TOOLS)}.")
    positive_number(timeout_s, "timeout_s", "seconds")
    reports = []
    for tool in tools:
        command, explains = MONITOR_TOOLS[tool]
        if shutil.which(tool) is None:
            reports.append(ToolReport(tool, False, "Would show: " + explains))
            continue
        if command is None or not run:
            reports.append(ToolReport(tool, True, f"Installed. {explains}"))
            continue
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            text = (done.stdout or "").strip()
            if done.returncode != 0:
                text = f"exited with status {done.returncode}: {(done.stderr or text).strip()[:500]}\nWould show: {explains}"
        except (OSError, subprocess.SubprocessError) as err:
            text = f"could not run ({type(err).__name__}: {err}).\nWould show: {explains}"
        reports.append(ToolReport(tool, True, text))
    return reports


# The article: "memory = params x n", n = 2 for SGD (weights + grads) and 4 for Adam (+ m and v).
# It says nothing of momentum, which keeps one more copy: n = 3.
_SEED_N = {"sgd": 2, "sgd_momentum": 3, "adam": 4, "adamw": 4}


def seed_multiplier(optimizer: str) -> int:
    """The article's n in ``params x n``: 2 for SGD, 3 for SGD with momentum, 4 for Adam/AdamW."""
    from .estimate import normalize_optimizer

    key = normalize_optimizer(optimizer)
    if key not in _SEED_N:
        raise ValueError(f"The params x n rule covers {sorted(_SEED_N)}, not {optimizer!r} (8-bit Adam is notebook 05).")
    return _SEED_N[key]


@dataclass
class ModelSize:
    """The article's ``modelsize()`` result, in bytes."""

    params_bytes: int
    outputs_bytes: int  # sum of the module outputs ("without backward")
    n_outputs: int

    @property
    def with_backward_bytes(self) -> int:
        """The article doubles the outputs for their gradients."""
        return 2 * self.outputs_bytes


def modelsize(model: nn.Module, input: torch.Tensor, type_size: int = 4) -> ModelSize:
    """The article's ``modelsize()``: feed ``input`` through ``model.modules()`` one after the other."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"modelsize() chains model.modules() in order, which only works for an nn.Sequential, not "
                        f"{type(model).__name__}; use module_output_bytes(model, input) for other models.")
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be an example batch (a tensor), not {type(input).__name__}.")
    if isinstance(type_size, bool) or not isinstance(type_size, int) or type_size <= 0:
        raise ValueError(f"type_size must be a positive number of bytes per element (4 for fp32), not {type_size!r}.")
    n_params, total, count, x = sum(p.numel() for p in model.parameters()), 0, 0, input.detach().clone()
    with torch.no_grad():
        for m in list(model.modules())[1:]:
            if isinstance(m, nn.Sequential):
                raise TypeError("modelsize() cannot follow nested nn.Sequential blocks; use module_output_bytes().")
            if isinstance(m, nn.ReLU) and m.inplace:
                continue
            x = m(x)
            total += x.numel()
            count += 1
    return ModelSize(params_bytes=n_params * type_size, outputs_bytes=total * type_size, n_outputs=count)


def module_output_bytes(model: nn.Module, *inputs, skip_inplace: bool = True, **kwargs):
    """Bytes of every leaf module's output in one forward pass (the article's count, for any model)."""
    import pandas as pd

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
    if not inputs and not kwargs:
        raise ValueError("Pass an example input, e.g. module_output_bytes(model, torch.randn(8, 1, 28, 28)).")
    rows = []
    names = {m: n for n, m in model.named_modules()}

    def hook(mod, args, out):
        if skip_inplace and getattr(mod, "inplace", False):
            return
        for t in iter_tensors(out):
            rows.append({"module": names.get(mod, "?"), "type": type(mod).__name__, "shape": tuple(t.shape),
                         "bytes": t.numel() * t.element_size()})

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    frame = pd.DataFrame(rows, columns=["module", "type", "shape", "bytes"])
    return int(frame["bytes"].sum()), frame


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


def _peak_of(result) -> int:
    if hasattr(result, "peak_bytes"):
        result = result.peak_bytes
    if isinstance(result, bool) or not isinstance(result, (int, float)) or result < 0:
        raise TypeError(f"peak(batch) must return a MemoryReport or a number of bytes >= 0, not {result!r}.")
    return int(result)


def largest_batch_that_fits(peak: Callable[[int], object], budget_bytes: int, *, start: int = 1,
                            max_batch: int = 1 << 20) -> BatchSearch:
    """Largest batch size whose measured peak (``peak(batch)``: a MemoryReport or bytes; OOM = does not fit) stays
    within ``budget_bytes``: doubling, then line-guesses alternating with bisection (peak grows with the batch)."""
    callable_arg(peak, "peak", "a function batch -> MemoryReport or bytes")
    for name, value in (("budget_bytes", budget_bytes), ("start", start), ("max_batch", max_batch)):
        positive_int(value, name)
    if start > max_batch:
        raise ValueError(f"start ({start}) must not exceed max_batch ({max_batch}).")
    tried: dict[int, int | None] = {}

    def fits(b: int) -> bool:
        if b not in tried:
            try:
                tried[b] = _peak_of(peak(b))
            except torch.OutOfMemoryError:
                tried[b] = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return tried[b] is not None and tried[b] <= budget_bytes

    if not fits(start):
        needs = "more than the device has" if tried[start] is None else f"{tried[start] / MIB:.1f} MiB"
        raise ValueError(f"Even batch {start} does not fit in {budget_bytes / MIB:.1f} MiB (it needs {needs}): "
                         "raise the budget, or shrink the model (fewer/narrower layers, a smaller dtype).")
    good, bad = start, None
    while bad is None:
        nxt = min(good * 2, max_batch)
        if nxt == good:
            break
        good, bad = (nxt, None) if fits(nxt) else (good, nxt)
    interpolate = True
    while bad is not None and bad - good > 1:
        p_good, p_bad = tried[good], tried[bad]
        if interpolate and p_bad is not None and p_bad > p_good:
            # the peak is close to a straight line in the batch: aim where the line meets the budget,
            # then test the neighbour on the other side (usually the boundary, found in two measurements)
            guess = good + int((budget_bytes - p_good) * (bad - good) // (p_bad - p_good))
            guess = min(max(guess, good + 1), bad - 1)
            if fits(guess):
                good = guess
                if guess + 1 < bad and not fits(guess + 1):
                    bad = guess + 1
            else:
                bad = guess
                if guess - 1 > good and fits(guess - 1):
                    good = guess - 1
        else:  # bisection: guarantees progress where the line is a poor guide (or out of memory)
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        interpolate = not interpolate
    return BatchSearch(batch=good, peak_bytes=tried[good], budget_bytes=budget_bytes, tried=tried)


def quick_wins_frame(wins: dict[str, tuple[object, object]]):
    """``{name: (before, after)}`` (MemoryReports or bytes) -> DataFrame with MiB and the saving."""
    import pandas as pd

    if not isinstance(wins, dict) or not wins:
        raise ValueError("Pass a non-empty dict {quick win: (before, after)} of MemoryReports or byte counts.")
    rows = []
    for name, pair in wins.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{name!r}: give a (before, after) pair, not {pair!r}.")
        before, after = (_peak_of(x) for x in pair)
        if before == 0:
            raise ValueError(f"{name!r}: the 'before' peak is 0 bytes; nothing to compare.")
        rows.append({"quick win": name, "before_MiB": before / MIB, "after_MiB": after / MIB,
                     "saved_MiB": (before - after) / MIB, "saved_pct": 100 * (before - after) / before})
    return pd.DataFrame(rows)


def plot_quick_wins(frame, ax=None, title: str = "Quick wins: peak memory before and after"):
    """Grouped horizontal bars (before / after) per quick win, from :func:`quick_wins_frame`."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    needed = {"quick win", "before_MiB", "after_MiB"}
    if not needed <= set(getattr(frame, "columns", ())):
        raise ValueError(f"frame must come from quick_wins_frame() (columns {sorted(needed)}).")
    long = frame.melt(id_vars="quick win", value_vars=["before_MiB", "after_MiB"], var_name="when", value_name="MiB")
    long["when"] = long["when"].str.replace("_MiB", "")
    ax = ax or plt.subplots(figsize=(8, 0.55 * len(frame) + 1.5))[1]
    sns.barplot(data=long, y="quick win", x="MiB", hue="when", ax=ax, palette=["#C44E52", "#55A868"])
    ax.set(xlabel="peak memory (MiB)", ylabel="", title=title)
    return ax
