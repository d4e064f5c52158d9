"""course_utils.timing: one way to time code (torch.utils.benchmark), with clear errors."""
import time

import pytest

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


@pytest.mark.parametrize("kwargs, match", [
    ({"fn": 3}, "callable"),
    ({"fn": lambda: None, "min_run_time": 0}, "min_run_time"),
    ({"fn": lambda: None, "warmup": -1}, "warmup"),
    ({"fn": lambda: None, "threads": 0}, "threads"),
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
