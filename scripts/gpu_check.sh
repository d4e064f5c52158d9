#!/usr/bin/env bash
# One prepared GPU check, sized for a short loan of one modern GPU: at most 9 minutes in all.
#
#   scripts/gpu_check.sh            # run it (needs an NVIDIA GPU and the course installed: `make install`)
#   scripts/gpu_check.sh --dry-run  # print what it would run and each step's time budget; runs nothing, exits 0
#   scripts/gpu_check.sh --report-only  # rewrite the summary from the step results already in report/
#
# Steps (each under `timeout` with its own budget):
#   1. the GPU unit tests (pytest -m gpu);
#   2. notebooks 01, 04 and 06 (the recipe: CAPSTONE_PART=recipe) in profile full under a 12 GiB cap;
#   3. notebook 06's streamed run (CAPSTONE_PART=streamed) under a 6 GiB cap, in a fresh process;
#   4. notebook 09 in profile smoke: its CUDA weight-streaming engine (side stream, pinned host copies, events)
#      on the small model, against the same update on the recipe.
# Notebooks run under nbval through the validation CLI (python -m course_tools.validate), with a fresh
# COURSE_HOME, so no checkpoint from an earlier run is resumed. The cap on 01 and 04 comes from an IPython
# startup file (hardware.cap_gpu_memory); notebook 06 caps itself (12 GiB, then 6 GiB for the streamed run).
#
# Writes report/ (GPU_CHECK_OUT overrides): gpu_check.md and gpu_check.json (per step: pass/fail, wall time
# against its budget; per notebook: peak allocated, reserved and nvidia-smi memory; each fake-tensor prediction
# next to its measurement), plus each step's log and validation report. Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
REPORT_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --report-only) REPORT_ONLY=1 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$arg' (use --dry-run, --report-only or --help)" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-.venv/bin/python}"
OUT="${GPU_CHECK_OUT:-report}"
TOTAL_BUDGET_S=540   # 9 minutes

# name | budget (s) | extra environment | command. A notebook's nbval run gets its budget less 10 s, so the
# validation CLI records a timeout in its report before the step's own timeout would kill it.
STEPS=(
  "gpu-unit-tests|60||$PY -m pytest tests -m gpu -q"
  "01_memory_accounting|75|COURSE_GPU_CHECK_CAP_GIB=12|$PY -m course_tools.validate --profile full --notebooks 01_memory_accounting --timeout 65 --out $OUT/01_memory_accounting"
  "04_mixed_precision|60|COURSE_GPU_CHECK_CAP_GIB=12|$PY -m course_tools.validate --profile full --notebooks 04_mixed_precision --timeout 50 --out $OUT/04_mixed_precision"
  "06_capstone_recipe_12gib|150|CAPSTONE_PART=recipe|$PY -m course_tools.validate --profile full --notebooks 06_capstone_gpt2_xl --timeout 140 --out $OUT/06_capstone_recipe_12gib"
  "06_capstone_streamed_6gib|150|CAPSTONE_PART=streamed|$PY -m course_tools.validate --profile full --notebooks 06_capstone_gpt2_xl --timeout 140 --out $OUT/06_capstone_streamed_6gib"
  "09_weight_streaming_smoke|40|COURSE_GPU_CHECK_CAP_GIB=12|$PY -m course_tools.validate --profile smoke --notebooks 09_smaller_than_the_model --timeout 30 --out $OUT/09_weight_streaming_smoke"
)
REPORT_BUDGET_S=5

planned=$REPORT_BUDGET_S
for step in "${STEPS[@]}"; do
  IFS='|' read -r _ budget _ _ <<<"$step"
  planned=$((planned + budget))
done

