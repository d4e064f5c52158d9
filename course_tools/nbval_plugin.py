"""Pytest plugin for the course's notebook harness (loaded by pyproject's ``-p course_tools.nbval_plugin``).

- Each notebook runs once, as a learner installs the course, network off, in the background while the unit tests
  run (``course_tools.notebook_runs``); its cells' items report that run's outcomes. ``COURSE_NOTEBOOKS=here`` runs
  them in this environment instead.
- Notebooks and tests run without a display and without the internet, in a fresh course folder (COURSE_HOME).
- nbval compares stderr in checked cells; warnings and progress bars there are not lessons, so stderr is skipped.
  nbval 0.11 has no option for that, nor for keeping the kernel's history (its ``skip_compare`` list and
  ``store_history=False`` are fixed in its source; a sanitizer rewrites text but cannot drop a stream), so
  ``_patch_nbval`` sets both; its own options (lax mode, timeouts, kernel name, sanitizers) are used as they are.
- The committed outputs come from a profile-smoke run. In profile full (a GPU run) sizes, and so printed numbers,
  differ by design: there saved outputs are not compared, and the claim checks are the test.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
# Tests start from an empty course folder: a checkpoint or worker file left by an earlier run (or by the
# learner) must not change what a notebook does under test. COURSE_HOME set by the caller wins.
if not os.environ.get("COURSE_HOME") and not os.environ.get("COURSE_INSTALLED_RUN"):  # installed runs: HOME's
    import tempfile

    os.environ["COURSE_HOME"] = tempfile.mkdtemp(prefix="course-test-home-")
if not os.environ.get("COURSE_INSTALLED_RUN"):  # caches one run warms for the next (course_tools.installed)
    from course_tools.installed import warm_caches

    for _name, _folder in warm_caches().items():
        os.environ.setdefault(_name, _folder)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _sizes_differ_from_saved() -> bool:
    """True in a profile other than smoke (gpu-check, full): the saved outputs come from a smoke run."""
    try:
        from course_utils.hardware import course_profile

        return course_profile() != "smoke"
    except Exception:  # a bad COURSE_PROFILE fails in the notebook itself, with its message
        return False


def _patch_nbval() -> None:
    try:
        from nbval.kernel import RunningKernel
        from nbval.plugin import IPyNbCell, IPyNbFile
    except ImportError:  # nbval missing: the unit tests still run
        return
    if not getattr(RunningKernel, "_course_history", False):
        # nbval runs each cell with store_history=False; Jupyter stores it. With history, a test run's kernel is
        # the learner's: execution counts from 1, Out[n] and _n kept, and %reset -f out frees them (01c's lesson).
        def execute_cell_input(self, cell_input, allow_stdin=None):
            return self.kc.execute(cell_input, store_history=True, allow_stdin=allow_stdin, stop_on_error=False)

        RunningKernel.execute_cell_input = execute_cell_input
        RunningKernel._course_history = True
    if not getattr(IPyNbFile, "_course_patched", False):
        original_init = IPyNbFile.__init__

        def init_without_stderr(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.skip_compare = tuple(self.skip_compare) + ("stderr",)

        IPyNbFile.__init__ = init_without_stderr
        IPyNbFile._course_patched = True
    if _sizes_differ_from_saved() and not getattr(IPyNbCell, "_course_full_profile", False):
        IPyNbCell.compare_outputs = lambda self, test, ref, skip_compare=None: True
        IPyNbCell._course_full_profile = True


_patch_nbval()


# ----------------------------------------------------------------------------------------------
# Peak resident memory of each notebook's kernel (Binder gives a session about 2 GiB)
# ----------------------------------------------------------------------------------------------
RSS_LIMIT_MIB = 2048


def _vm_hwm_bytes(pid: int) -> int:
    """A process's peak resident set (Linux VmHWM), or its current RSS where /proc has no VmHWM."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:
        return 0


SHARED_SPACE_SLACK = 16 * 2**20   # a vfork'd child and the kernel read a few microseconds apart


