"""scripts/gpu_check.sh without a GPU: its dry run (the plan and its time budget) and its summary."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def run(*args, out=None):
    env = dict(os.environ, PYTHON=sys.executable)
    if out is not None:
        env["GPU_CHECK_OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_dry_run_prints_each_step_with_its_budget_within_nine_minutes(tmp_path):
    proc = run("--dry-run", out=tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    steps = re.findall(r"^\d+\. (\S+)\s+budget\s+(\d+)s\s+(.*)$", text, flags=re.M)
    names = [name for name, _, _ in steps]
    assert names == ["gpu-unit-tests", "01_memory_accounting", "04_mixed_precision", "06_capstone_recipe_12gib",
                     "06_capstone_streamed_6gib", "09_weight_streaming_smoke", "report"]
    commands = {name: cmd for name, _, cmd in steps}
    assert "-m pytest tests -m gpu" in commands["gpu-unit-tests"]
    for name in names[1:5]:
        assert "course_tools.validate --profile full" in commands[name]
    assert "COURSE_GPU_CHECK_CAP_GIB=12" in commands["01_memory_accounting"]
    assert "CAPSTONE_PART=recipe" in commands["06_capstone_recipe_12gib"]
    assert "--profile smoke --notebooks 09_smaller_than_the_model" in commands["09_weight_streaming_smoke"]
    assert "CAPSTONE_PART=streamed" in commands["06_capstone_streamed_6gib"]
    total = sum(int(budget) for _, budget, _ in steps)
    assert re.search(rf"total budget: {total}s of 540s", text) and total <= 540
    assert not (tmp_path / "report").exists(), "a dry run writes nothing"


def test_without_a_gpu_it_refuses_and_points_to_the_dry_run(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available() and shutil.which("nvidia-smi"):
        pytest.skip("a GPU is here: the check would run for real")
    proc = run(out=tmp_path / "report")
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
    assert run("--bogus").returncode == 2


def _notebook_report(folder: Path, notebook: str, passed: bool, figures: dict, smi_mib):
    folder.mkdir(parents=True)
    row = {"notebook": notebook, "passed": passed, "exit_code": 0 if passed else 1, "wall_s": 1.0,
           "peak_gpu_mib": smi_mib, "figures": {k: {"value": v, "unit": "GiB"} for k, v in figures.items()}}
    (folder / "report.json").write_text(json.dumps({"profile": "full", "passed": passed, "notebooks": [row]}))


def test_report_puts_each_prediction_next_to_its_measurement(tmp_path):
    out = tmp_path / "report"
    _notebook_report(out / "06_capstone_recipe_12gib", "06_capstone_gpt2_xl", True,
                     {"predicted_gpu_peak_gib": 7.5, "measured_gpu_peak_gib": 7.8, "measured_gpu_reserved_gib": 8.2,
                      "gpt2_xl_predicted_total_gib": 8.4}, 9216)
    _notebook_report(out / "06_capstone_streamed_6gib", "06_capstone_gpt2_xl", True,
                     {"streamed_predicted_gpu_peak_gib": 4.0, "streamed_measured_gpu_peak_gib": 4.2,
                      "streamed_measured_gpu_reserved_gib": 4.6}, None)
    (out / "steps.tsv").write_text("gpu-unit-tests\t60\t12\t0\n06_capstone_recipe_12gib\t150\t130\t0\n"
                                   "06_capstone_streamed_6gib\t150\t120\t0\n")
    proc = run("--report-only", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] and summary["total_s"] == 262
    pairs = {(p["step"], p["figure"]): p for p in summary["predictions"]}
    recipe = pairs[("06_capstone_recipe_12gib", "gpu_peak_gib")]
    assert (recipe["predicted"], recipe["measured"], recipe["error_pct"]) == (7.5, 7.8, 4.0)
    assert pairs[("06_capstone_streamed_6gib", "streamed_gpu_peak_gib")]["error_pct"] == 5.0
    assert len(pairs) == 2  # a prediction without a measurement is not paired
    rows = {n["step"]: n for n in summary["notebooks"]}
    assert rows["06_capstone_recipe_12gib"]["nvidia_smi_gib"] == 9.0
    assert rows["06_capstone_streamed_6gib"]["reserved_gib"] == 4.6
    markdown = (out / "gpu_check.md").read_text()
    assert "# GPU check: pass" in markdown and "| 7.5 | 7.8 | 4.0 % |" in markdown


def test_report_fails_when_a_step_failed_or_timed_out(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "steps.tsv").write_text("gpu-unit-tests\t60\t61\t124\n01_memory_accounting\t90\t30\t1\n")
    proc = run("--report-only", out=out)
    assert proc.returncode == 1
    results = [s["result"] for s in json.loads((out / "gpu_check.json").read_text())["steps"]]
    assert results == ["TIMEOUT", "FAIL"]
    assert run("--report-only", out=tmp_path / "empty").returncode == 2
