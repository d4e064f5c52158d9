"""course_utils.accumulation (gradient comparison, the micro-batch sweep) and the BatchNorm -> GroupNorm converter
that notebook 02 writes in a cell: the tests take that cell from the notebook and run it."""
import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from course_utils import accumulation as acc

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "02_gradient_accumulation.ipynb"


def _notebook_converter():
    """The notebook's own ``convert_bn_to_gn``: the code cell that defines it, executed here."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    (source,) = [s for s in sources if "def convert_bn_to_gn(" in s]
    namespace = {"torch": torch, "nn": nn}
    exec(compile(source, f"{NOTEBOOK.name}:convert_bn_to_gn", "exec"), namespace)
    return namespace["convert_bn_to_gn"]


def _batch(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 12, 12, generator=g), torch.randint(0, 10, (n,), generator=g)


def _grad_big_and_accumulated(model, x, y, k):
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    big = copy.deepcopy(model)
    (loss_fn(big(x), y) / len(x)).backward()
    small = copy.deepcopy(model)
    for xm, ym in acc.micro_batches(x, y, k):
        (loss_fn(small(xm), ym) / len(x)).backward()
    return acc.flat_grad(big), acc.flat_grad(small)


def test_groupnorm_accumulation_is_exact_batchnorm_is_not():
    torch.manual_seed(0)
    x, y = _batch(24)
    big, small = _grad_big_and_accumulated(acc.small_cnn("group"), x, y, k=4)
    assert acc.rel_diff(small, big) < 1e-5
    torch.manual_seed(0)
    big_bn, small_bn = _grad_big_and_accumulated(acc.small_cnn("batch"), x, y, k=4)
    assert acc.rel_diff(small_bn, big_bn) > 1e-2  # statistics per micro-batch change the gradient


def test_notebook_converter_plain_batchnorm_makes_accumulation_exact():
    convert_bn_to_gn = _notebook_converter()
    torch.manual_seed(0)
    model = acc.small_cnn("batch")
    assert convert_bn_to_gn(model) == 2
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) == 2
    x, y = _batch(12)
    big, small = _grad_big_and_accumulated(model, x, y, k=3)
    assert acc.rel_diff(small, big) < 1e-5


def test_notebook_converter_keeps_timm_activations_and_affine():
    timm = pytest.importorskip("timm")
    from timm.layers.norm_act import BatchNormAct2d, GroupNormAct

    convert_bn_to_gn = _notebook_converter()
    bn_act = BatchNormAct2d(8, act_layer=nn.SiLU)
    with torch.no_grad():
        bn_act.weight.fill_(2.0)
        bn_act.bias.fill_(0.5)
    holder = nn.Sequential(nn.Conv2d(1, 8, 3), bn_act)
    assert convert_bn_to_gn(holder) == 1
    gn = holder[1]
    assert isinstance(gn, GroupNormAct) and isinstance(gn.act, nn.SiLU)
    assert torch.equal(gn.weight, torch.full((8,), 2.0)) and torch.equal(gn.bias, torch.full((8,), 0.5))
    out = holder(torch.randn(2, 1, 6, 6))
    assert out.min().item() >= -0.2785  # SiLU's minimum: the activation is still applied
    m = timm.create_model("efficientnet_b0", in_chans=1, num_classes=10)
    n_silu = sum(isinstance(mod, nn.SiLU) for mod in m.modules())
    assert convert_bn_to_gn(m) == 49
    assert sum(isinstance(mod, nn.SiLU) for mod in m.modules()) == n_silu
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in m.modules())


def test_notebook_converter_groups_and_non_affine():
    convert_bn_to_gn = _notebook_converter()
    model = acc.small_cnn("batch", width=4)  # channels 4 and 8
    grouped = copy.deepcopy(model)
    assert convert_bn_to_gn(grouped, num_groups=4) == 2
    assert [m.num_groups for m in grouped.modules() if isinstance(m, nn.GroupNorm)] == [4, 4]
    with pytest.raises(ValueError, match="divisible"):  # torch's own message: 3 groups cannot split 4 channels
        convert_bn_to_gn(copy.deepcopy(model), num_groups=3)
    plain = nn.Sequential(nn.BatchNorm2d(4, affine=False))
    assert convert_bn_to_gn(plain) == 1 and plain[0].weight is None


def test_rel_diff_and_flat_vectors():
    a = torch.tensor([3.0, 4.0])
    assert acc.rel_diff(a, a) == 0.0
    assert acc.rel_diff(torch.zeros(2), a) == pytest.approx(1.0)
    assert acc.rel_diff(a * 1.1, a) == pytest.approx(0.1)
    model = nn.Linear(3, 2)
    assert torch.equal(acc.flat_grad(model), torch.zeros(8, dtype=torch.float64))  # no .grad yet: zeros
    assert acc.flat_params(model).shape == (8,)
    with pytest.raises(ValueError, match="all zeros"):
        acc.rel_diff(acc.flat_grad(model), acc.flat_grad(model))
    with pytest.raises(ValueError, match="Shapes differ"):
        acc.rel_diff(torch.ones(2), torch.ones(3))
    with pytest.raises(TypeError):
        acc.rel_diff([1.0], [1.0])
    with pytest.raises(ValueError, match="no trainable"):
        acc.flat_grad(nn.ReLU())


def test_micro_batches_and_small_cnn_checks():
    x, y = _batch(10)
    parts = acc.micro_batches(x, y, 4)
    assert [len(p[0]) for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    for bad in (0, 11, 2.0, True):
        with pytest.raises(ValueError):
            acc.micro_batches(x, y, bad)
    with pytest.raises(ValueError, match="same number"):
        acc.micro_batches(x, y[:5], 2)
    with pytest.raises(ValueError, match="norm"):
        acc.small_cnn("layer")
    with pytest.raises(ValueError, match="width"):
        acc.small_cnn(width=0)
    assert acc.small_cnn("none")(x).shape == (10, 10)


def _sweep_setup(width=32):
    torch.manual_seed(0)
    model = acc.small_cnn("group", width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def micro_step(x, y, n_total):
        (loss_fn(model(x), y) / n_total).backward()

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, micro_step, optimizer_step


def test_sweep_memory_falls_with_micro_batch_and_last_only_matches_whole_cycle():
    model, opt, micro_step, optimizer_step = _sweep_setup()
    x, y = _batch(32)
    micro_step(x[:8], y[:8], 8)
    optimizer_step()  # optimizer state exists, as in the middle of training
    fast = acc.sweep_micro_batch_sizes(model, opt, micro_step, optimizer_step, x, y, [32, 8, 4])
    assert list(fast["k"]) == [1, 4, 8] and fast["fits"].all()
    peaks = list(fast["peak_bytes"])
    assert peaks[0] > peaks[1] > peaks[2]
    assert (fast["seconds_per_sample"] > 0).all()
    assert (fast["grads_MiB"].iloc[1:] > 0).all()  # accumulated gradients held while the last micro-batch runs
    whole = acc.sweep_micro_batch_sizes(model, opt, micro_step, optimizer_step, x, y, [32, 8], whole_cycle=True)
    for a, b in zip(fast["peak_bytes"], whole["peak_bytes"]):
        assert abs(a - b) / b < 0.02  # measuring the last micro-batch gives the whole update's peak


def test_sweep_records_out_of_memory_and_goes_on():
    model, opt, micro_step, optimizer_step = _sweep_setup(width=4)
    x, y = _batch(8)

    def picky_step(xm, ym, n_total):
        if len(xm) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        micro_step(xm, ym, n_total)

    df = acc.sweep_micro_batch_sizes(model, opt, picky_step, optimizer_step, x, y, [8, 4])
    assert list(df["fits"]) == [False, True]
    assert df["peak_MiB"].isna().tolist() == [True, False]

    def broken_step(xm, ym, n_total):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        acc.sweep_micro_batch_sizes(model, opt, broken_step, optimizer_step, x, y, [8])


def test_sweep_bad_input():
    model, opt, micro_step, optimizer_step = _sweep_setup(width=4)
    x, y = _batch(12)
    with pytest.raises(ValueError, match="divide"):
        acc.sweep_micro_batch_sizes(model, opt, micro_step, optimizer_step, x, y, [5])
    with pytest.raises(ValueError, match="empty"):
        acc.sweep_micro_batch_sizes(model, opt, micro_step, optimizer_step, x, y, [])
    with pytest.raises(TypeError, match="optimizer"):
        acc.sweep_micro_batch_sizes(model, "adam", micro_step, optimizer_step, x, y, [4])
    with pytest.raises(TypeError, match="micro_step"):
        acc.sweep_micro_batch_sizes(model, opt, None, optimizer_step, x, y, [4])
    with pytest.raises(ValueError, match="same non-zero"):
        acc.sweep_micro_batch_sizes(model, opt, micro_step, optimizer_step, x, y[:3], [4])
    with pytest.raises(ValueError, match="min_run_time"):
        acc.sweep_micro_batch_sizes(model, opt, micro_step, optimizer_step, x, y, [4], min_run_time=0)


# ---------------------------------------------------------------- notebook 02's exercise checker, from its cells
def _exercise():
    """Notebook 02's exercise cells (the micro-batches, the stub, the checker, the solution) on random digits."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from notebook_lessons import exec_lesson_cells

    from course_utils.checks import check_exercise, claim

    gen = torch.Generator().manual_seed(0)
    namespace = dict(torch=torch, nn=nn, copy=copy, acc=acc, check_exercise=check_exercise, claim=claim,
                     DEVICE=torch.device("cpu"), images=torch.rand(64, 1, 28, 28, generator=gen),
                     labels=torch.randint(0, 10, (64,), generator=gen))
    return exec_lesson_cells(NOTEBOOK_02, {
        "micro-batches": lambda s, t: s.startswith("ex_sizes ="),
        "stub": lambda s, t: "def my_accumulate(" in s,
        "checker": lambda s, t: "def check_accumulation(" in s,
        "solution": lambda s, t: "solution" in t}, namespace)


