"""The memory timeline: its peak is measure_memory's, exactly; its export loads in PyTorch's memory viewer."""
import contextlib
import copy

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import allocator, hardware, models, timeline
from course_utils.memory import CATEGORIES, measure_memory

matplotlib.use("Agg")


def _mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters())

    def step():
        x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam's state exists, as in the middle of training
    return model, opt, step


def _gpt_step(fake=False):
    ctx = models.fake_mode() if fake else contextlib.nullcontext()
    with ctx:
        model = models.build_gpt2("gpt2", n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        opt = torch.optim.Adam(model.parameters())

        def step():
            ids = torch.randint(0, 512, (2, 32))
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
    return model, opt, step, ctx


@pytest.fixture(scope="module")
def mlp_timeline():
    model, opt, step = _mlp_step()
    return timeline.record_timeline(step, model=model, optimizer=opt), measure_memory(step, model=model, optimizer=opt)


def test_peak_equals_measure_memory_exactly(mlp_timeline):
    tl, report = mlp_timeline
    assert tl.peak_bytes == report.peak_bytes > 0
    assert sum(tl.at_peak().values()) == tl.peak_bytes
    assert list(tl.curve().columns) == list(CATEGORIES) and (tl.curve() >= 0).all().all()


def test_gpt2_real_and_fake_peaks_match_measure_memory():
    peaks = {}
    for fake in (False, True):
        model, opt, step, ctx = _gpt_step(fake)
        with ctx:
            tl = timeline.record_timeline(step, model=model, optimizer=opt)
            report = measure_memory(step, model=model, optimizer=opt)
        assert tl.fake == fake and tl.peak_bytes == report.peak_bytes
        peaks[fake] = tl.peak_bytes
    assert peaks[True] == peaks[False]  # fake tensors have the real tensors' sizes


def test_phases_come_in_training_order(mlp_timeline):
    tl, _ = mlp_timeline
    phases = tl.events.phase
    assert list(phases[phases != phases.shift()]) == ["start", "forward", "backward", "optimizer"]  # one run each
    start = tl.events[tl.events.phase == "start"]
    assert set(start.category) == {"params", "optimizer"} and (start.action == "alloc").all()
    assert (tl.events.category == "grads").any() and (tl.events.action == "move").any()


def test_trace_replays_in_the_simulator(mlp_timeline):
    tl, _ = mlp_timeline
    frame, sim = allocator.replay(tl.trace())
    assert frame["requested"].max() == tl.peak_bytes
    assert (frame["reserved"] >= frame["allocated"]).all()
    assert sim.peak_reserved >= tl.peak_bytes


@pytest.mark.parametrize("options", [{}, {"expandable_segments": True}])
def test_snapshot_export_loads_in_pytorchs_viewer(mlp_timeline, options):
    tl, _ = mlp_timeline
    snapshot = timeline.to_snapshot(tl, **options)
    summary = timeline.check_snapshot(snapshot)  # trace_plot, segment_plot, trace and segsum all read it
    assert "total_reserved" in summary
    frame = timeline.snapshot_frame(snapshot)
    replayed, sim = allocator.replay(tl.trace(), **options)
    assert frame["reserved"].max() == sim.peak_reserved
    assert frame["allocated"].max() == replayed["requested"].max() == tl.peak_bytes
    assert frame["allocated"].iloc[-1] == replayed["requested"].iloc[-1]


def test_check_snapshot_rejects_a_broken_snapshot(mlp_timeline):
    tl, _ = mlp_timeline
    broken = copy.deepcopy(timeline.to_snapshot(tl))
    broken["segments"][0]["total_size"] += 512  # the blocks no longer add up
    with pytest.raises(ValueError, match="cannot read"):
        timeline.check_snapshot(broken)
    with pytest.raises(ValueError, match="segments"):
        timeline.check_snapshot({"traces": []})


def test_snapshot_frame_reads_a_recording_that_began_mid_run():
    snapshot = {"segments": [{"device": 0, "address": 0, "total_size": 20 << 20, "stream": 0,
                              "blocks": [{"size": 4 << 20, "requested_size": 3 << 20, "state": "active_allocated"},
                                         {"size": 16 << 20, "state": "inactive"}]}],
                "device_traces": [[{"action": "alloc", "addr": 0, "size": 3 << 20}]]}
    frame = timeline.snapshot_frame(snapshot)
    assert frame.to_dict("records") == [{"action": "alloc", "allocated": 3 << 20, "reserved": 20 << 20}]
    with pytest.raises(ValueError, match="device 1"):
        timeline.snapshot_frame(snapshot, device=1)


def test_plot_and_bad_input(mlp_timeline):
    tl, _ = mlp_timeline
    frame, _ = allocator.replay(tl.trace())
    ax = timeline.plot_timeline(tl, reserved=frame["reserved"])
    assert ax.get_ylabel() == "MiB"
    matplotlib.pyplot.close("all")
    with pytest.raises(TypeError, match="Timeline"):
        timeline.plot_timeline("nope")
    with pytest.raises(ValueError, match="unit"):
        timeline.plot_timeline(tl, unit="MB")
    with pytest.raises(ValueError, match="one per alloc/free"):
        timeline.plot_timeline(tl, reserved=frame["reserved"][:-1])
    with pytest.raises(TypeError, match="callable"):
        timeline.record_timeline(42)
    with pytest.raises(TypeError, match="Module"):
        timeline.record_timeline(lambda: None, model="gpt2")


def test_the_private_memtracker_api_we_use_is_there():
    from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

    assert {"ADD", "DEL", "REF", "SIZE"} <= set(_UpdateType.__members__)
    tracker = MemTracker()
    for name in ("_in_opt", "_mod_tracker", "_WINFO", "_depth", "memory_tracking"):
        assert hasattr(tracker, name), name
    for name in ("_update_snap", "_update_peak_stats", "_pre_fw_hook"):
        assert callable(getattr(MemTracker, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_real_snapshot_reads_back_and_the_simulator_is_within_10_percent():
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # earlier tests' workspaces go: this step makes two (its thread, backward's)
    torch.cuda.empty_cache()
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters())

    def step():
        model(torch.randn(512, 1024, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tl = timeline.record_timeline(step, model=model, optimizer=opt)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    frame = timeline.snapshot_frame(snapshot)
    assert frame["reserved"].iloc[-1] == torch.cuda.memory_reserved()
    assert frame["reserved"].max() <= torch.cuda.max_memory_reserved()
    workspaces = [("alloc", ("cuBLAS", n), hardware.cublas_workspace_bytes(handles=1)) for n in range(2)]
    _, sim = allocator.replay(workspaces + tl.trace(), **allocator.options_from_env())
    assert abs(sim.peak_reserved - torch.cuda.max_memory_reserved()) <= 0.1 * torch.cuda.max_memory_reserved()
