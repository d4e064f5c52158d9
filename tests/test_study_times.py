"""course_tools.study_times: run time read from a validation report, study time counted from the notebook."""
import json

import pytest

from course_tools import study_times


def _notebook(path, cells):
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_counts_words_code_predictions_and_exercises(tmp_path):
    nb = _notebook(tmp_path / "01_x.ipynb", [
        {"cell_type": "markdown", "source": "# Title\n\nSix words of prose live here.", "metadata": {}},
        {"cell_type": "code", "source": "a = 1\n\nb = 2\n", "metadata": {}},
        {"cell_type": "code", "source": "guess = 3\n", "metadata": {"tags": ["predict"]}},
        {"cell_type": "markdown", "source": "## Exercise: write it", "metadata": {}},
        {"cell_type": "code", "source": "hidden = 1\nsolution = 2\n", "metadata": {"tags": ["solution"]}},
    ])
    row = study_times.count(nb, run_seconds=60)
    assert (row.words, row.code_lines, row.predict_cells, row.exercises) == (10, 3, 1, 1)
    expected = 10 / study_times.WORDS_PER_MINUTE + 3 / study_times.CODE_LINES_PER_MINUTE \
        + study_times.PREDICT_MINUTES + study_times.EXERCISE_MINUTES + 1
    assert row.study_minutes == pytest.approx(expected)


def test_run_times_come_from_the_validation_report(tmp_path):
    (tmp_path / "nb").mkdir()
    _notebook(tmp_path / "nb" / "00_a.ipynb", [{"cell_type": "markdown", "source": "hi", "metadata": {}}])
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"notebooks": [{"notebook": "00_a", "wall_s": 12.5}]}))
    rows = study_times.table(tmp_path / "nb", report)
    assert rows[0].run_seconds == 12.5
    assert "12 s" in study_times.markdown(rows) or "13 s" in study_times.markdown(rows)


def test_bad_inputs_are_explained(tmp_path):
    with pytest.raises(ValueError, match="No notebooks"):
        study_times.table(tmp_path)
    bad = tmp_path / "00_bad.ipynb"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not a readable notebook"):
        study_times.count(bad)


def test_the_course_itself():
    rows = study_times.table()
    assert len(rows) >= 8 and all(r.words > 300 for r in rows)