def _child_adds(child, kernel, kernel_cmdline, kernel_exe=None) -> int:
    """The bytes a kernel's child adds to the kernel's resident set (see KernelMemorySampler).

    A child that is about to run another program (``subprocess`` vforks, then the child execs g++) can exec while
    its memory is being read: what was read is then the kernel's own address space, under the compiler's name
    (a sampled "g++ 936 MiB" beside a 1,280 MiB kernel). So the program is read before and after the memory;
    if it changed, the memory is read again, now the new program's."""
    before = child.cmdline()
    info = child.memory_full_info()
    if before == kernel_cmdline and child.cmdline() != kernel_cmdline:
        before, info = child.cmdline(), child.memory_full_info()   # it exec'd while we read: read the new program
    if before != kernel_cmdline:
        if kernel_exe is not None and _exe(child) == kernel_exe:   # the kernel's interpreter: a rank, a worker
            return getattr(info, "uss", info.rss)  # its libraries' pages (libtorch) are the kernel's, charged once
        return getattr(info, "pss", info.rss)      # another program: its share of every page it maps
    kernel_now = kernel.memory_info()
    if info.vms == kernel_now.vms and abs(info.rss - kernel_now.rss) <= SHARED_SPACE_SLACK:
        return 0    # the kernel's own address space (vfork before exec), or a fork that has written nothing yet
    return getattr(info, "uss", info.rss)         # a copy of the kernel: the pages it alone holds


def _exe(process) -> str | None:
    try:
        return process.exe()
    except Exception:  # exited, or not ours to read
        return None


class KernelMemorySampler:
    """Peak resident memory of a kernel process together with the processes it spawns, sampled in a thread.

    What a session's memory limit sees is the sum at one moment, so every sample adds the kernel's
    resident set to what its children add, and the largest such sum is kept. A child that runs another
    program (a compiler) adds its proportional set size (PSS: pages shared between processes count once).
    A child that runs the kernel's own interpreter (a launched rank, a worker) maps the libraries the kernel
    has mapped (libtorch: hundreds of MiB, already in the kernel's resident set, which a memory limit
    charges once): it adds the pages it alone holds (USS). A child that is still a copy of the kernel
    (forked, not yet running another program) adds only the pages it owns alone (USS): the rest are the
    kernel's, already counted; and one that shares the kernel's whole address space (``vfork``, for the
    instant before ``exec``) adds nothing. The kernel's own peak is also read exactly (its VmHWM), so a
    kernel spike shorter than ``interval`` still counts, alone. A child living less than ``interval``
    seconds can be missed. ``peak_detail`` says who made up the largest sum. By hand, with psutil: pytest-memray
    counts what a test allocates in pytest's own process, and the kernel is another process, with children.
    """

    def __init__(self, pid: int, interval: float = 0.1):
        import threading

        self.pid, self.interval = pid, interval
        self.children_peak = 0   # the largest sum over the children at one sample
        self.kernel_peak = 0     # the kernel alone: its VmHWM
        self.together_peak = 0   # the kernel's RSS + what its children add, at one sample
        self.peak_detail = ""    # who made up together_peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kernel-rss")
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        self.kernel_peak = max(self.kernel_peak, _vm_hwm_bytes(self.pid))
        try:
            kernel = psutil.Process(self.pid)
            kernel_now = kernel.memory_info().rss
            kernel_cmdline, kernel_exe = kernel.cmdline(), _exe(kernel)
            children = kernel.children(recursive=True)
        except Exception:
            return
        now, who = 0, []
        for child in children:
            try:
                added = _child_adds(child, kernel, kernel_cmdline, kernel_exe)
                name = child.name()
            except Exception:  # exited since the listing, or not ours to read
                continue
            now += added
            who.append((added, name))
        self.children_peak = max(self.children_peak, now)
        if kernel_now + now > self.together_peak:
            self.together_peak = kernel_now + now
            parts = [f"kernel {kernel_now / 2**20:,.0f}"] + [f"{n} {b / 2**20:,.0f}" for b, n in sorted(who)[::-1][:4]]
            self.peak_detail = " + ".join(parts) + " MiB"

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def peak_bytes(self) -> int:
        self._sample()
        return max(self.kernel_peak, self.together_peak)

    def stop(self) -> int:
        peak = self.peak_bytes()
        self._stop.set()
        self._thread.join(timeout=2)
        return peak


def _kernel_pid(nbfile):
    km = getattr(getattr(nbfile, "kernel", None), "km", None)
    provisioner = getattr(km, "provisioner", None)
    process = getattr(provisioner, "process", None)
    return getattr(process, "pid", None) or getattr(provisioner, "pid", None)


