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
