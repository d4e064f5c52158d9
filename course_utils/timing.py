"""Timing, one way for the whole course: ``torch.utils.benchmark`` (CUDA sync, warm-up, median of many runs).
On a shared CPU timings wobble: time claims use generous bounds."""
from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.utils.benchmark as benchmark


def _check_fn(fn, what: str = "fn") -> None:
    if not callable(fn):
        raise TypeError(f"{what} must be a zero-argument callable (e.g. `lambda: step(batch)`), not {type(fn).__name__}.")


def time_fn(fn: Callable[[], object], *, min_run_time: float = 0.2, warmup: int = 1, threads: int | None = None) -> float:
    """Median seconds of one ``fn()`` call, measured by ``torch.utils.benchmark.Timer``."""
    _check_fn(fn)
    if isinstance(min_run_time, bool) or not isinstance(min_run_time, (int, float)) or min_run_time <= 0:
        raise ValueError(f"min_run_time must be a positive number of seconds, e.g. 0.2, not {min_run_time!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, not {warmup!r}.")
    if threads is None:
        threads = torch.get_num_threads()
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int such as 1 or 2, not {threads!r}.")
    for _ in range(warmup):
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return float(timer.blocked_autorange(min_run_time=min_run_time).median)


def time_fns(fns: dict, *, rounds: int = 3, min_run_time: float = 0.2, **kwargs) -> dict:
    """``{label: median seconds}`` for several callables, taking turns for ``rounds`` rounds so that a burst of
    load on a shared machine hits every callable alike."""
    if not isinstance(fns, dict) or not fns:
        raise TypeError("fns must be a non-empty dict {label: zero-argument callable}.")
    for label, fn in fns.items():
        _check_fn(fn, f"fns[{label!r}]")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int such as 3, not {rounds!r}.")
    if isinstance(min_run_time, bool) or not isinstance(min_run_time, (int, float)) or min_run_time <= 0:
        raise ValueError(f"min_run_time must be a positive number of seconds, e.g. 0.2, not {min_run_time!r}.")
    turns: dict = {label: [] for label in fns}
    for round_index in range(rounds):
        for label, fn in fns.items():
            warmup = kwargs.get("warmup", 1) if round_index == 0 else 0
            turns[label].append(time_fn(fn, min_run_time=min_run_time / rounds,
                                        **{**kwargs, "warmup": warmup}))
    return {label: statistics.median(values) for label, values in turns.items()}
