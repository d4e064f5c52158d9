"""Timing, one way for the whole course: ``torch.utils.benchmark`` (CUDA sync, warm-up, median of many runs).
On a shared CPU timings wobble: time claims use generous bounds."""
from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.utils.benchmark as benchmark

from .validation import callable_arg, positive_int, positive_number


def time_fn(fn: Callable[[], object], *, min_run_time: float = 0.2, warmup: int = 1, threads: int | None = None) -> float:
    """Median seconds of one ``fn()`` call, measured by ``torch.utils.benchmark.Timer``."""
    callable_arg(fn)
    positive_number(min_run_time, "min_run_time", "seconds, e.g. 0.2")
    positive_int(warmup, "warmup", allow_zero=True)
    threads = torch.get_num_threads() if threads is None else positive_int(threads, "threads", "e.g. 1 or 2")
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
        callable_arg(fn, f"fns[{label!r}]")
    positive_int(rounds, "rounds", "e.g. 3")
    turns: dict = {label: [] for label in fns}
    for round_index in range(rounds):
        for label, fn in fns.items():
            warmup = kwargs.get("warmup", 1) if round_index == 0 else 0
            turns[label].append(time_fn(fn, min_run_time=min_run_time / rounds, **{**kwargs, "warmup": warmup}))
    return {label: statistics.median(values) for label, values in turns.items()}
