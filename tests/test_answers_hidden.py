"""Nothing gives the answer away: every answer a prediction's reveal showed when the notebooks ran in this pytest
session (``checks.compare_prediction`` keeps each in the course folder's ``results/reveals/``) is looked for in the
saved course wherever a learner could read it before predicting: the notebooks before its own in the course's order
(their prose and saved outputs), and its own notebook from the top to the end of the prediction's section (the
saved outputs there are cleared by ``course_tools.hide_answers``; the prose must not state it either: the discussion
of a result is printed by the cell that measures it).

An answer is searched as the reveal printed it and at three significant digits; a number with fewer significant
digits is searched only with its unit beside it ("16 bytes"), a bare small number being everywhere. In the notebooks
before, an answer without a unit (a ratio, a fraction) is searched only at four significant digits or more: another
notebook's table of timings shows many a bare 0.123 that has nothing to do with it; and a zero ("0 MiB") is looked
for in its own notebook only. These run after
the notebooks of the same session (marker ``after_notebooks``); run alone they skip, saying so.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from course_tools import hide_answers
from course_utils import results
from course_utils.checks import _fmt

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))  # 00, 01, 01b, 01c, 02, ...: the course's order


def cell_text(cell) -> str:
    """What a reader sees of a saved cell: a markdown cell's prose, a code cell's saved outputs."""
    if cell["cell_type"] == "markdown":
        return "".join(cell["source"])
    parts = []
    for out in cell.get("outputs", []):
        parts.append("".join(out.get("text", "")))
        for kind in ("text/plain", "text/markdown", "text/html"):
            parts.append("".join(out.get("data", {}).get(kind, "")))
    return "\n".join(parts)


def predict_cells(cells) -> list[tuple[int, list[str]]]:
    """(index, the names it asks for) of each predict cell."""
    return [(i, [m[0] for m in hide_answers.ASSIGNMENT.findall("".join(c["source"]))]) for i, c in enumerate(cells)
            if c["cell_type"] == "code" and "predict" in c.get("metadata", {}).get("tags", [])]


def section_end(cells, start: int) -> int:
    """The index of the first cell after ``start`` that opens a new section (or len(cells))."""
    return next((j for j in range(start + 1, len(cells)) if cells[j]["cell_type"] == "markdown"
                 and hide_answers.SECTION.match("".join(cells[j]["source"]))), len(cells))


def significant_digits(text: str) -> int:
    return len(text.replace(",", "").replace("-", "").split("e")[0].replace(".", "").strip("0"))


def patterns(value, unit: str, fewest_digits: int = 3) -> list[re.Pattern]:
    """How an answer could be written: as the reveal printed it and at three significant digits; with its unit when
    the number alone has fewer than ``fewest_digits`` significant digits (without a unit, then, not at all)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return []
    forms = {_fmt(value)}
    if value != 0 and 1e-3 <= abs(value) < 1e6:
        digits = max(0, 2 - math.floor(math.log10(abs(value))))
        forms |= {f"{value:.{digits}f}", f"{value:,.{digits}f}"}
    found = []
    for form in forms:
        number = rf"(?<![\d.,]){re.escape(form)}(?![\d]|[.,]\d|[eE][+-]?\d)"  # not a longer number, nor 1.16e+07
        if significant_digits(form) >= fewest_digits:
            found.append(re.compile(number))
        elif unit:
            found.append(re.compile(number + rf"\s?{re.escape(unit)}\b"))
    return found


def reveals_of(notebook: Path) -> list[dict]:
    reveals = results.load_reveals(notebook.stem)
    if not reveals and not results.load_notebook(notebook.stem):
        pytest.skip(f"{notebook.name} did not run in this session: run the notebooks in the same pytest run")
    return reveals


pytestmark = pytest.mark.after_notebooks


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_prediction_is_revealed(path):
    """Each predict cell's names are compared with a measurement: the leak search knows every answer."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    asked = sum(len(names) for _, names in predict_cells(cells))
    revealed = reveals_of(path)
    assert len(revealed) >= asked, (f"{path.name} asks {asked} predictions but revealed {len(revealed)} answers: "
                                    "compare each with checks.compare_prediction")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_answer_is_on_the_page_before_its_reveal(path):
    course = {p: json.loads(p.read_text(encoding="utf-8"))["cells"] for p in NOTEBOOKS}
    cells = course[path]
    revealed = reveals_of(path)
    predicts = predict_cells(cells)
    leaks = []
    for k, answer in enumerate(revealed):
        # the k-th answer revealed belongs to the k-th prediction (the last one for any extra reveals)
        index = predicts[min(k, len(predicts) - 1)][0] if predicts else len(cells) - 1
        where = {p: course[p] for p in NOTEBOOKS[:NOTEBOOKS.index(path)]}  # the notebooks before
        where[path] = cells[:section_end(cells, index)]  # its own, to the end of the prediction's section
        for notebook, shown in where.items():
            if notebook != path and answer["value"] == 0:
                continue   # "0 MiB" in another notebook is another quantity: a zero is looked for in its own only
            # in another notebook: a bare ratio needs 4 digits, a figure with a unit its unit beside it (a
            # measured time once matched a GiB figure in 00's table by chance)
            elsewhere = notebook != path
            digits = 99 if elsewhere and answer["unit"] else 4 if elsewhere else 3
            for pattern in patterns(answer["value"], answer["unit"], fewest_digits=digits):
                for i, cell in enumerate(shown):
                    if pattern.search(cell_text(cell)):
                        leaks.append(f"{answer['name']} = {_fmt(answer['value'])} {answer['unit']} is shown in "
                                     f"{notebook.name}, cell {i} ({cell['cell_type']}), before its reveal")
    assert not leaks, "\n".join(sorted(set(leaks)))


def test_the_search_finds_an_answer_in_prose_and_in_outputs():
    md = {"cell_type": "markdown", "source": ["The step needs 119.7 GiB."]}
    out = {"cell_type": "code", "outputs": [{"output_type": "stream", "text": ["peak: 1,234 MiB\n"]}]}
    assert any(p.search(cell_text(md)) for p in patterns(119.7, "GiB"))
    assert any(p.search(cell_text(out)) for p in patterns(1234.0, "MiB"))
    assert not any(p.search("16 layers") for p in patterns(16, "bytes"))  # a small number needs its unit
    assert any(p.search("16 bytes a parameter") for p in patterns(16, "bytes"))
    assert not any(p.search("0.2571") for p in patterns(0.257, ""))  # a longer number is another number
    assert not any(p.search("1.16e+07 bytes") for p in patterns(1.1616, "x"))
    assert any(p.search("share 0.123") for p in patterns(0.123, ""))  # its own notebook: three digits
    assert not any(p.search("share 0.123") for p in patterns(0.123, "", fewest_digits=4))  # another's: four
    assert any(p.search("share 0.1234") for p in patterns(0.1234, "", fewest_digits=4))