def _patch_rss_and_installed_runs() -> None:
    """A notebook's kernel memory sampled from its setup; in installed mode no kernel here, and each cell's item
    reports the installed run's outcome instead of running the cell."""
    try:
        from nbval.plugin import IPyNbCell, IPyNbFile
    except ImportError:
        return
    if getattr(IPyNbFile, "_course_rss_patched", False):
        return
    original_setup = IPyNbFile.setup
    original_runtest, original_repr = IPyNbCell.runtest, IPyNbCell.repr_failure

    def runtest(self):
        if not _installed(self.config):
            return original_runtest(self)
        if self.options["skip"]:
            import pytest

            pytest.skip()
        _report_installed_outcome(self, self.name)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, InstalledRunFailure):
            return str(excinfo.value)
        return original_repr(self, excinfo)

    IPyNbCell.runtest, IPyNbCell.repr_failure = runtest, repr_failure

    def setup_with_sampler(self):
        if _installed(self.config):  # the notebook runs elsewhere (course_tools.notebook_runs): no kernel here
            self.setup_sanitize_files()
            self._course_rss = None
            return
        original_setup(self)
        pid = _kernel_pid(self)
        self._course_rss = KernelMemorySampler(pid) if pid else None

    IPyNbFile.setup = setup_with_sampler
    IPyNbFile._course_rss_patched = True


_patch_rss_and_installed_runs()


def _record_peak_rss(notebook: str, mib: float) -> None:
    """A notebook's kernel peak into the course's results, as the test run's own record; inside an installed run the
    test run that started it records it (that run's results would land in the repository). Recording is a
    convenience: the limit is the test."""
    if os.environ.get("COURSE_INSTALLED_RUN"):
        return
    try:
        from course_utils import results

        results.record("peak_rss_mib", mib, "MiB", notebook=notebook)
    except Exception:
        pass


def _peak_rss_item_class():
    import pytest

    class PeakRssItem(pytest.Item):
        """The last test of each notebook: its kernel's peak resident memory, recorded and checked."""

        def runtest(self):
            if _installed(self.config):
                _report_installed_outcome(self, "peak_rss")
                return
            sampler = getattr(self.parent, "_course_rss", None)
            if sampler is None:
                pytest.skip("the kernel's process could not be found, so its memory was not sampled")
            peak_mib = sampler.stop() / 2**20
            self.user_properties.append(("peak_rss_mib", round(peak_mib, 1)))
            _record_peak_rss(self.parent.path.stem, round(peak_mib, 1))
            if peak_mib > RSS_LIMIT_MIB:
                raise AssertionError(
                    f"{self.parent.path.name}: its kernel (with the processes it spawned) peaked at {peak_mib:,.0f} MiB "
                    f"of resident memory, above the {RSS_LIMIT_MIB} MiB a free Binder session has: shrink its "
                    f"profile-smoke sizes. The kernel alone peaked at {sampler.kernel_peak / 2**20:,.0f} MiB; the "
                    f"largest sum with its children was {sampler.peak_detail or 'never sampled'}.")

        def reportinfo(self):
            return self.path, None, f"{self.parent.path.name}::peak_rss"

    return PeakRssItem


# ----------------------------------------------------------------------------------------------
# Notebooks as installed, once, in the background (course_tools.notebook_runs)
# ----------------------------------------------------------------------------------------------
class InstalledRunFailure(Exception):
    """A cell that failed in the notebook's installed run; its text is that run's report."""


def _installed(config) -> bool:
    return getattr(config, "_course_notebooks", None) == "installed"


def _report_installed_outcome(item, name: str) -> None:
    import pytest

    from course_tools import notebook_runs

    path = item.parent.path
    result = notebook_runs.runs().result(path)
    cell = (result.get("cells") or {}).get(name)
    if cell is None:
        raise InstalledRunFailure(
            f"{path.name}: its installed run did not reach {name}.\n{result.get('error') or ''}\n"
            f"--- runner ---\n{result.get('runner_log', '')}")
    item.user_properties.extend(tuple(p) for p in cell.get("properties", []))
    if name == "peak_rss":
        for key, value in cell.get("properties", []):
            if key == "peak_rss_mib":
                _record_peak_rss(path.stem, value)
    if cell["outcome"] == "skipped":
        pytest.skip(cell["text"] or "skipped in the installed run")
    if cell["outcome"] == "failed":
        raise InstalledRunFailure(f"(in {path.name}'s installed run: {result.get('isolation')}, network off)\n"
                                  + cell["text"])


