"""Beyond one GPU (notebook 07): ZeRO per-rank bytes (2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2019),
the GPipe bubble (p - 1) / (m + p - 1), and ``run_ranks``, which launches a worker script on several processes (07's
FSDP and tensor-parallel workers, 11's sharded checkpoint). The workers themselves and the row-parallel exercise's
checker are written in the notebooks."""
from __future__ import annotations

import itertools
import math
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .units import GIB
from .validation import positive_int

ZERO_STAGES = (0, 1, 2, 3)
STAGE_LABELS = {0: "DDP (nothing sharded)", 1: "ZeRO-1 (optimizer sharded)", 2: "ZeRO-2 (+ gradients)",
                3: "ZeRO-3 / FSDP (+ parameters)"}
# mixed-precision Adam: fp16 weights and gradients, fp32 master weights + m + v; the stage from which each is sharded
BYTES_PER_PARAM = {"params": 2, "grads": 2, "optimizer": 12}
SHARDED_FROM = {"params": 3, "grads": 2, "optimizer": 1}


@dataclass(frozen=True)
class ZeroBytes:
    """Bytes one rank holds for the model state under a ZeRO stage."""

    stage: int
    world_size: int
    params: int
    grads: int
    optimizer: int

    total = property(lambda self: self.params + self.grads + self.optimizer)


def zero_bytes_per_rank(n_params: int, world_size: int, stage: int) -> ZeroBytes:
    """Per-rank model-state bytes under ZeRO ``stage`` (1: optimizer state sharded, 2: + gradients, 3: + parameters);
    a shard is ceil(bytes / world_size). Activations are not included."""
    n_params = positive_int(n_params, "n_params", "number of parameters, e.g. 1_557_611_200")
    world_size = positive_int(world_size, "world_size", "number of ranks, e.g. 8")
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {ZERO_STAGES} (0 = plain data parallelism), not {stage!r}.")
    held = {name: math.ceil(n_params * b / world_size) if stage >= SHARDED_FROM[name] else n_params * b
            for name, b in BYTES_PER_PARAM.items()}
    return ZeroBytes(stage=stage, world_size=world_size, **held)


def zero_table(n_params: int, world_sizes=(1, 2, 4, 8, 16, 32, 64)):
    """A pandas DataFrame of :func:`zero_bytes_per_rank` for every stage and world size (long format)."""
    import pandas as pd

    if not list(world_sizes):
        raise ValueError("world_sizes must list at least one number of ranks, e.g. (1, 2, 4).")
    rows = []
    for stage, n in itertools.product(ZERO_STAGES, world_sizes):
        z = zero_bytes_per_rank(n_params, n, stage)
        rows.append({"stage": stage, "strategy": STAGE_LABELS[stage], **asdict(z), "total": z.total,
                     "total_GiB": z.total / GIB})
    return pd.DataFrame(rows)


def min_world_size(n_params: int, budget_bytes: int, stage: int) -> int | None:
    """The fewest ranks (up to 4096) whose per-rank model state fits ``budget_bytes`` under ``stage``; else None."""
    budget_bytes = positive_int(budget_bytes, "budget_bytes", "e.g. 80 * 1024**3")
    fits = (n for n in range(1, 4097) if zero_bytes_per_rank(n_params, n, stage).total <= budget_bytes)
    return next(fits, None)


