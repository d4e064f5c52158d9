"""Run the whole course under nbval and write a report (Markdown + JSON).

    python -m course_tools.validate --profile full  --out report/      # on a GPU machine
    python -m course_tools.validate --profile smoke --out report/      # dry run on a CPU
    python -m course_tools.validate --profile gpu-check ...            # the GPU check's sizes (scripts/gpu_check.sh)
    python -m course_tools.validate --runner ipython ...               # without Jupyter: see execute_notebook

Per notebook: pass, FAIL or TIMEOUT (stopped at ``--timeout``), wall time, peak GPU memory seen by ``nvidia-smi`` while it ran (the
whole device, CUDA context included, as a learner would see it), and the figures it recorded.
Exits non-zero when any notebook fails. The report is rewritten after each notebook, so a run stopped from
outside keeps the rows of the notebooks that finished. ``scripts/validate_gpu.sh`` wraps it;
``scripts/gpu_check.sh`` runs it with ``--runner ipython`` on machines that have no Jupyter kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from course_utils import results
from course_utils.hardware import PROFILES

REPO_ROOT = Path(__file__).resolve().parent.parent  # the course checkout: its pyproject.toml sets up nbval


class GpuMemoryPoller:
    """Polls ``nvidia-smi`` for used memory (MiB) in a background thread; max over the run."""

    def __init__(self, interval_s: float = 0.5):
        if not interval_s > 0:
            raise ValueError("interval_s must be positive.")
        self.interval_s = interval_s
        self.available = shutil.which("nvidia-smi") is not None
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> float | None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout
            values = [float(v) for v in out.split() if v.strip()]
            return max(values) if values else None
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def _loop(self):
        while not self._stop.is_set():
            value = self._read()
            if value is not None:
                self.peak_mib = value if self.peak_mib is None else max(self.peak_mib, value)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        if self.available:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)


def notebooks_in(folder: Path, only: list[str] | None = None) -> list[Path]:
    paths = sorted(folder.glob("[0-9][0-9]*_*.ipynb"))  # 01b_... too
    if only:
        wanted = set(only)
        unknown = wanted - {p.stem for p in paths} - {p.name for p in paths}
        if unknown:
            raise ValueError(f"Unknown notebook(s) {sorted(unknown)}; choose from {[p.stem for p in paths]}.")
        paths = [p for p in paths if p.stem in wanted or p.name in wanted]
    if not paths:
        raise ValueError(f"No notebooks (NN_topic.ipynb) found in {folder}.")
    return paths


RUNNERS = ("nbval", "ipython")
TIMEOUT_EXIT = 124  # a notebook stopped at --timeout (coreutils' timeout says the same)
# nbval's cell markers, as comments in a cell or as its tags (nbval-skip, raises-exception)
SKIP_MARKER, RAISES_MARKER = "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION"


def cell_markers(cell: dict) -> set[str]:
    """The nbval markers a code cell carries: comment lines such as ``# NBVAL_SKIP``, or the matching tags."""
    source = "".join(cell.get("source", ""))
    found = {line.strip().lstrip("#").strip() for line in source.splitlines() if line.strip().startswith("#")}
    tags = set(cell.get("metadata", {}).get("tags", []))
    if "nbval-skip" in tags:
        found.add(SKIP_MARKER)
    if tags & {"raises-exception", "nbval-raises-exception"}:
        found.add(RAISES_MARKER)
    return found & {SKIP_MARKER, RAISES_MARKER}


def execute_notebook(path: Path) -> int:
    """Run a notebook's code cells in order, in this process, with IPython's ``InteractiveShell`` (display, the
    ``Out`` prompt and tracebacks as in a kernel, with no Jupyter kernel, ZeroMQ or nbformat); returns 0 when every
    cell behaved: none raised, except a cell marked ``NBVAL_RAISES_EXCEPTION``, which must raise. Like nbval, it runs
    from the notebook's folder, skips cells marked ``NBVAL_SKIP`` and runs IPython's startup files first. Saved
    outputs are not compared: the claim checks are the test (as under nbval in profile full)."""
    import course_tools.nbval_plugin  # noqa: F401  the environment the course's notebook harness sets up
    from IPython.core.interactiveshell import InteractiveShell

    cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    os.chdir(path.parent)
    sys.path.insert(0, str(path.parent))
    shell = InteractiveShell.instance(colors="nocolor")
    # a cell that catches its error and calls get_ipython().showtraceback() shows an error as a kernel would: nbval
    # counts that cell as raising, so this runner does too
    tracebacks = []
    show = shell.showtraceback
    shell.showtraceback = lambda *args, **kwargs: (tracebacks.append(1), show(*args, **kwargs))[1]
    for startup in sorted(Path(shell.profile_dir.startup_dir).glob("*.py")):
        if not shell.run_cell(startup.read_text(), store_history=False).success:
            print(f"[execute] the IPython startup file {startup} raised", flush=True)
            return 1
    for number, cell in enumerate(cells, start=1):
        markers = cell_markers(cell)
        if SKIP_MARKER in markers:
            print(f"[execute] code cell {number}/{len(cells)}: skipped ({SKIP_MARKER})", flush=True)
            continue
        print(f"[execute] code cell {number}/{len(cells)}", flush=True)
        tracebacks.clear()
        raised = not shell.run_cell("".join(cell["source"]), store_history=True).success or bool(tracebacks)
        if raised != (RAISES_MARKER in markers):
            how = "raised" if raised else f"is marked {RAISES_MARKER} but did not raise"
            print(f"[execute] {path.name}: code cell {number} {how}", flush=True)
            return 1
    print(f"[execute] {path.name}: all {len(cells)} code cells ran", flush=True)
    return 0


