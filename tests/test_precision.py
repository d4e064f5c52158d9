"""Tests of course_utils.precision (notebook 04)."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from course_utils import precision as P
from notebook_lessons import checker_rejects, exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "04_mixed_precision.ipynb"


def test_format_table_matches_ieee():
    t = P.format_table()
    assert list(t.index) == ["fp32", "tf32", "fp16", "bf16"]
    assert t.loc["fp16", "max"] == 65504.0
    assert t.loc["fp16", "smallest_subnormal"] == 2.0**-24
    assert t.loc["fp16", "smallest_normal"] == 2.0**-14
    assert t.loc["fp16", "eps"] == torch.finfo(torch.float16).eps == 2.0**-10
    assert t.loc["bf16", "eps"] == torch.finfo(torch.bfloat16).eps == 2.0**-7
    assert t.loc["bf16", "max"] == torch.finfo(torch.bfloat16).max
    assert t.loc["tf32", "bits"] == 19 and t.loc["tf32", "max"] == t.loc["fp32", "max"]
    assert t.loc["tf32", "eps"] == t.loc["fp16", "eps"]
    assert t.loc["fp32", "smallest_subnormal"] == 2.0**-149
    assert list(t.bytes_in_memory) == [4, 4, 2, 2]


def test_format_bad_inputs():
    with pytest.raises(TypeError, match="dict"):
        P.plot_ranges(mark=[1e-8])


def test_plot_ranges_draws_one_row_per_format():
    import matplotlib

    matplotlib.use("Agg")
    ax = P.plot_ranges(mark={"1e-8": 1e-8})
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fp32", "tf32", "fp16", "bf16"]


def test_underflow_and_overflow_fractions_are_exact():
    g = torch.tensor([1e-9, 1e-3, 0.0, 2e-8, 1.0])  # zeros are not counted
    assert P.underflow_fraction(g, "fp16") == 0.5  # 1e-9 and 2e-8 < 2**-25 vanish
    assert P.underflow_fraction(g, torch.bfloat16) == 0.0
    assert P.underflow_fraction(g, "fp16", scale=1024) == 0.0
    big = torch.tensor([1e5, 1.0, 70000.0, -1e6])
    assert P.overflow_fraction(big, "fp16") == 0.75
    assert P.overflow_fraction(big, "bf16") == 0.0
    assert P.overflow_fraction(torch.tensor([1.0]), "fp16", scale=1e5) == 1.0


@pytest.mark.parametrize("bad, err", [([1.0], TypeError), (torch.tensor([1, 2]), TypeError),
                                      (torch.tensor([]), ValueError), (torch.zeros(3), ValueError)])
def test_underflow_bad_tensors(bad, err):
    with pytest.raises(err):
        P.underflow_fraction(bad, "fp16")


def test_underflow_bad_dtype_and_scale():
    with pytest.raises(ValueError, match="Unknown format"):
        P.underflow_fraction(torch.ones(2), "int8")
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        P.underflow_fraction(torch.ones(2), torch.float64)
    for scale in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="scale"):
            P.underflow_fraction(torch.ones(2), "fp16", scale=scale)
    with pytest.raises(TypeError, match="scale"):
        P.underflow_fraction(torch.ones(2), "fp16", scale=True)


def test_autocast_op_table_cpu():
    t = P.autocast_op_table("cpu", torch.bfloat16)
    assert t.loc["linear", "fp32 input"] == "bf16"
    assert t.loc["cross_entropy", "bf16 input"] == "fp32"  # losses are on autocast's fp32 list
    assert t.loc["relu", "fp32 input"] == "fp32"  # not on the low-precision list: runs as fed
    with pytest.raises(ValueError, match="device_type"):
        P.autocast_op_table("tpu")
    with pytest.raises(ValueError, match="16-bit"):
        P.autocast_op_table("cpu", torch.float32)


def test_recommend_precision():
    assert P.recommend_precision((7, 5)) == "fp16 autocast + GradScaler"  # T4: emulated bf16 only
    assert P.recommend_precision((8, 0)) == "bf16 autocast, no GradScaler"
    assert P.recommend_precision((9, 0)).startswith("bf16")
    assert P.recommend_precision(None).startswith("fp32")
    for bad in ("8.0", (8,), (8, -1), [8, 0]):
        with pytest.raises(ValueError, match="compute_capability"):
            P.recommend_precision(bad)
    t = P.decision_table()
    assert t.loc["T4 / RTX 20xx (Turing)", "native bf16"] == False  # noqa: E712
    assert t.loc["A100 (Ampere)", "native bf16"] == True  # noqa: E712


def test_cpu_bf16_features(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16 amx_bf16 amx_tile\n"
                   "processor : 1\nflags : fpu sse avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert P.cpu_bf16_features(x86) == ["amx_bf16", "avx512_bf16"]
    arm = tmp_path / "arm"
    arm.write_text("Features : fp asimd bf16 i8mm\n")
    assert P.cpu_bf16_features(arm) == ["bf16"]
    old = tmp_path / "old"
    old.write_text("flags : fpu sse avx2\n")
    assert P.cpu_bf16_features(old) == []
    assert P.cpu_bf16_features(tmp_path / "missing") is None


# ---------------------------------------------------------------- the exercise's checker (the notebook's cell)
@pytest.fixture(scope="module")
def nb():
    """The notebook's checker cell, exec'd alone: it imports what it uses."""
    return exec_lesson_cells(NOTEBOOK, {"checker": lambda source, tags: "checker" in tags
                                        and "def check_amp_step" in source}, {})


def _step(*calls, autocast=True):
    """A training step whose calls after ``scaler.scale(loss).backward()`` come in the given order."""
    def step(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad(set_to_none=True)
        with torch.amp.autocast(x.device.type, dtype=torch.float16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        norm = None
        for call in calls:
            if call == "clip":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            elif call == "optimizer.step":
                optimizer.step()
            elif call == "update":
                scaler.update()
            else:  # "unscale_" or "step"
                getattr(scaler, call)(optimizer)
        return loss, norm
    return step


_right = _step("unscale_", "clip", "step", "update")
_clip_before_unscale = _step("clip", "unscale_", "step", "update")
_no_unscale = _step("clip", "step", "update")
_update_before_step = _step("unscale_", "clip", "update", "step")
_optimizer_step = _step("unscale_", "clip", "optimizer.step", "update")  # does not skip the overflowing step
_no_update = _step("unscale_", "clip", "step")
_fp32_forward = _step("unscale_", "clip", "step", "update", autocast=False)


def test_check_amp_step_passes_the_right_order(nb, capsys):
    assert nb["check_amp_step"](_right)
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (_clip_before_unscale, "scaled gradients"),
    (_no_unscale, "scaled gradients"),
    (_update_before_step, "raised RuntimeError"),
    (_optimizer_step, "must be skipped"),
    (_no_update, "raised RuntimeError"),
    (_fp32_forward, "fp16"),
])
def test_check_amp_step_rejects_wrong_orders(nb, wrong, says, capsys):
    assert not nb["check_amp_step"](wrong)
    assert says in capsys.readouterr().out


def test_checker_rejects_counts_every_wrong_order(nb):
    assert checker_rejects(nb["check_amp_step"], _clip_before_unscale, _update_before_step, _optimizer_step)
    assert not checker_rejects(nb["check_amp_step"], _clip_before_unscale, _right)


def test_the_overflow_is_real(nb):
    """The injected batch overflows fp16 only once scaled: the hand-made reference skips exactly that step."""
    _, norms = nb["_reference_run"]("cpu")
    assert [k for k, n in enumerate(norms) if not math.isfinite(n)] == [nb["OVERFLOW_STEP"]]


def test_check_amp_step_bad_inputs(nb):
    def todo(*args, **kwargs):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        nb["check_amp_step"](todo)
    with pytest.raises(ValueError, match="returned None"):
        nb["check_amp_step"](lambda *a: None)
    with pytest.raises(TypeError, match="function itself"):
        nb["check_amp_step"](None)
    assert not nb["check_amp_step"](lambda *a: 1.0)
