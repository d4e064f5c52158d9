"""Plots the notebooks share: the memory ledger (stacked bars by category against a budget)."""
from __future__ import annotations

from typing import Mapping

from .units import GIB, MIB

CATEGORY_ORDER = ("params", "grads", "optimizer", "master_weights", "activations", "other", "overhead")
CATEGORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "master_weights": "#8172B3",
                   "activations": "#C44E52", "other": "#937860", "overhead": "#BBBBBB"}


def _as_categories(item) -> dict[str, int]:
    if hasattr(item, "by_category"):
        return dict(item.by_category)
    if isinstance(item, Mapping):
        return dict(item)
    raise TypeError(f"Expected a MemoryReport, MemoryEstimate or a dict of bytes by category, not {type(item).__name__}.")


def ledger_frame(items: Mapping[str, object]):
    """Long-format DataFrame (scenario, category, bytes, GiB) from {scenario: report-or-dict}."""
    import pandas as pd

    if not items:
        raise ValueError("Nothing to plot: pass at least one scenario, e.g. {'fp32 + Adam': report}.")
    rows = []
    for scenario, item in items.items():
        for category, value in _as_categories(item).items():
            if value < 0:
                raise ValueError(f"{scenario}/{category} is negative ({value}); byte counts must be >= 0.")
            rows.append({"scenario": scenario, "category": category, "bytes": int(value), "GiB": value / GIB})
    return pd.DataFrame(rows)


def plot_ledger(items: Mapping[str, object], *, budget_bytes: int | None = None, budget_label: str = "budget",
                unit: str = "GiB", ax=None, title: str | None = None):
    """Stacked horizontal bars, one per scenario, by category; a dashed line at the budget."""
    import matplotlib.pyplot as plt

    if unit not in ("GiB", "MiB"):
        raise ValueError("unit must be 'GiB' or 'MiB'.")
    scale, frame, scenarios = GIB if unit == "GiB" else MIB, ledger_frame(items), list(items)
    ax = ax or plt.subplots(figsize=(8, 0.6 * len(items) + 1.5))[1]
    left = [0.0] * len(scenarios)
    categories = [c for c in CATEGORY_ORDER if c in set(frame.category)] + sorted(set(frame.category) - set(CATEGORY_ORDER))
    for category in categories:
        widths = [frame[(frame.scenario == s) & (frame.category == category)].bytes.sum() / scale for s in scenarios]
        ax.barh(scenarios, widths, left=left, label=category, color=CATEGORY_COLORS.get(category))
        left = [l + w for l, w in zip(left, widths)]
    if budget_bytes is not None:
        ax.axvline(budget_bytes / scale, color="black", linestyle="--", linewidth=1.5, label=budget_label)
    ax.invert_yaxis()
    ax.set_xlabel(f"memory ({unit})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    if title:
        ax.set_title(title)
    return ax


def show_figure(fig, *, dpi: int = 100) -> None:
    """Display ``fig`` as a PNG and close it: what a widget's output area shows on every front end (with a
    non-inline backend such as Agg, ``display(fig)`` shows only text)."""
    import io

    import matplotlib.pyplot as plt
    from IPython.display import Image, display

    if not hasattr(fig, "savefig"):
        raise TypeError(f"show_figure takes a matplotlib Figure, not {type(fig).__name__}.")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    display(Image(data=buffer.getvalue(), format="png"))
