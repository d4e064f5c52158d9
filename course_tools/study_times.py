"""Run time and study time of each notebook, for the README and the instructors' schedules.

    python -m course_tools.study_times [--report report/report.json] [--markdown]

*Run time* is measured: the wall time of one nbval run of the notebook, read from the validation
report (`course-validate --profile smoke` on a CPU, or `--profile full` on a GPU).
*Study time* is run time plus reading and exercise time, counted from the notebook itself at stated
rates: prose at ``WORDS_PER_MINUTE``, code at ``CODE_LINES_PER_MINUTE`` (read, not typed), each
`predict` cell ``PREDICT_MINUTES`` and each exercise ``EXERCISE_MINUTES``. The rates are the
Carpentries' rule of thumb for a technical lesson; an instructor's dry run replaces them.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 120
CODE_LINES_PER_MINUTE = 15
PREDICT_MINUTES = 1.0
EXERCISE_MINUTES = 8.0


@dataclass
class StudyTime:
    notebook: str
    words: int
    code_lines: int
    predict_cells: int
    exercises: int
    run_seconds: float | None

    @property
    def reading_minutes(self) -> float:
        return self.words / WORDS_PER_MINUTE + self.code_lines / CODE_LINES_PER_MINUTE

    @property
    def study_minutes(self) -> float:
        return (self.reading_minutes + self.predict_cells * PREDICT_MINUTES + self.exercises * EXERCISE_MINUTES
                + (self.run_seconds or 0) / 60)


def count(path: Path, run_seconds: float | None = None) -> StudyTime:
    """Words of prose, lines of visible code, predict cells and exercises of one notebook."""
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path} is not a readable notebook ({err}).") from None
    words = code_lines = predicts = exercises = 0
    for cell in cells:
        source = "".join(cell.get("source", ""))
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.get("cell_type") == "markdown":
            words += len(re.findall(r"[\w'’-]+", source))
            if re.search(r"^#+ .*exercise", source, re.I | re.M):
                exercises += 1
        elif cell.get("cell_type") == "code":
            if "solution" in tags:  # hidden: a learner opens it only on purpose
                continue
            code_lines += sum(1 for line in source.splitlines() if line.strip())
            predicts += "predict" in tags
    return StudyTime(Path(path).stem, words, code_lines, predicts, exercises, run_seconds)


def run_seconds_from_report(report: Path | None) -> dict[str, float]:
    if report is None or not Path(report).is_file():
        return {}
    data = json.loads(Path(report).read_text())
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
    lines = ["| notebook | prose words | code lines | predict cells | exercises | run (measured) | study (estimated) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        run = f"{r.run_seconds:.0f} s" if r.run_seconds is not None else "not measured"
        lines.append(f"| {r.notebook} | {r.words:,} | {r.code_lines} | {r.predict_cells} | {r.exercises} | {run} | "
                     f"{r.study_minutes:.0f} min |")
    total = sum(r.study_minutes for r in rows)
    lines.append(f"| **all** | {sum(r.words for r in rows):,} | {sum(r.code_lines for r in rows)} | "
                 f"{sum(r.predict_cells for r in rows)} | {sum(r.exercises for r in rows)} | | {total:.0f} min |")
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
