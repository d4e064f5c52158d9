"""The caching-allocator simulator follows CUDACachingAllocator.cpp's rules; OOM messages parse and diagnose."""
import ast
import json
from pathlib import Path

import pytest
import torch

from course_utils import allocator as A
from course_utils.units import GIB, KIB, MIB
from notebook_lessons import checker_rejects

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01b_reading_gpu_memory.ipynb"


def test_constants_are_pytorchs():
    # kMinBlockSize, kSmallSize, kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge in CUDACachingAllocator.cpp
    assert (A.K_MIN_BLOCK_SIZE, A.K_SMALL_SIZE, A.K_SMALL_BUFFER) == (512, 1048576, 2097152)
    assert (A.K_LARGE_BUFFER, A.K_MIN_LARGE_ALLOC, A.K_ROUND_LARGE) == (20971520, 10485760, 2097152)


@pytest.mark.parametrize("nbytes, rounded", [(0, 512), (1, 512), (512, 512), (513, 1024), (4 * MIB + 1, 4 * MIB + 512)])
def test_round_size(nbytes, rounded):
    assert A.round_size(nbytes) == rounded


@pytest.mark.parametrize("size, segment", [(512, 2 * MIB), (MIB, 2 * MIB), (MIB + 512, 20 * MIB),
                                           (10 * MIB - 512, 20 * MIB), (10 * MIB, 10 * MIB), (11 * MIB, 12 * MIB)])
def test_allocation_size(size, segment):
    assert A.allocation_size(size) == segment


def test_small_requests_share_a_2_mib_segment():
    sim = A.CachingAllocator()
    for i in range(4):
        sim.malloc(100 * KIB, i)
    assert sim.reserved == 2 * MIB and len(sim.segments) == 1
    assert sim.allocated == 4 * A.round_size(100 * KIB)


def test_a_3_mib_request_gets_a_20_mib_segment_and_the_rest_is_reused():
    sim = A.CachingAllocator()
    sim.malloc(3 * MIB, "a")
    assert (sim.reserved, sim.allocated) == (20 * MIB, 3 * MIB)
    sim.malloc(3 * MIB, "b")
    assert sim.reserved == 20 * MIB and len(sim.segments[0].blocks) == 3


def test_a_large_remainder_of_1_mib_or_less_is_not_split():
    sim = A.CachingAllocator()
    sim.malloc(11 * MIB, "a")  # 12 MiB segment, 1 MiB left: should_split needs more than kSmallSize
    assert sim.allocated == 12 * MIB and len(sim.segments[0].blocks) == 1


