"""course_tools.validate: runs notebooks under nbval and writes a Markdown + JSON report."""
import json
import shutil
import sys

import nbformat
import pytest

from course_tools import validate
from stand_ins import stand_in


def _notebook(path, code):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def _checked_notebook(path):
    """A cell checked against its saved output (``NBVAL_CHECK_OUTPUT``), saved by 'another profile': 5, not 4."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(2 + 2)", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="5\n")]
    nb.cells = [cell]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_report_for_a_passing_and_a_failing_notebook(tmp_path):
    """Also: in smoke, a checked cell whose saved output differs fails (saved outputs come from a smoke run)."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "01_ok.ipynb",
              "from course_utils import results\nresults.record('answer', 42, 'units', notebook='01_ok')")
    _notebook(notebooks / "02_bad.ipynb", "assert 1 == 2, 'a claim that fails'")
    _checked_notebook(notebooks / "03_checked.ipynb")
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
    assert "| 01_ok | pass" in markdown and "| 02_bad | FAIL" in markdown and "1 passed, 2 failed" in markdown
    log = (out / "logs" / "03_checked.log").read_text()
    assert not rows["03_checked"]["passed"] and "1 failed" in log and "mismatch" in log.lower(), log[-2000:]


def test_unknown_notebook_is_a_clear_message(tmp_path, capsys):
    (tmp_path / "01_x.ipynb").write_text("{}")
    assert validate.main(["--notebooks-dir", str(tmp_path), "--notebooks", "09_missing", "--out", str(tmp_path / "r")]) == 2
    assert "Unknown notebook" in capsys.readouterr().err


def test_poller_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(validate, "shutil", stand_in(shutil, which=lambda name: None))
    with validate.GpuMemoryPoller() as poller:
        pass
    assert poller.available is False and poller.peak_mib is None
    with pytest.raises(ValueError):
        validate.GpuMemoryPoller(interval_s=0)


@pytest.mark.slow
def test_saved_outputs_are_not_compared_in_full(tmp_path):
    """Saved outputs come from a smoke run: a checked cell whose numbers depend on the profile must not fail a full
    (GPU) run, where the claims are the test (in smoke it fails: test_report_for_a_passing_and_a_failing_notebook)."""
    import subprocess

    path = _checked_notebook(tmp_path / "01_checked.ipynb")
    root = validate.REPO_ROOT
    # in this environment, as course-validate runs notebooks: the comparison is the plugin's, the same in an installed
    # run (which every notebook of make test is), and a wheel and a fresh environment would add 10 s a case
    env = {**__import__("os").environ, "COURSE_PROFILE": "full", "COURSE_NOTEBOOKS": "here"}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(root), "-c", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]


# ---------------------------------------------------------------- the in-process runner (no Jupyter kernel)
def _cells_notebook(path, *cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source, metadata={"tags": list(tags)}) for source, tags in cells]
    nbformat.write(nb, path)
    return path


def test_execute_runs_the_cells_in_order_in_the_notebooks_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # execute_notebook moves into the notebook's folder and puts it on sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "nb").mkdir()
    (tmp_path / "nb" / "helper.py").write_text("VALUE = 41\n")
    path = _cells_notebook(tmp_path / "nb" / "01_ok.ipynb",
                           ("from helper import VALUE\nimport os\nhere = os.getcwd()", ()),
                           ("from IPython.display import display\ndisplay({'answer': VALUE + 1})", ()),
                           ("# NBVAL_SKIP\nraise RuntimeError('skipped')", ()),
                           ("raise ValueError('expected')", ("raises-exception",)),
                           ("# NBVAL_RAISES_EXCEPTION\n1 / 0", ()),
                           ("# NBVAL_RAISES_EXCEPTION\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n"
                            "    get_ipython().showtraceback()", ()),   # caught and shown, as 01c does
                           ("print('cwd', here)", ()))
    assert validate.execute_notebook(path) == 0
    out = capsys.readouterr().out
    assert "{'answer': 42}" in out and f"cwd {tmp_path / 'nb'}" in out
    assert "code cell 3/7: skipped (NBVAL_SKIP)" in out and "all 7 code cells ran" in out


