"""Compare two results folders (say a CPU smoke run and a GPU full run) side by side.

    course-compare results-cpu/ results-gpu/
    python -m course_tools.compare results-cpu/ results-gpu/ --notebook 03_gradient_checkpointing

Every notebook records its headline figures with ``course_utils.results.record``; this prints
them as one ledger: notebook, figure, value in A, value in B, unit, and B/A where both are numbers.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from course_utils import results


def load_all(folder: str | Path) -> dict[str, dict]:
    """``{notebook: {figure: entry}}`` for every results file in the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"No results folder at {folder}: run a notebook first, or pass the folder that holds them.")
    return {p.stem: results.load_notebook(p.stem, folder) for p in sorted(folder.glob("*.json"))}


def compare_frames(dir_a: str | Path, dir_b: str | Path, *, notebook: str | None = None):
    """A pandas DataFrame with one row per (notebook, figure) found in either folder."""
    import pandas as pd

    a, b = load_all(dir_a), load_all(dir_b)
    notebooks = sorted(set(a) | set(b))
    if notebook is not None:
        if notebook not in notebooks:
            raise ValueError(f"No results for notebook {notebook!r}; found {notebooks or 'none'}.")
        notebooks = [notebook]
    rows = []
    for nb in notebooks:
        figures_a, figures_b = a.get(nb, {}), b.get(nb, {})
        for name in sorted(set(figures_a) | set(figures_b)):
            ea, eb = figures_a.get(name, {}), figures_b.get(name, {})
            va, vb = ea.get("value"), eb.get("value")
            ratio = None
            if _is_number(va) and _is_number(vb) and va != 0:
                ratio = vb / va
            rows.append({
                "notebook": nb, "figure": name,
                "A": va, "A_run": _run(ea), "B": vb, "B_run": _run(eb),
                "unit": ea.get("unit") or eb.get("unit") or "", "B/A": ratio,
            })
    return pd.DataFrame(rows, columns=["notebook", "figure", "A", "A_run", "B", "B_run", "unit", "B/A"])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _run(entry: dict) -> str:
    return f"{entry['profile']}/{entry['device']}" if entry else "-"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def format_table(frame) -> str:
    headers = ["notebook", "figure", "A", "B", "unit", "B/A"]
    rows = [[str(r["notebook"]), str(r["figure"]), _fmt(r["A"]), _fmt(r["B"]), str(r["unit"]), _fmt(r["B/A"])]
            for _, r in frame.iterrows()]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="first results folder (e.g. a CPU smoke run)")
    parser.add_argument("b", help="second results folder (e.g. a GPU full run)")
    parser.add_argument("--notebook", help="only this notebook (e.g. 01_memory_accounting)")
    args = parser.parse_args(argv)
    try:
        frame = compare_frames(args.a, args.b, notebook=args.notebook)
    except ValueError as err:
        print(f"course-compare: {err}", file=sys.stderr)
        return 2
    runs_a = sorted(set(frame["A_run"]) - {"-"})
    runs_b = sorted(set(frame["B_run"]) - {"-"})
    print(f"A = {args.a} ({', '.join(runs_a) or 'empty'})    B = {args.b} ({', '.join(runs_b) or 'empty'})")
    print(format_table(frame))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