def test_free_merges_neighbours_and_empty_cache_keeps_segments_in_use():
    sim = A.CachingAllocator()
    for key in "abc":
        sim.malloc(3 * MIB, key)
    sim.free("b")
    sim.free("a")
    assert [(b.size // MIB, b.allocated) for b in sim.segments[0].blocks] == [(6, False), (3, True), (11, False)]
    assert sim.empty_cache() == 0  # c is alive: its segment cannot go back
    sim.malloc(50 * MIB, "big")
    sim.free("big")
    assert sim.empty_cache() == 50 * MIB and sim.reserved == 20 * MIB
    assert sim.memory_stats()["reserved_bytes.all.peak"] == 70 * MIB


def test_max_split_size_keeps_oversize_blocks_whole():
    sim = A.CachingAllocator(max_split_size=32 * MIB)
    sim.malloc(40 * MIB, "a")
    sim.free("a")
    sim.malloc(5 * MIB, "b")  # an oversize cached block is not handed to a smaller request
    assert sim.reserved == 60 * MIB
    sim.malloc(34 * MIB, "c")  # within kLargeBuffer of 40 MiB: reused whole, not split
    assert sim.live["c"].size == 40 * MIB and sim.reserved == 60 * MIB


def test_oversize_cached_segments_are_released_first():
    sim = A.CachingAllocator(capacity=100 * MIB, max_split_size=32 * MIB)
    sim.malloc(40 * MIB, "a")
    sim.malloc(8 * MIB, "small")
    sim.free("a")
    sim.malloc(70 * MIB, "b")  # the cached 40 MiB oversize segment goes back to the driver to make room
    assert sim.reserved == 90 * MIB and [e[0] for e in sim.events].count("segment_free") == 1
    assert sim.num_alloc_retries == 1


def _fragmenting_trace():
    trace = [("alloc", f"act{i}", 96 * MIB) for i in range(10)] + [("free", f"act{i}", 0) for i in range(10)]
    trace += [("alloc", f"keep{i}", 56 * MIB) for i in range(10)]
    return trace + [("alloc", f"new{i}", 64 * MIB) for i in range(6)]


def test_fragmentation_ooms_and_expandable_segments_do_not():
    with pytest.raises(A.OutOfMemory) as err:
        A.replay(_fragmenting_trace(), capacity=GIB)
    message = A.parse_oom(str(err.value))
    assert message.tried == 64 * MIB and message.unallocated == 400 * MIB and message.reserved == 1024 * MIB
    frame, sim = A.replay(_fragmenting_trace(), capacity=GIB, expandable_segments=True)
    assert sim.peak_reserved == 960 * MIB and frame["reserved"].iloc[-1] <= GIB
    plain, _ = A.replay(_fragmenting_trace())
    assert plain["reserved"].max() == 960 * MIB + 6 * 64 * MIB


def test_expandable_segments_map_pages_and_release_them():
    sim = A.CachingAllocator(expandable_segments=True)
    sim.malloc(30 * MIB, "a")
    assert sim.reserved == 40 * MIB  # two 20 MiB pages of the large pool
    sim.malloc(100 * KIB, "s")
    assert sim.reserved == 42 * MIB  # one 2 MiB page of the small pool
    sim.free("a")
    assert sim.empty_cache() == 40 * MIB and sim.reserved == 2 * MIB


def test_retry_frees_cached_segments_before_an_oom():
    sim = A.CachingAllocator(capacity=100 * MIB)
    sim.malloc(60 * MIB, "a")
    sim.free("a")
    sim.malloc(70 * MIB, "b")  # does not fit beside the cached 60 MiB: released, then retried
    assert sim.num_alloc_retries == 1 and sim.reserved == 70 * MIB


def test_running_counters_match_the_segments():
    frame, sim = A.replay(_fragmenting_trace()[:-3] + [("free", "keep3", 0), ("alloc", "x", 5 * MIB)],
                          expandable_segments=True)
    sim.empty_cache()
    for s in (sim, A.replay(_fragmenting_trace())[1]):
        assert s.reserved == sum(seg.size for seg in s.segments)
        assert s.allocated == sum(b.size for seg in s.segments for b in seg.blocks if b.allocated)


def test_replay_frame_and_overhead_ratio():
    frame, sim = A.replay([("alloc", 1, 3 * MIB), ("alloc", 2, 100), ("free", 1, 0)])
    assert list(frame.columns) == ["requested", "allocated", "reserved"]
    assert (frame["reserved"] >= frame["allocated"]).all() and (frame["allocated"] >= frame["requested"]).all()
    frame, sim = A.replay([("alloc", 1, 3 * MIB)])
    assert sim.peak_reserved / frame["requested"].max() == pytest.approx(20 / 3)  # a 20 MiB segment for 3 MiB


def test_bad_input_is_explained():
    sim = A.CachingAllocator()
    with pytest.raises(ValueError, match="whole number of bytes"):
        sim.malloc(-1)
    with pytest.raises(KeyError, match="not allocated"):
        sim.free("nope")
    sim.malloc(10, "x")
    with pytest.raises(ValueError, match="already allocated"):
        sim.malloc(10, "x")
    with pytest.raises(ValueError, match="capacity must be positive"):
        A.CachingAllocator(capacity=0)
    with pytest.raises(TypeError, match="True or False"):
        A.CachingAllocator(expandable_segments="yes")
    with pytest.raises(ValueError, match="'alloc' or 'free'"):
        A.replay([("malloc", 1, 10)])


@pytest.mark.parametrize("nbytes, text", [(0, "0 bytes"), (1024, "1024 bytes"), (1025, "1.00 KiB"),
                                          (MIB, "1024.00 KiB"), (20 * MIB, "20.00 MiB"), (GIB, "1024.00 MiB"),
                                          (int(1.5 * GIB), "1.50 GiB")])
def test_format_size_is_pytorchs(nbytes, text):
    assert A.format_size(nbytes) == text


def test_every_shipped_message_parses():
    messages = A.real_oom_messages()
    labels = {label for label, _ in messages}
    assert len(messages) >= 12 and labels >= {"fragmentation", "smaller peak", "another process"}
    for _, text in messages:
        m = A.parse_oom(text)
        assert 0 < m.tried and 0 < m.total and 0 <= m.allocated <= m.reserved <= m.total
    m = A.parse_oom(messages[0][1])
    assert (m.tried, m.unallocated) == (20 * MIB, round(21.90 * GIB))
    assert A.parse_oom(A.oom_message(3 * GIB, total=16 * GIB, free=GIB, allocated=12 * GIB, reserved=14 * GIB,
                                     this_process=15 * GIB)).others() == 0


def test_parse_oom_explains_bad_input():
    with pytest.raises(TypeError):
        A.parse_oom(42)
    with pytest.raises(ValueError, match="not an out-of-memory message"):
        A.parse_oom("RuntimeError: shape mismatch")
    with pytest.raises(ValueError, match="whole message"):
        A.parse_oom("CUDA out of memory. Tried to allocate 2.00 GiB.")


def _notebook_function(name):
    """The function ``name`` as notebook 01b defines it in a cell (only the cell's defs are run)."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if f"def {name}(" in "".join(c["source"]))
    tree = ast.parse(source)
    namespace = {"allocator": A}
    exec(compile(ast.Module([n for n in tree.body if isinstance(n, ast.FunctionDef)], []), name, "exec"), namespace)
    return namespace[name]


def test_notebooks_diagnosis_checker_accepts_its_solution_and_rejects_mistakes():
    check_diagnosis = _notebook_function("check_diagnosis")
    assert check_diagnosis(_notebook_function("solution_diagnose"))
    assert checker_rejects(
        check_diagnosis,
        lambda m: "fragmentation",  # always follow the message's own hint
        lambda m: "fragmentation" if m.unallocated >= m.tried - m.free else "smaller peak",  # forgets other processes
        lambda m: "smaller peak" if m.tried > m.free else "another process",  # compares tried with free only
    )


def test_options_from_env():
    assert A.options_from_env("") == {}
    assert A.options_from_env("expandable_segments:True, max_split_size_mb:128") == {
        "expandable_segments": True, "max_split_size": 128 * MIB}
    assert A.options_from_env("garbage_collection_threshold:0.6") == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_simulator_reserves_what_the_real_allocator_does():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, sim, keep = torch.cuda.memory_reserved(), A.CachingAllocator(**A.options_from_env()), []
    for nbytes in (100 * KIB, 100 * KIB, 3 * MIB, 3 * MIB, 15 * MIB, 25 * MIB + 1):
        sim.malloc(nbytes)
        keep.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        assert torch.cuda.memory_reserved() - base == sim.reserved, f"after a request of {nbytes} bytes"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_real_out_of_memory_message_parses():
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.02)
    chunks = []
    try:
        with pytest.raises(torch.OutOfMemoryError) as err:
            while True:
                chunks.append(torch.empty(64 * MIB, dtype=torch.uint8, device="cuda"))
    finally:
        del chunks
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    m = A.parse_oom(str(err.value))
    assert m.tried == 64 * MIB and m.allowed is not None and 0 < m.allocated <= m.reserved <= m.allowed


# ---------------------------------------------------------------------------- replaying a memory snapshot
def _event(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": []}


def _hand_built_snapshot():
    """In torch.cuda.memory._snapshot()'s format: a 100 KiB parameter allocated before the recording began (only in
    the segments), a 200 KiB tensor from before that the trace frees, two 96 MiB activations that come and go, two
    56 MiB tensors kept, then a 64 MiB one. Addresses are reused, as the real allocator reuses them."""
    p, q, a, b, e = 0x1000, 0x1000 + 100 * KIB, 1 << 32, (1 << 32) + 96 * MIB, 1 << 40
    trace = [_event("free_requested", q, 200 * KIB), _event("free_completed", q, 200 * KIB),
             _event("segment_alloc", a, 96 * MIB), _event("alloc", a, 96 * MIB), _event("segment_alloc", b, 96 * MIB),
             _event("alloc", b, 96 * MIB), _event("free_completed", a, 96 * MIB), _event("free_completed", b, 96 * MIB),
             _event("alloc", a, 56 * MIB), _event("alloc", b, 56 * MIB), _event("alloc", e, 64 * MIB)]
    block = lambda addr, size, state: {"address": addr, "size": size, "requested_size": size, "state": state}  # noqa: E731
    segments = [{"device": 0, "address": p, "total_size": 2 * MIB, "segment_type": "small",
                 "blocks": [block(p, 100 * KIB, "active_allocated"), block(q, 2 * MIB - 100 * KIB, "inactive")]}]
    segments += [{"device": 0, "address": x, "total_size": 96 * MIB, "segment_type": "large",
                  "blocks": [block(x, 56 * MIB, "active_allocated"), block(x + 56 * MIB, 40 * MIB, "inactive")]}
                 for x in (a, b)]
    segments += [{"device": 0, "address": e, "total_size": 64 * MIB, "segment_type": "large",
                  "blocks": [block(e, 64 * MIB, "active_allocated")]}]
    return {"segments": segments, "device_traces": [trace]}


def test_a_snapshots_trace_starts_with_what_was_alive_before_it():
    trace = A.snapshot_trace(_hand_built_snapshot())
    assert trace[:2] == [("alloc", ("before", 0x1000), 100 * KIB), ("alloc", ("before", 0x1000 + 100 * KIB), 200 * KIB)]
    assert [a for a, *_ in trace[2:]] == ["free", "alloc", "alloc", "free", "free", "alloc", "alloc", "alloc"]
    keys = [k for a, k, _ in trace if a == "alloc"]
    assert len(keys) == len(set(keys)) == 7  # a reused address gets a new key


def test_the_hand_built_snapshot_replays_to_the_hand_computed_reserved_bytes():
    trace = A.snapshot_trace(_hand_built_snapshot())
    # Default. The two small tensors share one 2 MiB small segment. Each 96 MiB request gets its own 96 MiB segment
    # (>= 10 MiB: rounded to 2 MiB); freed, both stay cached. Each 56 MiB tensor takes a cached 96 MiB block (best
    # fit) and is split (40 MiB left, over 1 MiB); no 64 MiB request fits in 40 MiB: a new 64 MiB segment.
    default = A.what_if(trace)
    assert default["peak_reserved"] == 2 * MIB + 2 * 96 * MIB + 64 * MIB == 258 * MIB
    # expandable_segments: the small pool maps one 2 MiB page; the large pool one segment of 20 MiB pages. The first
    # 96 MiB maps ceil(96/20) = 5 pages (100 MiB); the second uses the 4 MiB left and maps ceil(92/20) = 5 more
    # (200 MiB). Freed, they merge into one 200 MiB free block, which holds 56 + 56 + 64 = 176 MiB: nothing new.
    expandable = A.what_if(trace, expandable_segments=True)
    assert expandable["peak_reserved"] == 2 * MIB + 200 * MIB == 202 * MIB
    assert default["peak_allocated"] == expandable["peak_allocated"] == 100 * KIB + 2 * 96 * MIB  # blocks, not pages
    # On a 240 MiB card: the default allocator cannot release a segment (each holds a live block) and runs out
    card = A.what_if(trace, capacity=240 * MIB)
    assert not card["fits"] and A.parse_oom(card["oom"]).tried == 64 * MIB
    assert A.what_if(trace, capacity=240 * MIB, expandable_segments=True)["fits"]


def test_a_smaller_batch_scales_only_what_the_trace_allocates_and_frees():
    trace = [("alloc", ("before", 1), 30 * MIB), ("alloc", "act", 40 * MIB), ("alloc", "grad", 30 * MIB),
             ("free", "act", 0)]
    full, half = A.what_if(trace), A.what_if(trace, batch_scale=0.5)
    assert (full["peak_allocated"], half["peak_allocated"]) == (100 * MIB, 80 * MIB)
    with pytest.raises(ValueError, match="positive number"):
        A.what_if(trace, batch_scale=0)
    with pytest.raises(ValueError, match="'segments' and 'device_traces'"):
        A.snapshot_trace({"segments": []})


def test_a_snapshot_the_course_writes_replays_as_its_timeline():
    from course_utils import timeline

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(512, 256)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    tl = timeline.record_timeline(step, model=model, optimizer=opt)
    for options in ({}, {"expandable_segments": True}):
        snapshot = timeline.to_snapshot(tl, **options)
        _, sim = A.replay(tl.trace(), **options)
        replayed = A.what_if(A.snapshot_trace(snapshot), **options)
        assert (replayed["peak_reserved"], replayed["peak_allocated"]) == (sim.peak_reserved, sim.peak_allocated)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_real_snapshot_replays_to_its_reserved_peak():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (100 * KIB, 96 * MIB, 96 * MIB)]
        del keep[1:]
        keep += [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (56 * MIB, 56 * MIB, 64 * MIB)]
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    replayed = A.what_if(A.snapshot_trace(snapshot, torch.cuda.current_device()), **A.options_from_env())
    assert replayed["peak_reserved"] == pytest.approx(torch.cuda.max_memory_reserved(), rel=0.05)
    del keep