@pytest.mark.parametrize("cells, says", [
    ((("x = 1", ()), ("assert x == 2, 'a claim that fails'", ()), ("print('never')", ())), "code cell 2 raised"),
    ((("x = 1", ("raises-exception",)),), "code cell 1 is marked NBVAL_RAISES_EXCEPTION but did not raise"),
    ((("def broken(:\n    pass", ()),), "code cell 1 raised"),
    ((("try:\n    1 / 0\nexcept ZeroDivisionError:\n    get_ipython().showtraceback()", ()),), "code cell 1 raised"),
])
def test_execute_fails_on_a_raising_cell(tmp_path, capsys, monkeypatch, cells, says):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert validate.execute_notebook(_cells_notebook(tmp_path / "02_bad.ipynb", *cells)) == 1
    out = capsys.readouterr().out
    assert says in out and "never" not in out


def test_cell_markers_from_comments_and_tags():
    assert validate.cell_markers({"source": ["# NBVAL_SKIP\n", "x = 1"]}) == {"NBVAL_SKIP"}
    assert validate.cell_markers({"source": "x = 1", "metadata": {"tags": ["nbval-skip", "raises-exception"]}}) == {
        "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION"}
    assert validate.cell_markers({"source": "# NBVAL_CHECK_OUTPUT\nprint(1)", "metadata": {"tags": ["solution"]}}) == set()


@pytest.mark.slow
def test_ipython_runner_reports_like_nbval_and_runs_startup_files(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "01_ok.ipynb", "from course_utils import results\n"
              "results.record('answer', STARTED + 1, 'units', notebook='01_ok')")
    _notebook(notebooks / "02_bad.ipynb", "assert 1 == 2, 'a claim that fails'")
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-first.py").write_text("STARTED = 41\n")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    out = tmp_path / "report"
    rc = validate.main(["--runner", "ipython", "--profile", "smoke", "--out", str(out), "--notebooks-dir",
                        str(notebooks), "--timeout", "300"])
    assert rc == 1
    rows = {r["notebook"]: r for r in json.loads((out / "report.json").read_text())["notebooks"]}
    assert rows["01_ok"]["passed"] and rows["01_ok"]["figures"]["answer"]["value"] == 42
    assert not rows["02_bad"]["passed"] and "a claim that fails" in (out / "logs" / "02_bad.log").read_text()


def test_unknown_runner_is_a_clear_message(tmp_path):
    with pytest.raises(ValueError, match="runner must be one of"):
        validate.run_notebook(tmp_path / "01_x.ipynb", profile="smoke", results_dir=tmp_path, log_dir=tmp_path,
                              timeout_s=10, runner="papermill")


def test_a_notebook_stopped_at_its_timeout_reads_timeout_and_the_report_keeps_the_others(tmp_path, monkeypatch):
    """A notebook stopped at --timeout is reported as TIMEOUT (exit 124), not as a failure's exit code; the report is
    rewritten after each notebook, so a run stopped from outside keeps the notebooks that finished."""
    notebooks = tmp_path / "nb"
    notebooks.mkdir()
    for name in ("01_ok", "02_slow", "03_never"):
        _notebook(notebooks / f"{name}.ipynb", "x = 1")
    out, seen = tmp_path / "report", []

    def fake_run(path, *, profile, results_dir, log_dir, timeout_s, runner):
        if path.stem == "03_never":   # stopped from outside while this one runs: the report has the two before it
            seen.extend(r["notebook"] for r in json.loads((out / "report.json").read_text())["notebooks"])
            raise KeyboardInterrupt
        rc = 0 if path.stem == "01_ok" else validate.TIMEOUT_EXIT
        return {"notebook": path.stem, "passed": rc == 0, "exit_code": rc, "wall_s": 8.2, "peak_gpu_mib": None,
                "figures": {}, "log": "logs/x.log"}

    monkeypatch.setattr(validate, "run_notebook", fake_run)
    with pytest.raises(KeyboardInterrupt):
        validate.main(["--runner", "ipython", "--profile", "gpu-check", "--out", str(out), "--notebooks-dir",
                       str(notebooks), "--timeout", "8"])
    assert seen == ["01_ok", "02_slow"]
    report = json.loads((out / "report.json").read_text())
    assert report["profile"] == "gpu-check" and [r["exit_code"] for r in report["notebooks"]] == [0, 124]
    markdown = (out / "report.md").read_text()
    assert "| 02_slow | TIMEOUT (after 8 s) |" in markdown and "exit 124" not in markdown
    assert validate.outcome({"passed": False, "exit_code": 1, "wall_s": 3.0}) == "FAIL (exit 1)"