def pytest_configure(config):
    import pytest

    from course_tools import notebook_runs

    config.addinivalue_line("markers", "after_notebooks: runs after every notebook of the session (it reads what "
                                       "they recorded)")
    config.addinivalue_line("markers", "bare: runs notebooks without the optional packages (minutes); selected only "
                                       "by -m bare (make test-bare)")
    try:
        config._course_notebooks = notebook_runs.mode()
        notebook_runs.workers()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    config._course_started = time.perf_counter()
    config._course_durations = {}
    _CONFIG["config"] = config
    if os.environ.get("PYTEST_XDIST_WORKER"):   # one of pytest-xdist's workers (make test-fast): share the cores
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def _start_background_work(session) -> None:
    """A test module whose tests wait on a process of their own (``start_in_background(items)``: test_doctor's fresh
    run, test_gpu_check's dry run) starts it now when its tests are selected, so it runs beside the other tests
    instead of in their line. Not
    in a pytest-xdist worker: each collects every test, and the module then starts it at its first test."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    selected: dict = {}
    for item in session.items:
        selected.setdefault(getattr(item, "module", None), []).append(item)
    for module, items in selected.items():
        start = getattr(module, "start_in_background", None)
        if callable(start):
            start(items)   # the module's selected tests: it starts only what they need


def pytest_collection_finish(session):
    """Start the selected notebooks' installed runs now, so they run while the unit tests do; and the test modules'
    own background work (:func:`_start_background_work`)."""
    _start_background_work(session)
    if not _installed(session.config) or session.config.option.collectonly:
        return
    try:
        from nbval.plugin import IPyNbFile
    except ImportError:
        return
    notebooks = list(dict.fromkeys(item.parent.path for item in session.items if isinstance(item.parent, IPyNbFile)))
    if notebooks:
        from course_tools import notebook_runs
        from course_utils import paths

        base = session.config._tmp_path_factory.mktemp("notebook-runs")  # pytest keeps the last three runs'
        runs = notebook_runs.runs(results_dir=paths.results_dir(), base=base)
        runs.start(notebooks, getattr(session.config, "_course_beside_groups", []))


def pytest_runtest_setup(item):
    """The unit tests share the cores with the notebooks' kernels (threads that spin against each other waste them),
    and take every core back as the kernels finish: the last unit tests often run alone."""
    from course_tools import notebook_runs

    runs = notebook_runs.active()
    if runs is not None and _installed(item.config) and not os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        threads = runs.unit_test_threads()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


_CONFIG: dict = {}  # this test run's config, for the hooks that are not given it


def pytest_runtest_logreport(report):
    durations = getattr(_CONFIG.get("config"), "_course_durations", None)
    beside = getattr(_CONFIG.get("config"), "_course_beside", ())
    if durations is not None and ".ipynb::" not in report.nodeid and report.nodeid not in beside:
        durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration
    path = os.environ.get("COURSE_BESIDE_REPORT")
    if path:   # this is a unit-test group's own process (BESIDE_TEST_FILES): each phase's outcome, for the main run
        text = report.longreprtext if report.outcome != "passed" else ""
        if report.skipped and isinstance(report.longrepr, tuple):
            text = report.longrepr[2]
        with open(path, "a") as out:
            out.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                                  "text": text}) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    """The run's wall time and its ten slowest items; each notebook counts as one item (its installed run)."""
    from course_tools import notebook_runs

    if not hasattr(config, "_course_started"):
        return
    runs = notebook_runs.active()
    slow = [(seconds, nodeid) for nodeid, seconds in config._course_durations.items()]
    done = runs.done() if runs else {}
    for path, result in done.items():
        slow.append((result.get("wall_s", 0.0), f"{path.name} (its installed run, in the background)"))
    for result in (runs.test_groups_done() if runs else []):
        files = sorted({nodeid.split("::")[0] for nodeid in result["nodeids"]})
        slow.append((result["wall_s"], f"{' + '.join(files)} (a pytest process of its own, in the background)"))
    wall = time.perf_counter() - config._course_started
    terminalreporter.write_sep("-", "course: where the time went")
    if runs and done:
        span = (runs.finished or time.perf_counter()) - runs.started
        terminalreporter.write_line(f"notebooks: {len(done)} run as installed in {span:.0f} s, {runs.workers} at a "
                                    f"time, beside the unit tests")
    for seconds, name in sorted(slow, reverse=True)[:10]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
    terminalreporter.write_line(f"pytest wall time: {wall:.0f} s ({wall / 60:.1f} min)")


def pytest_unconfigure(config):
    from course_tools import notebook_runs

    runs = notebook_runs.active()
    if runs is not None:
        runs.stop()


