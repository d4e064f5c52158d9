"""The course as Colab installs it, proven on a CPU without the network.

The wheel is built once (offline). Then, for each notebook: an empty folder holding only that notebook, a fresh
HOME, and a fresh virtual environment in which the course's dependencies import but ``course_utils`` does not. The
notebook's first cell installs the wheel (``COURSE_INSTALL_SPEC``, non-editable) and the notebook runs top to bottom
in profile smoke with the network off, under nbval with the fresh environment's python as the kernel. Each run
must pass, import ``course_utils`` from the installed wheel (never the repository), write its results under the
fresh HOME, and write nothing into the package or the repository. What the kernel imported is reported by an
IPython startup file in the kernel's own IPYTHONDIR (the notebook itself is copied unchanged).

How the fresh environment sees the dependencies but not the course: ``python -m venv --without-pip`` from the base
interpreter, plus a ``.pth`` file whose one line names a folder of symlinks to this environment's site-packages,
minus the course's own entries (``course_utils``, ``course_tools``, their dist-info, the editable finder) and minus
every ``.pth`` file. A plain path line in a ``.pth`` file does not run the ``.pth`` files of the folder it adds, so
no editable finder can leak the repository in (naming this site-packages directly would hide the module too, but
pip would still see the editable install's dist-info and report it as installed outside the environment); the
test checks that ``course_utils`` is not importable there first.

How the network is off: a new user, network and mount namespace (``unshare -rnm``) whose only interface is
loopback, brought up for the kernel's sockets and notebook 07's gloo processes; there the repository is also
bind-mounted read-only, so any write into it fails the notebook. Where user namespaces are not allowed, a
``sitecustomize`` in the fresh environment refuses every non-loopback connection instead, and the repository's
files are compared before and after.

Also here: the planner widget with Colab's ipywidgets 7.7.1 (installed from PyPI into a cached ``--target`` folder;
skipped with the reason when PyPI cannot be reached).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))  # 01b_... too
PACKAGES = ("course_utils", "course_tools")
PARALLEL = int(os.environ.get("COURSE_INSTALLED_PARALLEL", "2"))
CELL_TIMEOUT_S = 600
NOTEBOOK_TIMEOUT_S = int(os.environ.get("COURSE_INSTALLED_TIMEOUT", "1200"))  # per notebook, kernel start included
OUTSIDE_ADDRESS = ("151.101.0.223", 443)  # pypi.org's CDN: must be unreachable inside the test
KERNEL_NAME = "course-installed"

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


def _probe() -> int:
    """``--probe``: run inside ``unshare -rnm``; exit 0 when loopback works and the outside is unreachable."""
    try:
        _loopback_up()
        state = _network_state()
    except OSError as err:
        print(f"probe: {err}")
        return 1
    return 0 if state["loopback"] and not state["outside"] else 1


def _run_notebook(args: dict) -> int:
    """``--run ARGS.json``: run one notebook under nbval in the fresh environment; write the result next to ARGS.json.

    nbval (the course's own notebook harness) rather than nbclient: with ipykernel 7, nbclient intermittently waited
    forever for a reply the kernel had sent (seen on the notebooks that display widgets). Outputs are not compared
    here (the README's test does that); a cell that raises, a failed claim included, fails the notebook.
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
    from nbval.plugin import IPyNbCell

    IPyNbCell.compare_outputs = lambda self, test, ref, skip_compare=None: True

    class Failures:
        def __init__(self):
            self.texts = []

        def pytest_runtest_logreport(self, report):
            if report.failed:
                self.texts.append(f"{report.nodeid}:\n{report.longreprtext}")

    (work / "pytest.ini").write_text("[pytest]\n")
    failures = Failures()
    start = time.perf_counter()
    code = _pytest.main([str(Path(args["folder"]) / args["notebook"]), "-q", "-p", "no:cacheprovider",
                         "-c", str(work / "pytest.ini"), "--rootdir", str(work), "--nbval-lax",
                         "--nbval-kernel-name", KERNEL_NAME, f"--nbval-cell-timeout={CELL_TIMEOUT_S}",
                         "--nbval-kernel-startup-timeout=300"], plugins=[failures])
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["passed"] = code == 0 and not failures.texts
    if not result["passed"]:
        text = failures.texts[0][-6000:] if failures.texts else f"pytest exited with {code}"  # the first failure
        if len(failures.texts) > 1:
            text += f"\n(and {len(failures.texts) - 1} more failing cell(s) after it)"
        result["error"] = re.sub(r"\x1b\[[0-9;]*m", "", text)  # no colours
    report = Path(args["env"]["COURSE_INSTALLED_REPORT"])
    result["report"] = json.loads(report.read_text()) if report.is_file() else None
    Path(args["result"]).write_text(json.dumps(result, indent=1))
    return 0


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The course's wheel, built offline from a copy of the sources (nothing is written into the repository)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(dist), str(src)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"building the wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def isolation() -> str:
    """'unshare' (network + mount namespace) where allowed, else 'sitecustomize' (sockets refused)."""
    forced = os.environ.get("COURSE_INSTALLED_ISOLATION")
    if forced in ("unshare", "sitecustomize"):
        return forced
    if shutil.which("unshare"):
        try:
            probe = subprocess.run(["unshare", "-rnm", sys.executable, __file__, "--probe"],
                                   capture_output=True, text=True, timeout=120)
            if probe.returncode == 0:
                return "unshare"
        except (OSError, subprocess.SubprocessError):
            pass
    return "sitecustomize"


def _is_course_entry(name: str) -> bool:
    low = name.lower()
    return low.startswith(("course_utils", "course-utils", "course_tools", "__editable__")) or low.endswith(
        (".pth", ".egg-link"))


@pytest.fixture(scope="module")
def dependencies(tmp_path_factory) -> Path:
    """A folder of symlinks to this environment's site-packages without the course itself."""
    folder = tmp_path_factory.mktemp("deps_without_course")
    for site in dict.fromkeys(Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")):
        if not site.is_dir():
            continue
        for entry in site.iterdir():
            if not _is_course_entry(entry.name) and not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    return folder


def _fresh_environment(work: Path, dependencies: Path, isolation: str) -> tuple[Path, Path]:
    """A venv without pip and without the course whose .pth names the dependency folder; returns (python, site)."""
    venv = work / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "_course_dependencies.pth").write_text(f"{dependencies}\n")
    if isolation == "sitecustomize":
        (site / "sitecustomize.py").write_text(BLOCK_NETWORK)
    return venv / "bin" / "python", site


def _kernel_env(work: Path, python: Path, wheel: Path) -> dict:
    home, tmp, jupyter, ipython = work / "home", work / "tmp", work / "jupyter", work / "ipython"
    kernel_dir, startup = jupyter / "kernels" / KERNEL_NAME, ipython / "profile_default" / "startup"
    for folder in (home, tmp, kernel_dir, startup):
        folder.mkdir(parents=True, exist_ok=True)
    (startup / "00_course_installed_report.py").write_text(REPORT_STARTUP)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "course, installed from the wheel", "language": "python"}))
    return {"HOME": str(home), "TMPDIR": str(tmp), "JUPYTER_PATH": str(jupyter), "IPYTHONDIR": str(ipython),
            "COURSE_INSTALLED_REPORT": str(work / "report.json"),
            "PATH": f"{python.parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1",
            "COURSE_PROFILE": "smoke", "COURSE_INSTALL_SPEC": str(wheel), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _run_one(source: Path, base: Path, wheel: Path, dependencies: Path, isolation: str) -> dict:
    """Copy the notebook at ``source`` alone into an empty folder and run it as installed; return the result."""
    notebook = source.name
    work = base / source.stem
    folder = work / "course"
    folder.mkdir(parents=True)
    python, site = _fresh_environment(work, dependencies, isolation)
    env = _kernel_env(work, python, wheel)
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
    try:
        proc = subprocess.run([*prefix, sys.executable, __file__, "--run", str(work / "args.json")],
                              capture_output=True, text=True, timeout=NOTEBOOK_TIMEOUT_S)
        runner_log = (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired:
        runner_log = f"the runner took more than {NOTEBOOK_TIMEOUT_S} s"
    result_file = work / "result.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {"passed": False, "report": None,
                                                                              "error": runner_log}
    result.update(wall_s=round(time.perf_counter() - start, 1), visible_before_install=before, runner_log=runner_log,
                  home=env["HOME"], site=str(site), folder_files=sorted(p.name for p in folder.iterdir()))
    return result


def _repo_snapshot() -> dict:
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


@pytest.fixture(scope="module")
def installed_runs(request, tmp_path_factory, wheel, dependencies, isolation) -> dict:
    """Run the selected notebooks, PARALLEL at a time; {notebook: result}."""
    wanted = [item.callspec.params["notebook"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_notebook_runs_as_installed" and hasattr(item, "callspec")]
    wanted = sorted(set(wanted)) or NOTEBOOKS
    base = tmp_path_factory.mktemp("installed")
    snapshot = _repo_snapshot()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, PARALLEL)) as pool:
        futures = {nb: pool.submit(_run_one, ROOT / "notebooks" / nb, base, wheel, dependencies, isolation)
                   for nb in wanted}
        runs = {nb: future.result() for nb, future in futures.items()}
    seconds = time.perf_counter() - start
    changed = sorted(k for k, v in _repo_snapshot().items() if snapshot.get(k) != v)
    for result in runs.values():
        result["repo_files_changed"] = changed
    print(f"\n[installed] {len(runs)} notebook(s) in {seconds:.0f} s ({isolation}, {PARALLEL} at a time): "
          + ", ".join(f"{nb.split('_')[0]} {r.get('seconds', '-')} s" for nb, r in runs.items()))
    return runs


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------
def test_hidden_dependency_folder_keeps_the_course_out(dependencies, tmp_path):
    """The trick the notebook runs rely on: with the .pth line, the dependencies import and the course does not."""
    python, _ = _fresh_environment(tmp_path, dependencies, "none")
    proc = subprocess.run([str(python), "-c", "import importlib.util as u; "
                           "print(*(u.find_spec(n) is not None for n in ('course_utils', 'course_tools', 'numpy')))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.stdout.split() == ["False", "False", "True"], proc.stderr
    assert not any(_is_course_entry(p.name) for p in dependencies.iterdir())


def test_the_harness_fails_a_failing_cell_and_catches_a_write_into_the_repository(tmp_path, wheel, dependencies,
                                                                                   isolation):
    """The checks below can fail: a cell that raises fails the run, the network is off inside it, and a write into
    the repository is refused (namespace) or found (fallback)."""
    import nbformat

    probe = ROOT / ".installed-write-probe"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"from pathlib import Path\nPath({str(probe)!r}).write_text('x')"),
                nbformat.v4.new_code_cell("assert 1 == 2, 'a claim that fails'")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    source = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, source)
    before = _repo_snapshot()
    try:
        r = _run_one(source, tmp_path / "runs", wheel, dependencies, isolation)
        assert not r["passed"] and r["report"] is not None and r["report"]["network"] is False, r
        if isolation == "unshare":
            assert r["repo_read_only"] and "Read-only file system" in r["error"] and not probe.exists(), r["error"]
        else:
            assert ".installed-write-probe" in set(_repo_snapshot()) - set(before)
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


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_as_installed(notebook, installed_runs):
    r = installed_runs[notebook]
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
    installed = {line.split(",")[0] for line in record.read_text().splitlines() if line}
    extra = sorted(p.relative_to(site).as_posix() for package in PACKAGES for p in (site / package).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.relative_to(site).as_posix() not in installed)
    assert extra == [], f"written inside the installed package: {extra}"
    # nothing written inside the repository: read-only there when the namespace allowed it, else compared
    if not r["repo_read_only"]:
        assert r["repo_files_changed"] == [], f"written inside the repository: {r['repo_files_changed']}"


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


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        sys.exit(_probe())
    if sys.argv[1:2] == ["--run"]:
        sys.exit(_run_notebook(json.loads(Path(sys.argv[2]).read_text())))
    sys.exit("usage: test_installed.py --probe | --run ARGS.json (pytest runs the tests)")
