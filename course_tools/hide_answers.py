"""Save notebooks so that a reader on GitHub or Colab predicts before seeing an answer.

After a notebook's outputs are refreshed, ``python -m course_tools.hide_answers notebooks/*.ipynb``:

* empties each ``predict`` cell: every ``my_... = <number>`` becomes ``my_... = None`` (the comment, which says what
  to predict and in what unit, stays);
* clears the outputs of the cells from each ``predict`` cell to the end of its section (the next ``#`` or ``##``
  heading): the reveal (the first code cell that reads one of its names, where the measurement is compared with the
  prediction) and everything after it that could restate the answer, so the measured answer is not on the page before
  the learner has typed a number and run the cells;
* clears the outputs of ``predict`` and ``solution`` cells.

The cells still run under nbval (a ``None`` prediction prints what to type and records nothing). A cleared cell must
not be marked ``# NBVAL_CHECK_OUTPUT`` (there is no saved output left to compare); :func:`problems` says so, and the
tests call it on every notebook.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ASSIGNMENT = re.compile(r"^(my_\w+)(\s*=\s*)([^#\n]*?)(\s*(#.*)?)$", re.M)
SECTION = re.compile(r"^#{1,2} ")  # a section starts at a level-1 or level-2 heading


def _source(cell) -> str:
    return "".join(cell["source"])


def _tags(cell) -> list:
    return cell.get("metadata", {}).get("tags", [])


def hidden_cells(cells) -> dict[int, str]:
    """``{index: why}`` of the code cells whose outputs must not be saved."""
    hidden = {}
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        if "solution" in _tags(cell):
            hidden[i] = "a solution cell"
        if "predict" not in _tags(cell):
            continue
        hidden[i] = "a predict cell"
        for j in range(i + 1, len(cells)):
            if cells[j]["cell_type"] == "markdown" and SECTION.match(_source(cells[j])):
                break
            if cells[j]["cell_type"] == "code":
                hidden[j] = f"is in the section of the prediction in cell {i}"
    return hidden


def hide(notebook: dict) -> dict:
    """The notebook with its predictions emptied and the answers' outputs cleared (see the module docstring)."""
    cells = notebook["cells"]
    for cell in cells:
        if cell["cell_type"] == "code" and "predict" in _tags(cell):
            text = ASSIGNMENT.sub(lambda m: f"{m[1]}{m[2]}None{m[4]}", _source(cell))
            cell["source"] = text.splitlines(keepends=True)
    for i in hidden_cells(cells):
        cells[i]["outputs"], cells[i]["execution_count"] = [], None
    return notebook


def problems(notebook: dict) -> list[str]:
    """What a saved notebook shows too early: pre-filled predictions, answers' outputs, checked cleared cells."""
    cells, found = notebook["cells"], []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code" and "predict" in _tags(cell):
            names = ASSIGNMENT.findall(_source(cell))
            if not names:
                found.append(f"cell {i}: a predict cell without a `my_... = None` line")
            found += [f"cell {i}: {name} is pre-filled ({value.strip()})" for name, _, value, *_ in names
                      if value.strip() != "None"]
    for i, why in hidden_cells(cells).items():
        if cells[i].get("outputs"):
            found.append(f"cell {i} has saved output but {why}")
        if "NBVAL_CHECK_OUTPUT" in _source(cells[i]):
            found.append(f"cell {i} is marked NBVAL_CHECK_OUTPUT but {why}: its output cannot be saved")
    return found


def main(argv=None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m course_tools.hide_answers NOTEBOOK.ipynb [...]", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        notebook = hide(json.loads(path.read_text(encoding="utf-8")))
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        for problem in problems(notebook):
            print(f"{path.name}: {problem}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
