"""Beyond one GPU (notebook 07): ZeRO per-rank bytes (2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2019),
the GPipe bubble (p - 1) / (m + p - 1), a ZeRO-Offload config, the row-parallel exercise's checker.
The multi-process workers are written in the notebook."""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .units import GIB
from .validation import callable_arg, positive_int

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


def plot_zero_per_rank(n_params: int, world_sizes=(1, 2, 4, 8, 16, 32, 64), *, budget_bytes: int | None = None,
                       budget_label: str = "GPU memory", ax=None):
    """Per-rank model state (GiB) vs number of ranks, one line per ZeRO stage (log-2 x axis)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = zero_table(n_params, world_sizes)
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    sns.lineplot(data=df, x="world_size", y="total_GiB", hue="strategy", marker="o", ax=ax)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(df["world_size"])), [str(n) for n in sorted(set(df["world_size"]))])
    if budget_bytes is not None:
        positive_int(budget_bytes, "budget_bytes")
        ax.axhline(budget_bytes / GIB, color="black", linestyle="--", linewidth=1)
        ax.text(ax.get_xlim()[0], budget_bytes / GIB, f" {budget_label}", va="bottom", ha="left", fontsize=9)
    ax.legend(title="strategy", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.set(xlabel="number of data-parallel ranks", ylabel="model state per rank (GiB)",
           title=f"ZeRO per-rank memory, {n_params / 1e9:.2f}B parameters, mixed-precision Adam")
    return ax


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


def plot_pipeline_schedule(p: int, m: int, *, ax=None, title: str | None = None):
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
    ax.set_title(title or f"GPipe, p={p} stages, m={m} micro-batches: bubble = {bubble_fraction(p, m):.0%}")
    return ax


def deepspeed_zero_offload_config(*, micro_batch_size: int = 4, grad_accum_steps: int = 16, stage: int = 2) -> dict:
    """A DeepSpeed config for ZeRO-Offload (Ren et al. 2021): optimizer state and step on the CPU."""
    positive_int(micro_batch_size, "micro_batch_size")
    positive_int(grad_accum_steps, "grad_accum_steps")
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"ZeRO-Offload needs stage 1, 2 or 3, not {stage!r}.")
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum_steps,
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
            "optimizer": {"type": "AdamW",
                          "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True},
            "zero_allow_untested_optimizer": True}


def check_row_parallel(fn, *, seed: int = 0) -> bool:
    """Check ``fn(x, weight, bias, n_ranks) -> (partials, y)``, a row-parallel Linear on simulated ranks, against
    ``F.linear`` for 2 and 4 ranks; partials exclude the bias, y adds it once. Prints a verdict, returns a bool."""
    callable_arg(fn, "fn", "your function (x, weight, bias, n_ranks) -> (partials, y)")
    gen = torch.Generator().manual_seed(seed)
    for n in (2, 4):
        x, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((8, 12), (6, 12), (6,)))
        wanted = [xr @ wr.T for xr, wr in zip(x.chunk(n, dim=1), weight.chunk(n, dim=1))]
        try:
            partials, y = fn(x, weight, bias, n)
            partials = list(partials)
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - a wrong split usually fails on a shape: a verdict, not a crash
            print(f"✗ row-parallel Linear on {n} ranks: your function raised {type(err).__name__}: {err}")
            return False
        verdicts = [(f"{n} ranks: rank {r}'s partial product", part, want,
                     "rank r multiplies its block of x's features by its block of weight's columns (no bias yet).")
                    for r, (part, want) in enumerate(zip(partials, wanted))]
        verdicts.append((f"{n} ranks: the output after the all-reduce", y, F.linear(x, weight, bias),
                         "sum the partials (that is what all_reduce does), then add the bias once."))
        if len(partials) != n:
            print(f"✗ {n} ranks: expected {n} partial products (one per rank), got {len(partials)}.")
            return False
        for name, got, want, hint in verdicts:
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                print(f"✗ {name}: expected shape {tuple(want.shape)}, got {shape}. Hint: {hint}")
                return False
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                print(f"✗ {name}: off by up to {(got - want).abs().max().item():.3g}. Hint: {hint}")
                return False
    print("✓ row-parallel Linear: every rank's partial product and the all-reduced output are right, on 2 and 4 ranks.")
    return True
