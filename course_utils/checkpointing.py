"""Gradient checkpointing on an abstract chain (notebook 03): run the notebook's keep/recompute rule, count, draw.

Nodes are ("f", i) (activations) and ("b", i) (gradients); f_i needs f_(i-1), b_i needs f_i and b_(i+1).
``rule(n, kept, keep_recomputed)`` yields ("compute", node, recomputed) and ("free", node). Memory is in nodes,
or in size units with ``sizes`` (b_i has f_i's size).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Iterable, Sequence

import numpy as np

from .validation import callable_arg, positive_int, positive_number

STRATEGIES = ("store_all", "recompute_all", "every_k", "checkpoints")
STRATEGY_LABELS = {
    "store_all": "keep everything",
    "recompute_all": "recompute everything",
    "every_k": "checkpoint every k (sqrt n)",
    "checkpoints": "chosen checkpoints",
}
MAX_LIVE_RECORD = 200  # record the live set of every step only for chains up to this length
MAX_BRUTE_FORCE_N = 16


def _check_n(n) -> int:
    return positive_int(n, "n (the number of layers)", "e.g. 9")


def _is_list(x) -> bool:
    return isinstance(x, Iterable) and not isinstance(x, (str, bytes))


def _check_sizes(sizes, n: int) -> tuple:
    if sizes is None:
        return (1,) * n
    if not _is_list(sizes):
        raise TypeError(f"sizes must be a list of {n} positive numbers (one per layer), not {type(sizes).__name__}.")
    sizes = tuple(sizes)
    if len(sizes) != n:
        raise ValueError(f"sizes has {len(sizes)} entries but the chain has n={n} layers: give one size per layer.")
    bad = [(i, s) for i, s in enumerate(sizes, 1) if isinstance(s, bool) or not isinstance(s, Real) or not 0 < s < math.inf]
    if bad:
        raise ValueError(f"sizes[{bad[0][0] - 1}] (the size of f{bad[0][0]}) must be a positive number, got {bad[0][1]!r}.")
    return sizes


def _check_positions(checkpoints, n: int) -> tuple:
    if checkpoints is None:
        raise ValueError("strategy 'checkpoints' needs checkpoints=[positions], e.g. checkpoints=[3, 6].")
    if not _is_list(checkpoints):
        raise TypeError(f"checkpoints must be a list of layer positions (ints 1..n), not {type(checkpoints).__name__}.")
    for c in checkpoints:
        if isinstance(c, bool) or not isinstance(c, int):
            raise TypeError(f"checkpoint positions must be ints between 1 and n={n}, got {c!r}.")
        if not 1 <= c <= n:
            raise ValueError(f"checkpoint position {c} is outside the chain: use positions between 1 and n={n}.")
    return tuple(sorted(set(checkpoints)))


def _check_sizes_budget(sizes, budget) -> tuple:
    """``(n, sizes, budget)`` for the exercise's functions: a non-empty list of sizes and a positive budget."""
    if not _is_list(sizes) or not hasattr(sizes, "__len__") or len(sizes) == 0:
        raise ValueError("sizes must list the size of each layer's activation, e.g. [4, 1, 6, 1].")
    budget = positive_number(budget, "budget", "in the units of sizes, e.g. 16")
    return len(sizes), _check_sizes(sizes, len(sizes)), budget


def default_k(n: int) -> int:
    """The sqrt(n) spacing: round(sqrt(n)), at least 1."""
    _check_n(n)
    return max(1, round(math.sqrt(n)))


