"""Plots the notebooks share: the memory ledger (stacked bars by category against a budget)."""
from __future__ import annotations

from typing import Mapping

from .units import GIB, MIB

CATEGORY_ORDER = ("params", "grads", "optimizer", "master_weights", "activations", "other", "overhead")
CATEGORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "master_weights": "#8172B3",
                   "activations": "#C44E52", "other": "#937860", "overhead": "#BBBBBB"}


def plot_ledger(items: Mapping[str, object], *, budget_bytes: int | None = None, budget_label: str = "budget",
                unit: str = "GiB", ax=None, title: str | None = None):
    """Stacked horizontal bars, one per scenario ``{name: MemoryReport, estimate or {category: bytes}}``, by
    category; a dashed line at the budget."""
    import matplotlib.pyplot as plt
    import pandas as pd

    if unit not in ("GiB", "MiB"):
        raise ValueError("unit must be 'GiB' or 'MiB'.")
    if not items:
        raise ValueError("Nothing to plot: pass at least one scenario, e.g. {'fp32 + Adam': report}.")
    for item in items.values():
        if not hasattr(item, "by_category") and not isinstance(item, Mapping):
            raise TypeError(f"Expected a MemoryReport, MemoryEstimate or a dict of bytes by category, "
                            f"not {type(item).__name__}.")
    frame = pd.DataFrame({name: dict(getattr(item, "by_category", item)) for name, item in items.items()}).T.fillna(0)
    if (frame < 0).any(axis=None):
        raise ValueError(f"Byte counts must be >= 0; {list(frame.index[(frame < 0).any(axis=1)])} has a negative one.")
    categories = [c for c in CATEGORY_ORDER if c in frame] + sorted(set(frame) - set(CATEGORY_ORDER))
    ax = ax or plt.subplots(figsize=(8, 0.6 * len(items) + 1.5))[1]
    scale = GIB if unit == "GiB" else MIB
    (frame[categories] / scale).plot.barh(
        stacked=True, width=0.8, ax=ax, color=[CATEGORY_COLORS.get(c, "#999999") for c in categories])
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
