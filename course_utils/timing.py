"""Timing, one way for the whole course: ``torch.utils.benchmark`` (CUDA sync, warm-up, median of many runs).
On a shared CPU timings wobble: time claims use generous bounds."""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from typing import Callable, NamedTuple

import torch
import torch.utils.benchmark as benchmark

from .memory import optimizer_state_bytes
from .validation import callable_arg, positive_int, positive_number


def time_fn(fn: Callable[[], object], *, min_run_time: float = 0.2, warmup: int = 1, threads: int | None = None,
            statistic: str = "median") -> float:
    """Seconds of one ``fn()`` call, measured by ``torch.utils.benchmark.Timer`` in blocks of calls: the blocks'
    ``"median"``, or the ``"fastest"`` block's (what the machine does when nothing else runs: a busy machine's
    other processes only add time, and they add the most to threads that wait for each other)."""
    callable_arg(fn)
    positive_number(min_run_time, "min_run_time", "seconds, e.g. 0.2")
    positive_int(warmup, "warmup", allow_zero=True)
    if statistic not in ("median", "fastest"):
        raise ValueError(f"statistic={statistic!r}: use 'median' or 'fastest'.")
    threads = torch.get_num_threads() if threads is None else positive_int(threads, "threads", "e.g. 1 or 2")
    for _ in range(warmup):
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return float(measurement.median if statistic == "median" else min(measurement.times))


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


class OptimizerStep(NamedTuple):
    ns_per_param: float   # the best of the timed repeats
    first_step_s: float   # the step that creates the state (and compiles)
    state_bytes_per_param: float
    threads: int
    n_params: int
    measured_by: str = "this cell"   # or the notebook whose measurement on this machine was read


def _kept_steps():
    """(path, {key: entry}) of the CPU steps measured on this machine, kept in the course's results."""
    from . import paths

    path = paths.results_dir() / "cpu_steps.json"
    try:
        return path, json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        return path, {}   # a damaged file is measured again and rewritten


def cpu_optimizer_step(make_optimizer: Callable, n_params: int = 2**22, *, threads: int | None = None,
                       repeats: int = 3, min_run_time: float = 0.2, shape: tuple | None = None,
                       dtype: torch.dtype = torch.float32, name: str | None = None) -> OptimizerStep:
    """Time one CPU optimizer step, the one way the course does: ``make_optimizer([param])`` on one parameter of
    ``n_params`` values (a multiple of 256: 8-bit optimizers quantize whole blocks; ``shape``: a matrix of as many, for
    optimizers that factor or project matrices; ``dtype``: fp32, or bf16 for pure-bf16 training) with a gradient; a
    first step creates the state; then the fastest block of calls in ``repeats`` timings (load on a shared machine
    only adds time: two threads waiting for each other on a busy machine measured 100x the idle step).
    ``name`` ('AdamW fused'): the step is measured once per machine, size and thread count, and kept in the course's
    results (cpu_steps.json); any notebook asking again reads that measurement (``measured_by`` says whose), so that
    the course shows one figure for one quantity."""
    callable_arg(make_optimizer, "make_optimizer", "a function [param] -> optimizer")
    n = positive_int(n_params, "n_params", "e.g. 2**22")
    threads = torch.get_num_threads() if threads is None else positive_int(threads, "threads", "e.g. 1 or 2")
    shape = (n,) if shape is None else tuple(shape)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape) or math.prod(shape) != n:
        raise ValueError(f"shape {shape} must be positive whole numbers whose product is n_params={n}, e.g. "
                         f"(1024, {n // 1024}).")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, not {dtype!r}.")
    key = None if name is None else "|".join(map(str, (name, n, shape, threads, dtype, torch.__version__,
                                                        platform.processor() or platform.machine(), os.cpu_count())))
    if key is not None:
        kept = _kept_steps()[1].get(key)
        if kept:
            return OptimizerStep(**kept)
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).view(shape).to(dtype))
    param.grad = (torch.randn(n, generator=gen) * 1e-3).view(shape).to(dtype)
    optimizer, start = make_optimizer([param]), time.perf_counter()
    optimizer.step()
    first = time.perf_counter() - start
    best = min(time_fn(optimizer.step, min_run_time=min_run_time, threads=threads, warmup=1, statistic="fastest")
               for _ in range(positive_int(repeats, "repeats", "e.g. 3")))
    step = OptimizerStep(best / n * 1e9, first, optimizer_state_bytes(optimizer) / n, threads, n)
    if key is not None:
        from . import results

        path, kept = _kept_steps()
        kept[key] = step._replace(measured_by=f"notebook {results.current_notebook() or 'a script'}")._asdict()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    return step