@dataclass
class ChainSchedule:
    """The result of :func:`simulate`: one entry per step (node computation)."""

    n: int
    strategy: str
    checkpoints: tuple  # positions of the f nodes kept from the first forward pass
    sizes: tuple
    ops: list = field(repr=False)  # "f3", "b3", ... in execution order
    recomputed: list = field(repr=False)  # True where the step recomputes an f node
    memory: list = field(repr=False)  # memory while the step runs (nodes or bytes)
    live_nodes: list = field(repr=False)  # number of live nodes while the step runs
    live: list | None = field(default=None, repr=False)  # frozensets of ("f"|"b", i), if recorded
    peak_memory: float = 0
    peak_nodes: int = 0
    forward_count: int = 0

    steps = property(lambda self: len(self.ops))

    @property
    def recompute_count(self) -> int:
        """Forward computations beyond the first forward pass."""
        return self.forward_count - self.n

    @property
    def forward_ratio(self) -> float:
        """Forward computations / n: 1 without recomputation, 2 is one extra forward pass."""
        return self.forward_count / self.n

    unit_sizes = property(lambda self: all(s == 1 for s in self.sizes))
    label = property(lambda self: STRATEGY_LABELS[self.strategy])

    def live_at(self, t: int) -> frozenset:
        """The nodes live while step ``t`` (0-based) runs, as ("f"|"b", i) pairs."""
        if self.live is None:
            raise ValueError(f"This schedule did not record live sets (n={self.n}); simulate(..., record_live=True) "
                             "records them (fine for n up to a few hundred).")
        if positive_int(t, "t (the step index)", allow_zero=True) >= self.steps:
            raise ValueError(f"step t={t} is outside the schedule: use 0..{self.steps - 1}.")
        return self.live[t]

    def summary(self) -> dict:
        return {"strategy": self.label, "n": self.n,
                "checkpoints": len(self.checkpoints) if self.strategy not in ("store_all", "recompute_all") else None,
                "peak_nodes": self.peak_nodes, "peak_memory": self.peak_memory,
                "forward_computations": self.forward_count, "forward_ratio": self.forward_ratio}


def simulate(n: int, strategy: str = "every_k", *, rule, k: int | None = None, checkpoints: Sequence[int] | None = None,
             sizes: Sequence[float] | None = None, record_live: bool | None = None) -> ChainSchedule:
    """Run ``rule`` (the notebook's keep/recompute rule) for a strategy on an n-layer chain."""
    _check_n(n)
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of {STRATEGIES}.")
    sizes = _check_sizes(sizes, n)
    if k is not None and strategy != "every_k":
        raise ValueError(f"k is the spacing of strategy 'every_k'; strategy {strategy!r} does not use it.")
    if checkpoints is not None and strategy != "checkpoints":
        raise ValueError(f"checkpoints=... goes with strategy='checkpoints', not {strategy!r}.")
    if strategy == "every_k":
        k = default_k(n) if k is None else positive_int(k, "k (the checkpoint spacing)", f"between 1 and n={n}")
        if k > n:
            raise ValueError(f"k (the checkpoint spacing) must be between 1 and n={n}, got {k}.")
    stored = {"store_all": lambda: tuple(range(1, n + 1)), "recompute_all": tuple,
              "every_k": lambda: tuple(range(k, n + 1, k)), "checkpoints": lambda: _check_positions(checkpoints, n)}
    record_live = n <= MAX_LIVE_RECORD if record_live is None else bool(record_live)
    # a recomputation keeps its nodes until their b node is done, except in recompute_all (only the newest)
    return _run(n, strategy, stored[strategy](), strategy != "recompute_all", sizes, record_live, rule)


def _node_name(node) -> str:
    return f"{node[0]}{node[1]}"


def _needs(node, n: int) -> list:
    """The nodes that must be live to compute ``node``."""
    kind, i = node
    if kind == "f":
        return [("f", i - 1)] if i > 1 else []
    return [("f", i)] + ([("b", i + 1)] if i < n else [])


def _run(n, strategy, stored, keep_recomputed, sizes, record_live, rule) -> ChainSchedule:
    callable_arg(rule, "rule", "the notebook's keep/recompute rule: a function (n, kept, keep_recomputed) that "
                 "yields ('compute', node, recomputed) and ('free', node) operations")
    live: dict = {}  # node -> size
    mem = peak_mem = peak_nodes = forward = 0
    ops, recomputed, memory, counts, lives = [], [], [], [], ([] if record_live else None)
    for op in rule(n, frozenset(stored), keep_recomputed):
        if not isinstance(op, tuple) or op[:1] not in (("compute",), ("free",)) or len(op) < 2:
            raise ValueError(f"The rule yielded {op!r}; yield ('compute', node, recomputed) or ('free', node).")
        node = op[1]
        if (not isinstance(node, tuple) or len(node) != 2 or node[0] not in ("f", "b")
                or not isinstance(node[1], int) or not 1 <= node[1] <= n):
            raise ValueError(f"The rule named the node {node!r}; nodes are ('f', i) or ('b', i) with i in 1..{n}.")
        if op[0] == "free":
            if node not in live:
                raise ValueError(f"The rule frees {_node_name(node)}, which is not in memory.")
            mem -= live.pop(node)
            continue
        if node in live:
            raise ValueError(f"The rule computes {_node_name(node)} while it is still in memory.")
        missing = [_node_name(m) for m in _needs(node, n) if m not in live]
        if missing:
            raise ValueError(f"The rule computes {_node_name(node)} but {', '.join(missing)} is not in memory: "
                             "free a node only after the last step that needs it, or recompute it first.")
        live[node] = sizes[node[1] - 1]
        mem += live[node]
        ops.append(_node_name(node))
        recomputed.append(bool(op[2]) if len(op) > 2 else False)
        memory.append(mem)
        counts.append(len(live))
        peak_mem, peak_nodes = max(peak_mem, mem), max(peak_nodes, len(live))
        forward += node[0] == "f"
        if lives is not None:
            lives.append(frozenset(live))
    if ops.count("b1") != 1 or sum(o[0] == "b" for o in ops) != n:
        raise ValueError(f"The rule must compute each of b{n}..b1 once; it computed {[o for o in ops if o[0] == 'b']}.")
    return ChainSchedule(n=n, strategy=strategy, checkpoints=tuple(stored), sizes=tuple(sizes), ops=ops,
                         recomputed=recomputed, memory=memory, live_nodes=counts, live=lives,
                         peak_memory=peak_mem, peak_nodes=peak_nodes, forward_count=forward)


