"""Each notebook runs once per test run, as installed, in the background while the unit tests run.

The README's test command used to run every notebook twice: under nbval with the repository's editable install, then
again as a learner installs it (``course_tools.installed``). One run now does both: the installed run is an nbval
run with the course's plugin and options, and it reports every cell, so the test items stay one per cell
(``course_tools.nbval_plugin`` turns each cell's item into a lookup of its outcome here). The runs start as soon as
pytest has collected, ``WORKERS`` at a time, longest first, and the main process runs the unit tests meanwhile:
the notebooks' cells are collected last, so by the time pytest reaches them most have finished. Why not
pytest-xdist (``make test-fast`` uses it): its workers are started once, alike, in this environment, and take test
items in its own order; each notebook needs a fresh environment, HOME and network namespace of its own, the longest
first, while the main process runs the unit tests and takes the cores back as kernels finish.

``COURSE_NOTEBOOKS=here`` runs notebooks the old way instead: nbval in this process's environment, with the
repository's editable install (quicker to start while editing a notebook; the installed checks are then skipped).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import installed

# Each notebook's smoke run may take at most this many reference workloads (installed.REFERENCE_WORKLOAD, timed just
# before the notebook in the same conditions): about twice what it took in `make test` on a fresh 2-core machine,
# two notebooks at a time beside the unit tests (2026-12-01: 08 44 references with a cold compile cache, 06 32, 09 15,
# the others 6-22). A notebook over its budget fails tests/test_installed.py, which names its slowest cells.
BUDGETS = {
    "00_start_here": 25, "01_memory_accounting": 45, "01b_reading_gpu_memory": 25, "01c_memory_doctor": 25,
    "02_gradient_accumulation": 45, "03_gradient_checkpointing": 35, "04_mixed_precision": 30, "05_8bit_adam": 30,
    "06_capstone_gpt2_xl": 90, "07_beyond_one_gpu": 30, "08_current_toolbox": 110, "09_smaller_than_the_model": 60,
    "10_beyond_adam": 35, "11_a_whole_run": 45, "12_rl_fine_tuning": 45,   # 11, 12: about twice their runs alone
}
# A group of unit-test files run in a pytest process of its own (nbval_plugin.BESIDE_TEST_FILES), in the same units:
# each took 2-2.5 minutes beside the notebooks on a fresh 2-core machine, between 09 and 06.
TEST_GROUP_BUDGET = 75
MODES = ("installed", "here")
# The test runs count as a GPU does: every storage in CUDA's 512-byte blocks (course_utils.memory.cuda_rounding), so
# an exact-byte claim that holds here holds on a GPU too; `make outputs` and a learner's run count exact bytes.
CUDA_ROUNDING = True


def mode() -> str:
    """How this test run executes notebooks: 'installed' (the default) or 'here' (``COURSE_NOTEBOOKS=here``)."""
    if os.environ.get("COURSE_INSTALLED_RUN"):
        return "here"  # inside an installed run: its own nbval runs the kernel
    chosen = os.environ.get("COURSE_NOTEBOOKS", "installed").strip() or "installed"
    if chosen not in MODES:
        raise ValueError(f"COURSE_NOTEBOOKS={chosen!r}: use 'installed' (each notebook as a learner installs the "
                         "course, network off; the default) or 'here' (this environment's editable install)")
    return chosen


def workers() -> int:
    """Notebooks run at a time: ``COURSE_NOTEBOOK_WORKERS``, else one per core up to two (the unit tests share)."""
    text = os.environ.get("COURSE_NOTEBOOK_WORKERS", "").strip()
    if not text:
        return max(1, min(2, os.cpu_count() or 1))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"COURSE_NOTEBOOK_WORKERS={text!r}: give a whole number of notebooks to run at a time, "
                         "at least 1")
    return int(text)


def budget_message(stem: str, result: dict) -> str | None:
    """None when the notebook's smoke run kept to its budget, else what went over and where the time went."""
    if stem not in BUDGETS:
        return f"{stem} has no time budget: add it to BUDGETS in course_tools/notebook_runs.py"
    seconds, reference = result.get("seconds"), result.get("reference_s")
    if seconds is None or not reference:
        return f"{stem}: the installed run reported no time ({result.get('error') or 'no result'})"
    allowed = BUDGETS[stem] * reference
    if seconds <= allowed:
        return None
    cells = sorted((result.get("cells") or {}).items(), key=lambda kv: -kv[1]["seconds"])[:5]
    slowest = ", ".join(f"{name} {cell['seconds']:.1f} s" for name, cell in cells)
    return (f"{stem} took {seconds:.0f} s in profile smoke: {seconds / reference:.0f} reference workloads of "
            f"{reference:.2f} s, over its budget of {BUDGETS[stem]} ({allowed:.0f} s here). Slowest: {slowest}. "
            "Shrink its smoke sizes, or raise its budget in course_tools/notebook_runs.py with the reason.")


