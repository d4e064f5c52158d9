"""Tests of course_utils.quantization and of notebook 05's own quantizers and exercise checker (run from its cells)."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import estimate, memory, models
from course_utils import quantization as Q

from notebook_lessons import checker_rejects, exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "05_8bit_adam.ipynb"


def test_error_metrics_exact():
    x = torch.tensor([1.0, -2.0, 3.0, 0.0])
    m = Q.error_metrics(x, torch.tensor([1.0, -2.5, 3.0, 0.5]))
    assert m["mean_abs_error"] == 0.25 and m["max_abs_error"] == 0.5
    assert m["rmse"] == pytest.approx(math.sqrt(0.125))
    assert m["rel_mean_error"] == pytest.approx(0.25 / 1.5)
    with pytest.raises(ValueError, match="same shape"):
        Q.error_metrics(x, torch.zeros(3))
    with pytest.raises(TypeError):
        Q.error_metrics([1.0], x)
    with pytest.raises(TypeError, match="floating"):
        Q.error_metrics(torch.ones(2, dtype=torch.long), x)


# ---------------------------------------------------------------- the notebook's quantizers
def _notebook_functions(*names):
    """Exec the code cells of notebook 05 that define ``names`` (the quantizers it teaches) and return them."""
    nb = json.loads(NOTEBOOK.read_text())
    ns = {"torch": torch, "F": F}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and any(f"def {name}(" in src for name in names):
            # only the definitions: the cell's other lines use the notebook's state
            defs = "\n\n".join(block for block in src.split("\n\n") if block.startswith("def "))
            exec(compile(defs, str(NOTEBOOK), "exec"), ns)
    missing = [name for name in names if name not in ns]
    assert not missing, f"notebook 05 no longer defines {missing}"
    return [ns[name] for name in names]


def test_notebook_blockwise_quantizer_matches_bitsandbytes_linear_map():
    quantize, dequantize = _notebook_functions("blockwise_quantize", "blockwise_dequantize")
    torch.manual_seed(0)
    x = torch.randn(5000)
    q, absmax = quantize(x, 256)
    assert q.dtype == torch.int8 and q.numel() == 5120 and absmax.numel() == 20  # last block zero-padded
    x_hat = dequantize(q, absmax, x.numel())
    assert (x - x_hat).abs().max() <= absmax.max() / 127 / 2 + 1e-6  # at most half a step
    ours = Q.error_metrics(x, x_hat)["mean_abs_error"]
    import bitsandbytes.functional as BF

    bnb = Q.error_metrics(x, Q.bnb_roundtrip(x, code=BF.create_linear_map(signed=True)))["mean_abs_error"]
    assert ours == pytest.approx(bnb, rel=0.02)


def test_notebook_blockwise_quantizer_isolates_an_outlier():
    quantize, dequantize = _notebook_functions("blockwise_quantize", "blockwise_dequantize")
    torch.manual_seed(0)
    x = torch.randn(4096) * 0.01
    x[3] = 10.0
    err = {bs: Q.error_metrics(x, dequantize(*quantize(x, bs), x.numel()))["mean_abs_error"] for bs in (256, 4096)}
    assert err[256] < err[4096] / 10


def test_notebook_dynamic_quantizer_matches_bitsandbytes():
    import bitsandbytes.functional as BF

    quantize, dequantize = _notebook_functions("dynamic_quantize", "dynamic_dequantize")
    torch.manual_seed(0)
    x = torch.randn(4096) * 1e-3
    code = BF.create_dynamic_map(signed=True)
    idx, absmax, sorted_code = quantize(x, code, 256)
    assert idx.dtype == torch.uint8
    bnb_idx, _ = BF.quantize_blockwise(x, code=code, blocksize=256)
    same = (sorted_code[idx.long()].flatten() == code[bnb_idx.long()]).double().mean()
    assert same > 0.99  # bitsandbytes' kernel rounds a few near-ties the other way
    x_hat = dequantize(idx, absmax, sorted_code, x.numel())
    assert Q.error_metrics(x, x_hat)["mean_abs_error"] == pytest.approx(
        Q.error_metrics(x, Q.bnb_roundtrip(x, blocksize=256))["mean_abs_error"], rel=0.01)


def test_bnb_roundtrip_shapes_and_maps():
    import bitsandbytes.functional as BF

    torch.manual_seed(0)
    x = torch.randn(5000)
    assert Q.bnb_roundtrip(x.view(50, 100)).shape == (50, 100)
    assert Q.bnb_roundtrip(x.abs(), code=BF.create_dynamic_map(signed=False)).min() >= 0
    assert Q.bnb_roundtrip(x, blocksize=Q.BNB_BLOCKSIZE).shape == x.shape


@pytest.mark.parametrize("bad", [0, 1, 2.5, True, "256"])
def test_bad_blocksize(bad):
    with pytest.raises(ValueError, match="blocksize"):
        Q.bnb_roundtrip(torch.ones(4), blocksize=bad)


def test_bnb_roundtrip_bad_inputs():
    with pytest.raises(TypeError, match="code"):
        Q.bnb_roundtrip(torch.ones(4), code="fp8")
    with pytest.raises(TypeError, match="floating"):
        Q.bnb_roundtrip(torch.ones(4, dtype=torch.long))


def _model_and_step(make_opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # 8192, 128, 1280, 10
    opt = make_opt(model.parameters())
    F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
    opt.step()
    return model, opt


def test_state_bytes_torch_adamw_is_8_bytes_per_param():
    model, opt = _model_and_step(lambda p: torch.optim.AdamW(p, lr=1e-3))
    n = sum(p.numel() for p in model.parameters())
    # exp_avg + exp_avg_sq fp32, plus a 4-byte fp32 step tensor per parameter tensor
    assert memory.optimizer_state_bytes(opt) == 8 * n + 4 * 4
    table = Q.state_table(opt, model)
    assert list(table.param) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert (table["state dtype"] == "float32").all()
    assert table["bytes"].sum() == memory.optimizer_state_bytes(opt)


def test_state_bytes_bnb_8bit_matches_estimate():
    import bitsandbytes as bnb

    model, opt = _model_and_step(lambda p: bnb.optim.Adam8bit(p, lr=1e-3))
    sizes = [p.numel() for p in model.parameters()]
    table = Q.state_table(opt, model).set_index("param")
    assert table.loc["0.weight", "state dtype"] == "uint8"  # 8192 >= min_8bit_size 4096
    assert table.loc["2.weight", "state dtype"] == "float32"  # 1280 < 4096 keeps 32-bit state
    assert table.loc["0.weight", "absmax1"] == 4 * 8192 // 256
    qmaps = 2 * 256 * 4  # qmap1 + qmap2, shared by all 8-bit tensors, counted once
    assert memory.optimizer_state_bytes(opt) == estimate.optimizer_state_bytes(sum(sizes), "adam8bit", tensor_sizes=sizes) + qmaps


def test_state_bad_inputs():
    with pytest.raises(TypeError, match="Optimizer"):
        Q.state_table(object())
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="step"):
        Q.state_table(opt)
    with pytest.raises(TypeError, match="Module"):
        Q.state_table(opt, model="m")


def test_gpt2_tensor_sizes():
    assert sum(Q.gpt2_tensor_sizes("gpt2-xl")) == models.GPT2_XL_PARAMS
    real = sorted(p.numel() for p in models.build_gpt2("gpt2", n_layer=2, n_embd=64, n_head=4).parameters())
    assert sorted(Q.gpt2_tensor_sizes("gpt2", n_layer=2, n_embd=64, n_head=4)) == real
    with pytest.raises(ValueError):
        Q.gpt2_tensor_sizes("gpt5")


# ---------------------------------------------------------------- the exercise's checker (the notebook's cell)
@pytest.fixture(scope="module")
def check_block_quantizer():
    """The checker exactly as the notebook's hidden checker cell defines it, exec'd alone."""
    lesson = {"checker": lambda source, tags: "checker" in tags and "def check_block_quantizer" in source}
    return exec_lesson_cells(NOTEBOOK, lesson, {})["check_block_quantizer"]


def _code():
    import bitsandbytes.functional as BF

    return BF.create_dynamic_map(signed=True)


def _block():
    torch.manual_seed(0)
    block = torch.randn(256) * 1e-3
    block[7] = 0.05  # an outlier: the other values land on the map's fine codes near 0
    return block


def _quantize(block, code):
    absmax = block.abs().max()
    return (block[:, None] / absmax - code[None, :]).abs().argmin(dim=1).to(torch.uint8), absmax


def _dequantize(idx, absmax, code):
    return code[idx.long()] * absmax


def test_check_block_quantizer_passes_a_right_answer(check_block_quantizer, capsys):
    assert check_block_quantizer(_quantize, _dequantize, _block(), _code())
    out = capsys.readouterr().out
    assert "✗" not in out and "bitsandbytes' quantize_blockwise picks the same index as yours" in out


def _code_above(block, code):  # searchsorted: the code just above, not the nearest
    absmax = block.abs().max()
    return torch.searchsorted(code, block / absmax).clamp(max=255).to(torch.uint8), absmax


def _not_normalized(block, code):  # forgets to divide by absmax
    return torch.bucketize(block, (code[1:] + code[:-1]) / 2).to(torch.uint8), block.abs().max()


def _linear_int8(block, code):  # block-wise absmax with linear codes: int8, not indices into the map
    absmax = block.abs().max()
    return torch.round(block / absmax * 127).to(torch.int8), absmax


def _mean_not_max(block, code):
    scale = block.abs().mean()
    return (block[:, None] / scale - code[None, :]).abs().argmin(dim=1).to(torch.uint8), scale


@pytest.mark.parametrize("quantize, dequantize, says", [
    (_code_above, _dequantize, "nearest code"),
    (_not_normalized, _dequantize, "nearest code"),
    (_linear_int8, _dequantize, "uint8"),
    (_mean_not_max, _dequantize, "absmax of the block"),
    (_quantize, lambda idx, absmax, code: code[idx.long()], "dequantized right"),
    (_quantize, lambda idx, absmax, code: code[idx.long()][:10] * absmax, "shape"),
])
def test_check_block_quantizer_rejects_wrong_answers(check_block_quantizer, quantize, dequantize, says, capsys):
    assert not check_block_quantizer(quantize, dequantize, _block(), _code())
    assert says in capsys.readouterr().out


def test_checker_rejects_counts_every_wrong_answer(check_block_quantizer):

    check = lambda fns: check_block_quantizer(*fns, _block(), _code())  # noqa: E731
    assert checker_rejects(check, (_code_above, _dequantize), (_linear_int8, _dequantize))
    assert not checker_rejects(check, (_code_above, _dequantize), (_quantize, _dequantize))


def test_check_block_quantizer_bad_inputs(check_block_quantizer):
    block, code = _block(), _code()
    with pytest.raises(ValueError, match="None"):
        check_block_quantizer(lambda b, c: None, _dequantize, block, code)
    with pytest.raises(TypeError, match="functions themselves"):
        check_block_quantizer(None, _dequantize, block, code)
    with pytest.raises(ValueError, match="256"):
        check_block_quantizer(_quantize, _dequantize, block, code[:16])
    with pytest.raises(TypeError, match="floating"):
        check_block_quantizer(_quantize, _dequantize, block.long(), code)
    assert not check_block_quantizer(lambda b, c: b, _dequantize, block, code)

    def todo(*args):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        check_block_quantizer(todo, _dequantize, block, code)


@pytest.mark.parametrize("signed", [True, False])
def test_the_course_dynamic_map_is_bitsandbytes(signed):
    """Notebook 05 uses this copy where bitsandbytes is not installed: the same 256 values."""
    BF = pytest.importorskip("bitsandbytes.functional")
    ours = Q.create_dynamic_map(signed)
    assert ours.dtype == torch.float32 and ours.numel() == 256 and torch.equal(ours, BF.create_dynamic_map(signed))


def test_dynamic_map_bad_input():
    with pytest.raises(TypeError, match="signed must be True"):
        Q.create_dynamic_map("yes")
