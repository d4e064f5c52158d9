"""course_tools.compare: two results folders side by side (CLI included)."""
import json
import subprocess
import sys

import pytest

from course_tools import compare


def _write(folder, notebook, figures, profile, device):
    folder.mkdir(parents=True, exist_ok=True)
    data = {k: {"value": v, "unit": u, "profile": profile, "device": device} for k, (v, u) in figures.items()}
    (folder / f"{notebook}.json").write_text(json.dumps(data))


@pytest.fixture
def two_runs(tmp_path):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    _write(cpu, "03_ckpt", {"activation_ratio": (0.2, "ratio"), "peak": (100, "MiB")}, "smoke", "cpu")
    _write(gpu, "03_ckpt", {"activation_ratio": (0.1, "ratio"), "tokens_per_s": (5000.0, "tok/s")}, "full", "cuda")
    _write(gpu, "06_cap", {"measured_gpu_peak_gib": (9.5, "GiB")}, "full", "cuda")
    return cpu, gpu


def test_frame_has_union_of_figures_and_ratio(two_runs):
    frame = compare.compare_frames(*two_runs)
    assert len(frame) == 4
    row = frame[frame.figure == "activation_ratio"].iloc[0]
    assert row["A"] == 0.2 and row["B"] == 0.1 and row["B/A"] == pytest.approx(0.5)
    assert row["A_run"] == "smoke/cpu" and row["B_run"] == "full/cuda"
    missing = frame[frame.figure == "peak"].iloc[0]
    assert missing["B"] is None or missing["B"] != missing["B"]  # absent in B


def test_cli_prints_table(two_runs, capsys):
    assert compare.main([str(p) for p in two_runs]) == 0
    out = capsys.readouterr().out
    assert "activation_ratio" in out and "measured_gpu_peak_gib" in out and "smoke/cpu" in out


def test_cli_bad_folder_is_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "course_tools.compare", str(tmp_path / "nope"), str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "run a notebook first" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_notebook(two_runs):
    with pytest.raises(ValueError, match="No results for notebook"):
        compare.compare_frames(*two_runs, notebook="99_none")
