"""Tests of course_utils.checkpointing: exact counts worked out by hand for small chains."""
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_utils import checkpointing as ck  # noqa: E402


# ---------------------------------------------------------------- exact counts, by hand
def test_store_all_n4_by_hand():
    s = ck.simulate(4, "store_all")
    assert s.ops == ["f1", "f2", "f3", "f4", "b4", "b3", "b2", "b1"]
    # forward keeps all; b4 runs with f1..f4 live; each b frees its f and the previous b
    assert s.memory == [1, 2, 3, 4, 5, 5, 4, 3]
    assert (s.peak_nodes, s.forward_count, s.recompute_count) == (5, 4, 0)


def test_recompute_all_n4_by_hand():
    s = ck.simulate(4, "recompute_all")
    assert s.ops == ["f1", "f2", "f3", "f4", "b4",
                     "f1", "f2", "f3", "b3",
                     "f1", "f2", "b2",
                     "f1", "b1"]
    assert s.memory == [1, 2, 2, 2, 2, 2, 3, 3, 3, 2, 3, 3, 2, 3]
    assert s.peak_nodes == 3
    assert s.forward_count == 10  # 4 + 3 + 2 + 1 = n(n+1)/2
    assert s.recomputed == [False] * 5 + [True] * 3 + [False] + [True] * 2 + [False] + [True, False]


def test_every_k_n4_k2_by_hand():
    s = ck.simulate(4, "every_k", k=2)
    assert s.checkpoints == (2, 4)
    assert s.ops == ["f1", "f2", "f3", "f4", "b4", "f3", "b3", "b2", "f1", "b1"]
    assert s.memory == [1, 2, 2, 3, 3, 3, 4, 3, 2, 3]
    assert (s.peak_nodes, s.forward_count) == (4, 6)
    assert s.live_at(6) == frozenset({("f", 2), ("f", 3), ("b", 4), ("b", 3)})


@pytest.mark.parametrize("n", [4, 9, 16, 25, 1024])
def test_sqrt_n_closed_forms_for_perfect_squares(n):
    k = math.isqrt(n)
    s = ck.simulate(n, "every_k")
    # peak: k-1 checkpoints below + k-1 recomputed nodes of the top segment + two b nodes
    assert s.peak_nodes == 2 * k
    # one recomputation per non-checkpoint node: n + k (k - 1) = 2n - k
    assert s.forward_count == 2 * n - k


@pytest.mark.parametrize("n", [1, 2, 3, 9, 16, 100])
def test_store_all_and_recompute_all_closed_forms(n):
    keep = ck.simulate(n, "store_all")
    assert (keep.peak_nodes, keep.forward_count, keep.steps) == (n + 1, n, 2 * n)
    rec = ck.simulate(n, "recompute_all")
    assert rec.forward_count == n * (n + 1) // 2
    assert rec.peak_nodes == (2 if n == 1 else 3)


def test_n9_and_n16_forward_counts():
    assert ck.simulate(9, "every_k").forward_count == 15  # 9 + 3 segments x 2 recomputed nodes
    assert ck.simulate(16, "every_k").forward_count == 28  # 16 + 4 x 3
    assert ck.simulate(9, "recompute_all").forward_count == 45
    assert ck.simulate(16, "recompute_all").forward_count == 136


def test_unequal_sizes_count_bytes():
    s = ck.simulate(3, "store_all", sizes=[1, 2, 3])
    # f1, f1+f2, f1+f2+f3, +b3 (size 3), then f1+f2+b3+b2, then f1+b2+b1
    assert s.memory == [1, 3, 6, 9, 8, 4]
    assert (s.peak_memory, s.peak_nodes) == (9, 4)
    assert not s.unit_sizes


def test_checkpoints_strategy_matches_every_k():
    a = ck.simulate(16, "every_k", k=4)
    b = ck.simulate(16, "checkpoints", checkpoints=[12, 4, 8, 16, 8])
    assert a.ops == b.ops and a.memory == b.memory and b.checkpoints == (4, 8, 12, 16)


def test_no_checkpoints_with_keep_recomputed_is_like_store_all_plus_one_forward():
    s = ck.simulate(5, "checkpoints", checkpoints=[])
    assert s.forward_count == 5 + 4
    assert s.peak_nodes == 6


def test_to_frame_and_summary():
    s = ck.simulate(4, "every_k", k=2)
    df = s.to_frame()
    assert list(df.columns) == ["step", "op", "recompute", "live_nodes", "memory"]
    assert len(df) == s.steps == 10
    assert df["recompute"].sum() == 2
    summ = s.summary()
    assert summ["peak_nodes"] == 4 and summ["forward_ratio"] == 1.5