def run_notebook(path: Path, *, profile: str, results_dir: Path, log_dir: Path, timeout_s: int,
                 runner: str = "nbval") -> dict:
    """Run one notebook in a fresh process (under nbval, or :func:`execute_notebook`) and return its report row."""
    env = dict(os.environ, COURSE_PROFILE=profile, COURSE_RESULTS_DIR=str(results_dir.resolve()),
               COURSE_NOTEBOOKS="here")  # this machine's environment and GPU, its results where the report reads
    if runner == "nbval":
        cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider",
               "--rootdir", str(REPO_ROOT), "-c", str(REPO_ROOT / "pyproject.toml")]
    elif runner == "ipython":
        cmd = [sys.executable, "-m", "course_tools.validate", "--execute", str(path.resolve())]
    else:
        raise ValueError(f"runner must be one of {RUNNERS}, not {runner!r}.")
    log_path = log_dir / f"{path.stem}.log"
    start = time.perf_counter()
    with GpuMemoryPoller() as poller, open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = TIMEOUT_EXIT
    seconds = time.perf_counter() - start
    return {
        "notebook": path.stem,
        "passed": rc == 0,
        "exit_code": rc,
        "wall_s": round(seconds, 1),
        "peak_gpu_mib": poller.peak_mib,
        "figures": results.load_notebook(path.stem, results_dir),
        "log": str(log_path.relative_to(log_dir.parent)) if log_dir.parent in log_path.parents else str(log_path),
    }


def write_report(rows: list[dict], out: Path, *, profile: str) -> tuple[Path, Path]:
    from course_utils.hardware import banner

    out.mkdir(parents=True, exist_ok=True)
    summary = {"profile": profile, "machine": banner(), "passed": all(r["passed"] for r in rows), "notebooks": rows}
    json_path = out / "report.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"# Course validation report ({profile})", "", f"`{banner()}`", "",
             "| notebook | result | wall time | peak GPU memory | figures |", "|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r['peak_gpu_mib'] / 1024:.2f} GiB" if r["peak_gpu_mib"] is not None else "n/a (no nvidia-smi)"
        figures = "<br>".join(f"{k} = {_fmt(v['value'])} {v['unit']}" for k, v in sorted(r["figures"].items()))
        lines.append(f"| {r['notebook']} | {outcome(r)} "
                     f"| {r['wall_s']:.0f} s | {peak} | {figures or '-'} |")
    passed = sum(r["passed"] for r in rows)
    lines += ["", f"{passed} passed, {len(rows) - passed} failed"]
    md_path = out / "report.md"
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, json_path


def outcome(row: dict) -> str:
    """'pass', 'TIMEOUT (after N s)' for a notebook stopped at its timeout, else 'FAIL (exit N)'."""
    if row["passed"]:
        return "pass"
    if row["exit_code"] == TIMEOUT_EXIT:
        return f"TIMEOUT (after {row['wall_s']:.0f} s)"
    return f"FAIL (exit {row['exit_code']})"


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every notebook under nbval and write a report.")
    parser.add_argument("--profile", choices=PROFILES, default="full",
                        help="smoke (CPU sizes), gpu-check (the short GPU check's sizes) or full (default)")
    parser.add_argument("--out", default=str(REPO_ROOT / "report"), help="report folder (default: report/)")
    parser.add_argument("--notebooks", nargs="*", help="only these notebooks (stems), default all")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per notebook (default 3600)")
    parser.add_argument("--notebooks-dir", default=str(REPO_ROOT / "notebooks"))
    parser.add_argument("--runner", choices=RUNNERS, default="nbval",
                        help="nbval (default: a Jupyter kernel, saved outputs compared in profile smoke) or ipython "
                             "(the code cells in-process with IPython alone: no Jupyter, no nbval)")
    parser.add_argument("--execute", metavar="NOTEBOOK", help="run this one notebook in this process and exit "
                        "(what --runner ipython runs for each notebook)")
    args = parser.parse_args(argv)
    if args.execute:
        return execute_notebook(Path(args.execute))
    if args.runner == "nbval" and not (REPO_ROOT / "pyproject.toml").is_file():
        print(f"validate: no pyproject.toml in {REPO_ROOT}; run it from a checkout of the course repository "
              "(scripts/validate_gpu.sh), whose pytest settings it uses.", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        paths = notebooks_in(Path(args.notebooks_dir), args.notebooks)
    except ValueError as err:
        print(f"validate: {err}", file=sys.stderr)
        return 2
    results_dir, log_dir = out / "results", out / "logs"
    for folder in (results_dir, log_dir):
        folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in paths:
        print(f"[validate] {path.stem} (profile {args.profile}) ...", flush=True)
        row = run_notebook(path, profile=args.profile, results_dir=results_dir, log_dir=log_dir, timeout_s=args.timeout,
                           runner=args.runner)
        print(f"[validate] {path.stem}: {outcome(row)} in {row['wall_s']:.0f} s", flush=True)
        rows.append(row)
        md_path, json_path = write_report(rows, out, profile=args.profile)   # after each: a stopped run keeps them
    print(md_path.read_text())
    print(f"[validate] report: {md_path} and {json_path}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
