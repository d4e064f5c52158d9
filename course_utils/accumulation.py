"""Gradient accumulation helpers (notebook 02): compare gradients, a small CNN, micro-batches, the
micro-batch-size sweep. The loops, the GroupNorm converter and the sweep's plot are written in the notebook."""
from __future__ import annotations

import gc
import math
from typing import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .memory import MIB, _state_tensors, measure_memory
from .timing import time_fn
from .validation import callable_arg, positive_int


def _trainable(model) -> list[nn.Parameter]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The model has no trainable parameters, so it has no gradient or update to compare.")
    return params


def flat_grad(model: nn.Module) -> torch.Tensor:
    """All parameter gradients as one float64 vector (a parameter without ``.grad`` counts as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
                      for p in _trainable(model)])


def flat_params(model: nn.Module) -> torch.Tensor:
    """All trainable parameters as one float64 vector (to compare two models after an update)."""
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in _trainable(model)])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` for two tensors (e.g. two :func:`flat_grad`): 0 when equal, ~1 when unrelated."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"rel_diff compares two tensors, not {type(a).__name__} and {type(b).__name__}.")
    if a.shape != b.shape:
        raise ValueError(f"Shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}; compare the same model's gradients.")
    norm_b = torch.linalg.vector_norm(b.detach().double())
    if not norm_b > 0:
        raise ValueError("The reference (second argument) is all zeros: run backward() before comparing gradients.")
    return float(torch.linalg.vector_norm(a.detach().double() - b.detach().double()) / norm_b)


def small_cnn(norm: str = "group", *, width: int = 16) -> nn.Sequential:
    """1-channel images -> 10 classes: (conv with stride 2 - norm - ReLU) twice, global pool, linear."""
    norms = {"group": lambda c: nn.GroupNorm(1, c), "batch": nn.BatchNorm2d, "none": lambda c: nn.Identity()}
    if norm not in norms:
        raise ValueError(f"norm must be one of {sorted(norms)}, not {norm!r}.")
    positive_int(width, "width")
    make = norms[norm]
    return nn.Sequential(nn.Conv2d(1, width, 3, stride=2, padding=1), make(width), nn.ReLU(),
                         nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), make(2 * width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10))


def micro_batches(images: torch.Tensor, labels: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a batch into ``k`` micro-batches (``torch.tensor_split``: sizes differ by at most one)."""
    if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("images and labels must be tensors.")
    if len(images) != len(labels):
        raise ValueError(f"images ({len(images)}) and labels ({len(labels)}) must hold the same number of samples.")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(images):
        raise ValueError(f"k must be an int between 1 and the batch size {len(images)}, not {k!r}.")
    return list(zip(torch.tensor_split(images, k), torch.tensor_split(labels, k)))


def sweep_micro_batch_sizes(model: nn.Module, optimizer: torch.optim.Optimizer,
                            micro_step: Callable[[torch.Tensor, torch.Tensor, int], None], optimizer_step: Callable[[], None],
                            images: torch.Tensor, labels: torch.Tensor, micro_batch_sizes: Sequence[int], *,
                            whole_cycle: bool = False, min_run_time: float = 0.2):
    """Peak memory and time per sample of one accumulated update, for each micro-batch size (a DataFrame).
    ``micro_step(x, y, n_total)`` and ``optimizer_step()`` come from the notebook; an OOM gives fits=False."""
    import pandas as pd

    _trainable(model)
    _state_tensors(optimizer)  # checks it is an optimizer
    callable_arg(micro_step, "micro_step", "the notebook's function (x, y, n_total)")
    callable_arg(optimizer_step, "optimizer_step", "the notebook's zero-argument function")
    n = len(images)
    if len(labels) != n or n == 0:
        raise ValueError(f"images ({len(images)}) and labels ({len(labels)}) must be the same non-zero length.")
    if not micro_batch_sizes:
        raise ValueError("micro_batch_sizes is empty: pass e.g. [256, 128, 64].")
    for m in micro_batch_sizes:
        if n % positive_int(m, "each micro-batch size"):
            raise ValueError(f"Each micro-batch size must divide the batch of {n}; {m!r} does not.")
    rows = []
    for m in tqdm(micro_batch_sizes, desc="micro-batch sizes"):
        k, chunks = n // m, [(images[i : i + m], labels[i : i + m]) for i in range(0, n, m)]
        row = {"micro_batch": m, "k": k, "fits": True}
        try:
            optimizer.zero_grad(set_to_none=True)
            seconds = time_fn(lambda: micro_step(*chunks[0], n), min_run_time=min_run_time, warmup=0)
            optimizer.zero_grad(set_to_none=True)

            # whole_cycle=False (cheaper on a CPU): the first k-1 micro-batches run untracked, and only the last one
            # (which holds the most: all gradients exist) and the step are measured
            measured = chunks if whole_cycle else chunks[-1:]
            for x, y in chunks[:len(chunks) - len(measured)]:
                micro_step(x, y, n)

            def work():
                for x, y in measured:
                    micro_step(x, y, n)
                optimizer_step()
            report = measure_memory(work, model=model, optimizer=optimizer)
        except RuntimeError as err:  # torch.OutOfMemoryError is one: a micro-batch too big for the GPU, recorded
            if "out of memory" not in str(err).lower():
                raise
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()  # a no-op without CUDA
            rows.append({**row, "fits": False, "peak_bytes": math.nan, "peak_MiB": math.nan, "seconds_per_sample": math.nan})
            continue
        optimizer.zero_grad(set_to_none=True)
        rows.append({**row, "peak_bytes": int(report.peak_bytes), "peak_MiB": report.peak_bytes / MIB,
                     "seconds_per_sample": seconds / m, **{f"{c}_MiB": v / MIB for c, v in report.by_category.items()}})
    return pd.DataFrame(rows)