# The summary: pass/fail and time per step, GPU memory per notebook, each prediction next to its measurement.
write_report() {
timeout "$REPORT_BUDGET_S" "$PY" - "$OUT" "$1" "$TOTAL_BUDGET_S" <<'PYREPORT'
"""Summarise the steps: pass/fail and time, GPU memory per notebook, each prediction next to its measurement."""
import json
import sys
from pathlib import Path

out, total_s, budget_s = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
steps, notebooks, pairs = [], [], []
for line in (out / "steps.tsv").read_text().splitlines():
    name, budget, wall, rc = line.split("\t")
    steps.append({"step": name, "budget_s": int(budget), "wall_s": int(wall), "exit_code": int(rc),
                  "result": "pass" if rc == "0" else ("TIMEOUT" if rc in ("124", "137") else "FAIL")})
    report = out / name / "report.json"
    if not report.exists():
        continue
    for row in json.loads(report.read_text())["notebooks"]:
        figures = {k: v["value"] for k, v in row.get("figures", {}).items()}

        def gib(key):
            value = figures.get(key)
            return None if value is None else round(float(value), 3)

        smi = row.get("peak_gpu_mib")
        notebooks.append({"step": name, "notebook": row["notebook"], "passed": row["passed"],
                          "allocated_gib": gib("measured_gpu_peak_gib") or gib("streamed_measured_gpu_peak_gib"),
                          "reserved_gib": gib("measured_gpu_reserved_gib") or gib("streamed_measured_gpu_reserved_gib"),
                          "nvidia_smi_gib": None if smi is None else round(smi / 1024, 3)})
        for key, predicted in sorted(figures.items()):
            if "predicted" in key and key.replace("predicted", "measured") in figures:
                measured = figures[key.replace("predicted", "measured")]
                error = None if not predicted else round(100 * (measured - predicted) / predicted, 1)
                pairs.append({"step": name, "figure": key.replace("predicted_", ""), "predicted": predicted,
                              "measured": measured, "error_pct": error})
passed = all(s["result"] == "pass" for s in steps)
summary = {"passed": passed, "total_s": total_s, "budget_s": budget_s, "steps": steps, "notebooks": notebooks,
           "predictions": pairs}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")


def cell(v):
    return "n/a" if v is None else str(v)


lines = [f"# GPU check: {'pass' if passed else 'FAIL'} in {total_s} s (budget {budget_s} s)", "",
         "| step | result | wall / budget |", "|---|---|---|"]
lines += [f"| {s['step']} | {s['result']} (exit {s['exit_code']}) | {s['wall_s']} s / {s['budget_s']} s |" for s in steps]
lines += ["", "| step | notebook | result | allocated peak (GiB) | reserved peak (GiB) | nvidia-smi peak (GiB) |",
          "|---|---|---|---|---|---|"]
lines += [f"| {n['step']} | {n['notebook']} | {'pass' if n['passed'] else 'FAIL'} | {cell(n['allocated_gib'])} "
          f"| {cell(n['reserved_gib'])} | {cell(n['nvidia_smi_gib'])} |" for n in notebooks]
lines += ["", "| step | fake-tensor prediction | predicted | measured | error |", "|---|---|---|---|---|"]
lines += [f"| {p['step']} | {p['figure']} | {p['predicted']} | {p['measured']} | {cell(p['error_pct'])} % |" for p in pairs]
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if passed else 1)
PYREPORT
}

if [ "$REPORT_ONLY" = 1 ]; then
  [ -f "$OUT/steps.tsv" ] || { echo "gpu_check: no $OUT/steps.tsv: run the check first" >&2; exit 2; }
  write_report "$(awk -F'\t' '{s += $3} END {print s + 0}' "$OUT/steps.tsv")"
  exit $?
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check --dry-run: the steps it would run, each under timeout with its budget"
  i=0
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name budget env cmd <<<"$step"
    i=$((i + 1))
    printf '%d. %-28s budget %4ss  %s%s\n' "$i" "$name" "$budget" "${env:+$env }" "$cmd"
  done
  printf '%d. %-28s budget %4ss  writes %s/gpu_check.md and %s/gpu_check.json\n' "$((i + 1))" "report" \
    "$REPORT_BUDGET_S" "$OUT" "$OUT"
  echo "total budget: ${planned}s of ${TOTAL_BUDGET_S}s (9 min)"
  [ "$planned" -le "$TOTAL_BUDGET_S" ] || { echo "gpu_check: the budgets exceed 9 minutes" >&2; exit 1; }
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA GPU visible to $PY; run scripts/gpu_check.sh --dry-run to see the plan" >&2
  exit 2
fi

mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# A fresh course folder: checkpoints and results from earlier runs are not resumed.
export COURSE_HOME="$WORK/course_home"
# The 12 GiB cap for notebooks that do not cap themselves: an IPython startup file the kernels run first.
export IPYTHONDIR="$WORK/ipython"
mkdir -p "$IPYTHONDIR/profile_default/startup"
cat > "$IPYTHONDIR/profile_default/startup/00-gpu-check-cap.py" <<'PYCAP'
import os
if os.environ.get("COURSE_GPU_CHECK_CAP_GIB"):
    from course_utils import hardware
    print("[gpu_check]", hardware.cap_gpu_memory(float(os.environ["COURSE_GPU_CHECK_CAP_GIB"])))
PYCAP

: > "$OUT/steps.tsv"
started=$(date +%s)
for step in "${STEPS[@]}"; do
  IFS='|' read -r name budget env cmd <<<"$step"
  echo "[gpu_check] $name (budget ${budget}s): ${env:+$env }$cmd"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  env $env timeout --kill-after=10 "$budget" $cmd > "$OUT/$name.log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - t0 ))
  echo "[gpu_check] $name: exit $rc after ${wall}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$budget" "$wall" "$rc" >> "$OUT/steps.tsv"
done

write_report "$(( $(date +%s) - started ))"