class NotebookRuns:
    """The test run's installed notebook runs: started in the background, looked up (waiting) by path."""

    def __init__(self, base: Path, workers: int, results_dir: Path | None = None):
        self.base, self.workers, self.results_dir = Path(base), workers, results_dir
        self.threads = max(1, (os.cpu_count() or 1) // workers)  # each kernel's share of the cores
        # read once, here: the runs start in background threads while unit tests may set COURSE_PROFILE for a moment
        self.profile = os.environ.get("COURSE_PROFILE", "smoke")
        self._setup_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="notebook-setup")
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="notebook")
        self._setup = self._setup_pool.submit(self._prepare)
        self._futures: dict[Path, concurrent.futures.Future] = {}
        self._test_jobs: dict[str, concurrent.futures.Future] = {}   # nodeid -> its group's pytest process
        self._lock = threading.Lock()
        self.snapshot = installed.repo_snapshot()
        self.started = time.perf_counter()
        self.finished: float | None = None

    def _prepare(self):
        for name in ("dist", "src", "deps", "runs"):
            (self.base / name).mkdir(parents=True, exist_ok=True)
        wheel = installed.build_wheel(self.base / "dist", self.base / "src")
        return wheel, installed.dependency_folder(self.base / "deps"), installed.choose_isolation()

    def setup(self):
        """(wheel, dependency folder, isolation), waiting for them."""
        return self._setup.result()

    def start(self, notebooks, test_groups=()) -> None:
        """Queue the notebooks not queued yet, and each group of unit tests (node ids) as a pytest process of its
        own: longest budget first, so that the last to finish is a short notebook while this process runs the other
        unit tests (a group weighs ``TEST_GROUP_BUDGET``)."""
        jobs = [(BUDGETS.get(Path(p).stem, 0), "notebook", Path(p)) for p in notebooks]
        jobs += [(TEST_GROUP_BUDGET, "tests", list(nodeids)) for nodeids in test_groups]
        with self._lock:
            for _, kind, job in sorted(jobs, key=lambda j: -j[0]):
                if kind == "notebook" and job not in self._futures:
                    self._futures[job] = self._pool.submit(self._run, job)
                elif kind == "tests":
                    nodeids = [n for n in job if n not in self._test_jobs]
                    if nodeids:
                        future = self._pool.submit(self._run_tests, nodeids)
                        self._test_jobs.update(dict.fromkeys(nodeids, future))

    def _run(self, path: Path) -> dict:
        try:
            wheel, dependencies, isolation = self.setup()
        except Exception as err:  # noqa: BLE001 - every notebook then reports why
            return {"notebook": path.name, "passed": False, "cells": {}, "report": None, "runner_log": "",
                    "error": f"could not prepare the installed runs: {err}"}
        result = installed.run_one(path, self.base / "runs", wheel, dependencies, isolation, self.threads,
                                    self.profile, cuda_rounding=CUDA_ROUNDING)
        # What the notebook recorded under its fresh HOME, where this test run keeps results (tests that compare
        # notebooks read it there, as after a run in this environment).
        folder = Path(result["home"]) / "when-the-model-does-not-fit" / "results"
        for recorded, kept in ((folder / f"{path.stem}.json", f"{path.stem}.json"),  # its figures, its answers revealed
                               (folder / "reveals" / f"{path.stem}.json", f"reveals/{path.stem}.json")):
            if self.results_dir is not None and recorded.is_file():
                (self.results_dir / kept).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(recorded, self.results_dir / kept)
        with self._lock:
            if all(f.done() for p, f in self._futures.items() if p != path):
                self.finished = time.perf_counter()
        return result

    def _run_tests(self, nodeids: list[str]) -> dict:
        self.base.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="beside-", dir=self.base))
        report = folder / "report.jsonl"
        # its own course folder and pytest folder: nothing it writes meets what this process's tests write
        (folder / "home").mkdir()
        env = dict(os.environ, COURSE_BESIDE_REPORT=str(report), OMP_NUM_THREADS=str(self.threads),
                   COURSE_HOME=str(folder / "home"))
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(installed.ROOT / "pyproject.toml"),
                                   f"--basetemp={folder / 'tmp'}", *nodeids],
                                  env=env,
                                  cwd=installed.ROOT, capture_output=True, text=True, timeout=1800)
            log = (done.stdout[-12000:] + done.stderr[-4000:])
        except subprocess.TimeoutExpired as err:
            log = f"TIMEOUT after {err.timeout:.0f} s"
        outcomes: dict[str, dict] = {}
        if report.is_file():
            for line in report.read_text().splitlines():
                entry = json.loads(line)
                seen = outcomes.setdefault(entry["nodeid"], {"outcome": "passed", "text": ""})
                if entry["outcome"] == "failed" or (entry["outcome"] == "skipped" and seen["outcome"] == "passed"):
                    seen.update(outcome=entry["outcome"], text=entry["text"])
        return {"outcomes": outcomes, "log": log, "wall_s": time.perf_counter() - start, "nodeids": nodeids}

    def test_result(self, nodeid: str) -> dict:
        """``{"outcome", "text"}`` of a unit test run in its group's own process (waiting for it)."""
        if nodeid not in self._test_jobs:
            return {"outcome": "failed", "text": f"{nodeid} was not queued to run in a process of its own"}
        result = self._test_jobs[nodeid].result()
        found = result["outcomes"].get(nodeid)
        if found is None:
            return {"outcome": "failed", "text": f"{nodeid} did not report in its pytest process; its output:\n"
                                                 + result["log"]}
        return found

    def test_groups_done(self) -> list[dict]:
        """The unit-test processes that finished."""
        seen, out = set(), []
        for future in self._test_jobs.values():
            if id(future) not in seen and future.done() and not future.cancelled():
                seen.add(id(future))
                out.append(future.result())
        return out

    def result(self, notebook) -> dict:
        path = Path(notebook)
        self.start([path])
        return self._futures[path].result()

    def running(self) -> int:
        """How many processes this pool runs now (kernels, unit-test groups), at most ``workers`` at a time."""
        jobs = list(self._futures.values()) + list({id(f): f for f in self._test_jobs.values()}.values())
        return min(self.workers, sum(not f.done() for f in jobs))

    def unit_test_threads(self) -> int:
        """The unit tests' share of the cores: what the running kernels leave, every core once they are done."""
        return max(1, (os.cpu_count() or 1) - self.running() * self.threads)

    def done(self) -> dict[Path, dict]:
        """The runs that finished, by path."""
        return {p: f.result() for p, f in self._futures.items() if f.done() and not f.cancelled()}

    def repo_files_changed(self) -> list[str]:
        return sorted(k for k, v in installed.repo_snapshot().items() if self.snapshot.get(k) != v)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._setup_pool.shutdown(wait=False, cancel_futures=True)
        installed.stop_all()


_RUNS: NotebookRuns | None = None


def runs(results_dir: Path | None = None, base: Path | None = None) -> NotebookRuns:
    """This test run's notebook runs (created on first use, in ``base``: pytest's temporary folder for the run)."""
    global _RUNS
    if _RUNS is None:
        base = base or Path(tempfile.mkdtemp(prefix="course-notebook-runs-"))
        _RUNS = NotebookRuns(base, workers(), results_dir)
    return _RUNS


def active() -> NotebookRuns | None:
    return _RUNS