def sweep(ns: Iterable[int], *, rule, strategies: Sequence[str] = ("store_all", "recompute_all", "every_k")):
    """Simulate each strategy for each n with ``rule``; a DataFrame with n, strategy, peak_nodes, forward_computations."""
    import pandas as pd

    if not _is_list(ns):
        raise TypeError("ns must be a list of chain lengths, e.g. [4, 16, 64, 256, 1024].")
    ns = [_check_n(n) for n in ns]
    if not ns:
        raise ValueError("ns is empty: give at least one chain length.")
    for s in strategies:
        if s not in STRATEGIES or s == "checkpoints":
            raise ValueError(f"sweep strategies must be among {STRATEGIES[:3]}, got {s!r}.")
    return pd.DataFrame([simulate(n, s, rule=rule, record_live=False).summary() for n in ns for s in strategies])


def segment_checkpoints(n: int, segments: int) -> tuple:
    """Checkpoint positions that cut an n-layer chain into ``segments`` nearly equal segments."""
    _check_n(n)
    if positive_int(segments, "segments", f"between 1 and n={n}") > n:
        raise ValueError(f"segments must be between 1 and n={n}, got {segments}.")
    return tuple(sorted({round(i * n / segments) for i in range(1, segments + 1)}))


def best_segment_count(n: int, *, rule, max_segments: int | None = None):
    """Try every segment count s (1..max_segments) with evenly spaced checkpoints."""
    import pandas as pd

    _check_n(n)
    if max_segments is None:
        max_segments = min(n, 4 * math.isqrt(n) + 4)
    if isinstance(max_segments, bool) or not isinstance(max_segments, int) or not 1 <= max_segments <= n:
        raise ValueError(f"max_segments must be an int between 1 and n={n}, got {max_segments!r}.")
    rows = []
    for s in range(1, max_segments + 1):
        sched = simulate(n, "checkpoints", rule=rule, checkpoints=segment_checkpoints(n, s), record_live=False)
        rows.append({"segments": s, "peak_nodes": sched.peak_nodes, "forward_computations": sched.forward_count})
    best = min(rows, key=lambda r: (r["peak_nodes"], r["forward_computations"], r["segments"]))
    return best["segments"], pd.DataFrame(rows)


def optimal_checkpoints(sizes: Sequence[float], budget: float, *, rule) -> ChainSchedule:
    """The checkpoint set that keeps the peak within ``budget`` with the fewest recomputations."""
    n, sizes, budget = _check_sizes_budget(sizes, budget)
    if n > MAX_BRUTE_FORCE_N:
        raise ValueError(f"optimal_checkpoints tries every subset; keep n <= {MAX_BRUTE_FORCE_N} (got n={n}).")
    best, best_key, lowest = None, None, None
    for r in range(n):
        for subset in itertools.combinations(range(1, n), r):
            sched = simulate(n, "checkpoints", rule=rule, checkpoints=subset, sizes=sizes, record_live=False)
            lowest = sched.peak_memory if lowest is None else min(lowest, sched.peak_memory)
            key = (sched.forward_count, sched.peak_memory, len(subset), subset)
            if sched.peak_memory <= budget and (best_key is None or key < best_key):
                best, best_key = sched, key
    if best is None:
        floor = simulate(n, "recompute_all", rule=rule, sizes=sizes, record_live=False).peak_memory
        raise ValueError(f"No checkpoint set keeps the peak within budget={budget}: the smallest peak a checkpoint set "
                         f"reaches is {lowest}. Raise the budget to at least {lowest} (recomputing everything would need {floor}).")
    return simulate(n, "checkpoints", rule=rule, checkpoints=best.checkpoints, sizes=sizes)


