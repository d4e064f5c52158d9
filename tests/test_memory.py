"""course_utils.memory: exact byte counts on known tensors and models, fake tensors, bad input."""
import pytest
import torch
from torch import nn

from course_utils import models
from course_utils.memory import MemoryReport, format_bytes, measure_memory, tensor_bytes


def _mlp_and_adam():
    torch.manual_seed(0)
    model = models.mlp(n_layers=2, width=128, in_features=64, n_classes=10)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train_step(model, opt, batch=32):
    x = torch.randn(batch, 64)
    y = torch.randint(0, 10, (batch,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_known_tensors_give_exact_bytes():
    def fn():
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float16)  # 1000 bytes
        del a, b

    report = measure_memory(fn)
    assert report.peak_bytes == 5000
    assert sum(report.by_category.values()) == 5000


def test_peak_is_the_maximum_not_the_sum():
    def fn():
        for _ in range(3):
            t = torch.empty(1024, dtype=torch.float32)
            del t

    assert measure_memory(fn).peak_bytes == 4096


def test_mlp_with_adam_exact_categories():
    model, opt = _mlp_and_adam()
    numel = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    report = measure_memory(lambda: _train_step(model, opt), model=model, optimizer=opt)
    assert report.by_category["params"] == numel * 4
    assert report.by_category["grads"] == numel * 4
    # Adam: exp_avg + exp_avg_sq in fp32 = 2 * numel * 4, plus one 4-byte `step` counter per tensor
    assert report.optimizer_state_bytes == 2 * numel * 4 + 4 * n_tensors
    assert report.by_category["optimizer"] == 2 * numel * 4 + 4 * n_tensors
    assert report.peak_bytes >= 4 * numel * 4
    assert report.device == "cpu"


def test_several_steps_in_one_fn():
    model, opt = _mlp_and_adam()
    one = measure_memory(lambda: _train_step(model, opt), model=model, optimizer=opt)
    three = measure_memory(lambda: [_train_step(model, opt) for _ in range(3)], model=model, optimizer=opt)
    assert three.peak_bytes == one.peak_bytes  # steady state: same peak each step


def test_sgd_has_no_state_and_momentum_one_copy():
    torch.manual_seed(0)
    for momentum, copies in ((0.0, 0), (0.9, 1)):
        model = models.mlp(n_layers=1, width=32, in_features=16, n_classes=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        numel = sum(p.numel() for p in model.parameters())

        def step():
            nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            opt.step()
            opt.zero_grad()

        report = measure_memory(step, model=model, optimizer=opt)
        assert report.optimizer_state_bytes == copies * numel * 4


def test_fake_gpt2_xl_params_are_2_bytes_each():
    with models.fake_mode():
        model = models.build_gpt2("gpt2-xl", dtype=torch.float16)
        numel = sum(p.numel() for p in model.parameters())
        ids = torch.zeros(1, 4, dtype=torch.long)

        def forward_only():
            with torch.no_grad():
                model(input_ids=ids)

        report = measure_memory(forward_only, model=model)
    assert numel == models.GPT2_XL_PARAMS
    assert report.fake
    assert report.by_category["params"] == 2 * numel
    assert report.peak_bytes >= 2 * numel


def test_report_repr_and_frame():
    model, opt = _mlp_and_adam()
    report = measure_memory(lambda: _train_step(model, opt), model=model, optimizer=opt)
    text = str(report)
    assert "params" in text and "Peak memory on cpu" in text
    frame = report.to_frame()
    assert set(frame.category) == {"params", "grads", "optimizer", "activations", "other"}
    assert isinstance(report, MemoryReport)


def test_tensor_bytes_counts_shared_storage_once():
    a = torch.empty(256, dtype=torch.float32)
    assert tensor_bytes(a, a[:10], a.view(16, 16)) == 1024
    assert tensor_bytes(a, torch.empty(10, dtype=torch.int8)) == 1034
    with pytest.raises(TypeError, match="tensors"):
        tensor_bytes([1, 2])


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(fn=42), TypeError, "zero-argument callable"),
        (dict(fn=lambda: None, model="resnet"), TypeError, "nn.Module"),
        (dict(fn=lambda: None, optimizer=object()), TypeError, "Optimizer"),
    ],
)
def test_bad_input_says_what_to_change(kwargs, error, match):
    fn = kwargs.pop("fn")
    with pytest.raises(error, match=match):
        measure_memory(fn, **kwargs)
