"""Run a notebook as a learner on Colab does: the course installed from its wheel, nothing else, the network off.

The wheel is built once (offline). Then, for each notebook: an empty folder holding only that notebook, a fresh
HOME, and a fresh virtual environment in which the course's dependencies import but ``course_utils`` does not. The
notebook's first cell installs the wheel (``COURSE_INSTALL_SPEC``, non-editable) and the notebook runs top to bottom
in profile smoke with the network off, under nbval (outputs of ``# NBVAL_CHECK_OUTPUT`` cells compared, stderr not)
with the fresh environment's python as the kernel. What the kernel imported is reported by an IPython startup file
in the kernel's own IPYTHONDIR (the notebook itself is copied unchanged). Each cell's outcome comes back, so the
README's test command reports the notebooks cell by cell from this one run (``course_tools.nbval_plugin``).

How the fresh environment sees the dependencies but not the course: ``python -m venv --without-pip`` from the base
interpreter, plus a ``.pth`` file whose one line names a folder of symlinks to this environment's site-packages,
minus the course's own entries (``course_utils``, ``course_tools``, their dist-info, the editable finder) and minus
every ``.pth`` file. A plain path line in a ``.pth`` file does not run the ``.pth`` files of the folder it adds, so
no editable finder can leak the repository in (naming this site-packages directly would hide the module too, but
pip would still see the editable install's dist-info and report it as installed outside the environment). The folder
can also leave out other distributions (``without``): tests/test_without_optional.py runs notebooks where the
optional packages were never installed. Why by hand: ``venv --system-site-packages`` would see the base
interpreter's packages, not this environment's, and virtualenv or uv would install every dependency again (torch
included) into each notebook's environment; a folder of symlinks installs nothing.

How the network is off: a new user, network and mount namespace (``unshare -rnm``) whose only interface is
loopback, brought up for the kernel's sockets and notebook 07's gloo processes; there the repository is also
bind-mounted read-only, so any write into it fails the notebook. Where user namespaces are not allowed, a
``sitecustomize`` in the fresh environment refuses every non-loopback connection instead, and the repository's
files are compared before and after. Why by hand: pytest-socket's ``--disable-socket`` blocks sockets in pytest's
own process, and the process that must be offline is the kernel, which pytest starts as another one.

Also here, for the per-notebook time budget: a fixed reference workload, timed in the same conditions just before
each notebook, so a budget is a multiple of what this machine does now, not an absolute time.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("course_utils", "course_tools")
CELL_TIMEOUT_S = 600
NOTEBOOK_TIMEOUT_S = int(os.environ.get("COURSE_INSTALLED_TIMEOUT", "1200"))  # per notebook, kernel start included
OUTSIDE_ADDRESS = ("151.101.0.223", 443)  # pypi.org's CDN: must be unreachable inside the run
KERNEL_NAME = "course-installed"
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"

# The reference workload: start python, import torch (every kernel does), then a fixed small training loop on one
# thread (two would spin against the notebooks beside it). On an idle 2-core CPU it takes about 2 s; budgets are
# stated in these units.
REFERENCE_WORKLOAD = """
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters())
x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
for _ in range(150):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def warm_caches() -> dict:
    """Caches that one test run warms for the next, shared by the notebooks and the unit tests: torch.compile's
    kernels (06, 08 and the tests compile the same optimizer steps; a C++ compile takes seconds each) and
    matplotlib's font list. They live in the user's cache folder (``~/.cache/when-the-model-does-not-fit-tests``),
    outside the repository; a notebook's fresh HOME stays fresh otherwise."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "when-the-model-does-not-fit-tests"
    try:  # outside the repository, which an installed run mounts read-only (a compile takes a lock file there)
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        base = Path(os.environ.get("TMPDIR", "/tmp")) / "when-the-model-does-not-fit-tests"
    folders = {"TORCHINDUCTOR_CACHE_DIR": base / "torchinductor", "MPLCONFIGDIR": base / "matplotlib"}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return {name: str(folder) for name, folder in folders.items()}


def reference_seconds(python: str | Path = sys.executable) -> float:
    """Wall seconds of the reference workload in a new process (what a notebook's kernel start and cells look like)."""
    start = time.perf_counter()
    subprocess.run([str(python), "-c", REFERENCE_WORKLOAD], check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


# An IPython startup file for the kernel (in its own IPYTHONDIR, not in HOME): after every cell it writes where
# course_utils came from, what was imported from the repository, and whether the outside network answers.
REPORT_STARTUP = f"""
def _course_installed_report():
    import importlib.metadata, json, os, socket, sys

    path, repo = os.environ["COURSE_INSTALLED_REPORT"], {str(ROOT)!r}
    try:
        socket.create_connection({OUTSIDE_ADDRESS!r}, timeout=3).close()
        network = True
    except OSError:
        network = False

    def write(*_):
        files = {{name: getattr(module, "__file__", None) or "" for name, module in list(sys.modules.items())}}
        course = sys.modules.get("course_utils")
        try:
            direct_url = json.loads(importlib.metadata.distribution("course_utils").read_text("direct_url.json") or "null")
        except Exception:
            direct_url = None
        report = {{"course_utils_file": getattr(course, "__file__", None), "network": network, "direct_url": direct_url,
                  "modules_from_repo": sorted(n for n, f in files.items() if f.startswith(repo + "/")
                                              and not f.startswith(repo + "/.venv/")),
                  "course_tools_imported": any(n == "course_tools" or n.startswith("course_tools.") for n in files)}}
        with open(path + ".tmp", "w") as out:
            json.dump(report, out)
        os.replace(path + ".tmp", path)

    get_ipython().events.register("post_run_cell", write)


_course_installed_report()
del _course_installed_report
"""

# With keep_output, a second startup file: the text the cells print also goes to a file (the kernel's stdout is
# ipykernel's stream to the notebook; this copies what passes through it).
KEEP_OUTPUT_STARTUP = """
def _course_keep_output():
    import os, sys

    log = open(os.environ["COURSE_INSTALLED_OUTPUT"], "a", encoding="utf-8")
    stream, write = sys.stdout, sys.stdout.write

    def tee(text):
        log.write(text)
        log.flush()
        return write(text)

    stream.write = tee


_course_keep_output()
del _course_keep_output
"""

# Fallback network-off for machines without user namespaces: loopback connections only.
BLOCK_NETWORK = '''"""Network off (tests/test_installed.py): only loopback connections are allowed in this environment."""
import ipaddress
import socket

_connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo


def _local(host):
    if host in (None, "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _allowed(sock, address):
    return sock.family not in (socket.AF_INET, socket.AF_INET6) or _local(address[0])


def connect(self, address):
    if not _allowed(self, address):
        raise OSError(101, "Network is unreachable (the network is off for this test)")
    return _connect(self, address)


def connect_ex(self, address):
    return _connect_ex(self, address) if _allowed(self, address) else 101


def getaddrinfo(host, *args, **kwargs):
    if not _local(host.decode() if isinstance(host, bytes) else host):
        raise socket.gaierror(-3, "Temporary failure in name resolution (the network is off for this test)")
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
'''


# ------------------------------------------------------------------------------------------------
# building blocks (also run inside the namespace, where this file is the runner)
# ------------------------------------------------------------------------------------------------
def _loopback_up() -> None:
    """Bring up ``lo`` in a fresh network namespace (where it starts down), without needing `ip`."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, ifreq))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def _network_state() -> dict:
    """Loopback works and the outside does not (what a notebook run needs)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5):
            pass
    try:
        socket.create_connection(OUTSIDE_ADDRESS, timeout=3).close()
        outside = True
    except OSError:
        outside = False
    return {"loopback": True, "outside": outside}


def _mount_read_only(path: Path) -> bool:
    """Bind-mount ``path`` read-only in this mount namespace; True when writing there now fails."""
    mount = shutil.which("mount")
    if mount is None:
        return False
    for cmd in ([mount, "--bind", str(path), str(path)], [mount, "-o", "remount,bind,ro", str(path)]):
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return False
    try:
        (path / ".installed-test-write-probe").touch()
    except OSError:
        return True
    (path / ".installed-test-write-probe").unlink()
    return False


def probe() -> int:
    """``--probe``: run inside ``unshare -rnm``; exit 0 when loopback works and the outside is unreachable."""
    try:
        _loopback_up()
        state = _network_state()
    except OSError as err:
        print(f"probe: {err}")
        return 1
    return 0 if state["loopback"] and not state["outside"] else 1



class CellOutcomes:
    """A pytest plugin that keeps each item's outcome, failure text, seconds and properties, by item name.
    (pytest-reportlog's ``--report-log`` writes the same reports as JSON lines: a file to parse, and one more
    dependency, for what these few lines keep in memory.)"""

    def __init__(self):
        self.outcomes: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        cell = self.outcomes.setdefault(name, {"outcome": "passed", "text": "", "seconds": 0.0, "properties": []})
        cell["seconds"] = round(cell["seconds"] + report.duration, 3)
        if report.failed or (report.skipped and cell["outcome"] == "passed"):
            cell["outcome"] = "failed" if report.failed else "skipped"
            text = report.longreprtext
            if report.skipped and isinstance(report.longrepr, tuple):
                text = report.longrepr[2]  # the skip's reason, not a location tuple
            cell["text"] = re.sub(r"\x1b\[[0-9;]*m", "", text)  # no colours
        if report.when == "call":
            cell["properties"] = [list(p) for p in report.user_properties]


def run_notebook(args: dict) -> int:
    """``--run ARGS.json``: run one notebook under nbval in the fresh environment; write the result next to ARGS.json.

    nbval (the course's own notebook harness) rather than nbclient: with ipykernel 7, nbclient intermittently waited
    forever for a reply the kernel had sent (seen on the notebooks that display widgets). With the course's nbval
    plugin and options, as the README's test runs notebooks: a cell that raises (a failed claim included) or whose
    checked output differs fails, and the kernel's peak resident memory is checked.
    """
    result = {"notebook": args["notebook"], "isolation": args["isolation"], "repo_read_only": False,
              "passed": False, "error": None, "report": None}
    if args["isolation"] == "unshare":
        _loopback_up()
        result["repo_read_only"] = _mount_read_only(ROOT)
    os.environ.clear()
    os.environ.update(args["env"])
    work = Path(args["work"])
    os.chdir(work)
    import pytest as _pytest

    (work / "pytest.ini").write_text("[pytest]\n")
    cells = CellOutcomes()
    result["reference_s"] = round(reference_seconds(), 2)  # the same conditions as the notebook, just before it
    start = time.perf_counter()
    code = _pytest.main([str(Path(args["folder"]) / args["notebook"]), "-q", "-p", "no:cacheprovider",
                         "-c", str(work / "pytest.ini"), "--rootdir", str(work), "-p", "course_tools.nbval_plugin",
                         "--nbval-lax", "--nbval-sanitize-with", str(SANITIZE), "--nbval-kernel-name", KERNEL_NAME,
                         f"--nbval-cell-timeout={CELL_TIMEOUT_S}", "--nbval-kernel-startup-timeout=300"],
                        plugins=[cells])
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["cells"] = cells.outcomes
    failed = [name for name, cell in cells.outcomes.items() if cell["outcome"] == "failed"]
    result["passed"] = code == 0 and not failed
    if not result["passed"]:
        text = cells.outcomes[failed[0]]["text"][-6000:] if failed else f"pytest exited with {code}"  # the first
        if len(failed) > 1:
            text += f"\n(and {len(failed) - 1} more failing item(s) after it: {', '.join(failed[1:])})"
        result["error"] = text
    report = Path(args["env"]["COURSE_INSTALLED_REPORT"])
    result["report"] = json.loads(report.read_text()) if report.is_file() else None
    Path(args["result"]).write_text(json.dumps(result, indent=1))
    return 0


def build_wheel(dist: Path, scratch: Path) -> Path:
    """The course's wheel in ``dist``, built offline from a copy of the sources in ``scratch`` (nothing is written
    into the repository)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, scratch / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, scratch / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(dist), str(scratch)], capture_output=True, text=True, env=env, timeout=600)
    return the_wheel(dist, proc)


def the_wheel(dist: Path, pip: subprocess.CompletedProcess) -> Path:
    """The one wheel ``pip`` (a finished ``pip wheel``) left in ``dist``, or an error that says what is there."""
    built = sorted(dist.glob("*.whl"))
    if pip.returncode != 0 or len(built) != 1:
        raise RuntimeError(f"building the wheel failed (pip's exit code {pip.returncode}; {dist} holds "
                           f"{[p.name for p in dist.iterdir()] if dist.is_dir() else 'nothing: it is gone'}):\n"
                           f"{pip.stdout}\n{pip.stderr}")
    return built[0]


def choose_isolation() -> str:
    """'unshare' (network + mount namespace) where allowed, else 'sitecustomize' (sockets refused)."""
    forced = os.environ.get("COURSE_INSTALLED_ISOLATION")
    if forced in ("unshare", "sitecustomize"):
        return forced
    if shutil.which("unshare"):
        try:
            answer = subprocess.run(["unshare", "-rnm", sys.executable, "-m", "course_tools.installed", "--probe"],
                                    capture_output=True, text=True, timeout=120)
            if answer.returncode == 0:
                return "unshare"
        except (OSError, subprocess.SubprocessError):
            pass
    return "sitecustomize"


def is_course_entry(name: str) -> bool:
    low = name.lower()
    return low.startswith(("course_utils", "course-utils", "course_tools", "__editable__")) or low.endswith(
        (".pth", ".egg-link"))


def distribution_entries(import_names) -> set[str]:
    """The top-level entries of site-packages (package folders, modules, the ``.dist-info`` folder) that the
    distributions providing ``import_names`` installed: leaving them out is as if pip had never installed them."""
    providers = importlib.metadata.packages_distributions()
    entries = set()
    for name in import_names:
        for dist_name in providers.get(name, []):
            for file in importlib.metadata.distribution(dist_name).files or []:
                top = file.parts[0]
                if top != "..":
                    entries.add(top)
    return entries


def dependency_folder(folder: Path, without=()) -> Path:
    """Fill ``folder/site-packages`` with symlinks to this environment's site-packages without the course itself,
    and without the distributions of the import names in ``without`` (their files and their metadata); returns it.
    The name matters: libraries judge "installed" by the path (dill pickles a module by value unless its file is
    under ``sys.prefix`` or a ``site-packages`` folder, and so fails on pyarrow's tables in 12's ``datasets``)."""
    left_out = distribution_entries(without)
    folder = folder / "site-packages"
    folder.mkdir(parents=True, exist_ok=True)
    for site in dict.fromkeys(Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")):
        if not site.is_dir():
            continue
        for entry in site.iterdir():
            if not is_course_entry(entry.name) and entry.name not in left_out and not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    return folder


def fresh_environment(work: Path, dependencies: Path, isolation: str) -> tuple[Path, Path]:
    """A venv without pip and without the course whose .pth names the dependency folder; returns (python, site)."""
    venv = work / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "_course_dependencies.pth").write_text(f"{dependencies}\n")
    if isolation == "sitecustomize":
        (site / "sitecustomize.py").write_text(BLOCK_NETWORK)
    return venv / "bin" / "python", site


def kernel_env(work: Path, python: Path, wheel: Path, threads: int | None = None, profile: str | None = None,
               keep_output: bool = False, cuda_rounding: bool = False) -> dict:
    """The kernel's whole environment (nothing inherited). ``profile`` defaults to this process's COURSE_PROFILE (smoke
    if unset); a caller in a background thread passes the one it read at its start, because a unit test running
    beside it may set COURSE_PROFILE for a moment. ``keep_output``: the cells' printed text also goes to
    ``work/output.txt``. ``cuda_rounding``: the course's tracker counts every storage in CUDA's 512-byte blocks
    (``COURSE_CUDA_ROUNDING=1``), so that the notebook's exact-byte claims are checked as a GPU would count."""
    home, tmp, jupyter, ipython = work / "home", work / "tmp", work / "jupyter", work / "ipython"
    kernel_dir, startup = jupyter / "kernels" / KERNEL_NAME, ipython / "profile_default" / "startup"
    for folder in (home, tmp, kernel_dir, startup):
        folder.mkdir(parents=True, exist_ok=True)
    (startup / "00_course_installed_report.py").write_text(REPORT_STARTUP)
    if keep_output:
        (startup / "01_course_keep_output.py").write_text(KEEP_OUTPUT_STARTUP)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "course, installed from the wheel", "language": "python"}))
    return {"HOME": str(home), "TMPDIR": str(tmp), "JUPYTER_PATH": str(jupyter), "IPYTHONDIR": str(ipython),
            "COURSE_INSTALLED_REPORT": str(work / "report.json"),
            "PATH": f"{python.parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1",
            "COURSE_PROFILE": profile or os.environ.get("COURSE_PROFILE", "smoke"), "COURSE_INSTALL_SPEC": str(wheel), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "COURSE_INSTALLED_RUN": "1", "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            **warm_caches(), **({"COURSE_INSTALLED_OUTPUT": str(work / "output.txt")} if keep_output else {}),
            **({"COURSE_CUDA_ROUNDING": "1"} if cuda_rounding else {}),
            # notebooks run side by side: each kernel's default thread count (a cell that times threads sets its own)
            **({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {})}


def run_one(source: Path, base: Path, wheel: Path, dependencies: Path, isolation: str, threads: int | None = None,
            profile: str | None = None, keep_output: bool = False, cuda_rounding: bool = False) -> dict:
    """Copy the notebook at ``source`` alone into an empty folder and run it as installed; return the result
    (``keep_output``: with the text its cells printed, under "output"). The run's limit (NOTEBOOK_TIMEOUT_S) is on a
    background process, not on a test item, so pytest-timeout (which times items) cannot set it; nbval's
    ``--nbval-cell-timeout`` limits each cell."""
    notebook = source.name
    work = base / source.stem
    folder = work / "course"
    folder.mkdir(parents=True)
    python, site = fresh_environment(work, dependencies, isolation)
    env = kernel_env(work, python, wheel, threads, profile, keep_output, cuda_rounding)
    shutil.copy2(source, folder / notebook)
    seen = subprocess.run(
        [str(python), "-c", "import importlib.util as u, json; print(json.dumps({n: u.find_spec(n) is not None "
         "for n in ('course_utils', 'course_tools', 'torch', 'ipykernel', 'pip')}))"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    before = json.loads(seen.stdout) if seen.returncode == 0 else {"error": seen.stderr[-2000:]}
    args = {"notebook": notebook, "folder": str(folder), "work": str(work), "env": env, "isolation": isolation,
            "result": str(work / "result.json")}
    (work / "args.json").write_text(json.dumps(args))
    prefix = ["unshare", "-rnm"] if isolation == "unshare" else []
    start = time.perf_counter()
    # A session of its own, so that stop_all() (an interrupted test run) can end the runner, its kernel and
    # whatever the notebook spawned together.
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "course_tools.installed", "--run", str(work / "args.json")],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    RUNNING.add(proc)
    try:
        runner_log = proc.communicate(timeout=NOTEBOOK_TIMEOUT_S)[0][-4000:]
    except subprocess.TimeoutExpired:
        _kill(proc)
        runner_log = f"the runner took more than {NOTEBOOK_TIMEOUT_S} s"
    finally:
        RUNNING.discard(proc)
    result_file = work / "result.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {"passed": False, "report": None,
                                                                              "error": runner_log}
    result.update(wall_s=round(time.perf_counter() - start, 1), visible_before_install=before, runner_log=runner_log,
                  home=env["HOME"], site=str(site), folder_files=sorted(p.name for p in folder.iterdir()))
    if keep_output:
        output = work / "output.txt"
        result["output"] = output.read_text(encoding="utf-8", errors="replace") if output.is_file() else ""
    return result


RUNNING: set[subprocess.Popen] = set()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except OSError:
        pass
    proc.wait()


def stop_all() -> None:
    """End every notebook run still going (the test run was interrupted)."""
    for proc in list(RUNNING):
        _kill(proc)


def repo_snapshot() -> dict:
    skip = {".git", ".venv", "__pycache__", ".pytest_cache"}
    files = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            path = Path(dirpath) / name
            try:
                files[path.relative_to(ROOT).as_posix()] = path.stat().st_mtime_ns
            except OSError:
                pass
    return files


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        sys.exit(probe())
    if sys.argv[1:2] == ["--run"]:
        sys.exit(run_notebook(json.loads(Path(sys.argv[2]).read_text())))
    sys.exit("usage: python -m course_tools.installed --probe | --run ARGS.json (the test harness calls it)")
