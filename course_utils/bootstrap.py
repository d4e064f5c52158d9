"""A notebook's packages: ``ensure_packages(["seaborn"], optional={"bitsandbytes": "section 3"})`` in its first cell.
Where pip may install (Colab; a virtual environment it can write to, the network up) the missing ones are installed,
never torch. Elsewhere a missing required package stops the notebook with what to run; a missing optional one prints
one line, and each part that needs it asks :func:`available` first and is skipped, with a line saying so."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading

from . import hardware

# import name -> pip requirement (what requirements.txt asks for)
COURSE_PACKAGES = {"timm": "timm>=1.0", "bitsandbytes": "bitsandbytes>=0.50", "transformers": "transformers>=4.46",
                   "seaborn": "seaborn>=0.13", "tqdm": "tqdm>=4.66", "ipywidgets": "ipywidgets>=7.7",
                   "mlxtend": "mlxtend>=0.23", "sklearn": "scikit-learn>=1.3", "psutil": "psutil>=5.9",
                   "torchao": "torchao>=0.18", "peft": "peft>=0.21", "accelerate": "accelerate>=1.0",
                   "lion_pytorch": "lion-pytorch>=0.2.5,<0.3", "adam_mini": "adam-mini>=1.1.1,<1.2",
                   "galore_torch": "galore-torch>=1.0,<1.1", "apollo_torch": "apollo-torch>=1.0.3,<1.1",
                   "trl": "trl>=1.16,<2", "datasets": "datasets>=4.7"}
NEVER_INSTALL = {"torch", "torchvision", "torchaudio"}
# What a notebook may do without (README, "Optional packages"): libraries a lesson measures beside its own code.
OPTIONAL_PACKAGES = ("bitsandbytes", "torchao", "peft", "lion_pytorch", "adam_mini", "galore_torch", "apollo_torch")
PYPI, NETWORK_TIMEOUT_S = ("pypi.org", 443), 1.5  # the whole check, name lookup included: offline never waits longer


def _known(names, what: str) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{what} must be a list of import names, e.g. ['seaborn', 'tqdm'], not the string {names!r}.")
    unknown = [n for n in names if n not in COURSE_PACKAGES and n not in NEVER_INSTALL]
    if unknown:
        raise ValueError(f"Unknown package(s) {unknown}; the course knows {sorted(COURSE_PACKAGES)}.")
    return list(names)


def missing_packages(import_names) -> list[str]:
    """Import names among ``import_names`` that are not installed."""
    return [n for n in _known(import_names, "import_names") if importlib.util.find_spec(n) is None]


def pip_name(import_name: str) -> str:
    """What pip calls ``import_name`` (or its package, for 'torchao.optim'): 'lion_pytorch' -> 'lion-pytorch'."""
    top = _known([import_name.split(".")[0]], "import_name")[0]
    return COURSE_PACKAGES.get(top, top).split(">")[0].split("<")[0].split("=")[0]


def network_up(address=PYPI, timeout: float = NETWORK_TIMEOUT_S) -> bool:
    """True when PyPI answers within ``timeout`` s; a name lookup that hangs is left behind in its thread."""
    answered = []

    def connect():
        try:
            socket.create_connection(address, timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(answered)


def can_install() -> tuple[bool, str]:
    """(may this kernel pip-install, why not): on Colab; elsewhere into a virtual environment pip can write to, with
    the network up; never when ``COURSE_NO_INSTALL`` is set."""
    if os.environ.get("COURSE_NO_INSTALL"):
        return False, "cannot install here: COURSE_NO_INSTALL is set"
    if hardware.in_colab():
        return True, ""
    if sys.prefix == sys.base_prefix:
        return False, "cannot install here: not a virtual environment the course may install into"
    if importlib.util.find_spec("pip") is None or not os.access(sysconfig.get_paths()["purelib"], os.W_OK):
        return False, "cannot install here: pip cannot write to this environment"
    return (False, "cannot install here: no network") if os.environ.get("PIP_NO_INDEX") or not network_up() \
        else (True, "")


def _pip_install(requirements: list[str]) -> None:
    """pip-install ``requirements`` with the installed torch, torchvision and torchaudio pinned as they are."""
    pins = []
    for name in sorted(NEVER_INSTALL):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}\n")
        except importlib.metadata.PackageNotFoundError:
            pass
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="course-keep-torch-", delete=False) as constraints:
        constraints.writelines(pins)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", constraints.name, *requirements],
                       check=True)
    finally:
        os.unlink(constraints.name)
    importlib.invalidate_caches()


def _skip_line(import_name: str, parts: str | None) -> str:
    what = f"skipping {parts}" if parts else "the parts of this notebook that use it are skipped, each with a line"
    return f"[course] {pip_name(import_name)} is not installed: {what} (`pip install {pip_name(import_name)}` adds it)."


def ensure_packages(import_names, optional=None) -> list[str]:
    """Make this notebook's packages importable; return those installed now. ``import_names``: what it needs;
    ``optional``: what it can do without, a list of import names or {import name: the parts that need it}."""
    required = _known(import_names, "import_names")
    parts = dict(optional) if isinstance(optional, dict) else dict.fromkeys(_known(optional or [], "optional"))
    _known(parts, "optional")
    for clash, why in ((set(parts) & NEVER_INSTALL, "cannot be optional: every notebook needs torch"),
                       (set(parts) & set(required), "are both required and optional: name each once")):
        if clash:
            raise ValueError(f"{sorted(clash)} {why}.")
    missing, missing_optional = missing_packages(required), missing_packages(parts)
    if set(missing) & NEVER_INSTALL:
        raise ImportError(f"{sorted(set(missing) & NEVER_INSTALL)} not installed. Install PyTorch for your machine "
                          "first (https://pytorch.org), then re-run this cell; the course never installs torch itself.")
    installed, (allowed, why_not) = [], can_install() if missing or missing_optional else (False, "")
    if allowed and missing:
        print(f"[course] installing {', '.join(COURSE_PACKAGES[n] for n in missing)} (torch is left as it is)...")
        try:
            _pip_install([COURSE_PACKAGES[n] for n in missing])
            installed += missing
        except subprocess.CalledProcessError as err:
            why_not = f"pip failed: {err}"
    for name in missing_optional if allowed else []:   # one at a time: one that fails leaves the others
        print(f"[course] installing {COURSE_PACKAGES[name]} (optional)...")
        try:
            _pip_install([COURSE_PACKAGES[name]])
            installed.append(name)
        except subprocess.CalledProcessError as err:
            print(f"[course] could not install {pip_name(name)} ({err}): going on without it.")
    still = missing_packages(missing)
    if still:
        specs = " ".join(repr(COURSE_PACKAGES[n]) for n in still)
        raise ImportError(f"Missing package(s) {still} ({why_not or 'installed, but it does not import'}). From the "
                          "course folder run `make lab` (it installs everything into .venv), or `pip install -r "
                          f"requirements.txt -e .` in your own environment (or just `pip install {specs}`), then "
                          "restart the kernel.")
    for name in missing_packages(missing_optional):
        print(_skip_line(name, parts[name]))
    return installed


def available(import_name: str, skipping: str | None = None) -> bool:
    """True when ``import_name`` ('bitsandbytes', 'torchao.optim') imports here. Else False, with one line: what is
    skipped (``skipping``; without it, silent for a package not installed, which ensure_packages announced) and why."""
    if not isinstance(import_name, str) or not import_name:
        raise TypeError(f"import_name must be a module name such as 'bitsandbytes', not {import_name!r}.")
    name = pip_name(import_name)
    try:
        importlib.import_module(import_name)
        return True
    except Exception as err:  # noqa: BLE001 - not installed, or no build for this machine: both mean "not here"
        if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == import_name.split(".")[0]:
            if skipping:
                print(_skip_line(import_name, skipping))
            return False
        first = (str(err).strip().splitlines() or [""])[0][:200]
        print(f"[course] {name} is installed but does not import here ({type(err).__name__}: {first}): skipping "
              f"{skipping or 'what needs it'}.")
        return False