def test_record_live_off_for_long_chains():
    s = ck.simulate(1024, "every_k")
    assert s.live is None
    with pytest.raises(ValueError, match="record_live"):
        s.live_at(0)


# ---------------------------------------------------------------- sweeps and searches
def test_sweep_table():
    df = ck.sweep([4, 16])
    assert len(df) == 6
    row = df[(df.n == 16) & (df.strategy == ck.STRATEGY_LABELS["every_k"])].iloc[0]
    assert (row.peak_nodes, row.forward_computations) == (8, 28)


def test_segment_checkpoints():
    assert ck.segment_checkpoints(16, 4) == (4, 8, 12, 16)
    assert ck.segment_checkpoints(10, 3) == (3, 7, 10)
    assert ck.segment_checkpoints(5, 1) == (5,)


def test_best_segment_count_small_n():
    best, table = ck.best_segment_count(16)
    # peaks 8 for 3, 4, 5 segments; 5 segments recompute fewest nodes
    assert best == 5
    assert table.set_index("segments").loc[4, "peak_nodes"] == 8
    assert table["peak_nodes"].min() == 8


def test_best_segment_count_near_sqrt_n():
    best, table = ck.best_segment_count(256)
    assert table["peak_nodes"].min() == 32  # 2 sqrt(256)
    assert 12 <= best <= 24


def test_optimal_checkpoints_brute_force():
    sizes = [4, 1, 6, 1, 1, 5, 1, 2]
    best = ck.optimal_checkpoints(sizes, 16)
    assert best.checkpoints == (2, 4, 5, 6, 7)
    assert (best.peak_memory, best.recompute_count) == (14, 2)
    # the sqrt(n) rule does not fit this budget
    assert ck.simulate(8, "every_k", sizes=sizes).peak_memory == 17
    # a looser budget allows fewer recomputations; a huge one needs none
    assert ck.optimal_checkpoints(sizes, 18).recompute_count == 1
    assert ck.optimal_checkpoints(sizes, 100).recompute_count == 0


def test_optimal_is_optimal_against_exhaustive_check():
    sizes = [3, 1, 2, 2, 1]
    budget = 9
    best = ck.optimal_checkpoints(sizes, budget)
    import itertools

    fitting = []
    for r in range(5):
        for sub in itertools.combinations(range(1, 5), r):
            s = ck.simulate(5, "checkpoints", checkpoints=sub, sizes=sizes)
            if s.peak_memory <= budget:
                fitting.append(s.recompute_count)
    assert best.peak_memory <= budget and best.recompute_count == min(fitting)


def test_evaluate_checkpoints():
    sizes = [4, 1, 6, 1, 1, 5, 1, 2]
    good = ck.evaluate_checkpoints(sizes, 16, [2, 4, 5, 6, 7])
    assert good == {"checkpoints": (2, 4, 5, 6, 7), "peak_memory": 14, "fits": True, "recomputations": 2}
    assert ck.evaluate_checkpoints(sizes, 16, [3, 6])["fits"] is False


def test_optimal_checkpoints_budget_too_small():
    with pytest.raises(ValueError, match="Raise the budget to at least 14"):
        ck.optimal_checkpoints([4, 1, 6, 1, 1, 5, 1, 2], 10)


# ---------------------------------------------------------------- drawing
def test_draw_step_and_grid():
    s = ck.simulate(6, "every_k")
    ax = ck.draw_step(s, 8)
    assert "step 9/" in ax.get_title()
    plt.close("all")
    fig = ck.draw_strategy_grid(6, steps_per_strategy=3)
    assert len(fig.axes) == 9
    plt.close(fig)
    picks = ck.interesting_steps(ck.simulate(6, "recompute_all"), 4)
    assert len(picks) == 4 and picks == sorted(picks)


def test_plot_helpers():
    ax = ck.plot_timelines([ck.simulate(9, s) for s in ("store_all", "every_k")])
    assert len(ax.get_lines()) >= 2
    axes = ck.plot_scaling(ck.sweep([4, 16]))
    assert axes[0].get_xscale() == "log" and axes[1].get_yscale() == "log"
    plt.close("all")


