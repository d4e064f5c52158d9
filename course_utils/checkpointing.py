"""Gradient checkpointing on an abstract chain (notebook 03): run the notebook's keep/recompute rule, count, draw.

Nodes are ("f", i) (activations) and ("b", i) (gradients); f_i needs f_(i-1), b_i needs f_i and b_(i+1).
``rule(n, kept, keep_recomputed)`` yields ("compute", node, recomputed) and ("free", node). Memory is in nodes,
or in size units with ``sizes`` (b_i has f_i's size).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from numbers import Real
from typing import Iterable, Sequence

import numpy as np

from .validation import callable_arg, positive_int, positive_number

STRATEGY_LABELS = {
    "store_all": "keep everything",
    "recompute_all": "recompute everything",
    "every_k": "checkpoint every k (sqrt n)",
    "checkpoints": "chosen checkpoints",
}
COMPARED = ("store_all", "recompute_all", "every_k")  # the three strategies the notebook compares
MAX_LIVE_RECORD = 200  # record the live set of every step only for chains up to this length
MAX_BRUTE_FORCE_N = 16
MAX_DRAWN_N = 16


def default_k(n: int) -> int:
    """The sqrt(n) spacing: round(sqrt(n)), at least 1."""
    return max(1, round(math.sqrt(positive_int(n, "n (the number of layers)", "e.g. 9"))))


@dataclass(repr=False)
class ChainSchedule:
    """The result of :func:`simulate`: one entry per step (node computation)."""

    n: int
    strategy: str
    checkpoints: tuple  # positions of the f nodes kept from the first forward pass
    sizes: tuple
    ops: list  # "f3", "b3", ... in execution order
    recomputed: list  # True where the step recomputes an f node
    memory: list  # memory while the step runs (nodes or size units)
    live_nodes: list  # number of live nodes while the step runs
    live: list | None  # frozensets of ("f"|"b", i) while the step runs, for n <= MAX_LIVE_RECORD

    steps = property(lambda self: len(self.ops))
    peak_memory = property(lambda self: max(self.memory))
    peak_nodes = property(lambda self: max(self.live_nodes))
    forward_count = property(lambda self: sum(op[0] == "f" for op in self.ops))
    recompute_count = property(lambda self: self.forward_count - self.n)  # beyond the first forward pass
    forward_ratio = property(lambda self: self.forward_count / self.n)  # 2 is one extra forward pass
    unit_sizes = property(lambda self: all(s == 1 for s in self.sizes))
    label = property(lambda self: STRATEGY_LABELS[self.strategy])

    def live_at(self, t: int) -> frozenset:
        """The nodes live while step ``t`` (0-based) runs, as ("f"|"b", i) pairs."""
        if self.live is None:
            raise ValueError(f"Live sets are recorded only for chains of up to {MAX_LIVE_RECORD} layers (n={self.n}).")
        return self.live[t]

    def summary(self) -> dict:
        return {"strategy": self.label, "n": self.n,
                "checkpoints": len(self.checkpoints) if self.strategy not in ("store_all", "recompute_all") else None,
                "peak_nodes": self.peak_nodes, "peak_memory": self.peak_memory,
                "forward_computations": self.forward_count, "forward_ratio": self.forward_ratio}


def _positions(checkpoints, n: int) -> tuple:
    if not isinstance(checkpoints, (list, tuple, range)):
        raise TypeError(f"strategy 'checkpoints' needs checkpoints= a list of layer positions (ints 1..n), "
                        f"e.g. [3, 6], not {checkpoints!r}.")
    for c in checkpoints:
        if positive_int(c, "a checkpoint position", f"between 1 and n={n}") > n:
            raise ValueError(f"checkpoint position {c} is outside the chain: use positions between 1 and n={n}.")
    return tuple(sorted(set(checkpoints)))


def simulate(n: int, strategy: str = "every_k", *, rule, checkpoints: Sequence[int] | None = None,
             sizes: Sequence[float] | None = None) -> ChainSchedule:
    """Run ``rule`` (the notebook's keep/recompute rule) on an n-layer chain with one of the strategies
    'store_all', 'recompute_all', 'every_k' (a checkpoint every sqrt(n) layers) or 'checkpoints' (yours)."""
    k = default_k(n)  # also checks n
    callable_arg(rule, "rule", "the notebook's keep/recompute rule: a function (n, kept, keep_recomputed) that "
                 "yields ('compute', node, recomputed) and ('free', node) operations")
    if strategy not in STRATEGY_LABELS:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of {tuple(STRATEGY_LABELS)}.")
    if checkpoints is not None and strategy != "checkpoints":
        raise ValueError(f"checkpoints=... goes with strategy='checkpoints', not {strategy!r}.")
    if sizes is None:
        sizes = (1,) * n
    positive = isinstance(sizes, (list, tuple)) and all(isinstance(s, Real) and 0 < s < math.inf for s in sizes)
    if not positive or len(sizes) != n:
        raise ValueError(f"sizes must list {n} positive numbers, one per layer, e.g. [4, 1, 6, 1] for 4 layers.")
    kept = {"store_all": range(1, n + 1), "recompute_all": (), "every_k": range(k, n + 1, k)}.get(strategy)
    kept = _positions(checkpoints, n) if kept is None else tuple(kept)
    # a recomputation keeps its nodes until their b node is done, except in recompute_all (only the newest)
    live: dict = {}  # node -> size
    nodes = {(kind, i) for kind in "fb" for i in range(1, n + 1)}
    sched = ChainSchedule(n, strategy, kept, tuple(sizes), [], [], [], [], [] if n <= MAX_LIVE_RECORD else None)
    for op in rule(n, frozenset(kept), strategy != "recompute_all"):
        if not (isinstance(op, tuple) and len(op) >= 2 and op[0] in ("compute", "free") and op[1] in nodes):
            raise ValueError(f"The rule yielded {op!r}; yield ('compute', node, recomputed) or ('free', node), where "
                             f"nodes are ('f', i) or ('b', i) with i in 1..{n}.")
        node, name = op[1], "{}{}".format(*op[1])
        if op[0] == "free":
            if node not in live:
                raise ValueError(f"The rule frees {name}, which is not in memory.")
            del live[node]
            continue
        if node in live:
            raise ValueError(f"The rule computes {name} while it is still in memory.")
        i = node[1]
        needs = [("f", i - 1)] if node[0] == "f" else [("f", i), ("b", i + 1)]  # f0 (the input) and b(n+1): no nodes
        missing = ["{}{}".format(*m) for m in needs if m in nodes and m not in live]
        if missing:
            raise ValueError(f"The rule computes {name} but {', '.join(missing)} is not in memory: "
                             "free a node only after the last step that needs it, or recompute it first.")
        live[node] = sizes[i - 1]
        sched.ops.append(name)
        sched.recomputed.append(bool(op[2]) if len(op) > 2 else False)
        sched.memory.append(sum(live.values()))
        sched.live_nodes.append(len(live))
        if sched.live is not None:
            sched.live.append(frozenset(live))
    if sorted(o for o in sched.ops if o[0] == "b") != sorted(f"b{i}" for i in range(1, n + 1)):
        raise ValueError(f"The rule must compute each of b{n}..b1 once; it computed "
                         f"{[o for o in sched.ops if o[0] == 'b']}.")
    return sched


def sweep(ns: Iterable[int], *, rule):
    """Simulate the three compared strategies for each n with ``rule``: a DataFrame of their summaries."""
    import pandas as pd

    return pd.DataFrame([simulate(n, s, rule=rule).summary() for n in ns for s in COMPARED])


def best_segment_count(n: int, *, rule, max_segments: int | None = None):
    """Try every segment count s (1..max_segments), checkpoints cutting the chain into s nearly equal segments:
    ``(best s, DataFrame)``."""
    import pandas as pd

    rows = []
    for s in range(1, (max_segments or min(n, 4 * math.isqrt(n) + 4)) + 1):
        sched = simulate(n, "checkpoints", rule=rule, checkpoints=[round(i * n / s) for i in range(1, s + 1)])
        rows.append({"segments": s, "peak_nodes": sched.peak_nodes, "forward_computations": sched.forward_count})
    best = min(rows, key=lambda r: (r["peak_nodes"], r["forward_computations"], r["segments"]))
    return best["segments"], pd.DataFrame(rows)


def optimal_checkpoints(sizes: Sequence[float], budget: float, *, rule) -> ChainSchedule:
    """The checkpoint set that keeps the peak within ``budget`` with the fewest recomputations (brute force)."""
    budget, n = positive_number(budget, "budget", "in the units of sizes, e.g. 16"), len(sizes)
    if n > MAX_BRUTE_FORCE_N:
        raise ValueError(f"optimal_checkpoints tries every subset; keep n <= {MAX_BRUTE_FORCE_N} (got n={n}).")
    best, lowest = None, math.inf
    for subset in itertools.chain.from_iterable(itertools.combinations(range(1, n), r) for r in range(n)):
        sched = simulate(n, "checkpoints", rule=rule, checkpoints=subset, sizes=sizes)
        lowest = min(lowest, sched.peak_memory)
        key = (sched.forward_count, sched.peak_memory, len(subset), subset)
        if sched.peak_memory <= budget and (best is None or key < best[0]):
            best = key, sched
    if best is None:
        raise ValueError(f"No checkpoint set keeps the peak within budget={budget}: the smallest peak a checkpoint "
                         f"set reaches is {lowest}. Raise the budget to at least {lowest}.")
    return best[1]


def evaluate_checkpoints(sizes: Sequence[float], budget: float, checkpoints: Sequence[int], *, rule) -> dict:
    """Grade a checkpoint choice: does it fit the budget, and how many recomputations does it cost?"""
    budget = positive_number(budget, "budget", "in the units of sizes, e.g. 16")
    sched = simulate(len(sizes), "checkpoints", rule=rule, checkpoints=checkpoints, sizes=sizes)
    return {"checkpoints": sched.checkpoints, "peak_memory": sched.peak_memory, "fits": sched.peak_memory <= budget,
            "recomputations": sched.recompute_count}


LIVE_COLOR = "#8e44ad"  # the article's purple
RECOMPUTE_COLOR = "#e67e22"
CURRENT_EDGE = "#c0392b"


def draw_step(schedule: ChainSchedule, t: int, ax=None):
    """Draw the f/b graph with the nodes live at step ``t`` shaded; the node computed is outlined red."""
    import matplotlib.pyplot as plt

    live, n, op = schedule.live_at(t), schedule.n, schedule.ops[t]
    ax = ax or plt.subplots(figsize=(max(4.0, 0.75 * n + 1.5), 2.2))[1]
    current, kept = (op[0], int(op[1:])), set(schedule.checkpoints) if schedule.strategy != "store_all" else set()
    # edges (f(i-1) -> fi along the top, b(i+1) -> bi along the bottom, fi -> bi), shortened by `gap` so they stop
    # at the node circles; one quiver call (FancyArrowPatch is slow)
    edges = [(0, 1, 1, 1)] + [e for i in range(1, n) for e in ((i, 1, i + 1, 1), (i + 1, 0, i, 0))]
    edges += [(i, 1, i, 0) for i in range(1, n + 1)]
    x0, y0, x1, y1 = (np.array(c, dtype=float) for c in zip(*edges))
    length, gap = np.hypot(x1 - x0, y1 - y0), 0.24
    ux, uy = (x1 - x0) / length, (y1 - y0) / length
    ax.quiver(x0 + gap * ux, y0 + gap * uy, (length - 2 * gap) * ux, (length - 2 * gap) * uy, angles="xy",
              scale_units="xy", scale=1, color="0.55", width=0.003, headwidth=4, headlength=4.5, headaxislength=4,
              zorder=1)
    ax.scatter([0], [1], s=260, marker="o", facecolor="0.85", edgecolor="0.4", zorder=2)
    ax.text(0, 1, "x", ha="center", va="center", fontsize=8, zorder=3)
    for (kind, y), i in itertools.product((("f", 1), ("b", 0)), range(1, n + 1)):
        node, is_live = (kind, i), (kind, i) in live
        face = (RECOMPUTE_COLOR if node == current and schedule.recomputed[t] else LIVE_COLOR) if is_live else "white"
        ax.scatter([i], [y], s=300, marker="s" if kind == "f" and i in kept else "o", facecolor=face, zorder=2,
                   edgecolor=CURRENT_EDGE if node == current else "0.3", linewidths=2.5 if node == current else 1.0)
        ax.text(i, y, f"{kind}{i}", ha="center", va="center", fontsize=7 if n < 13 else 6,
                color="white" if is_live else "black", zorder=3)
    if not schedule.unit_sizes:  # each node's size above its f node
        for i, label in enumerate(["size"] + [f"{v:g}" for v in schedule.sizes]):
            ax.text(i, 1.42, label, ha="center", va="center", fontsize=7, color="0.35")
    ax.set(xlim=(-0.6, n + 0.6), ylim=(-0.55, 1.55 if schedule.unit_sizes else 1.7), aspect="equal")
    ax.axis("off")
    memory = "" if schedule.unit_sizes else f", memory {schedule.memory[t]:g} (size units)"
    verb = "recompute" if schedule.recomputed[t] else "compute"
    ax.set_title(f"{schedule.label}: step {t + 1}/{schedule.steps}, {verb} {op}; live {schedule.live_nodes[t]} "
                 f"nodes{memory}", fontsize=9)
    return ax


def interesting_steps(schedule: ChainSchedule, count: int = 4) -> list:
    """A few steps worth showing: end of the forward pass, the peak, a recomputation, the last step."""
    s = schedule
    recomputations = [t for t in range(s.steps) if s.recomputed[t]]
    picks = {s.n - 1, s.memory.index(s.peak_memory), s.steps - 1, *recomputations[len(recomputations) // 2:][:1]}
    return sorted(picks)[:count]


def draw_strategy_grid(n: int = 6, steps_per_strategy: int = 3, *, rule):
    """The static figure: one row per compared strategy, a few time steps each (the fallback for the slider)."""
    import matplotlib.pyplot as plt

    if n > MAX_DRAWN_N:
        raise ValueError(f"draw_strategy_grid draws every node; keep n <= {MAX_DRAWN_N} (got {n}).")
    fig, axes = plt.subplots(len(COMPARED), steps_per_strategy,
                             figsize=(steps_per_strategy * (0.62 * n + 1.2), 1.9 * len(COMPARED)), squeeze=False)
    for row, strategy in zip(axes, COMPARED):
        sched = simulate(n, strategy, rule=rule)
        picks = interesting_steps(sched, steps_per_strategy)
        for ax, t in itertools.zip_longest(row, picks):
            if t is None:
                ax.axis("off")
                continue
            draw_step(sched, t, ax)
            ax.title.set_fontsize(8)
    fig.suptitle("Live nodes (purple) at a few steps; red outline = node computed now, orange = recomputed, "
                 "square = kept checkpoint", fontsize=9)
    fig.tight_layout()
    return fig


def plot_timelines(schedules: Iterable[ChainSchedule], ax=None):
    """Memory (live nodes or size units) at each step, one line per schedule."""
    import matplotlib.pyplot as plt

    schedules = list(schedules)
    ax = ax or plt.subplots(figsize=(8, 3.2))[1]
    for s in schedules:
        ax.step(range(1, s.steps + 1), s.memory, where="mid", label=f"{s.label} (peak {s.peak_memory:g})")
    ax.set(xlabel="step (one node computed per step)",
           ylabel="live nodes" if all(s.unit_sizes for s in schedules) else "memory (size units)")
    ax.legend(fontsize=8)
    return ax


def plot_scaling(table, axes=None):
    """Two log-log panels of a :func:`sweep` table: peak live nodes and forward computations vs n, with references."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    axes = plt.subplots(1, 2, figsize=(11, 4))[1] if axes is None else axes
    ns = np.array(sorted(table["n"].unique()), dtype=float)
    panels = [("peak_nodes", "peak memory", "peak live nodes",
               [(np.sqrt(ns), "k:", "sqrt(n)"), (2 * np.sqrt(ns), "k--", "2 sqrt(n)")]),
              ("forward_computations", "compute", "forward computations",
               [(ns, "k:", "n"), (2 * ns, "k--", "2n"), (ns ** 2 / 2, "k-.", "n²/2")])]
    for ax, (column, title, ylabel, lines) in zip(axes, panels):
        sns.lineplot(data=table, x="n", y=column, hue="strategy", marker="o", ax=ax)
        for y, style, label in lines:
            ax.plot(ns, y, style, lw=1, label=label)
        ax.set(yscale="log", title=title, ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    return axes


def chain_explorer(n: int = 9, *, rule):
    """An ipywidgets explorer: pick a strategy, drag the time step, see which nodes are live."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from .plots import show_figure

    if n > MAX_DRAWN_N:
        raise ValueError(f"chain_explorer draws every node; keep n <= {MAX_DRAWN_N} (got {n}).")
    schedules = {STRATEGY_LABELS[s]: simulate(n, s, rule=rule) for s in COMPARED}
    picker = widgets.ToggleButtons(options=list(schedules), description="strategy")
    slider = widgets.IntSlider(value=0, min=0, max=schedules[picker.value].steps - 1, description="step",
                               continuous_update=False)
    out = widgets.Output()

    def redraw(*_):
        sched = schedules[picker.value]
        slider.max = sched.steps - 1  # a later step than the new schedule has moves to its last step
        with out:
            out.clear_output(wait=True)
            fig, (ax_graph, ax_mem) = plt.subplots(2, 1, figsize=(0.75 * n + 2, 4.2),
                                                   gridspec_kw={"height_ratios": [1.3, 1]})
            draw_step(sched, slider.value, ax_graph)
            ax_mem.step(range(1, sched.steps + 1), sched.memory, where="mid", color=LIVE_COLOR)
            ax_mem.axvline(slider.value + 1, color=CURRENT_EDGE, lw=1)
            ax_mem.set(xlabel="step", ylabel="live nodes")
            fig.tight_layout()
            show_figure(fig)

    picker.observe(redraw, names="value")
    slider.observe(redraw, names="value")
    redraw()
    return widgets.VBox([picker, slider, out])