NOTEBOOK_02 = Path(__file__).resolve().parent.parent / "notebooks" / "02_gradient_accumulation.ipynb"


def _wrong_mean_over_k(model, micro_batches):  # the article's normalization: each micro-batch's mean / k
    model.zero_grad(set_to_none=True)
    for x, y in micro_batches:
        (nn.functional.cross_entropy(model(x), y, ignore_index=-100) / len(micro_batches)).backward()


def _wrong_count_rows(model, micro_batches):  # counts the ignored rows too
    model.zero_grad(set_to_none=True)
    n_rows = sum(len(y) for _, y in micro_batches)
    for x, y in micro_batches:
        (nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n_rows).backward()


def _wrong_keeps_old_grad(model, micro_batches):  # right normalization, but the stale gradient stays
    n_counted = sum(int((y != -100).sum()) for _, y in micro_batches)
    for x, y in micro_batches:
        (nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n_counted).backward()


def test_notebook_02_checker_accepts_the_solution_and_rejects_each_mistake(capsys):
    lesson = _exercise()  # exec'ing the solution cell already claimed that it passes
    assert lesson["check_accumulation"](lesson["solution_accumulate"])
    for wrong in (_wrong_mean_over_k, _wrong_count_rows, _wrong_keeps_old_grad):
        assert not lesson["check_accumulation"](wrong), wrong.__name__
    assert "fill in my_accumulate" in capsys.readouterr().out  # the stub's NotImplementedError is explained