def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of a GPipe schedule: ``(p - 1) / (m + p - 1)`` for ``p`` stages, ``m`` micro-batches."""
    p, m = positive_int(p, "p", "pipeline stages"), positive_int(m, "m", "micro-batches per step")
    return (p - 1) / (m + p - 1)


def gpipe_schedule(p: int, m: int) -> list[dict]:
    """The GPipe schedule as a list of ``{stage, slot, micro_batch, phase}`` (phase 'F' or 'B')."""
    p, m = positive_int(p, "p", "pipeline stages"), positive_int(m, "m", "micro-batches per step")
    # stage s runs micro-batch j's forward at slot s + j; the backwards start after the last forward, last stage first
    cells = [{"stage": s, "slot": slot, "micro_batch": j, "phase": phase} for s in range(p) for j in range(m)
             for phase, slot in (("F", s + j), ("B", m + p - 1 + (p - 1 - s) + j))]
    return sorted(cells, key=lambda c: (c["stage"], c["slot"]))


def schedule_bubble_fraction(schedule: list[dict]) -> float:
    """Idle slots / all slots of a schedule from :func:`gpipe_schedule` (the measured bubble)."""
    if not schedule:
        raise ValueError("schedule is empty; build one with gpipe_schedule(p, m).")
    n_stages, n_slots = 1 + max(c["stage"] for c in schedule), 1 + max(c["slot"] for c in schedule)
    busy = {(c["stage"], c["slot"]) for c in schedule}
    if len(busy) != len(schedule):
        raise ValueError("schedule puts two tasks on one stage in the same slot.")
    return 1 - len(busy) / (n_stages * n_slots)


def plot_pipeline_schedule(p: int, m: int, *, ax=None):
    """Draw the GPipe schedule: one row per stage, forward (blue) and backward (orange) per micro-batch."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule, n_slots = gpipe_schedule(p, m), 2 * (m + p - 1)
    ax = ax or plt.subplots(figsize=(min(14, 1.5 + 0.45 * n_slots), 0.6 * p + 1.2))[1]
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for s in range(p):
        ax.broken_barh([(0, n_slots)], (s - 0.4, 0.8), facecolors="#eeeeee", edgecolor="none")
    for c in schedule:
        ax.broken_barh([(c["slot"], 1)], (c["stage"] - 0.4, 0.8), facecolors=colors[c["phase"]], edgecolor="white")
        ax.text(c["slot"] + 0.5, c["stage"], f"{c['phase']}{c['micro_batch']}", ha="center", va="center",
                color="white", fontsize=8)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xticks(range(0, n_slots + 1, 1 if n_slots <= 30 else 2 if n_slots <= 60 else 5))
    ax.set(xlim=(0, n_slots), xlabel="time slot (one forward or backward of one micro-batch)")
    ax.grid(False)
    ax.legend(handles=[Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward"),
                       Patch(color="#eeeeee", label="idle (bubble)")], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"GPipe, p={p} stages, m={m} micro-batches: bubble = {bubble_fraction(p, m):.0%}")
    return ax


def run_ranks(script, inputs: dict, *, world_size: int = 2, timeout_s: int = 300, folder=None) -> list:
    """Save ``inputs`` to a fresh run folder (in ``folder``, default: the script's), run ``script RUN_DIR`` on
    ``world_size`` processes with the course's launcher (``python -m course_tools.launcher``, what ``torchrun
    --nproc-per-node N`` does: each process gets its rank in the environment, the rendezvous listens on a port the
    operating system picks, every process is stopped after an error or ``timeout_s``), print the command and what the
    ranks printed, and return what each rank saved to ``RUN_DIR/rank<r>.pt``, by rank. The run folder is removed."""
    import torch

    script = Path(script)
    if not script.is_file():
        raise ValueError(f"{script} is not a file: write the worker script first (its %%writefile cell).")
    positive_int(world_size, "world_size")
    positive_int(timeout_s, "timeout_s")
    run_dir = tempfile.mkdtemp(prefix="run_", dir=folder or script.parent)
    try:
        torch.save(inputs, f"{run_dir}/data.pt")
        command = [sys.executable, "-m", "course_tools.launcher", f"--nproc-per-node={world_size}",
                   f"--timeout={timeout_s}", str(script), run_dir]
        print("$ python", *command[1:])
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout + done.stderr)
        if done.returncode:
            raise RuntimeError(f"the ranks failed (exit code {done.returncode}); the launcher's report is above")
        return [torch.load(f"{run_dir}/rank{rank}.pt") for rank in range(world_size)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
