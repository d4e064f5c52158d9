"""course_tools.notebook_runs and the nbval plugin's side of it: how notebooks run in a test run, their cells'
outcomes reported from the installed run, the time budgets, and bad settings refused with a message."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from course_tools import installed, nbval_plugin, notebook_runs
from stand_ins import SHARED, stand_in


def test_notebooks_run_as_installed_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("COURSE_INSTALLED_RUN", raising=False)
    monkeypatch.delenv("COURSE_NOTEBOOKS", raising=False)
    assert notebook_runs.mode() == "installed"
    monkeypatch.setenv("COURSE_NOTEBOOKS", "here")
    assert notebook_runs.mode() == "here"
    monkeypatch.setenv("COURSE_NOTEBOOKS", "colab")
    with pytest.raises(ValueError, match="COURSE_NOTEBOOKS='colab': use 'installed'"):
        notebook_runs.mode()
    monkeypatch.setenv("COURSE_INSTALLED_RUN", "1")  # inside an installed run, its own nbval runs the kernel
    assert notebook_runs.mode() == "here"


@pytest.mark.parametrize("value, expected", [("1", 1), ("3", 3), ("", None)])
def test_workers(monkeypatch, value, expected):
    monkeypatch.setenv("COURSE_NOTEBOOK_WORKERS", value)
    assert notebook_runs.workers() == (expected or max(1, min(2, __import__("os").cpu_count() or 1)))


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_worker_count_says_what_to_give(monkeypatch, value):
    monkeypatch.setenv("COURSE_NOTEBOOK_WORKERS", value)
    with pytest.raises(ValueError, match="whole number of notebooks to run at a time"):
        notebook_runs.workers()


def test_the_budget_check_names_an_overrun_and_its_slowest_cells():
    stem = next(iter(notebook_runs.BUDGETS))
    cells = {"Cell 3": {"seconds": 40.0}, "Cell 7": {"seconds": 2.0}}
    allowed = notebook_runs.BUDGETS[stem] * 2.0
    assert notebook_runs.budget_message(stem, {"seconds": allowed - 1, "reference_s": 2.0, "cells": cells}) is None
    message = notebook_runs.budget_message(stem, {"seconds": allowed + 1, "reference_s": 2.0, "cells": cells})
    assert message and "over its budget" in message and message.index("Cell 3") < message.index("Cell 7"), message
    assert "no time budget" in notebook_runs.budget_message("99_unknown", {"seconds": 1, "reference_s": 1})
    assert "reported no time" in notebook_runs.budget_message(stem, {"error": "the kernel died"})


def test_the_reference_workload_takes_a_measurable_time():
    seconds = installed.reference_seconds()
    assert 0.2 < seconds < 120, f"the reference workload took {seconds:.2f} s: a budget in its units means nothing"


class FakeRuns:
    def __init__(self, result):
        self.seen, self._result = [], result

    def result(self, path):
        self.seen.append(Path(path))
        return self._result


def _item(tmp_path):
    return SimpleNamespace(parent=SimpleNamespace(path=tmp_path / "03_x.ipynb"), user_properties=[])


RUN = {"isolation": "unshare", "error": "Cell 1 failed", "runner_log": "log",
       "cells": {"Cell 0": {"outcome": "passed", "text": "", "seconds": 1.0, "properties": [["k", 1]]},
                 "Cell 1": {"outcome": "failed", "text": "AssertionError: the claim", "seconds": 1.0, "properties": []},
                 "Cell 2": {"outcome": "skipped", "text": "no GPU", "seconds": 0.0, "properties": []}}}


def test_a_cell_reports_its_outcome_in_the_installed_run(monkeypatch, tmp_path):
    fake = FakeRuns(RUN)
    monkeypatch.setattr(notebook_runs, "runs", lambda *a, **k: fake)
    item = _item(tmp_path)
    nbval_plugin._report_installed_outcome(item, "Cell 0")  # passes, with the run's properties
    assert item.user_properties == [("k", 1)] and fake.seen == [tmp_path / "03_x.ipynb"]
    with pytest.raises(nbval_plugin.InstalledRunFailure, match="AssertionError: the claim"):
        nbval_plugin._report_installed_outcome(item, "Cell 1")
    with pytest.raises(pytest.skip.Exception, match="no GPU"):
        nbval_plugin._report_installed_outcome(item, "Cell 2")
    with pytest.raises(nbval_plugin.InstalledRunFailure, match="did not reach Cell 9"):
        nbval_plugin._report_installed_outcome(item, "Cell 9")


def test_a_bad_notebook_mode_stops_pytest_with_the_message(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    env = dict(os.environ, COURSE_NOTEBOOKS="sometimes")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "course_tools.nbval_plugin", "-c", "/dev/null",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "COURSE_NOTEBOOKS='sometimes': use 'installed'" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_shared_caches_are_outside_the_repository():
    """An installed run mounts the repository read-only, and torch.compile takes a lock file in its cache: a cache
    inside the repository (say in .venv) fails 06's and 08's compiled optimizers there."""
    for name, folder in installed.warm_caches().items():
        assert not Path(folder).resolve().is_relative_to(installed.ROOT), f"{name}={folder} is inside the repository"
        assert Path(folder).is_dir()


def test_the_unit_tests_take_back_the_cores_as_the_kernels_finish(tmp_path, monkeypatch):
    import concurrent.futures

    monkeypatch.setattr(notebook_runs, "os", stand_in(os, cpu_count=lambda: 4))
    runs = notebook_runs.NotebookRuns.__new__(notebook_runs.NotebookRuns)
    runs.workers, runs.threads = 2, 1
    pending = [concurrent.futures.Future() for _ in range(3)]
    runs._futures = {Path(f"{i}.ipynb"): f for i, f in enumerate(pending)}
    group = concurrent.futures.Future()   # a group of unit tests in a process of its own, behind the notebooks
    runs._test_jobs = {"tests/test_a.py::test_one": group, "tests/test_a.py::test_two": group}
    assert runs.running() == 2 and runs.unit_test_threads() == 2      # three queued, two at a time
    pending[0].set_result({})
    pending[1].set_result({})
    assert runs.running() == 2 and runs.unit_test_threads() == 2      # a notebook and the group
    pending[2].set_result({})
    assert runs.running() == 1 and runs.unit_test_threads() == 3
    group.set_result({})
    assert runs.running() == 0 and runs.unit_test_threads() == 4      # every core once the others are done


# ---------------------------------------------------------------- unit tests beside the background runs
def patches_of_shared_modules(source: str) -> list[str]:
    """``monkeypatch.setattr`` calls in ``source`` that change a module the background notebook runs share."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                and node.args):
            continue
        target = node.args[0]
        name = (target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute)
                else target.value.split(".")[0] if isinstance(target, ast.Constant) and isinstance(target.value, str)
                else None)
        if name in SHARED:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_unit_test_patches_a_module_the_background_runs_share():
    offenders = {path.name: found for path in sorted(Path(__file__).parent.glob("*.py"))
                 if (found := patches_of_shared_modules(path.read_text()))}
    assert not offenders, ("These tests patch a module for the whole process, the notebooks' background runs "
                           "included; give the module under test a stand-in (tests/stand_ins.py) instead: "
                           f"{offenders}")


