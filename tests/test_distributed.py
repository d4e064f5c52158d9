"""Tests of course_utils.distributed (ZeRO and pipeline arithmetic), of the exercise's checker and of the
worker scripts notebook 07 writes with ``%%writefile``: the tests take those cells from the notebook
itself (the checker is exec'd; the workers run on 2 real processes, gloo, CPU, through the course's launcher).
"""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_tools.launcher import launch
from course_utils import distributed as D
from course_utils.models import mlp
from notebook_lessons import exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "07_beyond_one_gpu.ipynb"

XL = 1_557_611_200


# ----------------------------------------------------------------------------- ZeRO formulas
def test_zero_stage0_is_16_bytes_per_param_on_every_rank():
    for n in (1, 2, 64):
        z = D.zero_bytes_per_rank(XL, n, 0)
        assert (z.params, z.grads, z.optimizer) == (2 * XL, 2 * XL, 12 * XL)
        assert z.total == 16 * XL


def test_zero_stages_shard_optimizer_then_grads_then_params():
    n = 8
    z1, z2, z3 = (D.zero_bytes_per_rank(XL, n, s) for s in (1, 2, 3))
    assert (z1.params, z1.grads, z1.optimizer) == (2 * XL, 2 * XL, 12 * XL // n)
    assert (z2.params, z2.grads, z2.optimizer) == (2 * XL, 2 * XL // n, 12 * XL // n)
    assert z3.total == 16 * XL // n
    # the paper's formulas: (2 + 2 + K/N), (2 + (2 + K)/N), (2 + 2 + K)/N bytes per parameter
    assert z1.total == (4 + 12 / n) * XL
    assert z2.total == (2 + 14 / n) * XL
    assert z3.total == 16 / n * XL


def test_zero_shards_round_up():
    z = D.zero_bytes_per_rank(10, 3, 3)   # 160 bytes over 3 ranks: padded shards
    assert (z.params, z.grads, z.optimizer) == (7, 7, 40)


def test_zero_table_and_min_world_size():
    df = D.zero_table(XL, (1, 2, 4))
    assert len(df) == 12 and set(df["stage"]) == {0, 1, 2, 3}
    one = df[(df.stage == 3) & (df.world_size == 4)].iloc[0]
    assert one["total"] == 4 * XL and math.isclose(one["total_GiB"], 4 * XL / 2**30)
    budget = 16 * 2**30
    assert D.min_world_size(XL, budget, 0) is None             # DDP never fits 24.9 GB in 16 GiB
    n3 = D.min_world_size(XL, budget, 3)
    assert n3 == 2                                               # 12.5 GB per rank
    assert D.zero_bytes_per_rank(XL, n3, 3).total <= budget < D.zero_bytes_per_rank(XL, n3 - 1, 3).total
    assert D.min_world_size(XL, 4 * 2**30, 1) is None          # 4 bytes/param of weights+grads always stay


@pytest.mark.parametrize("bad, err", [
    (dict(n_params=0, world_size=2, stage=1), ValueError),
    (dict(n_params=1.5, world_size=2, stage=1), TypeError),
    (dict(n_params=10, world_size=0, stage=1), ValueError),
    (dict(n_params=10, world_size=2, stage=4), ValueError),
    (dict(n_params=10, world_size=2, stage="3"), ValueError),
])
def test_zero_bad_input(bad, err):
    with pytest.raises(err):
        D.zero_bytes_per_rank(**bad)


def test_zero_table_empty_raises():
    with pytest.raises(ValueError, match="at least one"):
        D.zero_table(XL, ())


# ----------------------------------------------------------------------------- pipeline
def test_bubble_fraction_values():
    assert D.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert D.bubble_fraction(1, 5) == 0
    assert D.bubble_fraction(2, 1) == 0.5
    assert D.bubble_fraction(8, 1000) < 0.01


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (4, 8), (5, 2)])
def test_schedule_measured_bubble_matches_formula(p, m):
    sched = D.gpipe_schedule(p, m)
    assert len(sched) == 2 * p * m
    assert D.schedule_bubble_fraction(sched) == pytest.approx(D.bubble_fraction(p, m))
    # dependencies: forward of micro-batch j reaches stage s after stage s-1; backward flows back
    at = {(c["stage"], c["micro_batch"], c["phase"]): c["slot"] for c in sched}
    for j in range(m):
        for s in range(1, p):
            assert at[(s, j, "F")] > at[(s - 1, j, "F")]
            assert at[(s - 1, j, "B")] > at[(s, j, "B")]
        assert at[(p - 1, j, "B")] > at[(p - 1, m - 1, "F")]


def test_pipeline_bad_input():
    with pytest.raises(ValueError):
        D.bubble_fraction(0, 4)
    with pytest.raises(TypeError):
        D.bubble_fraction(4, 2.0)
    with pytest.raises(ValueError):
        D.schedule_bubble_fraction([])


def test_plots_draw():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax2 = D.plot_pipeline_schedule(3, 4)
    assert "bubble = 33%" in ax2.get_title()
    plt.close("all")


# ----------------------------------------------------------------------------- the exercise's checker (notebook cell)
@pytest.fixture(scope="module")
def check_row_parallel():
    checker = {"checker": lambda source, tags: "checker" in tags and "def check_row_parallel" in source}
    return exec_lesson_cells(NOTEBOOK, checker, {})["check_row_parallel"]


