"""Pre-flight check for a workshop: is this laptop ready to run the course?

    make check            # or: python -m course_tools.preflight

Prints one line per item, green (ready) or red (with the fix), then a one-line summary a learner can
paste into the workshop chat. Exits 0 when every item is ready, 1 otherwise. Never ends in a
traceback: each check's failure becomes its red line. Takes about 10-30 s (starting a Jupyter kernel
is most of it).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import io
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MIN_PYTHON = (3, 10)
REPO_ROOT = Path(__file__).resolve().parent.parent
# What a learner needs to open and run the notebooks (the rest of requirements.txt is for tests).
LEARNER_PACKAGES = ("torch", "numpy", "pandas", "matplotlib", "seaborn", "tqdm", "ipywidgets", "jupyterlab",
                    "ipykernel", "transformers", "timm", "mlxtend", "scikit-learn", "psutil", "trl", "datasets")
# The course runs without these (README, "Optional packages"): a missing one is reported, not a failure.
OPTIONAL_PACKAGES = ("bitsandbytes", "torchao", "peft", "lion-pytorch", "adam-mini", "galore-torch", "apollo-torch")
INSTALL_FIX = "from the course folder run `make install` (or `pip install -r requirements.txt -e .`)"


@dataclass
class Item:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self, color: bool) -> str:
        mark = "✓" if self.ok else "✗"
        text = f"{mark} {self.name}: {self.detail}" + ("" if self.ok or not self.fix else f"  -> fix: {self.fix}")
        if not color:
            return text
        return f"\033[32m{text}\033[0m" if self.ok else f"\033[31m{text}\033[0m"


def _requirement_lines(path: Path) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            lines.append(line)
    return lines


def requirements(path: Path | None = None) -> dict[str, str]:
    """``{distribution name: specifier}`` from requirements.txt (the tested ranges)."""
    path = Path(path or REPO_ROOT / "requirements.txt")
    if not path.is_file():
        return {}
    out = {}
    for line in _requirement_lines(path):
        match = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", line)
        if match:
            out[match[1].lower()] = match[2].replace(" ", "")
    return out


def _in_range(version: str, specifier: str) -> bool:
    from course_utils.versions import in_range  # one reading of versions and ranges for the course

    return in_range(version, specifier)


def check_python(version_info=None) -> Item:
    version = tuple((version_info or sys.version_info)[:3])
    text = ".".join(map(str, version))
    if version[:2] < MIN_PYTHON:
        return Item("python", False, f"{text} is too old (the course needs {MIN_PYTHON[0]}.{MIN_PYTHON[1]}+)",
                    "install Python 3.11 and run `make check PYTHON=python3.11`")
    return Item("python", True, text)


def check_packages(packages=LEARNER_PACKAGES, ranges: dict[str, str] | None = None,
                   version_of: Callable[[str], str] = importlib.metadata.version, optional=OPTIONAL_PACKAGES) -> Item:
    ranges = requirements() if ranges is None else ranges
    absent = []
    for name in optional:
        try:
            version_of(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    without = f"; not installed (optional: the notebooks skip what needs them): {', '.join(absent)}" if absent else ""
    missing, outside, found = [], [], []
    for name in packages:
        try:
            version = version_of(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
            continue
        spec = ranges.get(name.lower(), "")
        try:
            inside = _in_range(version, spec)
        except Exception:  # an unparsable local version: report, do not crash
            inside = False
        (found if inside else outside).append(f"{name} {version}" + ("" if inside else f" (tested: {spec})"))
    if missing:
        return Item("packages", False, f"missing: {', '.join(missing)}", INSTALL_FIX)
    if outside:
        return Item("packages", False, f"outside the tested range: {'; '.join(outside)}",
                    "reinstall the tested versions: `pip install -r requirements.txt`")
    return Item("packages", True, f"{len(found)} installed in the tested ranges{without}")


def check_course_folder() -> Item:
    from course_utils import paths

    try:
        home = paths.course_home()
        with tempfile.NamedTemporaryFile(dir=home, prefix=".preflight-", delete=True):
            pass
    except OSError as err:
        return Item("course folder", False, str(err), "set COURSE_HOME to a folder you can write to")
    return Item("course folder", True, f"{home} is writable")


def check_hardware() -> Item:
    from course_utils import hardware

    report = hardware.hardware_report()
    return Item("hardware", True, str(report))


def check_measure_memory() -> Item:
    import torch

    from course_utils.memory import measure_memory

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(8, 64)).pow(2).mean().backward()
        optimizer.step()

    report = measure_memory(step, model=model, optimizer=optimizer)
    params = 64 * 64 * 4 + 64 * 4
    if report.by_category["params"] != params or report.peak_bytes < params:
        return Item("measure_memory", False, f"parameters measured as {report.by_category['params']} bytes, not {params}",
                    "reinstall the course's torch (requirements.txt): the memory tracker changed")
    return Item("measure_memory", True, f"one tiny training step peaked at {report.peak_bytes:,} bytes")


def check_widgets() -> Item:
    import ipywidgets

    slider = ipywidgets.IntSlider(value=1, min=0, max=4)
    slider.value = 3
    return Item("widgets", True, f"ipywidgets {ipywidgets.__version__}")


def check_plotting() -> Item:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(2, 2))
    sns.barplot(x=["a", "b"], y=[1, 2], ax=ax)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return Item("plotting", buffer.tell() > 0, f"seaborn {sns.__version__} drew a chart")


def check_kernel(timeout_s: float = 60.0) -> Item:
    from jupyter_client.manager import start_new_kernel

    import subprocess

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=timeout_s,
                              stderr=subprocess.DEVNULL)  # the kernel's own start-up chatter is not for learners
    try:
        reply = kc.execute_interactive("import course_utils; print(course_utils.__version__)", timeout=timeout_s,
                                       output_hook=lambda msg: None)
        ok = reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    if not ok:
        return Item("jupyter kernel", False, "the kernel started but cannot import course_utils",
                    "install the kernel into the course's environment: `make install`, then pick the .venv kernel")
    return Item("jupyter kernel", True, "started, and imports course_utils")


CHECKS: tuple[tuple[str, Callable[[], Item], str], ...] = (
    ("python", check_python, "install Python 3.11"),
    ("packages", check_packages, INSTALL_FIX),
    ("course folder", check_course_folder, "set COURSE_HOME to a folder you can write to"),
    ("hardware", check_hardware, INSTALL_FIX),
    ("measure_memory", check_measure_memory, INSTALL_FIX),
    ("widgets", check_widgets, INSTALL_FIX),
    ("plotting", check_plotting, INSTALL_FIX),
    ("jupyter kernel", check_kernel, INSTALL_FIX),
)


def run_checks(checks=CHECKS) -> list[Item]:
    items = []
    for name, check, fix in checks:
        try:
            item = check()
        except ImportError as err:
            item = Item(name, False, f"cannot import {err.name or err}", fix)
        except Exception as err:  # every failure becomes a red line, never a traceback
            item = Item(name, False, f"{type(err).__name__}: {err}".strip()[:300], fix)
        items.append(item)
    return items


def summary(items: list[Item], seconds: float) -> str:
    passed = sum(item.ok for item in items)
    failed = [item.name for item in items if not item.ok]
    try:
        from course_utils import hardware

        where = f"{hardware.device_type()}, profile {hardware.course_profile()}"
    except Exception:
        where = "hardware unknown"
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "missing"
    status = "READY" if not failed else "NOT READY (" + ", ".join(failed) + ")"
    return (f"course preflight: {status} | {passed}/{len(items)} ok | {where} | python {platform.python_version()}, "
            f"torch {torch_version} | {seconds:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Is this machine ready for the course? One line per item.")
    parser.add_argument("--no-color", action="store_true", help="plain text (for pasting into a chat)")
    parser.add_argument("--record", action="store_true", help="record preflight_seconds in the course's results")
    args = parser.parse_args(argv)
    color = not args.no_color and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    start = time.perf_counter()
    items = run_checks()
    seconds = time.perf_counter() - start
    for item in items:
        print(item.line(color))
    print(summary(items, seconds))
    if args.record:
        try:
            from course_utils import results

            results.record("preflight_seconds", round(seconds, 1), "s", notebook="preflight")
        except Exception as err:  # the check's verdict matters more than the record
            print(f"(could not record preflight_seconds: {err})")
    return 0 if all(item.ok for item in items) else 1


if __name__ == "__main__":
    sys.exit(main())
