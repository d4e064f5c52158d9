"""Run time and study time of each notebook, for the README and the instructors' schedules.

    python -m course_tools.study_times [--report report/report.json] [--markdown]

*Run time* is measured: the wall time of one nbval run of the notebook, read from the validation
report (`course-validate --profile smoke` on a CPU, or `--profile full` on a GPU; a `--profile gpu-check` report is
refused: its sizes are the short GPU check's, not a learner's).
*Study time* is run time plus reading and exercise time, counted from the notebook itself at stated
rates that weigh what each part asks of a learner: prose at ``WORDS_PER_MINUTE``; code that defines a
function or a class (a training loop, a hook, a quantizer: read line by line) at ``DENSE_LINES_PER_MINUTE``,
other code (settings, calls, prints, plots, claims) at ``LIGHT_LINES_PER_MINUTE``; each `predict` cell
``PREDICT_MINUTES``; each exercise ``EXERCISE_MINUTES`` plus ``EXERCISE_MINUTES_PER_LINE`` for every line
of its solution's functions (the code a learner writes). Hidden solution cells, link addresses and the setup
cell (the same in every notebook) are not read. The rates are
a rule of thumb for a technical lesson (the Carpentries'); an instructor's dry run replaces them.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 120
DENSE_LINES_PER_MINUTE = 6      # a function or class: what each line does, and why
LIGHT_LINES_PER_MINUTE = 20     # settings, calls, prints, plots, claims
PREDICT_MINUTES = 1.0
EXERCISE_MINUTES = 3.0          # reading the task and the checker's verdicts
EXERCISE_MINUTES_PER_LINE = 0.75  # per line of the solution's functions: what the learner writes


@dataclass
class StudyTime:
    notebook: str
    words: int
    dense_lines: int
    light_lines: int
    predict_cells: int
    exercises: int
    solution_lines: int
    run_seconds: float | None

    @property
    def code_lines(self) -> int:
        return self.dense_lines + self.light_lines

    @property
    def reading_minutes(self) -> float:
        return (self.words / WORDS_PER_MINUTE + self.dense_lines / DENSE_LINES_PER_MINUTE
                + self.light_lines / LIGHT_LINES_PER_MINUTE)

    @property
    def exercise_minutes(self) -> float:
        return self.exercises * EXERCISE_MINUTES + self.solution_lines * EXERCISE_MINUTES_PER_LINE

    @property
    def study_minutes(self) -> float:
        return (self.reading_minutes + self.predict_cells * PREDICT_MINUTES + self.exercise_minutes
                + (self.run_seconds or 0) / 60)


def _lines(source: str) -> list[str]:
    return [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith(("#", "%"))]


def _definition_lines(source: str) -> int:
    """Lines of ``source`` inside a top-level function or class (blank and comment lines left out); a script
    written from a cell (%%writefile) counts whole: all of it is systems code to read."""
    if source.lstrip().startswith("%%"):
        return len(_lines(source))
    rows = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]  # IPython magics
    try:
        tree = ast.parse("\n".join(rows))
    except SyntaxError:
        return 0
    spans = [(n.lineno, n.end_lineno) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return sum(1 for start, end in spans for line in rows[start - 1:end]
               if line.strip() and not line.lstrip().startswith("#"))


def count(path: Path, run_seconds: float | None = None) -> StudyTime:
    """Words of prose, lines of visible code (dense and light), predict cells, exercises and the lines of their
    solutions' functions, of one notebook."""
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path} is not a readable notebook ({err}).") from None
    words = dense = light = predicts = exercises = solution = 0
    first_code = True
    for cell in cells:
        source = "".join(cell.get("source", ""))
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.get("cell_type") == "markdown":
            words += len(re.findall(r"[\w'’-]+", re.sub(r"\]\([^)]*\)", "]", source)))  # a link's address is not read
            if re.search(r"^#+ .*exercise", source, re.I | re.M):
                exercises += 1
        elif cell.get("cell_type") == "code":
            first_code, setup = False, first_code
            if setup:  # the setup cell, the same in every notebook: read once, in 00
                continue
            if "solution" in tags:  # hidden: not read, but its functions are what the learner writes
                solution += _definition_lines(source)
                continue
            total = len(_lines(source))
            in_definitions = min(_definition_lines(source), total)
            dense += in_definitions
            light += total - in_definitions
            predicts += "predict" in tags
    return StudyTime(Path(path).stem, words, dense, light, predicts, exercises, solution, run_seconds)


def run_seconds_from_report(report: Path | None) -> dict[str, float]:
    if report is None or not Path(report).is_file():
        return {}
    data = json.loads(Path(report).read_text())
    if isinstance(data, dict) and data.get("profile") == "gpu-check":
        raise ValueError(f"{report} is a profile gpu-check run (scripts/gpu_check.sh's reduced sizes): its wall times "
                         "are not a learner's. Pass a report of profile smoke (a CPU) or full (a GPU).")
    rows = data.get("notebooks", data) if isinstance(data, dict) else data
    out = {}
    for row in rows if isinstance(rows, list) else []:
        name, seconds = row.get("notebook"), row.get("wall_s", row.get("seconds"))
        if name and isinstance(seconds, (int, float)):
            out[Path(name).stem] = float(seconds)
    return out


def table(notebooks_dir: Path | None = None, report: Path | None = None) -> list[StudyTime]:
    folder = Path(notebooks_dir or REPO_ROOT / "notebooks")
    runs = run_seconds_from_report(report)
    paths = sorted(folder.glob("[0-9][0-9]*_*.ipynb"))
    if not paths:
        raise ValueError(f"No notebooks in {folder}.")
    return [count(p, runs.get(p.stem)) for p in paths]


def markdown(rows: list[StudyTime]) -> str:
    lines = ["| notebook | prose words | code lines (dense + light) | predict cells | exercises (solution lines) | "
             "run (measured) | study (estimated) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        run = f"{r.run_seconds:.0f} s" if r.run_seconds is not None else "not measured"
        lines.append(f"| {r.notebook} | {r.words:,} | {r.dense_lines} + {r.light_lines} | {r.predict_cells} | "
                     f"{r.exercises} ({r.solution_lines}) | {run} | {r.study_minutes:.0f} min |")
    total = sum(r.study_minutes for r in rows)
    lines.append(f"| **all** | {sum(r.words for r in rows):,} | {sum(r.dense_lines for r in rows)} + "
                 f"{sum(r.light_lines for r in rows)} | {sum(r.predict_cells for r in rows)} | "
                 f"{sum(r.exercises for r in rows)} ({sum(r.solution_lines for r in rows)}) | | {total:.0f} min |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=REPO_ROOT / "report" / "report.json",
                        help="validation report with measured run times (default: report/report.json)")
    parser.add_argument("--notebooks-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        rows = table(args.notebooks_dir, args.report)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
