"""Headline figures: ``record(name, value, unit)`` appends to results/<notebook>.json in
``$COURSE_RESULTS_DIR`` or the course home's results/; ``record_reveal`` keeps, apart, each answer a prediction cell
revealed (results/reveals/<notebook>.json), which the tests search the saved course for."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from . import hardware, paths

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_current_notebook: str | None = None


def set_notebook(name: str) -> None:
    """Name the notebook whose figures :func:`record` writes (``01_memory_accounting``)."""
    global _current_notebook
    _current_notebook = _check_name(name, "notebook name")


def current_notebook() -> str | None:
    """The notebook :func:`set_notebook` named (``06_capstone_gpt2_xl``), or None outside a notebook."""
    return _current_notebook


def _check_name(name, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{what} {name!r} must be a non-empty string of letters, digits, '_', '-' or '.', "
                         "for example 'gpt2_xl_params'.")
    return name


def record(name: str, value, unit: str, *, notebook: str | None = None) -> None:
    """Append one headline figure to ``results/<notebook>.json``. It returns nothing, so that a cell ending with it
    shows no echo of the entry (:func:`load_notebook` reads the entries back)."""
    _check_name(name, "figure name")
    notebook = _check_name(notebook, "notebook name") if notebook is not None else _current_notebook
    if notebook is None:
        raise ValueError("record() does not know which notebook this is: call course_utils.setup('NN_topic') "
                         "in the notebook's first cell, or pass notebook='NN_topic'.")
    if not isinstance(unit, str):
        raise TypeError(f"unit must be a string such as 'GiB', 'bytes' or 'ratio', not {type(unit).__name__}.")
    if hasattr(value, "item") and callable(value.item):  # numpy or torch scalar
        value = value.item()
    if not isinstance(value, (bool, int, float, str, list, tuple)):
        raise TypeError(f"value for {name!r} must be a number, a string or a list of them, not {type(value).__name__}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"value for {name!r} is {value}; record a finite number.")
    value = list(value) if isinstance(value, tuple) else value
    entry = {"value": value, "unit": unit, "profile": hardware.course_profile(), "device": hardware.device_type()}
    folder = paths.results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path, data = folder / f"{notebook}.json", load_notebook(notebook, folder)
    data[name] = entry
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: a crash mid-write never leaves half a file


def load_notebook(notebook: str, folder: str | Path | None = None) -> dict:
    path = Path(folder or paths.results_dir()) / f"{notebook}.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete it and re-run the notebook.") from None


def record_reveal(name: str, value, unit: str) -> None:
    """Keep the answer a prediction's reveal showed (``checks.compare_prediction`` calls it), in the order revealed,
    in ``results/reveals/<notebook>.json``: the tests look for each in the saved course, where it must not appear
    before its reveal. Outside a notebook (no ``setup``), nothing is kept."""
    if _current_notebook is None:
        return
    folder = paths.results_dir() / "reveals"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_current_notebook}.json"
    reveals = [r for r in load_reveals(_current_notebook, folder.parent) if r["name"] != name] + [
        {"name": name, "value": value.item() if hasattr(value, "item") else value, "unit": unit}]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(reveals, indent=2) + "\n")
    os.replace(tmp, path)


def load_reveals(notebook: str, folder: str | Path | None = None) -> list[dict]:
    """The answers ``notebook``'s predictions revealed when it last ran (see :func:`record_reveal`)."""
    path = Path(folder or paths.results_dir()) / "reveals" / f"{notebook}.json"
    return json.loads(path.read_text()) if path.exists() else []