# Tests that drive processes of their own (a JupyterLab server, Chromium) run last among the unit tests: there the
# notebooks' runs are ending and leave them the cores (first, beside every kernel starting, they took twice as long).
LATE_TEST_FILES = ("test_browser.py",)
# Unit-test files that run, when the notebooks run as installed, in pytest processes of their own queued with the
# notebooks (one process per group, the longest jobs first): they keep the second core busy while this process runs
# the other unit tests (before, the last four minutes of `make test` ran on one core). Their items here wait for
# and report that process's outcome, test by test. Files whose tests compare what the notebooks recorded stay here.
BESIDE_TEST_FILES = (("test_capstone.py", "test_protocol.py"), ("test_validate.py", "test_planner_export.py"))


def _beside_item_class():
    import pytest

    class BesideItem(pytest.Item):
        """A unit test run in its group's own pytest process (``BESIDE_TEST_FILES``): its outcome, reported here."""

        def runtest(self):
            from course_tools import notebook_runs

            found = notebook_runs.runs().test_result(self.nodeid)
            if found["outcome"] == "skipped":
                pytest.skip(found["text"] or "skipped in its own process")
            if found["outcome"] == "failed":
                raise InstalledRunFailure(f"(in the pytest process of its group, beside the notebooks)\n{found['text']}")

        def repr_failure(self, excinfo):
            return str(excinfo.value) if isinstance(excinfo.value, InstalledRunFailure) else super().repr_failure(excinfo)

        def reportinfo(self):
            return self.path, None, self.nodeid

    return BesideItem


def _run_beside(config, items) -> None:
    """Replace the items of ``BESIDE_TEST_FILES`` by items that report their group's own process, when the notebooks
    run as installed in this session (their pool runs the groups); not in a group's process, nor in an xdist worker,
    nor for a test marked ``after_notebooks``."""
    if (not _installed(config) or config.option.collectonly or os.environ.get("COURSE_BESIDE_REPORT")
            or os.environ.get("PYTEST_XDIST_WORKER")
            or not any(str(getattr(item, "path", "")).endswith(".ipynb") for item in items)):
        return
    item_class, groups, beside = _beside_item_class(), [], set()
    for names in BESIDE_TEST_FILES:
        group = [item for item in items if Path(str(getattr(item, "path", ""))).name in names
                 and item.get_closest_marker("after_notebooks") is None]
        if group:
            groups.append([item.nodeid for item in group])
            beside.update(groups[-1])
    if not groups:
        return
    config._course_beside, config._course_beside_groups = beside, groups
    items[:] = [item_class.from_parent(item.parent, name=item.name) if item.nodeid in beside else item
                for item in items]


def _order(item) -> tuple:
    """The unit tests, then those of ``LATE_TEST_FILES``, then those reported from their group's own process, then the
    notebooks' cells, then ``after_notebooks``."""
    path = Path(str(getattr(item, "path", "")))
    beside = type(item).__name__ == "BesideItem"   # reported from its group's own process (BESIDE_TEST_FILES)
    group = 3 if path.suffix == ".ipynb" else 2 if beside else 1 if path.name in LATE_TEST_FILES else 0
    return item.get_closest_marker("after_notebooks") is not None, group


def pytest_collection_modifyitems(session, config, items):
    """Append a peak-RSS check after the last cell of every notebook that runs; the browser tests run after the other
    unit tests (:func:`_order`); tests marked ``after_notebooks`` (they compare the figures several notebooks recorded)
    go last. Tests marked ``bare`` (the notebooks again,
    without the optional packages: minutes) run only when ``-m`` names them (``make test-bare``)."""
    if "bare" not in (config.option.markexpr or ""):
        bare = [item for item in items if item.get_closest_marker("bare") is not None]
        if bare:
            config.hook.pytest_deselected(items=bare)
            items[:] = [item for item in items if item.get_closest_marker("bare") is None]
    _run_beside(config, items)
    items.sort(key=_order)  # stable: the order within each group kept
    try:
        from nbval.plugin import IPyNbFile
    except ImportError:
        return
    item_class = _peak_rss_item_class()
    out, last_parent = [], None
    for item in items:
        parent = item.parent
        if last_parent is not None and parent is not last_parent and isinstance(last_parent, IPyNbFile):
            out.append(item_class.from_parent(last_parent, name="peak_rss"))
        out.append(item)
        last_parent = parent
    if last_parent is not None and isinstance(last_parent, IPyNbFile):
        out.append(item_class.from_parent(last_parent, name="peak_rss"))
    items[:] = out
