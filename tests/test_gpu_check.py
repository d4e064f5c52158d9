"""scripts/gpu_check.sh without a GPU: its plan and budgets, its summary, its wheels, and a whole dry run on the CPU in
an environment built like a bare GPU machine (torch's stack and pytest, nothing else, the network off)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_report  # noqa: E402
import gpu_check_wheels  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")
# What a bare GPU machine's Python has: torch's stack and pytest (with what they depend on), nothing of the course's.
BARE = ("torch", "transformers", "numpy", "pandas", "matplotlib", "seaborn", "pytest")
NOTEBOOK_STEPS = {"01_memory_accounting": "01_memory_accounting", "01b_reading_gpu_memory": "01b_reading_gpu_memory",
                  "04_mixed_precision": "04_mixed_precision", "06_capstone_recipe_12gib": "06_capstone_gpt2_xl",
                  "06_capstone_streamed_6gib": "06_capstone_gpt2_xl",
                  "09_weight_streaming_2gib": "09_smaller_than_the_model"}


def run(*args, out=None, python=sys.executable, timeout=60, prefix=()):
    env = dict(os.environ, PYTHON=str(python), PYTHONPATH="")
    if out is not None:
        env["GPU_CHECK_OUT"] = str(out)
    return subprocess.run([*prefix, "bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def plan_steps(text):
    return re.findall(r"^\d+\. (\S+)\s+budget\s+(\d+)s\s+(.*)$", text, flags=re.M)


# ------------------------------------------------------------------------------------------------ the plan
def test_plan_prints_each_step_with_its_budget_within_eight_minutes(tmp_path):
    proc = run("--plan", out=tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    steps = plan_steps(proc.stdout)
    names = [name for name, _, _ in steps]
    assert names == ["setup", "gpu-unit-tests", *NOTEBOOK_STEPS, "report"]
    commands = {name: cmd for name, _, cmd in steps}
    unit = commands["gpu-unit-tests"]
    assert "-m pytest" in unit and "-m gpu" in unit and "tests/test_gpu_repros.py" in unit
    assert "-o addopts= " in unit and "nbval" not in unit.replace("course_tools.nbval_plugin", "")  # no nbval needed
    for name, notebook in NOTEBOOK_STEPS.items():
        assert f"course_tools.validate --runner ipython --profile full --notebooks {notebook} " in commands[name]
    assert "COURSE_GPU_CHECK_CAP_GIB=12" in commands["01_memory_accounting"]
    assert "COURSE_GPU_CHECK_CAP_GIB=12" in commands["04_mixed_precision"]
    assert "CAPSTONE_PART=recipe" in commands["06_capstone_recipe_12gib"]
    assert "CAPSTONE_PART=streamed" in commands["06_capstone_streamed_6gib"]
    total = sum(int(budget) for _, budget, _ in steps)
    assert re.search(rf"total budget: {total}s of 480s", proc.stdout) and total <= 480
    assert not (tmp_path / "report").exists(), "a plan writes nothing"
    assert run("--bogus").returncode == 2
    assert run("--steps", "01_memory_accounting,no_such_step", out=tmp_path / "r").returncode == 2


def _seconds(estimate: str) -> int:
    number, unit = re.fullmatch(r"(\d+) (s|min)", estimate).groups()
    return int(number) * (60 if unit == "min" else 1)


def test_budgets_fit_within_the_readmes_gpu_estimates():
    """The check runs on a fast GPU, a learner's full run on any: a notebook's steps (06 has two) get at most what the
    README estimates for a whole full run of it, and the report puts the measured wall time beside that estimate."""
    estimates = gpu_check_report.readme_gpu_estimates(ROOT / "README.md")
    budgets = dict((name, int(budget)) for name, budget, _ in plan_steps(run("--plan").stdout))
    per_notebook = {}
    for step, notebook in NOTEBOOK_STEPS.items():
        per_notebook[notebook] = per_notebook.get(notebook, 0) + budgets[step]
    for notebook, budget in per_notebook.items():
        assert notebook in estimates, f"README's syllabus has no GPU estimate for {notebook}"
        assert budget <= _seconds(estimates[notebook]), (
            f"{notebook}: the check allows {budget} s, more than the README's estimate ({estimates[notebook]})")


def test_without_a_gpu_it_refuses_and_points_to_the_dry_run(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available() and shutil.which("nvidia-smi"):
        pytest.skip("a GPU is here: the check would run for real")
    proc = run(out=tmp_path / "report")
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


# ------------------------------------------------------------------------------------------------ the report
def _notebook_report(folder: Path, notebook: str, passed: bool, figures: dict, smi_mib):
    folder.mkdir(parents=True)
    units = {k: "tokens/s" if "tokens_per_s" in k else "GiB" for k in figures}
    row = {"notebook": notebook, "passed": passed, "exit_code": 0 if passed else 1, "wall_s": 1.0,
           "peak_gpu_mib": smi_mib, "figures": {k: {"value": v, "unit": units[k]} for k, v in figures.items()}}
    (folder / "report.json").write_text(json.dumps({"profile": "full", "passed": passed, "notebooks": [row]}))


def test_report_puts_each_prediction_next_to_its_measurement(tmp_path):
    out = tmp_path / "report"
    _notebook_report(out / "06_capstone_recipe_12gib", "06_capstone_gpt2_xl", True,
                     {"predicted_gpu_peak_gib": 7.5, "measured_gpu_peak_gib": 7.8, "measured_gpu_reserved_gib": 8.2,
                      "gpt2_xl_predicted_total_gib": 8.4, "tokens_per_s": 2100.5}, 9216)
    _notebook_report(out / "06_capstone_streamed_6gib", "06_capstone_gpt2_xl", True,
                     {"streamed_predicted_gpu_peak_gib": 4.0, "streamed_measured_gpu_peak_gib": 4.2,
                      "streamed_measured_gpu_reserved_gib": 4.6}, None)
    (out / "steps.tsv").write_text("setup\t15\t2\t0\t\ngpu-unit-tests\t45\t12\t0\t\n"
                                   "06_capstone_recipe_12gib\t130\t128\t0\t06_capstone_gpt2_xl\n"
                                   "06_capstone_streamed_6gib\t105\t120\t0\t06_capstone_gpt2_xl\n"
                                   "09_weight_streaming_2gib\t75\t0\tskip\t09_smaller_than_the_model\n")
    proc = run("--report-only", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] and summary["total_s"] == 262 and not summary["dry_run"]
    pairs = {(p["step"], p["figure"]): p for p in summary["predictions"]}
    recipe = pairs[("06_capstone_recipe_12gib", "gpu_peak_gib")]
    assert (recipe["predicted"], recipe["measured"], recipe["error_pct"]) == (7.5, 7.8, 4.0)
    assert pairs[("06_capstone_streamed_6gib", "streamed_gpu_peak_gib")]["error_pct"] == 5.0
    assert len(pairs) == 2  # a prediction without a measurement is not paired
    rows = {n["step"]: n for n in summary["notebooks"]}
    assert rows["06_capstone_recipe_12gib"]["nvidia_smi_gib"] == 9.0
    assert rows["06_capstone_recipe_12gib"]["tokens_per_s"] == {"tokens_per_s": 2100.5}
    assert rows["06_capstone_streamed_6gib"]["reserved_gib"] == 4.6
    steps = {s["step"]: s for s in summary["steps"]}
    readme = gpu_check_report.readme_gpu_estimates(ROOT / "README.md")
    assert steps["06_capstone_recipe_12gib"]["readme_gpu_estimate"] == readme["06_capstone_gpt2_xl"]
    assert steps["09_weight_streaming_2gib"]["result"] == "skipped" and steps["setup"]["readme_gpu_estimate"] is None
    markdown = (out / "gpu_check.md").read_text()
    assert "# GPU check: pass" in markdown and "| 7.5 | 7.8 | 4.0 % |" in markdown
    assert "| 128 s / 130 s |" in markdown and "tokens_per_s = 2100.5" in markdown


def test_report_fails_when_a_step_failed_or_timed_out(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "steps.tsv").write_text("gpu-unit-tests\t45\t46\t124\t\n01_memory_accounting\t40\t30\t1\t01_memory_accounting\n"
                                   "04_mixed_precision\t35\t0\tskip\t04_mixed_precision\n")
    proc = run("--report-only", out=out)
    assert proc.returncode == 1
    results = [s["result"] for s in json.loads((out / "gpu_check.json").read_text())["steps"]]
    assert results == ["TIMEOUT", "FAIL", "skipped"]
    assert "| FAIL (exit 1) |" in (out / "gpu_check.md").read_text()
    assert run("--report-only", out=tmp_path / "empty").returncode == 2


def test_report_lists_the_unit_tests_and_pairs_their_recorded_figures(tmp_path):
    out = tmp_path / "report"
    (out / "gpu-unit-tests").mkdir(parents=True)
    (out / "steps.tsv").write_text("gpu-unit-tests\t45\t20\t1\t\n")
    (out / "gpu-unit-tests" / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu_repros" name="test_a[cuda]"><properties>'
        '<property name="small_predicted_mib" value="10.0"/><property name="small_measured_mib" value="10.5"/>'
        '</properties></testcase><testcase classname="tests.test_gpu_repros" name="test_b[cuda]">'
        '<failure message="AssertionError: off by 30%">trace</failure></testcase>'
        '<testcase classname="" name="tests.test_capstone"><skipped message="collection skipped">(\'x.py\', 0, '
        '\'Skipped: test_capstone.py imports bitsandbytes, which is not installed here\')</skipped></testcase>'
        '<testcase classname="tests.test_memory" name="test_c"><skipped message="needs a CUDA GPU">t</skipped>'
        '</testcase></testsuite></testsuites>')
    assert run("--report-only", out=out).returncode == 1
    summary = json.loads((out / "gpu_check.json").read_text())
    tests = summary["unit_tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 2)
    outcomes = {t["test"]: (t["outcome"], t["message"]) for t in tests["tests"]}
    assert outcomes["tests.test_capstone"] == ("skipped", "test_capstone.py imports bitsandbytes, which is not installed here")
    assert outcomes["tests.test_gpu_repros.test_b[cuda]"] == ("failed", "AssertionError: off by 30%")
    assert summary["predictions"] == [{"step": "gpu-unit-tests", "figure": "small_mib", "predicted": 10.0,
                                       "measured": 10.5, "error_pct": 5.0}]
    assert "Unit tests: 1 passed, 1 failed, 2 skipped." in (out / "gpu_check.md").read_text()


def test_a_test_module_that_needs_bitsandbytes_is_skipped_with_a_line(tmp_path):
    (tmp_path / "test_needs_bnb.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'bitsandbytes'\", name='bitsandbytes')\n")
    (tmp_path / "test_broken.py").write_text("import no_such_module_anywhere\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "gpu_check_pytest_plugin",
                           "-p", "no:cacheprovider", "-rs", "test_needs_bnb.py", "test_broken.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert "test_needs_bnb.py imports bitsandbytes, which is not installed here" in proc.stdout, proc.stdout
    assert proc.returncode != 0 and "no_such_module_anywhere" in proc.stdout  # any other import error still fails


# ------------------------------------------------------------------------------------------------ the wheels
def test_install_unpacks_only_what_the_python_lacks(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    import zipfile

    with zipfile.ZipFile(wheels / "pytest-0.0.1-py3-none-any.whl", "w") as zf:   # installed here: not unpacked
        zf.writestr("pytest/__init__.py", "raise ImportError('the wheel replaced the installed pytest')\n")
    with zipfile.ZipFile(wheels / "tiny_pkg-1.0-py3-none-any.whl", "w") as zf:    # missing: unpacked
        zf.writestr("tiny_pkg-1.0.data/purelib/tiny_pkg.py", "ANSWER = 42\n")
        zf.writestr("tiny_pkg-1.0.data/scripts/tiny", "#!/bin/sh\n")
        zf.writestr("tiny_pkg-1.0.dist-info/METADATA", "Name: tiny-pkg\nVersion: 1.0\n")
    with pytest.raises(SystemExit, match="no course wheel"):
        gpu_check_wheels.install(wheels, site)
    gpu_check_wheels.build_course_wheel(wheels, offline=True)
    gpu_check_wheels.install(wheels, site)
    assert (site / "tiny_pkg.py").read_text() == "ANSWER = 42\n" and not list(site.glob("*.data"))
    assert not (site / "pytest").exists() and (site / "course_utils" / "__init__.py").is_file()
    assert gpu_check_wheels.course_files_differing(site) == []   # built from this checkout just now
    assert any(p.name.startswith("course_utils-") for p in site.glob("*.dist-info"))


# ------------------------------------------------------------------------------------------------ a whole dry run
def _closure(names) -> list[metadata.Distribution]:
    """The installed distributions ``names`` need, their dependencies included (no extras)."""
    from packaging.requirements import Requirement

    seen, todo = {}, list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = seen[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this environment does not have
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(seen.values())


BLOCK_NETWORK = """import socket
def _refuse(self, address, *args, **kwargs):
    if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
        raise OSError("the network is off in this test")
    return _connect(self, address, *args, **kwargs)
