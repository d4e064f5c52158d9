"""The course as Colab installs it, proven on a CPU without the network.

Each notebook runs once per test run, as a learner installs it (``course_tools.installed`` says how: the wheel
built offline, an empty folder, a fresh HOME, a fresh environment where ``course_utils`` is not importable until
the notebook's first cell installs the wheel, the network off and the repository read-only). That one run is also
the notebook's nbval run: the README's test command reports it cell by cell (``course_tools.notebook_runs``). Here:
that the harness can fail, that the wheel ships what notebooks read, what each notebook's kernel imported and wrote,
and each notebook's time budget.

Also here: the planner widget with Colab's ipywidgets 7.7.1 (installed from PyPI into a cached ``--target`` folder;
skipped with the reason when PyPI cannot be reached).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from course_tools import installed, notebook_runs
from course_utils import paths

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))  # 01b_... too
PACKAGES = installed.PACKAGES


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(wheel, dependency folder, isolation) of this test run's notebook runs, built once."""
    return notebook_runs.runs(paths.results_dir(), tmp_path_factory.mktemp("notebook-runs")).setup()


@pytest.fixture(scope="module")
def wheel(prepared) -> Path:
    return prepared[0]


def test_hidden_dependency_folder_keeps_the_course_out(prepared, tmp_path):
    """The trick the notebook runs rely on: with the .pth line, the dependencies import and the course does not."""
    dependencies = prepared[1]
    python, _ = installed.fresh_environment(tmp_path, dependencies, "none")
    proc = subprocess.run([str(python), "-c", "import importlib.util as u; "
                           "print(*(u.find_spec(n) is not None for n in ('course_utils', 'course_tools', 'numpy')))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.stdout.split() == ["False", "False", "True"], proc.stderr
    assert not any(installed.is_course_entry(p.name) for p in dependencies.iterdir())


def test_a_dependency_folder_can_leave_packages_out(tmp_path):
    """tests/test_without_optional.py's environments: as if pip had never installed these (files and metadata)."""
    (tmp_path / "deps").mkdir()
    folder = installed.dependency_folder(tmp_path / "deps", without=["bitsandbytes", "lion_pytorch"])
    names = {p.name for p in folder.iterdir()}
    assert "bitsandbytes" not in names and "lion_pytorch" not in names, "their packages"
    assert not any(n.startswith(("bitsandbytes-", "lion_pytorch-")) for n in names), "their metadata"
    assert "torch" in names and "transformers" in names
    assert folder.name == "site-packages", "a library judging 'installed' by the path (dill) must see an install"


@pytest.mark.slow  # processes of their own (tens of seconds): make test runs it, make test-fast does not
def test_the_harness_fails_a_failing_cell_and_catches_a_write_into_the_repository(tmp_path, prepared):
    """The checks below can fail: a cell that raises fails the run, a checked output that differs fails its cell,
    the network is off inside it, a write into the repository is refused (namespace) or found (fallback), and
    each cell's outcome comes back by name."""
    import nbformat

    wheel, dependencies, isolation = prepared
    probe = ROOT / ".installed-write-probe"
    nb = nbformat.v4.new_notebook()
    checked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(2)")
    checked.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nb.cells = [nbformat.v4.new_code_cell(f"from pathlib import Path\nPath({str(probe)!r}).write_text('x')"),
                nbformat.v4.new_code_cell("assert 1 == 2, 'a claim that fails'"),
                nbformat.v4.new_code_cell("print('this cell passes')"), checked]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    source = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, source)
    before = installed.repo_snapshot()
    try:
        r = installed.run_one(source, tmp_path / "runs", wheel, dependencies, isolation)
        assert not r["passed"] and r["report"] is not None and r["report"]["network"] is False, r
        outcomes = {name: cell["outcome"] for name, cell in r["cells"].items()}
        assert outcomes == {"Cell 0": "failed", "Cell 1": "failed", "Cell 2": "passed", "Cell 3": "failed",
                            "peak_rss": "passed"}, outcomes
        assert "a claim that fails" in r["cells"]["Cell 1"]["text"]
        if isolation == "unshare":
            assert r["repo_read_only"] and "Read-only file system" in r["error"] and not probe.exists(), r["error"]
        else:
            assert ".installed-write-probe" in set(installed.repo_snapshot()) - set(before)
    finally:
        probe.unlink(missing_ok=True)


def test_wheel_ships_everything_a_notebook_reads(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        corpus = zf.read("course_utils/data_files/course_corpus.txt").decode("utf-8")
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            rel = path.relative_to(ROOT)
            if path.is_file() and "__pycache__" not in rel.parts and not any(p.startswith(".") for p in rel.parts):
                assert rel.as_posix() in names, f"{rel} is not in the wheel: add it to pyproject's package-data"
    assert len(corpus) > 50_000 and "MIT license" in corpus.splitlines()[0]
    assert not any(n.startswith(("notebooks/", "tests/", "scripts/")) for n in names)


def _installed_run(notebook: str) -> dict:
    if notebook_runs.mode() != "installed":
        pytest.skip("COURSE_NOTEBOOKS=here: the notebooks ran in this environment, not as installed")
    return notebook_runs.runs(results_dir=paths.results_dir()).result(ROOT / "notebooks" / notebook)


@pytest.mark.slow
@pytest.mark.after_notebooks
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_as_installed(notebook):
    r = _installed_run(notebook)
    stem = Path(notebook).stem
    assert r.get("visible_before_install", {}).get("course_utils") is False, r.get("visible_before_install")
    assert r["visible_before_install"]["torch"] and r["visible_before_install"]["ipykernel"]
    assert r["passed"], f"{notebook} failed as installed:\n{r['error']}\n--- runner ---\n{r.get('runner_log', '')}"
    report = r["report"]
    assert report is not None, "the kernel wrote no report (its IPython startup file did not run?)"
    site = Path(r["site"])
    assert Path(report["course_utils_file"]).parent == site / "course_utils", report["course_utils_file"]
    assert report["modules_from_repo"] == [], f"imported from the repository: {report['modules_from_repo']}"
    assert report["direct_url"] and report["direct_url"]["url"].endswith(".whl"), report["direct_url"]
    assert not report["direct_url"].get("dir_info", {}).get("editable"), "installed editable"
    assert report["network"] is False, "the network was reachable"
    assert report["course_tools_imported"] is False, "a notebook imported course_tools"
    results = Path(r["home"]) / "when-the-model-does-not-fit" / "results" / f"{stem}.json"
    assert results.is_file(), f"no results under the fresh HOME ({results})"
    # nothing written inside the installed package: every file there is one the wheel installed
    (record,) = site.glob("course_utils-*.dist-info/RECORD")
    installed_files = {line.split(",")[0] for line in record.read_text().splitlines() if line}
    extra = sorted(p.relative_to(site).as_posix() for package in PACKAGES for p in (site / package).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts
                   and p.relative_to(site).as_posix() not in installed_files)
    assert extra == [], f"written inside the installed package: {extra}"
    # nothing written inside the repository: read-only there when the namespace allowed it, else compared
    if not r["repo_read_only"]:
        changed = notebook_runs.runs().repo_files_changed()
        assert changed == [], f"written inside the repository: {changed}"


@pytest.mark.after_notebooks
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_keeps_to_its_time_budget(notebook):
    """A notebook's smoke run stays within its stated budget, in reference workloads timed just before it (so a
    slow or busy machine does not fail it; a notebook that grew does)."""
    message = notebook_runs.budget_message(Path(notebook).stem, _installed_run(notebook))
    assert message is None, message


def test_every_notebook_has_a_time_budget_and_every_budget_a_notebook():
    stems = {Path(n).stem for n in NOTEBOOKS}
    assert stems - set(notebook_runs.BUDGETS) == set(), "add these notebooks' budgets to course_tools/notebook_runs.py"
    assert set(notebook_runs.BUDGETS) - stems == set(), "budgets for notebooks that do not exist"


COLAB_WIDGETS = ("ipywidgets==7.7.1", "widgetsnbextension~=3.6.0", "jupyterlab-widgets>=1.0,<2",
                 "ipython-genutils~=0.2.0")

WIDGET_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import matplotlib
matplotlib.use("Agg")
import ipywidgets
assert ipywidgets.__version__ == "7.7.1", (ipywidgets.__version__, ipywidgets.__file__)
try:
    from course_utils.planner import widget as pw
except ImportError:
    from course_utils import planner_widget as pw
box = pw.planner_widget()
before = box.last_result
box.controls["model"].value = pw.MODEL_LABELS["efficientnet_b0"]
after = box.last_result
print(json.dumps({"file": ipywidgets.__file__, "before": [before.ok, before.message.splitlines()[0]],
                  "after": [after.ok, after.message.splitlines()[0]]}))
"""


@pytest.fixture(scope="module")
def colab_ipywidgets(tmp_path_factory) -> Path:
    """ipywidgets 7.7.1 (what Colab ships) in a --target folder cached in this environment."""
    cache = Path(sys.prefix) / "colab-ipywidgets-7.7.1"
    if not os.access(sys.prefix, os.W_OK):
        cache = tmp_path_factory.mktemp("colab") / "colab-ipywidgets-7.7.1"
    if (cache / "ipywidgets" / "__init__.py").is_file():
        return cache
    partial = cache.with_name(cache.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--timeout", "20",
                               "--disable-pip-version-check", "--target", str(partial), *COLAB_WIDGETS],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("PyPI did not answer within 300 s: cannot install Colab's ipywidgets 7.7.1")
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.skip(f"cannot install Colab's ipywidgets 7.7.1 from PyPI (offline?): {proc.stderr.strip()[-300:]}")
    if cache.exists():  # another run finished first
        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.rename(cache)
    return cache


def test_planner_widget_works_with_colab_ipywidgets(colab_ipywidgets, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", WIDGET_SCRIPT, str(colab_ipywidgets)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["file"].startswith(str(colab_ipywidgets))
    (ok_before, verdict_before), (ok_after, verdict_after) = data["before"], data["after"]
    assert ok_before and ok_after
    assert "does NOT fit" in verdict_before and "-> fits" in verdict_after, (verdict_before, verdict_after)


def test_a_wheel_build_that_leaves_no_wheel_says_so(tmp_path):
    """pip answering 0 without a wheel (it once did, under a test's fake subprocess.run) is an error that says what
    the folder holds, not an unpacking error."""
    done = subprocess.CompletedProcess(["pip", "wheel"], 0, "pip's output", "")
    with pytest.raises(RuntimeError, match=r"exit code 0; .*dist holds nothing: it is gone\):\npip's output"):
        installed.the_wheel(tmp_path / "dist", done)
    (tmp_path / "dist").mkdir()
    with pytest.raises(RuntimeError, match=r"dist holds \[\]"):
        installed.the_wheel(tmp_path / "dist", done)
    (tmp_path / "dist" / "course_utils-0.1.0-py3-none-any.whl").write_bytes(b"")
    assert installed.the_wheel(tmp_path / "dist", done).name == "course_utils-0.1.0-py3-none-any.whl"
    with pytest.raises(RuntimeError, match="exit code 1"):
        installed.the_wheel(tmp_path / "dist", subprocess.CompletedProcess(["pip"], 1, "", "error"))


def test_a_kernel_runs_in_the_profile_read_when_the_runs_started(tmp_path, monkeypatch):
    """The background runs pass the profile they read at their start: a unit test that sets COURSE_PROFILE for a
    moment beside them (as this one does) must not turn a notebook's smoke run into a full one."""
    monkeypatch.setenv("COURSE_PROFILE", "full")
    env = installed.kernel_env(tmp_path / "a", Path(sys.executable), tmp_path / "course.whl", profile="smoke")
    assert env["COURSE_PROFILE"] == "smoke"
    assert installed.kernel_env(tmp_path / "b", Path(sys.executable), tmp_path / "course.whl")["COURSE_PROFILE"] == "full"


def test_the_test_runs_count_storages_as_cuda_does(tmp_path):
    """The notebooks' exact-byte claims run under CUDA's 512-byte counting in the test runs, not in a learner's."""
    rounded = installed.kernel_env(tmp_path / "a", Path(sys.executable), tmp_path / "course.whl", cuda_rounding=True)
    assert rounded["COURSE_CUDA_ROUNDING"] == "1" and notebook_runs.CUDA_ROUNDING
    assert "COURSE_CUDA_ROUNDING" not in installed.kernel_env(tmp_path / "b", Path(sys.executable),
                                                              tmp_path / "course.whl")
