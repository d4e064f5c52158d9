#!/usr/bin/env bash
# Validate the whole course on this machine and write report/report.md + report/report.json.
#   scripts/validate_gpu.sh                 # profile full (the articles' sizes), for a GPU machine
#   scripts/validate_gpu.sh --profile smoke # dry run anywhere (CPU, minutes)
#   scripts/validate_gpu.sh --notebooks 03_gradient_checkpointing 06_capstone_gpt2_xl
# Installs the course into .venv first (same install as `make test`); exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
make install
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "[validate] no nvidia-smi: no NVIDIA GPU visible; peak GPU memory will read n/a" >&2
fi
exec .venv/bin/python -m course_tools.validate "$@"
