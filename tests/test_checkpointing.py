"""Tests of course_utils.checkpointing with the keep/recompute rule that notebook 03 writes in a cell (taken from
the notebook and run here): exact counts worked out by hand for small chains, and the checks on a rule."""
import functools
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_utils import checkpointing as ck  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "03_gradient_checkpointing.ipynb"


def _notebook_rule():
    """The notebook's own ``chain_step``: the code cell that defines it, executed here."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    (source,) = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and "def chain_step(" in "".join(c["source"])]
    namespace = {}
    exec(compile(source, f"{NOTEBOOK.name}:chain_step", "exec"), namespace)
    return namespace["chain_step"]


RULE = _notebook_rule()
simulate = functools.partial(ck.simulate, rule=RULE)
sweep = functools.partial(ck.sweep, rule=RULE)
best_segment_count = functools.partial(ck.best_segment_count, rule=RULE)
optimal_checkpoints = functools.partial(ck.optimal_checkpoints, rule=RULE)
evaluate_checkpoints = functools.partial(ck.evaluate_checkpoints, rule=RULE)
draw_strategy_grid = functools.partial(ck.draw_strategy_grid, rule=RULE)
chain_explorer = functools.partial(ck.chain_explorer, rule=RULE)


# ---------------------------------------------------------------- exact counts, by hand
def test_store_all_n4_by_hand():
    s = simulate(4, "store_all")
    assert s.ops == ["f1", "f2", "f3", "f4", "b4", "b3", "b2", "b1"]
    # forward keeps all; b4 runs with f1..f4 live; each b frees its f and the previous b
    assert s.memory == [1, 2, 3, 4, 5, 5, 4, 3]
    assert (s.peak_nodes, s.forward_count, s.recompute_count) == (5, 4, 0)


def test_recompute_all_n4_by_hand():
    s = simulate(4, "recompute_all")
    assert s.ops == ["f1", "f2", "f3", "f4", "b4",
                     "f1", "f2", "f3", "b3",
                     "f1", "f2", "b2",
                     "f1", "b1"]
    assert s.memory == [1, 2, 2, 2, 2, 2, 3, 3, 3, 2, 3, 3, 2, 3]
    assert s.peak_nodes == 3
    assert s.forward_count == 10  # 4 + 3 + 2 + 1 = n(n+1)/2
    assert s.recomputed == [False] * 5 + [True] * 3 + [False] + [True] * 2 + [False] + [True, False]


def test_every_k_n4_k2_by_hand():
    s = simulate(4, "every_k")  # k = sqrt(4) = 2
    assert s.checkpoints == (2, 4)
    assert s.ops == ["f1", "f2", "f3", "f4", "b4", "f3", "b3", "b2", "f1", "b1"]
    assert s.memory == [1, 2, 2, 3, 3, 3, 4, 3, 2, 3]
    assert (s.peak_nodes, s.forward_count) == (4, 6)
    assert s.live_at(6) == frozenset({("f", 2), ("f", 3), ("b", 4), ("b", 3)})


@pytest.mark.parametrize("n", [4, 9, 16, 25, 1024])
def test_sqrt_n_closed_forms_for_perfect_squares(n):
    k = math.isqrt(n)
    s = simulate(n, "every_k")
    # peak: k-1 checkpoints below + k-1 recomputed nodes of the top segment + two b nodes
    assert s.peak_nodes == 2 * k
    # one recomputation per non-checkpoint node: n + k (k - 1) = 2n - k
    assert s.forward_count == 2 * n - k


@pytest.mark.parametrize("n", [1, 2, 3, 9, 16, 100])
def test_store_all_and_recompute_all_closed_forms(n):
    keep = simulate(n, "store_all")
    assert (keep.peak_nodes, keep.forward_count, keep.steps) == (n + 1, n, 2 * n)
    rec = simulate(n, "recompute_all")
    assert rec.forward_count == n * (n + 1) // 2
    assert rec.peak_nodes == (2 if n == 1 else 3)


def test_n9_and_n16_forward_counts():
    assert simulate(9, "every_k").forward_count == 15  # 9 + 3 segments x 2 recomputed nodes
    assert simulate(16, "every_k").forward_count == 28  # 16 + 4 x 3
    assert simulate(9, "recompute_all").forward_count == 45
    assert simulate(16, "recompute_all").forward_count == 136


def test_unequal_sizes_count_bytes():
    s = simulate(3, "store_all", sizes=[1, 2, 3])
    # f1, f1+f2, f1+f2+f3, +b3 (size 3), then f1+f2+b3+b2, then f1+b2+b1
    assert s.memory == [1, 3, 6, 9, 8, 4]
    assert (s.peak_memory, s.peak_nodes) == (9, 4)
    assert not s.unit_sizes


def test_checkpoints_strategy_matches_every_k():
    a = simulate(16, "every_k")  # k = sqrt(16) = 4
    b = simulate(16, "checkpoints", checkpoints=[12, 4, 8, 16, 8])
    assert a.ops == b.ops and a.memory == b.memory and b.checkpoints == (4, 8, 12, 16)


def test_no_checkpoints_with_keep_recomputed_is_like_store_all_plus_one_forward():
    s = simulate(5, "checkpoints", checkpoints=[])
    assert s.forward_count == 5 + 4
    assert s.peak_nodes == 6


def test_summary():
    s = simulate(4, "every_k")
    assert s.steps == 10 and sum(s.recomputed) == 2
    summ = s.summary()
    assert summ["peak_nodes"] == 4 and summ["forward_ratio"] == 1.5


def test_live_sets_not_recorded_for_long_chains():
    s = simulate(1024, "every_k")
    assert s.live is None
    with pytest.raises(ValueError, match="up to 200 layers"):
        s.live_at(0)


# ---------------------------------------------------------------- sweeps and searches
def test_sweep_table():
    df = sweep([4, 16])
    assert len(df) == 6
    row = df[(df.n == 16) & (df.strategy == ck.STRATEGY_LABELS["every_k"])].iloc[0]
    assert (row.peak_nodes, row.forward_computations) == (8, 28)


def test_segments_are_evenly_spaced_checkpoints():
    _, table = best_segment_count(16, max_segments=4)
    four = table.set_index("segments").loc[4]  # checkpoints 4, 8, 12, 16: every_k with k = sqrt(16)
    every_k = simulate(16, "every_k")
    assert (four.peak_nodes, four.forward_computations) == (every_k.peak_nodes, every_k.forward_count)
    one = table.set_index("segments").loc[1]  # only f16 kept: everything below it is recomputed once
    assert one.forward_computations == 16 + 15


def test_best_segment_count_small_n():
    best, table = best_segment_count(16)
    # peaks 8 for 3, 4, 5 segments; 5 segments recompute fewest nodes
    assert best == 5
    assert table.set_index("segments").loc[4, "peak_nodes"] == 8
    assert table["peak_nodes"].min() == 8


def test_best_segment_count_near_sqrt_n():
    best, table = best_segment_count(256)
    assert table["peak_nodes"].min() == 32  # 2 sqrt(256)
    assert 12 <= best <= 24


def test_optimal_checkpoints_brute_force():
    sizes = [4, 1, 6, 1, 1, 5, 1, 2]
    best = optimal_checkpoints(sizes, 16)
    assert best.checkpoints == (2, 4, 5, 6, 7)
    assert (best.peak_memory, best.recompute_count) == (14, 2)
    # the sqrt(n) rule does not fit this budget
    assert simulate(8, "every_k", sizes=sizes).peak_memory == 17
    # a looser budget allows fewer recomputations; a huge one needs none
    assert optimal_checkpoints(sizes, 18).recompute_count == 1
    assert optimal_checkpoints(sizes, 100).recompute_count == 0


def test_optimal_is_optimal_against_exhaustive_check():
    sizes = [3, 1, 2, 2, 1]
    budget = 9
    best = optimal_checkpoints(sizes, budget)
    import itertools

    fitting = []
    for r in range(5):
        for sub in itertools.combinations(range(1, 5), r):
            s = simulate(5, "checkpoints", checkpoints=sub, sizes=sizes)
            if s.peak_memory <= budget:
                fitting.append(s.recompute_count)
    assert best.peak_memory <= budget and best.recompute_count == min(fitting)


def test_evaluate_checkpoints():
    sizes = [4, 1, 6, 1, 1, 5, 1, 2]
    good = evaluate_checkpoints(sizes, 16, [2, 4, 5, 6, 7])
    assert good == {"checkpoints": (2, 4, 5, 6, 7), "peak_memory": 14, "fits": True, "recomputations": 2}
    assert evaluate_checkpoints(sizes, 16, [3, 6])["fits"] is False


def test_optimal_checkpoints_budget_too_small():
    with pytest.raises(ValueError, match="Raise the budget to at least 14"):
        optimal_checkpoints([4, 1, 6, 1, 1, 5, 1, 2], 10)


# ---------------------------------------------------------------- drawing
def test_draw_step_and_grid():
    s = simulate(6, "every_k")
    ax = ck.draw_step(s, 8)
    assert "step 9/" in ax.get_title()
    plt.close("all")
    fig = draw_strategy_grid(6, steps_per_strategy=3)
    assert len(fig.axes) == 9
    plt.close(fig)
    picks = ck.interesting_steps(simulate(6, "recompute_all"), 4)
    assert len(picks) == 4 and picks == sorted(picks)


def test_plot_helpers():
    ax = ck.plot_timelines([simulate(9, s) for s in ("store_all", "every_k")])
    assert len(ax.get_lines()) >= 2
    axes = ck.plot_scaling(sweep([4, 16]))
    assert axes[0].get_xscale() == "log" and axes[1].get_yscale() == "log"
    plt.close("all")


def test_chain_explorer_builds():
    pytest.importorskip("ipywidgets")
    w = chain_explorer(5)
    picker, slider = w.children[0], w.children[1]
    assert slider.max == simulate(5, "store_all").steps - 1
    picker.value = ck.STRATEGY_LABELS["recompute_all"]
    assert slider.max == simulate(5, "recompute_all").steps - 1
    plt.close("all")


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(n=0), ValueError, "must be positive"),
        (dict(n=2.5), TypeError, "must be a whole number"),
        (dict(n=True), TypeError, "must be a whole number"),
        (dict(n=4, strategy="sqrt"), ValueError, "Unknown strategy"),
        (dict(n=4, strategy="checkpoints"), TypeError, "needs checkpoints"),
        (dict(n=4, strategy="checkpoints", checkpoints=[5]), ValueError, "outside the chain"),
        (dict(n=4, strategy="checkpoints", checkpoints=["2"]), TypeError, "checkpoint position must be a whole"),
        (dict(n=4, strategy="checkpoints", checkpoints=[0]), ValueError, "must be positive"),
        (dict(n=4, strategy="checkpoints", checkpoints="23"), TypeError, "list of layer positions"),
        (dict(n=4, strategy="every_k", checkpoints=[2]), ValueError, "goes with strategy"),
        (dict(n=3, sizes=[1, 2]), ValueError, "one per layer"),
        (dict(n=2, sizes=[1, -2]), ValueError, "positive numbers"),
        (dict(n=2, sizes=5), ValueError, "list 2 positive"),
    ],
)
def test_simulate_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        simulate(**kwargs)


def test_other_bad_input():
    with pytest.raises(ValueError, match="n <= 16"):
        optimal_checkpoints([1] * 17, 100)
    with pytest.raises(ValueError, match="budget must be a positive"):
        optimal_checkpoints([1, 2], 0)
    with pytest.raises(ValueError, match="budget must be a positive"):
        evaluate_checkpoints([1, 2], -1, [1])
    with pytest.raises(ValueError, match="keep n <= 16"):
        draw_strategy_grid(17)


# ---------------------------------------------------------------- the rule is checked
def _ops_of(rule_ops):
    return lambda n, kept, keep_recomputed: iter(rule_ops)


@pytest.mark.parametrize(
    "n, ops, match",
    [
        (2, [("compute", ("f", 2), False)], "computes f2 but f1 is not in memory"),
        (1, [("compute", ("f", 1), False), ("free", ("f", 1)), ("compute", ("b", 1), False)], "f1 is not in memory"),
        (2, [("compute", ("f", 1), False), ("compute", ("f", 2), False), ("compute", ("b", 1), False)],
         "b2 is not in memory"),
        (1, [("free", ("f", 1))], "frees f1, which is not in memory"),
        (1, [("compute", ("f", 1), False), ("compute", ("f", 1), True)], "still in memory"),
        (1, [("compute", ("f", 1), False)], "each of b1..b1 once"),
        (1, [("compute", ("f", 2), False)], "nodes are"),
        (1, ["f1"], "yield"),
    ],
)
def test_a_rule_that_breaks_the_graph_gets_a_clear_message(n, ops, match):
    with pytest.raises(ValueError, match=match):
        ck.simulate(n, "store_all", rule=_ops_of(ops))


def test_a_rule_must_be_a_function():
    with pytest.raises(TypeError, match="keep/recompute rule"):
        ck.simulate(3, "store_all", rule=None)


def test_a_rule_that_forgets_to_recompute_is_caught():
    def lazy(n, kept, keep_recomputed):  # frees like the notebook's rule but never recomputes
        for op in RULE(n, kept, keep_recomputed):
            if op[0] == "compute" and op[2]:
                continue
            yield op

    with pytest.raises(ValueError, match="not in memory"):
        ck.simulate(9, "every_k", rule=lazy)


def test_small_helpers_bad_input():
    assert ck.default_k(10) == 3 and ck.default_k(1) == 1
    with pytest.raises(ValueError, match="must be positive"):
        ck.default_k(0)
    with pytest.raises(ValueError, match="keep n <= 16"):
        chain_explorer(20)


# ---------------------------------------------------------------- the exercise's checker, from the notebook's cells
def test_exercise_checker_accepts_the_optimum_and_rejects_plausible_mistakes(capsys):
    from course_utils import checks

    cells = [("".join(c["source"]), c["metadata"].get("tags", [])) for c in json.loads(NOTEBOOK.read_text())["cells"]
             if c["cell_type"] == "code"]
    namespace = {"ckpt": ck, "checks": checks, "chain_step": RULE}
    for source, tags in cells:  # the exercise's sizes and budget, the stub, the checker
        if "EX_SIZES = " in source or "def my_checkpoints(" in source or "def check_my_checkpoints(" in source:
            exec(compile(source, NOTEBOOK.name, "exec"), namespace)
    check = namespace["check_my_checkpoints"]
    assert check(list(namespace["optimum"].checkpoints))
    # the sqrt(n) rule, keeping everything, a set that fits but recomputes more, one that recomputes less but won't fit
    for wrong in ([3, 6], [1, 2, 3, 4, 5, 6, 7], [2, 4, 6], [1, 2, 4, 5, 6, 7]):
        assert not check(wrong), wrong
    assert "fill in my_checkpoints" in capsys.readouterr().out
