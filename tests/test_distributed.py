"""Tests of course_utils.distributed (formulas, launcher) and course_utils.dist_workers.

Four tests start real processes (2 ranks, gloo on CPU): a collective across ranks, a rank that
hangs (killed at the timeout, no process left behind), a rank that raises (its traceback
reaches the parent) and a launcher killed by SIGKILL (its ranks exit by themselves).
"""
import json
import math
import time

import psutil
import pytest
import torch
import torch.nn.functional as F

from course_utils import distributed as D
from course_utils import dist_workers as W

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


def test_zero_shards_round_up_and_custom_bytes():
    z = D.zero_bytes_per_rank(10, 3, 3)   # 160 bytes over 3 ranks: padded shards
    assert (z.params, z.grads, z.optimizer) == (7, 7, 40)
    fp32 = D.zero_bytes_per_rank(100, 4, 3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32.total == 400


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
    (dict(n_params=10, world_size=2, stage=1, param_bytes=-2), ValueError),
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

    ax = D.plot_zero_per_rank(XL, (1, 2, 4), budget_bytes=12 * 2**30)
    assert len(ax.get_lines()) >= 4
    ax2 = D.plot_pipeline_schedule(3, 4)
    assert "bubble = 33%" in ax2.get_title()
    plt.close("all")


# ----------------------------------------------------------------------------- offload
def test_offload_pcie_cost():
    c = D.offload_pcie_cost(XL, link="pcie3_x16")
    assert c.bytes_to_cpu == 2 * XL and c.bytes_to_gpu == 2 * XL and c.bytes_per_step == 4 * XL
    assert c.seconds_per_step == pytest.approx(4 * XL / 15.75e9)
    assert D.offload_pcie_cost(1000, link=10, efficiency=0.5).seconds_per_step == pytest.approx(4000 / 5e9)
    for bad in (dict(link="pcie9"), dict(link=0), dict(efficiency=0), dict(efficiency=1.5)):
        with pytest.raises(ValueError):
            D.offload_pcie_cost(1000, **bad)


def test_deepspeed_config_is_json_and_checks_stage():
    cfg = D.deepspeed_zero_offload_config(micro_batch_size=4, grad_accum_steps=16)
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in cfg["zero_optimization"]
    assert "offload_param" in D.deepspeed_zero_offload_config(stage=3, offload_params=True)["zero_optimization"]
    with pytest.raises(ValueError, match="stage=3"):
        D.deepspeed_zero_offload_config(stage=2, offload_params=True)
    with pytest.raises(ValueError):
        D.deepspeed_zero_offload_config(stage=0)


# ----------------------------------------------------------------------------- shard accounting
def test_local_state_bytes_plain_model():
    model = W.build_mlp(8, 16, 4, 1, seed=0)
    opt = torch.optim.Adam(model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert D.local_state_bytes(model, opt) == {"params": 4 * n, "grads": 0, "optimizer": 0}
    F.cross_entropy(model(torch.randn(2, 8)), torch.tensor([0, 1])).backward()
    opt.step()
    b = D.local_state_bytes(model, opt)
    assert b["grads"] == 4 * n and b["optimizer"] == 8 * n + 4 * len(list(model.parameters()))  # m, v, step
    with pytest.raises(TypeError):
        D.local_state_bytes("model")
    with pytest.raises(ValueError):
        W.build_mlp(8, 0, 4)
    with pytest.raises(ValueError, match="multiple of 2"):
        W.rank_slice(5, 0, 2)


# ----------------------------------------------------------------------------- launcher
def test_find_free_port_and_backend():
    port = D.find_free_port()
    assert 0 < port < 65536
    assert D.default_backend(1) == "gloo"
    if torch.cuda.device_count() < 2:
        assert D.default_backend(2) == "gloo"


def test_launch_rejects_bad_input():
    def local_fn():
        return 1

    with pytest.raises(TypeError, match="module"):
        D.launch(local_fn, 2)
    with pytest.raises(TypeError, match="module"):
        D.launch(lambda: 1, 2)
    with pytest.raises(TypeError):
        D.launch("fn", 2)
    with pytest.raises(ValueError):
        D.launch(W.rank_info_worker, 0)
    with pytest.raises(ValueError, match="gloo"):
        D.launch(W.rank_info_worker, 2, backend="mpi")
    with pytest.raises(ValueError):
        D.launch(W.rank_info_worker, 2, timeout_s=0)
    with pytest.raises(TypeError):
        D.launch(W.rank_info_worker, 2, args=5)


def _my_children():
    return [c for c in psutil.Process().children(recursive=True) if c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE]


def test_launch_two_ranks_all_reduce_over_gloo():
    before = {c.pid for c in _my_children()}
    results = D.launch(W.rank_info_worker, 2, args=(2.0,), backend="gloo", timeout_s=90)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" for r in results)
    assert [r["sum"] for r in results] == [6.0, 6.0]           # 2*1 + 2*2 on both ranks
    assert results[0]["pid"] != results[1]["pid"]
    assert {c.pid for c in _my_children()} <= before           # nothing left running


def test_launch_kills_hanging_ranks_at_timeout(tmp_path):
    before = {c.pid for c in _my_children()}
    t0 = time.monotonic()
    with pytest.raises(D.LaunchError, match="did not finish within timeout_s=3"):
        D.launch(W.hang_worker, 2, args=(str(tmp_path),), timeout_s=3, grace_s=1)
    assert time.monotonic() - t0 < 3 + 1 + 6                    # timeout + grace + SIGKILL wait, not forever
    assert {c.pid for c in _my_children()} <= before           # no orphaned ranks
    for pid_file in tmp_path.glob("rank*.pid"):                 # ranks that got as far as the hang are gone
        assert not psutil.pid_exists(int(pid_file.read_text())) or \
            psutil.Process(int(pid_file.read_text())).status() == psutil.STATUS_ZOMBIE


def test_launch_reports_a_failing_rank_and_stops_the_others():
    before = {c.pid for c in _my_children()}
    with pytest.raises(D.LaunchError) as info:
        D.launch(W.failing_worker, 2, kwargs={"bad_rank": 1}, timeout_s=90, grace_s=1)
    msg = str(info.value)
    assert "failed on rank(s) [1]" in msg or "failed on rank(s) [0, 1]" in msg
    assert "rank 1 failed on purpose" in msg                    # the rank's own traceback reaches the parent
    assert {c.pid for c in _my_children()} <= before


@pytest.mark.slow
def test_ranks_exit_when_the_launcher_is_killed(tmp_path):
    """Even a SIGKILLed notebook kernel leaves no rank behind: each rank watches its parent."""
    import os
    import signal
    import subprocess
    import sys

    code = ("from course_utils import distributed as D, dist_workers as W; "
            f"D.launch(W.hang_worker, 2, args=({str(tmp_path)!r},), timeout_s=120)")
    work = tmp_path / "tmp"
    work.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(work)})
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert time.monotonic() < deadline, "the ranks never started"
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in tmp_path.glob("rank*.pid"):  # never leave a stray process, even if the test fails
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
