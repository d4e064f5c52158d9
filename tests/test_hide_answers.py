"""course_tools.hide_answers: a saved notebook shows no answer before the learner predicts it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from course_tools import hide_answers

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def code(source, tags=(), outputs=("an output",)):
    return {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": source, "execution_count": 3,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": o} for o in outputs]}


def small_notebook():
    return {"cells": [code("x = 1"),
                      code("my_peak_mib = 12.5   # your prediction, in MiB\nmy_ratio = 2  # and this", tags=["predict"]),
                      code("peak = measure()"),  # measures: its output is the answer
                      {"cell_type": "markdown", "metadata": {}, "source": "Now compare."},
                      code("compare_prediction('peak', my_peak_mib, peak)"),
                      code("print('after, in the same section')"),
                      {"cell_type": "markdown", "metadata": {}, "source": "## 2. The next section"},
                      code("print('the next section')"),
                      code("#@title Solution\nanswer = 42", tags=["solution"])]}


def test_hide_empties_predictions_and_clears_the_answers_outputs():
    nb = hide_answers.hide(small_notebook())
    cells = nb["cells"]
    assert "".join(cells[1]["source"]) == "my_peak_mib = None   # your prediction, in MiB\nmy_ratio = None  # and this"
    # from the predict cell to the end of its section: the reveal and what follows it there
    assert [bool(c.get("outputs")) for c in cells] == [True, False, False, False, False, False, False, True, False]
    assert cells[2]["execution_count"] is None
    assert hide_answers.problems(nb) == []


def test_problems_names_what_shows_too_early():
    nb = small_notebook()
    nb["cells"][2]["source"] = "# NBVAL_CHECK_OUTPUT\npeak = measure()"
    found = hide_answers.problems(nb)
    assert any("my_peak_mib is pre-filled (12.5)" in p for p in found)
    assert any("cell 2 has saved output" in p for p in found) and any("cell 8 has saved output" in p for p in found)
    assert any("cell 5 has saved output" in p for p in found)  # after the reveal, in the same section
    assert any("cell 2 is marked NBVAL_CHECK_OUTPUT" in p for p in found)
    assert not any("cell 7" in p for p in found)  # in the next section, outputs may stay


def test_the_command_rewrites_files_and_reports(tmp_path, capsys):
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(small_notebook()))
    assert hide_answers.main([str(path)]) == 0
    assert hide_answers.problems(json.loads(path.read_text())) == []
    assert hide_answers.main([]) == 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_that_asks_a_prediction_is_tagged(path):
    """A cell that sets `my_... = None` asks the learner a prediction: tagged `predict`, hide_answers empties it and
    clears its section's outputs, and the leak test knows it."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    untagged = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and "predict" not in c.get(
        "metadata", {}).get("tags", []) and re.search(r"^my_\w+\s*=\s*None\b", "".join(c["source"]), re.M)]
    assert not untagged, f"{path.name}: cells {untagged} ask a prediction without the `predict` tag"