def test_chain_explorer_builds():
    pytest.importorskip("ipywidgets")
    w = ck.chain_explorer(5)
    picker, slider = w.children[0], w.children[1]
    assert slider.max == ck.simulate(5, "store_all").steps - 1
    picker.value = ck.STRATEGY_LABELS["recompute_all"]
    assert slider.max == ck.simulate(5, "recompute_all").steps - 1
    plt.close("all")


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(n=0), ValueError, "at least 1"),
        (dict(n=2.5), TypeError, "must be an int"),
        (dict(n=True), TypeError, "must be an int"),
        (dict(n=4, strategy="sqrt"), ValueError, "Unknown strategy"),
        (dict(n=4, strategy="every_k", k=0), ValueError, "between 1 and n"),
        (dict(n=4, strategy="every_k", k=2.0), TypeError, "spacing"),
        (dict(n=4, strategy="store_all", k=2), ValueError, "does not use it"),
        (dict(n=4, strategy="checkpoints"), ValueError, "needs checkpoints"),
        (dict(n=4, strategy="checkpoints", checkpoints=[5]), ValueError, "outside the chain"),
        (dict(n=4, strategy="checkpoints", checkpoints=["2"]), TypeError, "ints between"),
        (dict(n=4, strategy="checkpoints", checkpoints="23"), TypeError, "list of layer positions"),
        (dict(n=4, strategy="every_k", checkpoints=[2]), ValueError, "goes with strategy"),
        (dict(n=3, sizes=[1, 2]), ValueError, "one size per layer"),
        (dict(n=2, sizes=[1, -2]), ValueError, "positive number"),
        (dict(n=2, sizes=5), TypeError, "list of 2 positive"),
    ],
)
def test_simulate_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ck.simulate(**kwargs)


def test_other_bad_input():
    with pytest.raises(ValueError, match="between 1 and n"):
        ck.segment_checkpoints(4, 5)
    with pytest.raises(ValueError, match="max_segments"):
        ck.best_segment_count(4, max_segments=9)
    with pytest.raises(ValueError, match="n <= 16"):
        ck.optimal_checkpoints([1] * 17, 100)
    with pytest.raises(ValueError, match="budget must be a positive"):
        ck.optimal_checkpoints([1, 2], 0)
    with pytest.raises(ValueError, match="sizes must list"):
        ck.optimal_checkpoints([], 3)
    with pytest.raises(ValueError, match="budget must be a positive"):
        ck.evaluate_checkpoints([1, 2], -1, [1])
    with pytest.raises(TypeError, match="list of chain lengths"):
        ck.sweep(16)
    with pytest.raises(ValueError, match="sweep strategies"):
        ck.sweep([4], strategies=["checkpoints"])
    with pytest.raises(ValueError, match="outside the schedule"):
        ck.simulate(3, "store_all").live_at(6)
    with pytest.raises(ValueError, match="keep n <= 16"):
        ck.draw_strategy_grid(17)
    with pytest.raises(TypeError, match="simulate"):
        ck.draw_step("not a schedule", 0)
    with pytest.raises(ValueError, match="columns"):
        ck.plot_scaling([1, 2, 3])
    with pytest.raises(TypeError, match="non-empty list"):
        ck.plot_timelines([])


# ---------------------------------------------------------------- measurement helpers
def test_time_it():
    calls = []
    t = ck.time_it(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and t >= 0
    with pytest.raises(ValueError, match="repeats"):
        ck.time_it(lambda: None, repeats=0)
    with pytest.raises(TypeError, match="callable"):
        ck.time_it(3)


def test_time_steps_interleaves_and_takes_the_minimum():
    order = []
    best = ck.time_steps({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=2, warmup=1)
    assert order == ["a", "b"] * 3
    assert set(best) == {"a", "b"} and all(v >= 0 for v in best.values())
    with pytest.raises(TypeError, match="non-empty dict"):
        ck.time_steps({})
    with pytest.raises(TypeError, match="callable"):
        ck.time_steps({"a": 1})
    with pytest.raises(ValueError, match="warmup"):
        ck.time_steps({"a": lambda: None}, warmup=-1)


def test_small_helpers_bad_input():
    assert ck.default_k(10) == 3 and ck.default_k(1) == 1
    with pytest.raises(ValueError, match="at least 1"):
        ck.default_k(0)
    with pytest.raises(ValueError, match="count must be"):
        ck.interesting_steps(ck.simulate(3, "store_all"), 0)
    with pytest.raises(TypeError, match="simulate"):
        ck.interesting_steps([1, 2], 2)
    with pytest.raises(ValueError, match="keep n <= 16"):
        ck.chain_explorer(20)
