"""Held to the world: peaks others measured on real GPUs and published, priced by the planner.

``published.json`` (package data) keeps each measurement with its source (repository and file, or paper and table),
the figure as printed (its unit as the source computed it), what the figure is (``max_memory_allocated``,
``max_memory_reserved``, ``nvidia-smi`` or ``longest_context``, the longest sequence that fits a card), the model,
the card, the settings the source states as the planner's knobs, and what it leaves unstated, with the values those
settings could take. :func:`price` prices a row over every combination of its unstated values: its range; a row
with nothing unstated that moves the figure (a range under 1% wide) is *stated*, and its error is the planner's own.

What the planner does not model, and the rows therefore avoid: torch.compile (it fuses kernels and frees
intermediates a plain step keeps), FlashAttention-2 against PyTorch's SDPA kernels (the planner prices SDPA's flash
and memory-efficient kernels), and the loss's differences between transformers versions (older versions upcast the
logits to fp32 inside the model and copied them to shift them; the planner measures the installed version).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

from ..units import GIB, MIB
from .llm import get_model, hf_spec
from .model import make_settings, predict_settings
from .search import largest_fit
from .specs import get_gpu, published_data

UNITS = {"bytes": 1, "GB": 10**9, "GiB": GIB, "MB": 10**6, "MiB": MIB, "tokens": 1}
FIGURES = ("max_memory_allocated", "max_memory_reserved", "nvidia-smi", "longest_context")
STATED_WIDTH = 0.01  # a range narrower than this is one number: nothing unstated moves the figure


def rows() -> list[dict]:
    """The published measurements (``published.json``'s rows)."""
    return published_data()["rows"]


def published_value(row: dict) -> float:
    """A row's figure in bytes (tokens for ``longest_context``)."""
    return row["value"] * UNITS[row["unit"]]


def row_model(row: dict):
    """A row's ModelSpec: a shipped name, or ``{"name", "config"}`` (a transformers config, priced on fake tensors
    at the kind and pricing a bf16 step on a GPU uses)."""
    model = row["model"]
    if isinstance(model, str):
        return get_model(model)
    return hf_spec(model["config"], name=model["name"], kinds=("half",), pricings=("cuda-fused",))


def _card(gpu, row: dict):
    card = get_gpu(gpu)
    return replace(card, context_bytes=round(row["context_mib"] * MIB)) if "context_mib" in row else card


def predict_figure(row: dict, **changes) -> float:
    """The planner's figure for ``row`` with ``changes`` to its settings (an unstated one's values; ``gpu`` and
    ``figure`` too): bytes, or tokens for the longest context (the largest size whose expected peak fits)."""
    knobs = {**row["settings"], **changes}
    gpu, figure = _card(knobs.pop("gpu", row["hardware"]), row), knobs.pop("figure", row["figure"])
    model = row_model(row)
    if figure == "longest_context":
        return float(largest_fit(model, gpu, "size", host_gib=math.inf, **knobs).expected or 0)
    plan = predict_settings(model, gpu, make_settings(model, **knobs))
    return float(plan.figures[figure])


def price(row: dict, spread: tuple | None = None) -> dict:
    """The planner's price of a published row: ``expected`` (the row's settings, each unstated one at its first
    value), ``low`` and ``high`` over every combination of the unstated values, ``stated`` (the range is under 1%
    wide: nothing unstated moves the figure), ``error`` (published / expected - 1) and ``inside``: the published
    figure lies in the range widened by the planner's own ``spread`` (low, high; default: the stored one, as every
    plan carries it), for the settings are unknown *and* the planner errs."""
    unstated = row.get("unstated", {})
    names = list(unstated)
    values = [predict_figure(row, **dict(zip(names, combo))) for combo in itertools.product(*unstated.values())]
    expected = values[0] if values else predict_figure(row)
    low, high = (min(values), max(values)) if values else (expected, expected)
    published = published_value(row)
    if spread is None:
        spread = (published_data()["spread"]["low"], published_data()["spread"]["high"])
    return {"published": published, "expected": expected, "low": low, "high": high,
            "stated": (high - low) <= STATED_WIDTH * expected, "error": published / expected - 1,
            "inside": low * (1 + spread[0]) * (1 - 1e-9) <= published <= high * (1 + spread[1]) * (1 + 1e-9)}


def table(spread: tuple | None = None):
    """Every row priced (:func:`price`, ``spread`` as it takes it): a pandas DataFrame (GiB for memory, tokens for the
    longest context) with its source."""
    import pandas as pd

    out = []
    for row in rows():
        p = price(row, spread)
        scale = 1 if row["figure"] == "longest_context" else GIB
        out.append({"id": row["id"], "source": row["source"].split(",")[0], "model": row_model(row).name,
                    "card": row["hardware"], "figure": row["figure"], "measured": row["measured"],
                    "published": p["published"] / scale, "planner": p["expected"] / scale, "low": p["low"] / scale,
                    "high": p["high"] / scale, "error %": 100 * p["error"], "stated": p["stated"],
                    "inside": p["inside"]})
    return pd.DataFrame(out)


# The planner agrees with the course's CPU twins within this (tests/test_protocol.py, tests/test_planner_llms.py: a
# measured whole step, the same code): no range is narrower, whatever the published rows say.
TWIN_AGREEMENT = 0.02


def spread(priced=None) -> dict:
    """How far the published figures of the stated memory rows fell from the planner's expected value (published /
    expected - 1): ``low`` (the lowest) and ``high`` (the highest), never inside the planner's agreement with its CPU
    twins (+-``TWIN_AGREEMENT``), with the rows used. ``priced``: ``table()``'s frame (computed when not given). A
    plan's range is its expected peak times (1 + low) to (1 + high)."""
    frame = table() if priced is None else priced
    stated = frame[frame["stated"] & (frame["figure"] != "longest_context")]
    errors = stated["error %"] / 100
    # rounded outward to 4 decimals, so that every stated row lies inside the range it gives
    return {"low": math.floor(min(-TWIN_AGREEMENT, float(errors.min())) * 1e4) / 1e4,
            "high": math.ceil(max(TWIN_AGREEMENT, float(errors.max())) * 1e4) / 1e4, "rows": list(stated["id"])}
