"""course_utils.timing: one way to time code (torch.utils.benchmark), with clear errors."""
import time

import pytest
import torch

from course_utils import timing


def test_time_fn_measures_a_known_sleep():
    seconds = timing.time_fn(lambda: time.sleep(0.01), min_run_time=0.05)
    assert 0.009 <= seconds <= 0.05


def test_time_fns_orders_slow_and_fast():
    result = timing.time_fns({"fast": lambda: None, "slow": lambda: time.sleep(0.005)}, min_run_time=0.03)
    assert set(result) == {"fast", "slow"}
    assert result["fast"] < result["slow"]


def test_warmup_calls_happen_before_timing():
    calls = []
    timing.time_fn(lambda: calls.append(1), min_run_time=0.01, warmup=3)
    assert len(calls) > 3


def test_the_fastest_block_is_the_machine_without_its_burst_of_load(monkeypatch):
    """Blocks of calls slowed by a busy machine (3 ms) but one (1 ms): the blocks' median is the busy time, the fastest
    block the quiet one, and cpu_optimizer_step reports the quiet one. (The blocks are given, not slept: a sleep's
    timing on a loaded test machine is itself a burst of load.)"""
    import types

    blocks = types.SimpleNamespace(times=[0.003, 0.003, 0.001, 0.003, 0.003], median=0.003)
    monkeypatch.setattr(timing.benchmark.Timer, "blocked_autorange", lambda self, min_run_time: blocks)
    assert timing.time_fn(lambda: None, warmup=0) == 0.003
    assert timing.time_fn(lambda: None, warmup=0, statistic="fastest") == 0.001
    step = timing.cpu_optimizer_step(lambda ps: torch.optim.SGD(ps, lr=0.1), n_params=1000, threads=1, repeats=2)
    assert step.ns_per_param == pytest.approx(0.001 / 1000 * 1e9)


@pytest.mark.parametrize("kwargs, match", [
    ({"fn": 3}, "callable"),
    ({"fn": lambda: None, "min_run_time": 0}, "min_run_time"),
    ({"fn": lambda: None, "warmup": -1}, "warmup"),
    ({"fn": lambda: None, "threads": 0}, "threads"),
    ({"fn": lambda: None, "statistic": "mean"}, "use 'median' or 'fastest'"),
])
def test_bad_input_is_explained(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        timing.time_fn(**kwargs)


def test_time_fns_needs_a_dict():
    with pytest.raises(TypeError, match="dict"):
        timing.time_fns([lambda: None])
    with pytest.raises(TypeError, match="callable"):
        timing.time_fns({"x": 1})


def test_time_fns_takes_turns():
    order = []
    timing.time_fns({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=3, min_run_time=0.03)
    switches = sum(1 for x, y in zip(order, order[1:]) if x != y)
    assert switches >= 5, "a and b must alternate across rounds"
    with pytest.raises(ValueError, match="rounds"):
        timing.time_fns({"a": lambda: None}, rounds=0)


def test_cpu_optimizer_step_measures_ns_per_param_state_and_threads():
    import torch

    sgd = timing.cpu_optimizer_step(lambda ps: torch.optim.SGD(ps, lr=0.1), n_params=4096, threads=1, repeats=2,
                                    min_run_time=0.01)
    adam = timing.cpu_optimizer_step(lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False), n_params=4096, threads=1,
                                     repeats=2, min_run_time=0.01)
    assert sgd.state_bytes_per_param == 0 and adam.state_bytes_per_param == pytest.approx(8, abs=0.01)  # m, v (+ step)
    assert sgd.threads == adam.threads == 1 and sgd.n_params == 4096
    assert 0 < sgd.ns_per_param and 0 < adam.ns_per_param and sgd.first_step_s > 0
    with pytest.raises(TypeError, match="make_optimizer"):
        timing.cpu_optimizer_step(None)
    with pytest.raises(ValueError, match="n_params"):
        timing.cpu_optimizer_step(lambda ps: torch.optim.SGD(ps, lr=0.1), n_params=0)


def test_cpu_optimizer_step_on_a_matrix_or_in_bf16():
    import torch

    seen = {}

    def make(params):
        seen["shape"], seen["dtype"] = tuple(params[0].shape), params[0].dtype
        return torch.optim.Adafactor(params, lr=1e-2)
    step = timing.cpu_optimizer_step(make, 64 * 32, shape=(64, 32), repeats=1, min_run_time=0.01)
    assert seen["shape"] == (64, 32) and step.n_params == 2048
    assert step.state_bytes_per_param == pytest.approx((64 + 32 + 1) * 4 / 2048)  # factored: a row and a column mean
    timing.cpu_optimizer_step(make, 256, shape=(16, 16), dtype=torch.bfloat16, repeats=1, min_run_time=0.01)
    assert seen == {"shape": (16, 16), "dtype": torch.bfloat16}
    with pytest.raises(ValueError, match="product is n_params"):
        timing.cpu_optimizer_step(make, 100, shape=(10, 11))
    with pytest.raises(ValueError, match="dtype"):
        timing.cpu_optimizer_step(make, 256, dtype=torch.int8)


def test_a_named_cpu_step_is_measured_once_and_read_by_every_notebook_after(tmp_path, monkeypatch):
    """One number per quantity: 06, 07 and 08 show the same CPU AdamW figure, measured by whichever ran first."""
    from course_utils import paths, results

    monkeypatch.setattr(paths, "results_dir", lambda: tmp_path)
    made = []

    def make(params):
        made.append(1)
        return torch.optim.AdamW(params, fused=True)

    monkeypatch.setattr(results, "_current_notebook", "06_capstone_gpt2_xl")
    first = timing.cpu_optimizer_step(make, 2**12, threads=1, repeats=1, min_run_time=0.01, name="AdamW fused")
    monkeypatch.setattr(results, "_current_notebook", "08_current_toolbox")
    again = timing.cpu_optimizer_step(make, 2**12, threads=1, repeats=1, min_run_time=0.01, name="AdamW fused")
    assert len(made) == 1 and first.measured_by == "this cell"
    assert again.ns_per_param == first.ns_per_param and again.measured_by == "notebook 06_capstone_gpt2_xl"
    other = timing.cpu_optimizer_step(make, 2**12, threads=2, repeats=1, min_run_time=0.01, name="AdamW fused")
    assert len(made) == 2 and other.measured_by == "this cell", "another thread count is another measurement"
    timing.cpu_optimizer_step(make, 2**12, threads=1, repeats=1, min_run_time=0.01)
    assert len(made) == 3, "without a name nothing is kept or read"
    (tmp_path / "cpu_steps.json").write_text("{ not json")
    timing.cpu_optimizer_step(make, 2**12, threads=1, repeats=1, min_run_time=0.01, name="AdamW fused")
    assert len(made) == 4, "a damaged file is measured again"
