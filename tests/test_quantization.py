"""Tests of course_utils.quantization (notebook 05)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import estimate, models
from course_utils import quantization as Q


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


def test_blockwise_roundtrip_and_shapes():
    torch.manual_seed(0)
    x = torch.randn(1000)
    q, absmax = Q.blockwise_quantize(x, 256)
    assert q.dtype == torch.int8 and q.numel() == 1000 and absmax.numel() == 4
    assert int(q.abs().max()) == 127  # each block's largest value maps to +-127
    x_hat = Q.blockwise_dequantize(q, absmax, 256, x.shape)
    # rounding error is at most half a step: absmax / 127 / 2 per block
    assert (x - x_hat).abs().max() <= absmax.max() / 127 / 2 + 1e-6
    assert torch.equal(Q.blockwise_quantize(torch.zeros(10), 4)[0], torch.zeros(10, dtype=torch.int8))


def test_blockwise_isolates_an_outlier():
    torch.manual_seed(0)
    x = torch.randn(4096) * 0.01
    x[3] = 10.0
    global_err = Q.error_metrics(x, Q.blockwise_dequantize(*Q.blockwise_quantize(x, 4096), 4096))["mean_abs_error"]
    block_err = Q.error_metrics(x, Q.blockwise_dequantize(*Q.blockwise_quantize(x, 256), 256))["mean_abs_error"]
    assert block_err < global_err / 10


def test_reference_matches_bitsandbytes_linear_map():
    torch.manual_seed(0)
    x = torch.randn(5000)
    ours = Q.error_metrics(x, Q.blockwise_dequantize(*Q.blockwise_quantize(x, 256), 256))["mean_abs_error"]
    bnb = Q.error_metrics(x, Q.bnb_roundtrip(x, blocksize=256, code="linear"))["mean_abs_error"]
    assert ours == pytest.approx(bnb, rel=0.02)
    assert Q.bnb_roundtrip(x.view(50, 100)).shape == (50, 100)
    v = x.abs()
    assert Q.bnb_roundtrip(v, code="dynamic_unsigned").min() >= 0


@pytest.mark.parametrize("bad", [0, 1, 2.5, True, "256"])
def test_bad_blocksize(bad):
    with pytest.raises(ValueError, match="blocksize"):
        Q.blockwise_quantize(torch.ones(4), bad)


def test_dequantize_bad_inputs():
    q, absmax = Q.blockwise_quantize(torch.randn(100), 10)
    with pytest.raises(ValueError, match="same blocksize"):
        Q.blockwise_dequantize(q, absmax, 20)
    with pytest.raises(TypeError, match="integer"):
        Q.blockwise_dequantize(q.float(), absmax, 10)
    with pytest.raises(ValueError, match="code"):
        Q.bnb_roundtrip(torch.ones(4), code="fp8")


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
    assert Q.state_bytes(opt) == 8 * n + 4 * 4
    table = Q.state_table(opt, model)
    assert list(table.param) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert (table["state dtype"] == "float32").all()
    assert table["bytes"].sum() == Q.state_bytes(opt)


def test_state_bytes_bnb_8bit_matches_estimate():
    import bitsandbytes as bnb

    model, opt = _model_and_step(lambda p: bnb.optim.Adam8bit(p, lr=1e-3))
    sizes = [p.numel() for p in model.parameters()]
    table = Q.state_table(opt, model).set_index("param")
    assert table.loc["0.weight", "state dtype"] == "uint8"  # 8192 >= min_8bit_size 4096
    assert table.loc["2.weight", "state dtype"] == "float32"  # 1280 < 4096 keeps 32-bit state
    assert table.loc["0.weight", "absmax1"] == 4 * 8192 // 256
    qmaps = 2 * 256 * 4  # qmap1 + qmap2, shared by all 8-bit tensors, counted once
    assert Q.state_bytes(opt) == estimate.optimizer_state_bytes(sum(sizes), "adam8bit", tensor_sizes=sizes) + qmaps


def test_state_bad_inputs():
    with pytest.raises(TypeError, match="Optimizer"):
        Q.state_bytes(object())
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    assert Q.state_bytes(opt) == 0
    with pytest.raises(ValueError, match="step"):
        Q.state_table(opt)
    with pytest.raises(TypeError, match="Module"):
        Q.state_table(opt, model="m")


def test_gpt2_tensor_sizes():
    assert sum(Q.gpt2_tensor_sizes("gpt2-xl")) == models.GPT2_XL_PARAMS
    cfg = models.gpt2_config("gpt2", n_layer=2, n_embd=64, n_head=4)
    real = sorted(p.numel() for p in models.build_gpt2(cfg).parameters())
    assert sorted(Q.gpt2_tensor_sizes(cfg)) == real
    with pytest.raises(ValueError):
        Q.gpt2_tensor_sizes("gpt5")
    with pytest.raises(TypeError):
        Q.gpt2_tensor_sizes(42)


def test_check_blockwise_exercise(capsys):
    torch.manual_seed(0)
    x = torch.randn(3000) * 0.01
    x[5] = 3.0
    assert Q.check_blockwise_exercise(Q.blockwise_quantize, Q.blockwise_dequantize, x, 256)

    def global_absmax(x, blocksize):  # ignores the blocks: one absmax for everything
        q, a = Q.blockwise_quantize(x, x.numel())
        return q, a.repeat(math.ceil(x.numel() / blocksize))

    def deq(q, absmax, blocksize, shape):
        return Q.blockwise_dequantize(q, absmax[:1], q.numel(), shape)

    assert not Q.check_blockwise_exercise(global_absmax, deq, x, 256)
    assert not Q.check_blockwise_exercise(lambda x, b: (x.to(torch.float16), torch.ones(12)), deq, x, 256)
    assert "int8" in capsys.readouterr().out
    with pytest.raises(ValueError, match="None"):
        Q.check_blockwise_exercise(lambda x, b: None, deq, x, 256)
    with pytest.raises(TypeError, match="functions themselves"):
        Q.check_blockwise_exercise(None, deq, x)

    def todo(x, b):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        Q.check_blockwise_exercise(todo, deq, x)