def evaluate_checkpoints(sizes: Sequence[float], budget: float, checkpoints: Sequence[int], *, rule) -> dict:
    """Grade a checkpoint choice: does it fit the budget, and how many recomputations does it cost?"""
    n, sizes, budget = _check_sizes_budget(sizes, budget)
    if not _is_list(checkpoints):
        raise TypeError(f"checkpoints must be a list of positions such as [2, 5], not {checkpoints!r}.")
    sched = simulate(n, "checkpoints", rule=rule, checkpoints=list(checkpoints), sizes=sizes, record_live=False)
    return {"checkpoints": sched.checkpoints, "peak_memory": sched.peak_memory, "fits": sched.peak_memory <= budget,
            "recomputations": sched.recompute_count}


LIVE_COLOR = "#8e44ad"  # the article's purple
RECOMPUTE_COLOR = "#e67e22"
CURRENT_EDGE = "#c0392b"


def draw_step(schedule: ChainSchedule, t: int, ax=None, *, title: bool = True):
    """Draw the f/b graph with the nodes live at step ``t`` shaded; the node computed is outlined red."""
    import matplotlib.pyplot as plt

    _check_schedule(schedule)
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
              scale_units="xy", scale=1, color="0.55", width=0.003, headwidth=4, headlength=4.5, headaxislength=4, zorder=1)
    ax.scatter([0], [1], s=260, marker="o", facecolor="0.85", edgecolor="0.4", zorder=2)
    ax.text(0, 1, "x", ha="center", va="center", fontsize=8, zorder=3)
    for (kind, y), i in itertools.product((("f", 1), ("b", 0)), range(1, n + 1)):
        node, is_live = (kind, i), (kind, i) in live
        face = (RECOMPUTE_COLOR if node == current and schedule.recomputed[t] else LIVE_COLOR) if is_live else "white"
        ax.scatter([i], [y], s=300, marker="s" if kind == "f" and i in kept else "o", facecolor=face,
                   edgecolor=CURRENT_EDGE if node == current else "0.3", linewidths=2.5 if node == current else 1.0, zorder=2)
        ax.text(i, y, f"{kind}{i}", ha="center", va="center", fontsize=7 if n < 13 else 6,
                color="white" if is_live else "black", zorder=3)
    if not schedule.unit_sizes:  # each node's size above its f node
        for i, label in enumerate(["size"] + [f"{v:g}" for v in schedule.sizes]):
            ax.text(i, 1.42, label, ha="center", va="center", fontsize=7, color="0.35")
    ax.set(xlim=(-0.6, n + 0.6), ylim=(-0.55, 1.55 if schedule.unit_sizes else 1.7), aspect="equal")
    ax.axis("off")
    if title:
        memory = "" if schedule.unit_sizes else f", memory {schedule.memory[t]:g} (size units)"
        ax.set_title(f"{schedule.label}: step {t + 1}/{schedule.steps}, "
                     f"{'recompute' if schedule.recomputed[t] else 'compute'} {op}; "
                     f"live {schedule.live_nodes[t]} nodes{memory}", fontsize=9)
    return ax


def _check_schedule(schedule) -> None:
    if not isinstance(schedule, ChainSchedule):
        raise TypeError(f"schedule must come from simulate(...), not {type(schedule).__name__}.")


