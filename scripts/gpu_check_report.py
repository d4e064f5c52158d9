"""scripts/gpu_check.sh's summary: OUT/gpu_check.md and OUT/gpu_check.json from OUT/steps.tsv and each step's results.

    python scripts/gpu_check_report.py OUT --total-s 400 --budget-s 480 [--readme README.md] [--dry-run]

Per step: pass, FAIL, TIMEOUT (stopped by its timeout, or its notebook stopped by the runner's) or skipped (with
why), wall time against its budget and, for a notebook, the README's estimate of a full GPU run of it. Per notebook:
peak allocated, reserved and nvidia-smi memory, tokens/s. Each prediction next to its measurement: a figure a
notebook (or a unit test) recorded whose name has ``predicted`` beside the one with ``measured`` in its place, with
the error; the predictions that nothing measured in this run are listed after them. The unit tests: counts, failures
and every skip reason. Exits 1 when a step failed or timed out.
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


TIMEOUT_CODES = {"124", "137"}   # coreutils' timeout: TERM sent (124), or KILL after --kill-after (137)


def prediction_pairs(step: str, figures: dict, units: dict | None = None, notebook: str | None = None
                     ) -> tuple[list[dict], list[dict]]:
    """(pairs, unpaired): each number figure named ``...predicted...`` beside the one named ``...measured...`` in its
    place, with the measurement's error against the prediction in %; and the predictions with no measurement."""
    pairs, unpaired, units = [], [], units or {}
    for key, predicted in sorted(figures.items()):
        if "predicted" not in key or not _number(predicted):
            continue
        label = key.replace("predicted_", "").replace("_predicted", "")
        measured = figures.get(key.replace("predicted", "measured"))
        row = {"step": step, "notebook": notebook, "figure": label, "unit": units.get(key), "predicted": predicted}
        if not _number(measured):
            unpaired.append(row)
            continue
        error = None if not predicted else round(100 * (measured - predicted) / predicted, 1)
        pairs.append({**row, "measured": measured, "error_pct": error})
    return pairs, unpaired


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summarise(out: Path, total_s: int, budget_s: int, readme: Path | None = None, dry_run: bool = False) -> dict:
    estimates = readme_gpu_estimates(readme) if readme else {}
    steps, notebooks, pairs, unpaired, tests = [], [], [], [], None
    for line in (out / "steps.tsv").read_text().splitlines():
        # notebook: empty for other steps; why: a skipped step's reason
        name, budget, wall, rc, notebook, why = (line.split("\t") + ["", ""])[:6]
        report = out / name / "report.json"
        rows = json.loads(report.read_text())["notebooks"] if report.exists() and rc != "skip" else []
        if rc == "skip":
            result = "skipped"
        elif rc in TIMEOUT_CODES or any(row.get("exit_code") == 124 for row in rows):
            result = "TIMEOUT"   # the step's timeout, or the notebook runner's (the step then exits 1)
        else:
            result = "pass" if rc == "0" else "FAIL"
        step = {"step": name, "budget_s": int(budget), "wall_s": int(wall), "exit_code": None if rc == "skip" else int(rc),
                "result": result, "why": why or None, "readme_gpu_estimate": estimates.get(notebook)}
        steps.append(step)
        junit = unit_tests(out / name / "junit.xml")
        if junit is not None:
            tests = junit
            found, alone = prediction_pairs(name, junit["figures"])
            pairs, unpaired = pairs + found, unpaired + alone
        for row in rows:
            figures = {k: v["value"] for k, v in row.get("figures", {}).items()}
            units = {k: v.get("unit") for k, v in row.get("figures", {}).items()}

            def gib(*keys):
                values = [figures[k] for k in keys if isinstance(figures.get(k), (int, float))]
                return round(float(values[0]), 3) if values else None

            smi = row.get("peak_gpu_mib")
            notebooks.append({
                "step": name, "notebook": row["notebook"], "passed": row["passed"],
                "result": "pass" if row["passed"] else "TIMEOUT" if row.get("exit_code") == 124 else "FAIL",
                "allocated_gib": gib("measured_gpu_peak_gib", "streamed_measured_gpu_peak_gib"),
                "reserved_gib": gib("measured_gpu_reserved_gib", "streamed_measured_gpu_reserved_gib"),
                "nvidia_smi_gib": None if smi is None else round(smi / 1024, 3),
                "tokens_per_s": {k: v for k, v in sorted(figures.items()) if units[k] == "tokens/s"}})
            found, alone = prediction_pairs(name, figures, units, row["notebook"])
            pairs, unpaired = pairs + found, unpaired + alone
    passed = all(s["result"] in ("pass", "skipped") for s in steps)
    return {"passed": passed, "dry_run": dry_run, "total_s": total_s, "budget_s": budget_s, "steps": steps, "notebooks": notebooks,
            "predictions": pairs, "unpaired_predictions": unpaired, "unit_tests": tests}


def cell(value) -> str:
    return "n/a" if value is None else str(value)


def step_result(step: dict) -> str:
    """'pass', 'FAIL (exit N)', 'TIMEOUT (after N s of a budget of M s)' or 'skipped (why)'."""
    if step["result"] == "TIMEOUT":
        return f"TIMEOUT (after {step['wall_s']} s of a budget of {step['budget_s']} s)"
    if step["result"] == "FAIL":
        return f"FAIL (exit {step['exit_code']})"
    if step["result"] == "skipped" and step.get("why"):
        return f"skipped ({step['why']})"
    return step["result"]


def markdown(summary: dict) -> str:
    s = summary
    what = "GPU check, dry run on the CPU (profile smoke)" if s["dry_run"] else "GPU check (profile gpu-check)"
    skipped = sum(t["result"] == "skipped" for t in s["steps"])
    lines = [f"# {what}: {'pass' if s['passed'] else 'FAIL'} in {s['total_s']} s (budget {s['budget_s']} s)"
             + (f", {skipped} step(s) skipped" if skipped else ""), "",
             "| step | result | wall / budget | README's GPU estimate (whole notebook, profile full) |",
             "|---|---|---|---|"]
    for t in s["steps"]:
        lines.append(f"| {t['step']} | {step_result(t)} | {t['wall_s']} s / {t['budget_s']} s "
                     f"| {t['readme_gpu_estimate'] or '-'} |")
    lines += ["", "| step | notebook | result | allocated peak (GiB) | reserved peak (GiB) | nvidia-smi peak (GiB) "
              "| tokens/s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {n['step']} | {n['notebook']} | {n['result']} | {cell(n['allocated_gib'])} "
              f"| {cell(n['reserved_gib'])} | {cell(n['nvidia_smi_gib'])} "
              f"| {', '.join(f'{k} = {v}' for k, v in n['tokens_per_s'].items()) or '-'} |" for n in s["notebooks"]]
    lines += ["", "Each prediction beside its measurement (error: measured against predicted):", "",
              "| step | prediction | unit | predicted | measured | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {p['step']} | {p['figure']} | {p['unit'] or '-'} | {p['predicted']} | {p['measured']} "
              f"| {cell(p['error_pct'])} % |" for p in s["predictions"]]
    if s["unpaired_predictions"]:
        lines += ["", "Predictions nothing measured in this run: "
                  + "; ".join(f"{p['step']}: {p['figure']} = {p['predicted']}{' ' + p['unit'] if p['unit'] else ''}"
                              for p in s["unpaired_predictions"]) + "."]
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
