"""course_utils.results: headline figures recorded to results/<notebook>.json."""
import json

import pytest

from course_tools.compare import load_all
from course_utils import results


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("COURSE_PROFILE", "smoke")
    monkeypatch.setattr(results, "_current_notebook", None)
    return tmp_path


def test_record_appends_entries(tmp_results):
    results.set_notebook("01_memory_accounting")
    assert results.record("adam_fp32_bytes_per_param", 16, "bytes") is None   # a cell ending with it echoes nothing
    results.record("gpt2_xl_params", 1_557_611_200, "params")
    data = json.loads((tmp_results / "01_memory_accounting.json").read_text())
    assert data["adam_fp32_bytes_per_param"] == {"value": 16, "unit": "bytes", "profile": "smoke", "device": "cpu"}
    assert data["gpt2_xl_params"]["value"] == 1_557_611_200


def test_record_overwrites_same_name_and_accepts_tensors(tmp_results):
    import torch

    results.record("ratio", torch.tensor(0.5), "ratio", notebook="03_x")
    results.record("ratio", 0.25, "ratio", notebook="03_x")
    assert results.load_notebook("03_x")["ratio"]["value"] == 0.25
    assert load_all(tmp_results) == {"03_x": results.load_notebook("03_x")}


def test_record_without_notebook_says_to_call_setup(tmp_results):
    with pytest.raises(ValueError, match="course_utils.setup"):
        results.record("x", 1, "bytes")


@pytest.mark.parametrize(
    "name, value, unit, error",
    [("", 1, "b", ValueError), ("has space", 1, "b", ValueError), ("x", float("nan"), "b", ValueError),
     ("x", object(), "b", TypeError), ("x", 1, 3, TypeError)],
)
def test_bad_input(tmp_results, name, value, unit, error):
    with pytest.raises(error):
        results.record(name, value, unit, notebook="nb")


def test_load_all_without_folder(tmp_path):
    with pytest.raises(ValueError, match="run a notebook first"):
        load_all(tmp_path / "missing")