def interesting_steps(schedule: ChainSchedule, count: int = 4) -> list:
    """A few steps worth showing: end of the forward pass, the peak, a recomputation, the last step."""
    _check_schedule(schedule)
    positive_int(count, "count")
    rec = [s for s in range(schedule.steps) if schedule.recomputed[s]]
    picks = [schedule.n - 1, max(range(schedule.steps), key=lambda s: (schedule.memory[s], -s))]  # forward done, peak
    picks += rec[len(rec) // 2:][:1] + [schedule.steps - 1]
    middle = schedule.n + (schedule.steps - schedule.n) // 2
    for extra in (middle, schedule.n, schedule.n // 2, 0):
        if len(set(picks)) >= count:
            break
        picks.append(extra)
    return sorted(set(picks))[:count]


def draw_strategy_grid(n: int = 6, strategies: Sequence[str] = ("store_all", "recompute_all", "every_k"),
                       steps_per_strategy: int = 4, *, rule, k: int | None = None):
    """The static figure: one row per strategy, a few time steps each (the fallback for the slider)."""
    import matplotlib.pyplot as plt

    _check_n(n)
    if n > 16:
        raise ValueError(f"draw_strategy_grid draws every node; keep n <= 16 (got {n}).")
    positive_int(steps_per_strategy, "steps_per_strategy")
    strategies = list(strategies)
    for s in strategies:
        if s not in STRATEGIES[:3]:
            raise ValueError(f"draw_strategy_grid strategies must be among {STRATEGIES[:3]}, got {s!r}.")
    fig, axes = plt.subplots(len(strategies), steps_per_strategy,
                             figsize=(steps_per_strategy * (0.62 * n + 1.2), 1.9 * len(strategies)), squeeze=False)
    for row, s in enumerate(strategies):
        sched = simulate(n, s, rule=rule, k=k if s == "every_k" else None, record_live=True)
        picks = interesting_steps(sched, steps_per_strategy)
        for col in range(steps_per_strategy):
            ax = axes[row][col]
            if col < len(picks):
                draw_step(sched, picks[col], ax, title=False)
                verb = "recompute" if sched.recomputed[picks[col]] else "compute"
                ax.set_title(f"{sched.label} · step {picks[col] + 1}/{sched.steps}: {verb} "
                             f"{sched.ops[picks[col]]}, {sched.live_nodes[picks[col]]} live", fontsize=8)
            else:
                ax.axis("off")
    fig.suptitle("Live nodes (purple) at a few steps; red outline = node computed now, orange = recomputed, "
                 "square = kept checkpoint", fontsize=9)
    fig.tight_layout()
    return fig


def plot_timelines(schedules: Sequence[ChainSchedule], ax=None):
    """Memory (live nodes or size units) at each step, one line per schedule."""
    import matplotlib.pyplot as plt

    schedules = list(schedules)
    if not schedules or not all(isinstance(s, ChainSchedule) for s in schedules):
        raise TypeError("schedules must be a non-empty list of simulate(...) results.")
    ax = ax or plt.subplots(figsize=(8, 3.2))[1]
    for s in schedules:
        ax.step(range(1, s.steps + 1), s.memory, where="mid", label=f"{s.label} (peak {s.peak_memory:g})")
    ax.set(xlabel="step (one node computed per step)",
           ylabel="live nodes" if all(s.unit_sizes for s in schedules) else "memory (size units)")
    ax.legend(fontsize=8)
    return ax


def plot_scaling(table, axes=None):
    """Two log-log panels from :func:`sweep`: peak live nodes vs n and forward computations vs n,
    with the reference lines sqrt(n), 2 sqrt(n), n and n^2/2."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    needed = {"n", "strategy", "peak_nodes", "forward_computations"}
    if not needed <= set(getattr(table, "columns", [])):
        raise ValueError(f"table must be a DataFrame from sweep() with columns {sorted(needed)}.")
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
        ax.set(xscale="log", yscale="log", title=title, ylabel=ylabel)
        ax.legend(fontsize=8)
        ax.set_xscale("log", base=2)
    return axes


def chain_explorer(n: int = 9, strategies: Sequence[str] = ("store_all", "recompute_all", "every_k"), *, rule):
    """An ipywidgets explorer: pick a strategy, drag the time step, see which nodes are live."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from .plots import show_figure

    _check_n(n)
    if n > 16:
        raise ValueError(f"chain_explorer draws every node; keep n <= 16 (got {n}).")
    schedules = {STRATEGY_LABELS[s]: simulate(n, s, rule=rule, record_live=True) for s in strategies}
    picker = widgets.ToggleButtons(options=list(schedules), description="strategy")
    slider = widgets.IntSlider(value=0, min=0, max=schedules[picker.value].steps - 1, description="step",
                               continuous_update=False)
    out = widgets.Output()

    def redraw(*_):
        sched = schedules[picker.value]
        if slider.max != sched.steps - 1:
            slider.value = min(slider.value, sched.steps - 1)
            slider.max = sched.steps - 1
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
