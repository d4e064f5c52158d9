"""scripts/gpu_check.sh's summary: OUT/gpu_check.md and OUT/gpu_check.json from OUT/steps.tsv and each step's results.

    python scripts/gpu_check_report.py OUT --total-s 400 --budget-s 480 [--readme README.md] [--dry-run]

Per step: pass, FAIL, TIMEOUT or skipped, wall time against its budget and, for a notebook, the README's estimate
of a full GPU run of it. Per notebook: peak allocated, reserved and nvidia-smi memory, tokens/s. Each prediction
next to its measurement: a recorded figure whose name has ``predicted`` and one with ``measured`` in its place.
The unit tests: counts, failures and every skip reason. Exits 1 when a step failed or timed out.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def readme_gpu_estimates(readme: Path) -> dict[str, str]:
    """{notebook stem: the README syllabus table's "GPU run, full (estimated)" cell}."""
    if not readme.is_file():
        return {}
    lines = readme.read_text(encoding="utf-8").splitlines()
    header = next((line for line in lines if line.startswith("|") and "GPU run" in line), None)
    if header is None:
        return {}
    column = next(i for i, cell in enumerate(table_cells(header)) if "GPU run" in cell)
    estimates = {}
    for line in lines:
        link = re.search(r"\(notebooks/([^)]+)\.ipynb\)", line)
        if line.startswith("|") and link and len(table_cells(line)) > column:
            estimates[link.group(1)] = table_cells(line)[column]
    return estimates


def table_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def unit_tests(junit: Path) -> dict | None:
    """A junit XML report's counts, each test's outcome (with its failure message or skip reason), and the figures the
    tests recorded (``record_property``)."""
    if not junit.is_file():
        return None
    tests, figures = [], {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = ".".join(filter(None, (case.get("classname"), case.get("name"))))
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            outcome, message = "failed", (problem.get("message") or "")[:300]
        elif skipped is not None:   # a skipped collection keeps its reason in the text, after "Skipped: "
            found = re.search(r"Skipped: ([^'\"]+)", skipped.text or "")
            outcome, message = "skipped", found.group(1) if found else skipped.get("message") or ""
        else:
            outcome, message = "passed", ""
        tests.append({"test": name, "outcome": outcome, "message": message})
        for prop in case.iter("property"):
            figures[prop.get("name")] = float(prop.get("value"))
    counts = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in ("passed", "failed", "skipped")}
    return {**counts, "tests": tests, "figures": figures}


def prediction_pairs(step: str, figures: dict) -> list[dict]:
    """Each figure named ``...predicted...`` beside the one named ``...measured...`` in its place."""
    pairs = []
    for key, predicted in sorted(figures.items()):
        measured_key = key.replace("predicted", "measured")
        if "predicted" in key and measured_key in figures:
            measured = figures[measured_key]
            error = None if not predicted else round(100 * (measured - predicted) / predicted, 1)
            pairs.append({"step": step, "figure": key.replace("predicted_", ""), "predicted": predicted,
                          "measured": measured, "error_pct": error})
    return pairs


def summarise(out: Path, total_s: int, budget_s: int, readme: Path | None = None, dry_run: bool = False) -> dict:
    estimates = readme_gpu_estimates(readme) if readme else {}
    steps, notebooks, pairs, tests = [], [], [], None
    for line in (out / "steps.tsv").read_text().splitlines():
        name, budget, wall, rc, notebook = (line.split("\t") + [""])[:5]   # notebook: empty for other steps
        result = {"0": "pass", "124": "TIMEOUT", "137": "TIMEOUT", "skip": "skipped"}.get(rc, "FAIL")
        step = {"step": name, "budget_s": int(budget), "wall_s": int(wall), "exit_code": None if rc == "skip" else int(rc),
                "result": result, "readme_gpu_estimate": estimates.get(notebook)}
        steps.append(step)
        junit = unit_tests(out / name / "junit.xml")
        if junit is not None:
            tests = junit
            pairs += prediction_pairs(name, junit["figures"])
        report = out / name / "report.json"
        if not report.exists():
            continue
        for row in json.loads(report.read_text())["notebooks"]:
            figures = {k: v["value"] for k, v in row.get("figures", {}).items()}
            units = {k: v.get("unit") for k, v in row.get("figures", {}).items()}

            def gib(*keys):
                values = [figures[k] for k in keys if isinstance(figures.get(k), (int, float))]
                return round(float(values[0]), 3) if values else None

            smi = row.get("peak_gpu_mib")
            notebooks.append({
                "step": name, "notebook": row["notebook"], "passed": row["passed"],
                "allocated_gib": gib("measured_gpu_peak_gib", "streamed_measured_gpu_peak_gib"),
                "reserved_gib": gib("measured_gpu_reserved_gib", "streamed_measured_gpu_reserved_gib"),
                "nvidia_smi_gib": None if smi is None else round(smi / 1024, 3),
                "tokens_per_s": {k: v for k, v in sorted(figures.items()) if units[k] == "tokens/s"}})
            pairs += prediction_pairs(name, figures)
    passed = all(s["result"] in ("pass", "skipped") for s in steps)
    return {"passed": passed, "dry_run": dry_run, "total_s": total_s, "budget_s": budget_s, "steps": steps, "notebooks": notebooks,
            "predictions": pairs, "unit_tests": tests}


def cell(value) -> str:
    return "n/a" if value is None else str(value)


def markdown(summary: dict) -> str:
    s = summary
    what = "GPU check, dry run on the CPU (profile smoke)" if s["dry_run"] else "GPU check"
    lines = [f"# {what}: {'pass' if s['passed'] else 'FAIL'} in {s['total_s']} s (budget {s['budget_s']} s)", "",
             "| step | result | wall / budget | README's GPU estimate (whole notebook) |", "|---|---|---|---|"]
    for t in s["steps"]:
        result = t["result"] if t["exit_code"] in (0, None) else f"{t['result']} (exit {t['exit_code']})"
        lines.append(f"| {t['step']} | {result} | {t['wall_s']} s / {t['budget_s']} s | {t['readme_gpu_estimate'] or '-'} |")
    lines += ["", "| step | notebook | result | allocated peak (GiB) | reserved peak (GiB) | nvidia-smi peak (GiB) "
              "| tokens/s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {n['step']} | {n['notebook']} | {'pass' if n['passed'] else 'FAIL'} | {cell(n['allocated_gib'])} "
              f"| {cell(n['reserved_gib'])} | {cell(n['nvidia_smi_gib'])} "
              f"| {', '.join(f'{k} = {v}' for k, v in n['tokens_per_s'].items()) or '-'} |" for n in s["notebooks"]]
    lines += ["", "| step | prediction | predicted | measured | error |", "|---|---|---|---|---|"]
    lines += [f"| {p['step']} | {p['figure']} | {p['predicted']} | {p['measured']} | {cell(p['error_pct'])} % |"
              for p in s["predictions"]]
    tests = s["unit_tests"]
    if tests is not None:
        lines += ["", f"Unit tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped."]
        lines += [f"- {t['outcome']} {t['test']}" + (f": {t['message']}" if t["message"] else "") for t in tests["tests"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--total-s", type=int, required=True)
    parser.add_argument("--budget-s", type=int, required=True)
    parser.add_argument("--readme", default=None, help="README.md, for its GPU estimate of each notebook")
    parser.add_argument("--dry-run", action="store_true", help="the steps ran on a CPU in profile smoke")
    args = parser.parse_args(argv)
    out = Path(args.out)
    summary = summarise(out, args.total_s, args.budget_s, Path(args.readme) if args.readme else None, args.dry_run)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (out / "gpu_check.md").write_text(text)
    print(text, end="")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