def test_the_check_finds_such_a_patch_and_a_stand_in_changes_one_module():
    import subprocess

    bad = ('monkeypatch.setattr(A.subprocess, "run", fake)\nmonkeypatch.setattr(os, "cpu_count", lambda: 4)\n'
           'monkeypatch.setattr("shutil.which", None)\nmonkeypatch.setattr(A, "subprocess", stand_in(subprocess))\n')
    assert [line.split(":")[0] for line in patches_of_shared_modules(bad)] == ["line 1", "line 2", "line 3"]
    fake = stand_in(subprocess, run=lambda *a, **k: "fake")
    assert fake.run() == "fake" and fake.PIPE is subprocess.PIPE and subprocess.run is not fake.run
    with pytest.raises(AttributeError, match="has no runn"):
        stand_in(subprocess, runn=None)


def test_a_group_of_unit_tests_runs_in_its_own_process_and_reports_each_outcome(tmp_path, monkeypatch):
    # make test runs some unit-test files in pytest processes of their own, behind the notebooks
    # (nbval_plugin.BESIDE_TEST_FILES): each test's outcome and its text must come back, a failure's included
    monkeypatch.setattr(notebook_runs.NotebookRuns, "_prepare", lambda self: None)   # no wheel: no notebook runs
    tests = tmp_path / "test_group.py"
    tests.write_text("import pytest\n"
                     "def test_passes():\n    assert 1 + 1 == 2\n"
                     "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic broke'\n"
                     "def test_skips():\n    pytest.skip('nothing to do here')\n")
    runs = notebook_runs.NotebookRuns(tmp_path / "runs", workers=1)
    try:
        nodeids = [f"{tests}::test_{name}" for name in ("passes", "fails", "skips")]
        runs.start([], [nodeids])
        [result] = [runs._test_jobs[nodeids[0]].result()]
        assert result["outcomes"], result["log"]
        by_name = {nodeid.split("::")[-1]: found for nodeid, found in result["outcomes"].items()}
        assert by_name["test_passes"]["outcome"] == "passed"
        assert by_name["test_fails"]["outcome"] == "failed" and "arithmetic broke" in by_name["test_fails"]["text"]
        assert by_name["test_skips"]["outcome"] == "skipped" and "nothing to do here" in by_name["test_skips"]["text"]
        assert runs.test_result("tests/test_nowhere.py::test_missing")["outcome"] == "failed"
    finally:   # not runs.stop(): it ends every notebook run of this process, the test run's own included
        runs._pool.shutdown(wait=True)
        runs._setup_pool.shutdown(wait=True)
    assert runs.test_groups_done()[0]["wall_s"] > 0


def test_notebooks_and_test_groups_are_queued_longest_first(monkeypatch):
    order = []
    runs = notebook_runs.NotebookRuns.__new__(notebook_runs.NotebookRuns)
    runs._futures, runs._test_jobs = {}, {}
    runs._lock = __import__("threading").Lock()
    runs._pool = SimpleNamespace(submit=lambda fn, job: order.append(job) or __import__("concurrent.futures").futures.Future())
    runs.start([Path("00_start_here.ipynb"), Path("06_capstone_gpt2_xl.ipynb"), Path("09_smaller_than_the_model.ipynb")],
               [["tests/test_a.py::test_one"]])
    assert order == [Path("06_capstone_gpt2_xl.ipynb"), ["tests/test_a.py::test_one"],
                     Path("09_smaller_than_the_model.ipynb"), Path("00_start_here.ipynb")]
