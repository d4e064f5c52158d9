"""course_utils.plots: the memory ledger draws every category, names the budget in the legend, and keeps the
legend off the bars and the budget label off the title."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_utils import plots  # noqa: E402
from course_utils.units import GIB  # noqa: E402


def _ledger():
    return {"naive": {"params": 6 * GIB, "grads": 6 * GIB, "optimizer": 12 * GIB},
            "recipe": {"params": 3 * GIB, "grads": 3 * GIB, "activations": 1 * GIB, "overhead": GIB // 2}}


def test_bars_sum_to_each_scenario():
    ax = plots.plot_ledger(_ledger(), budget_bytes=12 * GIB, budget_label="12 GB card", title="GPT-2-XL")
    ends = {}
    for patch in ax.patches:
        y = round(patch.get_y(), 3)
        ends[y] = max(ends.get(y, 0), patch.get_x() + patch.get_width())
    assert sorted(ends.values()) == pytest.approx([7.5, 24.0])
    plt.close(ax.figure)


def test_budget_is_in_the_legend_and_legend_is_outside_the_bars():
    ax = plots.plot_ledger(_ledger(), budget_bytes=12 * GIB, budget_label="12 GB card", title="GPT-2-XL")
    fig = ax.figure
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "12 GB card" in labels and "params" in labels
    renderer = fig.canvas.get_renderer()
    legend_box = ax.get_legend().get_window_extent(renderer)
    axes_box = ax.get_window_extent(renderer)
    assert legend_box.x0 >= axes_box.x1 - 1, "the legend must not cover the bars"
    title_box = ax.title.get_window_extent(renderer)
    for text in ax.texts:  # no stray label may collide with the title
        assert not title_box.overlaps(text.get_window_extent(renderer))
    plt.close(fig)


@pytest.mark.parametrize("items, match", [({}, "Nothing to plot"), ({"x": {"params": -1}}, "negative"),
                                          ({"x": 3}, "MemoryReport")])
def test_bad_input_is_explained(items, match):
    with pytest.raises((ValueError, TypeError), match=match):
        plots.plot_ledger(items)


def test_unknown_unit():
    with pytest.raises(ValueError, match="GiB"):
        plots.plot_ledger(_ledger(), unit="GB")


def test_show_figure_displays_a_png_whatever_the_backend(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    plots.show_figure(fig)
    assert shown and shown[0].format == "png" and shown[0].data.startswith(b"\x89PNG")
    assert not plt.fignum_exists(fig.number), "the figure is closed once shown"
    with pytest.raises(TypeError, match="Figure"):
        plots.show_figure("not a figure")