_connect, socket.socket.connect = socket.socket.connect, _refuse
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A fresh venv (no pip) whose only packages are BARE and their dependencies: symlinks into this environment's
    site-packages, on the venv's path through a .pth file. Sockets to other hosts are refused."""
    base = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=""))
    packages = base / "packages"
    packages.mkdir()
    for dist in _closure(BARE):
        location = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (location / top).exists() and not (packages / top).exists():
                (packages / top).symlink_to(location / top)
    (site,) = (base / "venv" / "lib").glob("python3*/site-packages")
    (site / "bare_machine.pth").write_text(f"{packages}\n")
    (site / "sitecustomize.py").write_text(BLOCK_NETWORK)
    python = base / "venv" / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print([u.find_spec(n) is not None for n in "
                            "('torch', 'seaborn', 'pytest', 'IPython', 'psutil', 'nbval', 'course_utils')])"],
                           capture_output=True, text=True, timeout=120, cwd=base, env=dict(os.environ, PYTHONPATH=""))
    assert probe.stdout.strip() == "[True, True, True, False, False, False, False]", probe.stdout + probe.stderr
    return python


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """The wheel folder --fetch-wheels makes, built offline from this environment's installs and the checkout."""
    folder = tmp_path_factory.mktemp("wheels")
    gpu_check_wheels.pack(folder)
    return folder


