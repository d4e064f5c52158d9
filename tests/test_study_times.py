"""course_tools.study_times: run time read from a validation report, study time counted from the notebook."""
import json
from pathlib import Path

import pytest

from course_tools import study_times

ROOT = Path(__file__).resolve().parent.parent


def _notebook(path, cells):
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_counts_words_code_predictions_and_exercises(tmp_path):
    nb = _notebook(tmp_path / "01_x.ipynb", [
        {"cell_type": "markdown", "source": "# Title\n\nSix words of [prose](https://a.b/c) live here.", "metadata": {}},
        {"cell_type": "code", "source": "import course_utils\nPROFILE = 1\n", "metadata": {}},  # setup: not counted
        {"cell_type": "code", "source": "a = 1\n\n# a comment\nb = 2\n", "metadata": {}},
        {"cell_type": "code", "source": "def f(x):\n    # why\n    return x\n\n\nprint(f(1))\n", "metadata": {}},
        {"cell_type": "code", "source": "guess = 3\n", "metadata": {"tags": ["predict"]}},
        {"cell_type": "markdown", "source": "## Exercise: write it", "metadata": {}},
        {"cell_type": "code", "source": "#@title Solution\ndef g(x):\n    y = x + 1\n    return y\n\n\nassert g(1)\n",
         "metadata": {"tags": ["solution"]}},
    ])
    row = study_times.count(nb, run_seconds=60)
    assert (row.words, row.dense_lines, row.light_lines, row.predict_cells, row.exercises, row.solution_lines) == \
        (10, 2, 4, 1, 1, 3)  # the link's address is not read; def f's two lines are dense; g's three are written
    expected = 10 / study_times.WORDS_PER_MINUTE + 2 / study_times.DENSE_LINES_PER_MINUTE \
        + 4 / study_times.LIGHT_LINES_PER_MINUTE + study_times.PREDICT_MINUTES + study_times.EXERCISE_MINUTES \
        + 3 * study_times.EXERCISE_MINUTES_PER_LINE + 1
    assert row.study_minutes == pytest.approx(expected)


def test_dense_code_and_longer_exercises_take_longer(tmp_path):
    """A cell that defines a function reads slower than one that prints; an exercise with a longer solution
    takes longer; a %%writefile script counts whole as dense."""
    def minutes(cells):
        return study_times.count(_notebook(tmp_path / "02_y.ipynb", [{"cell_type": "code", "source": "x = 1",
                                                                      "metadata": {}}] + cells)).study_minutes
    code = lambda src, tags=(): {"cell_type": "code", "source": src, "metadata": {"tags": list(tags)}}  # noqa: E731
    exercise = {"cell_type": "markdown", "source": "## Exercise", "metadata": {}}
    prints = "\n".join(f"print({i})" for i in range(6))
    dense = "def f():\n" + "\n".join(f"    a{i} = {i}" for i in range(5))
    assert minutes([code(dense)]) > minutes([code(prints)])
    assert minutes([code("%%writefile w.py\n" + prints)]) == pytest.approx(minutes([code(dense)]))
    short, long = "def s():\n    return 1\n", "def s():\n" + "    a = 1\n" * 9 + "    return a\n"
    assert minutes([exercise, code(long, ["solution"])]) > minutes([exercise, code(short, ["solution"])])


def test_run_times_come_from_the_validation_report(tmp_path):
    (tmp_path / "nb").mkdir()
    _notebook(tmp_path / "nb" / "00_a.ipynb", [{"cell_type": "markdown", "source": "hi", "metadata": {}}])
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"notebooks": [{"notebook": "00_a", "wall_s": 12.5}]}))
    rows = study_times.table(tmp_path / "nb", report)
    assert rows[0].run_seconds == 12.5
    assert "12 s" in study_times.markdown(rows) or "13 s" in study_times.markdown(rows)


def test_a_gpu_check_report_is_not_a_learners_run_time(tmp_path):
    """scripts/gpu_check.sh's runs use reduced sizes: their wall times would understate a learner's run."""
    (tmp_path / "nb").mkdir()
    _notebook(tmp_path / "nb" / "00_a.ipynb", [{"cell_type": "markdown", "source": "hi", "metadata": {}}])
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"profile": "gpu-check", "notebooks": [{"notebook": "00_a", "wall_s": 3.0}]}))
    with pytest.raises(ValueError, match="profile gpu-check.*smoke.*full"):
        study_times.table(tmp_path / "nb", report)
    assert study_times.main(["--notebooks-dir", str(tmp_path / "nb"), "--report", str(report)]) == 2


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


def test_start_here_is_a_20_minute_start_with_one_prediction_and_each_notebooks_time():
    """00 takes at most 20 minutes by the course's own count, asks one prediction, and its map gives each notebook's
    time: the study-times table's (one number per quantity)."""
    import re

    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    start = next(p for p in notebooks if p.name.startswith("00_"))
    table = (ROOT / "INSTRUCTORS.md").read_text().split("<!-- study-times:begin -->")[1]
    run_s = float(re.search(r"^\| 00_start_here \|.*\| (\d+) s \|", table, re.M).group(1))
    assert study_times.count(start, run_s).study_minutes <= 20
    cells = json.loads(start.read_text(encoding="utf-8"))["cells"]
    assert sum("predict" in c.get("metadata", {}).get("tags", []) for c in cells) == 1
    study = {n: int(m) for n, m in re.findall(r"^\| (\d\d[a-z]?)_\w+ \|.* (\d+) min \|$", table, re.M)}
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    shown = dict(re.findall(r"^\| (\d\d[a-z]?) \| \[[^\]]+\]\(\d\d[a-z]?_\w+\.ipynb\) \|.*\| (\d+) min \|$", prose, re.M))
    assert shown and {n: int(m) for n, m in shown.items()} == {n: study[n] for n in shown}, shown
    assert set(shown) == set(study), "every notebook's time is on the map"
    assert "08_current_toolbox.ipynb#your-model-your-card" in prose, "my LLM on my card: 08's section 8"
