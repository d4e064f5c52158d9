"""course_utils.validate: runs notebooks under nbval and writes a Markdown + JSON report."""
import json

import nbformat
import pytest

from course_utils import validate


def _notebook(path, code):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.mark.slow
def test_report_for_a_passing_and_a_failing_notebook(tmp_path):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "01_ok.ipynb",
              "from course_utils import results\nresults.record('answer', 42, 'units', notebook='01_ok')")
    _notebook(notebooks / "02_bad.ipynb", "assert 1 == 2, 'a claim that fails'")
    out = tmp_path / "report"
    rc = validate.main(["--profile", "smoke", "--out", str(out), "--notebooks-dir", str(notebooks), "--timeout", "300"])
    assert rc == 1
    report = json.loads((out / "report.json").read_text())
    rows = {r["notebook"]: r for r in report["notebooks"]}
    assert rows["01_ok"]["passed"] and not rows["02_bad"]["passed"]
    assert rows["01_ok"]["figures"]["answer"]["value"] == 42
    assert rows["01_ok"]["figures"]["answer"]["profile"] == "smoke"
    assert rows["01_ok"]["wall_s"] > 0
    markdown = (out / "report.md").read_text()
    assert "| 01_ok | pass" in markdown and "| 02_bad | FAIL" in markdown and "1 passed, 1 failed" in markdown


def test_unknown_notebook_is_a_clear_message(tmp_path, capsys):
    (tmp_path / "01_x.ipynb").write_text("{}")
    assert validate.main(["--notebooks-dir", str(tmp_path), "--notebooks", "09_missing", "--out", str(tmp_path / "r")]) == 2
    assert "Unknown notebook" in capsys.readouterr().err


def test_poller_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(validate.shutil, "which", lambda name: None)
    with validate.GpuMemoryPoller() as poller:
        pass
    assert poller.available is False and poller.peak_mib is None
    with pytest.raises(ValueError):
        validate.GpuMemoryPoller(interval_s=0)