def _network_off() -> tuple[str, ...]:
    """`unshare -rn` (a new network namespace with no interface but loopback) where allowed, else nothing (the bare
    venv's sitecustomize refuses sockets anyway)."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        return ("unshare", "-rn")
    return ()


def test_without_wheels_a_bare_python_is_told_to_bring_them(tmp_path, bare_python):
    proc = run("--dry-run", out=tmp_path / "report", python=bare_python)
    assert proc.returncode == 2 and "lacks IPython psutil." in proc.stderr and "--wheels" in proc.stderr


@pytest.mark.slow
def test_dry_run_on_a_bare_machine_passes_end_to_end(tmp_path, bare_python, wheels):
    """The whole script on the CPU: wheels unpacked, the GPU unit tests collected without nbval (those needing CUDA
    skipped with their reason), notebook 01b run by the in-process runner in profile smoke with its figures recorded,
    the report written. The other notebooks are left out here for time (the report lists them as skipped); each
    runs under nbval in the test suite."""
    out = tmp_path / "report"
    env_prefix = _network_off()
    proc = run("--dry-run", "--wheels", str(wheels), "--steps", "gpu-unit-tests,01b_reading_gpu_memory", out=out,
               python=bare_python, timeout=400, prefix=env_prefix)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[wheels] ipython: unpacked" in proc.stdout and "[wheels] pytest" not in proc.stdout
    assert "bitsandbytes is not installed: the parts that need it are skipped" in proc.stdout
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] and summary["dry_run"]
    results = {s["step"]: s["result"] for s in summary["steps"]}
    assert results == {"setup": "pass", "gpu-unit-tests": "pass", "01_memory_accounting": "skipped",
                       "01b_reading_gpu_memory": "pass", "04_mixed_precision": "skipped",
                       "06_capstone_recipe_12gib": "skipped", "06_capstone_streamed_6gib": "skipped",
                       "09_weight_streaming_2gib": "skipped"}
    tests = summary["unit_tests"]
    assert tests["failed"] == 0 and tests["skipped"] > 0
    assert all(t["outcome"] == "skipped" and t["message"] for t in tests["tests"])  # each says why
    assert any(t["test"].startswith("tests.test_gpu_repros") and t["message"] == "needs a CUDA GPU"
               for t in tests["tests"])
    (notebook,) = summary["notebooks"]
    assert notebook["notebook"] == "01b_reading_gpu_memory" and notebook["passed"]
    figures = json.loads((out / "01b_reading_gpu_memory" / "report.json").read_text())["notebooks"][0]["figures"]
    assert figures["timeline_peak_equals_measured"]["value"] is True and figures["prediction_cells"]["value"] >= 1
    assert all(f["profile"] == "smoke" for f in figures.values())
    log = (out / "01b_reading_gpu_memory" / "logs" / "01b_reading_gpu_memory.log").read_text()
    assert re.search(r"01b_reading_gpu_memory.ipynb: all \d+ code cells ran", log)
    assert "dry run on the CPU" in (out / "gpu_check.md").read_text()
