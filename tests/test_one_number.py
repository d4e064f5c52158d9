"""One number per quantity: notebooks that show the same figure compute it with the same function and agree.

These run after the notebooks of the same pytest session (marker ``after_notebooks``, ordered by the course's
nbval plugin) and read what the notebooks recorded in this session's course folder. Run alone (``pytest tests``),
they skip, saying so.
"""
from __future__ import annotations

import pytest

from course_utils import results

pytestmark = pytest.mark.after_notebooks


def recorded(notebook: str, name: str) -> float:
    figures = results.load_notebook(notebook)
    if not figures:
        pytest.skip(f"{notebook} did not run in this session: run the notebooks in the same pytest run")
    assert name in figures, f"{notebook} ran but did not record {name}"
    return float(figures[name]["value"])


def test_00_and_06_show_the_same_recipe_peak():
    """00 (the planner) and 06 (the capstone) price GPT-2-XL's recipe step for the same settings, accumulation
    included: the planner's figure is the same call in both, and the capstone's fake-tensor step agrees within 5%."""
    planner_00 = recorded("00_start_here", "gpt2_xl_recipe_planner_tensor_gib")
    planner_06 = recorded("06_capstone_gpt2_xl", "gpt2_xl_recipe_planner_tensor_gib")
    fake_06 = recorded("06_capstone_gpt2_xl", "gpt2_xl_predicted_gpu_peak_gib")
    assert planner_00 == pytest.approx(planner_06, rel=1e-6), "00 and 06 must make the same planner call"
    assert abs(planner_06 - fake_06) <= 0.05 * fake_06, (planner_06, fake_06)


def test_06_and_07_price_the_recipes_pcie_traffic_alike():
    """06 (the capstone's PCIe table) and 07 (ZeRO-Offload's price) show the recipe's PCIe seconds per optimizer step
    of GPT-2-XL on PCIe 3.0 x16: the same bytes (capstone.pcie_bytes_per_step) through the same formula
    (hardware.pcie_seconds), so the same number."""
    from course_utils import capstone, hardware, models

    seconds_06 = recorded("06_capstone_gpt2_xl", "recipe_pcie_seconds_per_step_gpt2xl_pcie3")
    seconds_07 = recorded("07_beyond_one_gpu", "offload_pcie_seconds_per_step_gpt2xl_pcie3")
    expected = hardware.pcie_seconds(capstone.pcie_bytes_per_step(models.GPT2_XL_PARAMS)["total"], "PCIe 3.0 x16")
    assert seconds_06 == pytest.approx(seconds_07, rel=1e-9), "06 and 07 must price PCIe with the same call"
    assert seconds_07 == pytest.approx(expected, rel=1e-9)
