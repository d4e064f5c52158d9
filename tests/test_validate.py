"""course_tools.validate: runs notebooks under nbval and writes a Markdown + JSON report."""
import json

import nbformat
import pytest

from course_tools import validate


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


@pytest.mark.slow
@pytest.mark.parametrize("profile, passes", [("smoke", False), ("full", True)])
def test_saved_outputs_are_compared_in_smoke_only(tmp_path, profile, passes):
    """Saved outputs come from a smoke run: a checked cell whose numbers depend on the profile must
    fail in smoke when it changes, and must not fail a full (GPU) run, where the claims are the test."""
    import subprocess
    import sys

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(2 + 2)", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="5\n")]  # saved by 'another profile'
    nb.cells = [cell]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "01_checked.ipynb"
    nbformat.write(nb, path)
    root = validate.REPO_ROOT
    env = {**__import__("os").environ, "COURSE_PROFILE": profile}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(root), "-c", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 0) is passes, proc.stdout[-2000:]