def _partials(x, weight, n):
    return [xr @ wr.T for xr, wr in zip(x.chunk(n, dim=1), weight.chunk(n, dim=1))]


def row_parallel(x, weight, bias, n):
    partials = _partials(x, weight, n)
    return partials, torch.stack(partials).sum(dim=0) + bias


def concatenates(x, weight, bias, n):
    partials = _partials(x, weight, n)
    return partials, torch.cat(partials, dim=-1) + bias.repeat(n)


def bias_on_every_rank(x, weight, bias, n):
    partials = [p + bias for p in _partials(x, weight, n)]
    return partials, torch.stack(partials).sum(dim=0)


def splits_the_outputs(x, weight, bias, n):
    partials = [x @ wr.T for wr in weight.chunk(n, dim=0)]
    return partials, torch.cat(partials, dim=-1) + bias


def one_rank_only(x, weight, bias, n):
    return [x @ weight.T], x @ weight.T + bias


def test_check_row_parallel_accepts_the_right_layer(check_row_parallel, capsys):
    assert check_row_parallel(row_parallel) is True
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [concatenates, bias_on_every_rank, splits_the_outputs, one_rank_only])
def test_check_row_parallel_rejects_plausible_mistakes(check_row_parallel, wrong, capsys):
    assert check_row_parallel(wrong) is False
    assert "✗" in capsys.readouterr().out


def test_check_row_parallel_unfilled_stub_and_bad_input(check_row_parallel):
    def stub(x, weight, bias, n):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        check_row_parallel(stub)
    with pytest.raises(TypeError, match="your function"):
        check_row_parallel("row_parallel")


# ----------------------------------------------------------------------------- the notebook's workers
def notebook_worker(variable: str, folder: Path) -> Path:
    """Write notebook 07's ``%%writefile "{VARIABLE}"`` cell to ``folder/variable.py``, as the notebook does."""
    for cell in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]:
        first, _, body = "".join(cell["source"]).partition("\n")
        if cell["cell_type"] == "code" and first.startswith("%%writefile") and f"{{{variable}}}" in first:
            path = folder / f"{variable.lower()}.py"
            path.write_text(body + "\n", encoding="utf-8")
            return path
    raise AssertionError(f"notebook 07 has no %%writefile cell for {variable}")


def _run(script: Path, run_dir: Path, inputs: dict) -> list:
    torch.save(inputs, run_dir / "data.pt")
    launch(script, run_dir, nproc=2, timeout_s=180)
    return [torch.load(run_dir / f"rank{r}.pt") for r in range(2)]


def test_notebook_fsdp_worker_shards_and_trains_like_one_process(tmp_path):
    script = notebook_worker("FSDP_WORKER", tmp_path)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
    cfg = {"seed": 3, "n_layers": 1, "width": 16, "n_classes": 4, "steps": 2, "lr": 1e-2}
    ranks = _run(script, tmp_path, {"x": x, "y": y, **cfg})

    torch.manual_seed(cfg["seed"])  # the single process the notebook compares with
    net = mlp(cfg["n_layers"], cfg["width"], 8, cfg["n_classes"])
    opt = torch.optim.Adam(net.parameters(), lr=cfg["lr"])
    losses = []
    for step in range(cfg["steps"]):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        losses.append(loss.item())
    n = sum(p.numel() for p in net.parameters())
    n_tensors = len(list(net.parameters()))
    for r in ranks:
        assert r["ddp"]["bytes"] == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * n_tensors}
        assert r["fsdp"]["bytes"] == {"params": 2 * n, "grads": 2 * n, "optimizer": 4 * n + 4 * n_tensors}
        for strategy in ("ddp", "fsdp"):
            assert r[strategy]["losses"] == pytest.approx(losses, abs=1e-5)
            for name, g in grads.items():
                torch.testing.assert_close(r[strategy]["grads"][name], g, atol=1e-6, rtol=1e-5)
            for name, p in net.named_parameters():
                torch.testing.assert_close(r[strategy]["params"][name], p.detach(), atol=2 * cfg["steps"] * cfg["lr"],
                                           rtol=0)


def test_notebook_tp_worker_equals_the_unsplit_layers(tmp_path):
    script = notebook_worker("TP_WORKER", tmp_path)
    torch.manual_seed(0)
    fc1, fc2, x = nn.Linear(6, 8), nn.Linear(8, 6), torch.randn(3, 6)
    ranks = _run(script, tmp_path, {"x": x, "w1": fc1.weight.detach(), "b1": fc1.bias.detach(),
                                    "w2": fc2.weight.detach(), "b2": fc2.bias.detach()})
    with torch.no_grad():
        expected = {"column_parallel": fc1(x), "row_parallel": fc2(fc1(x)), "megatron_mlp": fc2(F.gelu(fc1(x)))}
    for r in ranks:
        for name, want in expected.items():
            torch.testing.assert_close(r[name], want, atol=1e-5, rtol=1e-5)
        assert r["shapes"] == {"w1": (4, 6), "w2": (6, 4)}
        assert r["weight_bytes"] == 4 * (fc1.weight.numel() + fc1.bias.numel() + fc2.weight.numel()) // 2
