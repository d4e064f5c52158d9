"""course_utils.memory: exact byte counts on known tensors and models, fake tensors, the allocator
branch on a CPU (a fake counter source), the device measured, stale tensors, state on another device, bad input;
notebook 01's live bytes over steps."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import memory, models
from course_utils.memory import (GIB, MIB, CudaCounters, MemoryReport, format_bytes, iter_tensors, measure_memory,
                                 optimizer_state_bytes, state_bytes, tensor_bytes)
from counting import counted, counting  # noqa: F401 (a fixture)
from notebook_lessons import exec_lesson_cells


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


def test_known_tensors_give_exact_bytes(counting):
    def fn():
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes (4096 in CUDA's blocks)
        b = torch.empty(500, dtype=torch.float16)  # 1000 bytes (1024)
        del a, b

    report = measure_memory(fn)
    assert report.peak_bytes == counted(4000, 1000) == (5000 if counting == "exact" else 5120)
    assert sum(report.by_category.values()) == counted(4000, 1000)


def test_peak_is_the_maximum_not_the_sum():
    def fn():
        for _ in range(3):
            t = torch.empty(1024, dtype=torch.float32)
            del t

    assert measure_memory(fn).peak_bytes == 4096


def test_mlp_with_adam_exact_categories(counting):
    model, opt = _mlp_and_adam()
    numel = sum(p.numel() for p in model.parameters())
    sizes = [4 * p.numel() for p in model.parameters()]
    report = measure_memory(lambda: _train_step(model, opt), model=model, optimizer=opt)
    assert report.by_category["params"] == counted(*sizes) == memory.block_bytes(*model.parameters())
    assert report.by_category["grads"] == counted(*sizes)
    # Adam: exp_avg + exp_avg_sq in fp32 = 2 * numel * 4, plus one 4-byte `step` counter per tensor
    adam = counted(*sizes, *sizes, *[4] * len(sizes))
    assert adam == (2 * numel * 4 + 4 * len(sizes) if counting == "exact" else adam)
    assert report.optimizer_state_bytes == adam
    assert report.by_category["optimizer"] == adam
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


def test_fake_gpt2_xl_params_are_2_bytes_each(counting):
    with models.fake_mode():
        model = models.build_gpt2("gpt2-xl", dtype=torch.float16)
        numel = sum(p.numel() for p in model.parameters())
        sizes = [p.numel() for p in model.parameters()]
        ids = torch.zeros(1, 4, dtype=torch.long)

        def forward_only():
            with torch.no_grad():
                model(input_ids=ids)

        report = measure_memory(forward_only, model=model)
    assert numel == models.GPT2_XL_PARAMS
    assert report.fake
    assert report.by_category["params"] == counted(*(2 * n for n in sizes))
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


class _Wrapped(torch.Tensor):
    """A wrapper subclass whose flattening names a tensor and a non-tensor (as FSDP2's sharded parameters name their
    device mesh)."""

    @staticmethod
    def __new__(cls, inner, note):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        out.inner, out.note = inner, note
        return out

    def __tensor_flatten__(self):
        return ["inner", "note"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return _Wrapped(inner_tensors["inner"], "unflattened")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


def test_tensor_bytes_counts_a_wrappers_inner_tensors_and_skips_what_is_not_a_tensor():
    assert tensor_bytes(_Wrapped(torch.empty(10), note="a device mesh")) == 40


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


# ---------------------------------------------------------------- one meaning of "peak"

def _figures(report):
    """Every figure of a report but the run time."""
    return (report.peak_bytes, report.by_category, report.tracked_peak_bytes, report.optimizer_state_bytes,
            report.reserved_peak_bytes, report.cuda_context_bytes, report.device, report.fake, report.notes)


def test_a_stale_model_kept_alive_outside_fn_changes_no_figure():
    model, opt = _mlp_and_adam()
    _train_step(model, opt)  # Adam's state exists
    alone = measure_memory(lambda: _train_step(model, opt), model=model, optimizer=opt)
    stale, stale_opt = models.mlp(n_layers=3, width=512, in_features=64, n_classes=10), None
    stale_opt = torch.optim.Adam(stale.parameters())
    _train_step(stale, stale_opt)  # ~12 MiB of weights, gradients and Adam state, alive outside fn
    assert tensor_bytes(*stale.parameters()) + optimizer_state_bytes(stale_opt) > 10 * alone.peak_bytes
    with_stale = measure_memory(lambda: _train_step(model, opt), model=model, optimizer=opt)
    assert _figures(with_stale) == _figures(alone)


class FakeAllocator:
    """Stands in for torch.cuda's counters on a CPU: allocate()/free() move 'allocated'; reserved grows
    in whole 2 MiB segments and keeps freed bytes cached until empty_cache(), as the caching allocator does."""

    SEGMENT = 2 * MIB

    def __init__(self, total=16 * GIB, context=300 * MIB):
        self.total, self.context = total, context
        self.allocated = self.max_allocated = self.reserved = self.max_reserved = 0
        self.calls = []

    def _segments(self, n):
        return math.ceil(n / self.SEGMENT) * self.SEGMENT

    def allocate(self, n):
        self.allocated += n
        self.max_allocated = max(self.max_allocated, self.allocated)
        if self.allocated > self.reserved:
            self.reserved = self._segments(self.allocated)
            self.max_reserved = max(self.max_reserved, self.reserved)

    def free(self, n):
        self.allocated -= n

    def synchronize(self):
        self.calls.append("synchronize")

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.reserved = self._segments(self.allocated)

    def reset_peak_memory_stats(self):
        self.calls.append("reset")
        self.max_allocated, self.max_reserved = self.allocated, self.reserved

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.max_allocated

    def memory_reserved(self):
        return self.reserved

    def max_memory_reserved(self):
        return self.max_reserved

    def mem_get_info(self):
        return self.total - self.context - self.reserved, self.total


def test_allocator_branch_runs_on_a_cpu_with_a_fake_counter_source():
    model, opt = _mlp_and_adam()
    _train_step(model, opt)
    state = tensor_bytes(*model.parameters()) + optimizer_state_bytes(opt)

    def measure(stale_bytes):
        fake = FakeAllocator()
        fake.allocate(state)
        fake.allocate(stale_bytes)  # tensors of earlier cells: counted by the allocator, not by the report
        fake.allocate(64 * MIB)
        fake.free(64 * MIB)  # a cached block from earlier code: empty_cache() drops it before fn

        def fn():
            _train_step(model, opt)
            fake.allocate(40 * MIB)  # what the step adds on the "GPU"
            fake.free(40 * MIB)

        return fake, measure_memory(fn, model=model, optimizer=opt, counters=fake)

    fake, report = measure(stale_bytes=0)
    assert fake.calls[:3] == ["synchronize", "empty_cache", "reset"]
    assert report.peak_bytes == state + 40 * MIB
    assert report.reserved_peak_bytes >= report.peak_bytes
    assert report.cuda_context_bytes == 300 * MIB
    assert report.card_bytes == report.reserved_peak_bytes + 300 * MIB
    readings = report.allocator_readings
    assert state + readings["max_allocated"] - readings["allocated_at_start"] == report.peak_bytes
    assert "caching allocator" in str(report) and "CUDA context" in str(report)
    _, stale_report = measure(stale_bytes=3 * GIB)
    assert (stale_report.peak_bytes, stale_report.cuda_context_bytes) == (report.peak_bytes, report.cuda_context_bytes)
    assert stale_report.reserved_peak_bytes - report.reserved_peak_bytes < FakeAllocator.SEGMENT  # segment rounding only


def test_allocator_branch_counts_only_the_state_on_the_measured_device():
    # a model "on the GPU" (here: the CPU, with a counter source) whose optimizer state lives elsewhere
    # (meta tensors stand in for the CPU copy of an offloaded optimizer) is charged only its own device's state
    model, opt = _mlp_and_adam()
    _train_step(model, opt)
    params = tensor_bytes(*model.parameters())
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = torch.empty_like(value, device="meta")
    fake = FakeAllocator()
    fake.allocate(params)
    report = measure_memory(lambda: None, model=model, optimizer=opt, counters=fake)
    step_counters = sum(4 for state in opt.state.values() if isinstance(state.get("step"), torch.Tensor))
    assert report.peak_bytes == params + step_counters


def test_without_a_model_the_device_is_where_fn_allocates():
    # fake CUDA tensors (no GPU needed) and a fake counter source: fn alone decides the device measured
    fake = FakeAllocator()

    def fn():
        x = torch.empty(64 * MIB // 4, device="cuda")  # 64 MiB "on the GPU"
        fake.allocate(64 * MIB)
        y = torch.nn.functional.relu(x)
        fake.allocate(64 * MIB)
        del x, y
        fake.free(128 * MIB)

    with models.fake_mode():
        report = measure_memory(fn, counters=fake)
    assert report.device == "cuda:0" and report.fake
    assert report.tracked_peak_bytes == 128 * MIB and report.by_category["other"] + report.by_category["activations"] == 128 * MIB
    assert report.peak_bytes == 128 * MIB and report.reserved_peak_bytes == 128 * MIB
    assert report.card_bytes == 128 * MIB + 300 * MIB


def test_without_a_model_a_gpu_is_read_only_when_fn_used_it(monkeypatch, counting):
    # a pretend GPU: measure_memory opens its counters before fn, as it cannot know fn's device yet...
    opened = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "CudaCounters", lambda device: opened.append(torch.device(device)) or FakeAllocator())
    report = measure_memory(lambda: torch.empty(1000))
    assert opened == [torch.device("cuda")]
    # ...and drops them when fn worked on the CPU: the CPU figures, no allocator fields
    assert report.device == "cpu" and report.peak_bytes == counted(4000) and report.reserved_peak_bytes is None
    with models.fake_mode():  # fake tensors never reach an allocator: the GPU is not opened
        assert measure_memory(lambda: torch.empty(1000)).fake
    model = nn.Linear(64, 10)  # nor for a CPU model
    measure_memory(lambda: model(torch.randn(2, 64)), model=model)
    assert len(opened) == 1


def test_state_on_another_device_counts_on_neither_side():
    # For CUDA parameters Adam keeps its `step` counters on the CPU (not capturable, not fused). Here: a CPU model
    # whose step counters live elsewhere (meta tensors stand in). The state measure_memory adds to the counters'
    # growth and the state the notebook's formula uses are the same tensors: those on the measured device.
    model, opt = _mlp_and_adam()
    _train_step(model, opt)
    for state in opt.state.values():
        state["step"] = torch.empty_like(state["step"], device="meta")
    steps = 4 * len(opt.state)
    on_device = state_bytes(model, opt)
    assert on_device == tensor_bytes(*model.parameters()) + optimizer_state_bytes(opt) - steps
    assert state_bytes(model, opt, device="meta") == steps
    fake = FakeAllocator()
    fake.allocate(on_device)
    report = measure_memory(lambda: (fake.allocate(40 * MIB), fake.free(40 * MIB)), model=model, optimizer=opt,
                            counters=fake)
    readings = report.allocator_readings
    assert state_bytes(model, opt) + readings["max_allocated"] - readings["allocated_at_start"] == report.peak_bytes
    assert report.peak_bytes == on_device + 40 * MIB
    assert report.optimizer_state_bytes == optimizer_state_bytes(opt) - steps == report.by_category["optimizer"]


def test_state_bytes_checks_its_input():
    assert state_bytes() == 0
    with pytest.raises(TypeError, match="nn.Module"):
        state_bytes("resnet")
    with pytest.raises(TypeError, match="Optimizer"):
        state_bytes(optimizer="adam")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_without_a_model_the_allocator_is_read():
    def allocate_free_allocate():
        big = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del big
        return torch.empty(32 * MIB, dtype=torch.uint8, device="cuda").numel()

    report = measure_memory(allocate_free_allocate)
    assert report.device.startswith("cuda") and report.peak_bytes == 64 * MIB
    assert report.reserved_peak_bytes >= report.peak_bytes and report.card_bytes > report.peak_bytes


def test_off_cuda_the_allocator_fields_are_none():
    model, opt = _mlp_and_adam()
    report = measure_memory(lambda: _train_step(model, opt), model=model, optimizer=opt)
    assert report.reserved_peak_bytes is None and report.cuda_context_bytes is None and report.card_bytes is None
    assert report.allocator_readings is None
    assert report.peak_bytes == report.tracked_peak_bytes


def test_the_reserved_peak_is_never_below_the_allocated_peak():
    # fn's tensor fits in the free room of a segment reserved before it: reserved does not grow, allocated does
    model, opt = _mlp_and_adam()
    _train_step(model, opt)
    state = tensor_bytes(*model.parameters()) + optimizer_state_bytes(opt)
    fake = FakeAllocator()
    fake.allocate(state)
    room = fake.reserved - fake.allocated
    report = measure_memory(lambda: (fake.allocate(room), fake.free(room)), model=model, optimizer=opt, counters=fake)
    assert room > 0 and report.peak_bytes == state + room
    assert report.reserved_peak_bytes == report.peak_bytes


def test_counter_sources_are_checked():
    with pytest.raises(TypeError, match="lacks"):
        measure_memory(lambda: None, counters=object())
    with pytest.raises(ValueError, match="CUDA"):
        CudaCounters("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="No CUDA GPU"):
            CudaCounters("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_stale_model_changes_no_figure():
    model = models.mlp(n_layers=2, width=256, in_features=64, n_classes=10).cuda()
    opt = torch.optim.Adam(model.parameters())

    def step():
        F.cross_entropy(model(torch.randn(64, 64, device="cuda")), torch.randint(0, 10, (64,), device="cuda")).backward()
        opt.step()
        opt.zero_grad()

    step()
    alone = measure_memory(step, model=model, optimizer=opt)
    stale = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    with_stale = measure_memory(step, model=model, optimizer=opt)
    assert with_stale.peak_bytes == alone.peak_bytes and alone.reserved_peak_bytes >= alone.peak_bytes
    assert alone.cuda_context_bytes > 0
    del stale


# ---------------------------------------------------------------- one copy of the byte counts

def test_optimizer_state_bytes_counts_state_once_and_checks_its_input():
    model, opt = _mlp_and_adam()
    assert optimizer_state_bytes(opt) == 0  # lazily created
    _train_step(model, opt)
    numel = sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes(opt) == 2 * 4 * numel + 4 * len(list(model.parameters()))
    with pytest.raises(TypeError, match="Optimizer"):
        optimizer_state_bytes("adam")


def test_iter_tensors_walks_nested_outputs():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert [t.numel() for t in iter_tensors({"x": [a, (b, 3)], "y": c, "z": "text"})] == [1, 2, 3]


# ---------------------------------------------------------------- notebook 01's live bytes over steps (the loss leak)

@pytest.fixture(scope="module")
def nb01():
    """Notebook 01's LiveBytes and live_bytes_over_steps, run from its own cell."""
    notebook = Path(__file__).resolve().parent.parent / "notebooks" / "01_memory_accounting.ipynb"
    namespace = {"torch": torch, "DEVICE": torch.device("cpu"), "storage_key": memory.storage_key}
    return exec_lesson_cells(notebook, {"live bytes": lambda src, tags: "class LiveBytes" in src}, namespace)


def test_live_bytes_over_steps_sees_a_leak_and_a_flat_line(nb01):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    totals = {"leak": 0.0, "item": 0.0}

    def make_step(kind):
        def step(i):
            loss = F.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 4, (32,)))
            totals[kind] = totals[kind] + (loss if kind == "leak" else loss.item())
        return step

    leak = nb01["live_bytes_over_steps"](make_step("leak"), 4)
    flat = nb01["live_bytes_over_steps"](make_step("item"), 4)
    per_step = [b - a for a, b in zip(leak, leak[1:])]
    assert len(set(per_step)) == 1 and per_step[0] >= 4 * 32 * (16 + 64 + 64)  # at least the saved inputs
    assert flat == [0, 0, 0, 0]  # the model's parameters are not the steps'


def test_live_bytes_counts_exact_sizes_and_frees(nb01):
    kept = []
    series = nb01["live_bytes_over_steps"](lambda i: kept.append(torch.zeros(256)), 3)
    assert series == [1024, 2048, 3072]
    assert nb01["live_bytes_over_steps"](lambda i: torch.zeros(256), 3) == [0, 0, 0]
    with nb01["LiveBytes"]() as live:
        a = torch.zeros(256)
        view = a[:10]  # a view: no new storage
        assert live.current == 1024
        del a
        assert live.current == 1024  # the view keeps the storage alive
        del view
        assert live.current == 0


def test_live_bytes_gpu_branch_with_a_fake_counter_source(nb01):
    fake = FakeAllocator()
    fake.allocate(5 * MIB)  # alive before: not the steps'
    assert nb01["live_bytes_over_steps"](lambda i: fake.allocate(MIB), 3, counters=fake) == [MIB, 2 * MIB, 3 * MIB]
    assert fake.calls.count("synchronize") == 4  # before the first step and after each


# ---- CUDA's 512-byte blocks, on the CPU -----------------------------------------------------------------------------
def test_cuda_rounding_counts_each_storage_in_512_byte_blocks():
    def fn():
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes: 8 blocks on CUDA
        b = torch.empty(500, dtype=torch.float16)  # 1000 bytes: 2 blocks
        del a, b

    with memory.cuda_rounding():
        rounded = measure_memory(fn).peak_bytes
        assert memory.block_bytes(torch.empty(1000), torch.empty(500, dtype=torch.float16)) == 4096 + 1024
    assert rounded == 4096 + 1024
    with memory.cuda_rounding(False):
        assert measure_memory(fn).peak_bytes == 5000, "outside the mode a CPU counts exact bytes"
        assert memory.block_bytes(torch.empty(1000)) == tensor_bytes(torch.empty(1000)) == 4000
    assert memory.block_bytes(torch.empty(1000, device="meta"), as_cuda=True) == 4096


def test_the_tracker_patch_is_torchs_cuda_rule_on_any_device():
    # the private API the mode replaces: MemTracker's per-storage size, which rounds on CUDA by the same block
    from torch.distributed._tools import mem_tracker

    assert mem_tracker._WeakRefInfo._calculate_mem_consumed is memory._consumed
    assert mem_tracker._PYTORCH_MIN_ALLOCATE == memory.CUDA_BLOCK_BYTES
    before = memory.rounding_to_blocks("cpu")   # on when the tests run with COURSE_CUDA_ROUNDING=1
    with memory.cuda_rounding(False):
        assert memory.rounding_to_blocks("cuda") and not memory.rounding_to_blocks("cpu")
        with memory.cuda_rounding():
            assert memory.rounding_to_blocks("cpu")
        assert not memory.rounding_to_blocks("cpu"), "the mode ends with its block"
    assert memory.rounding_to_blocks("cpu") == before


def test_like_with_like_holds_under_rounding():
    # an exact-byte claim about what the tracker measured holds in both modes when it compares with block_bytes
    model = models.mlp(n_layers=2, width=100, in_features=30, n_classes=10)   # sizes that are not whole blocks
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for rounding in (False, True):
        with memory.cuda_rounding(rounding):
            report = measure_memory(lambda: _train_step_30(model, opt), model=model, optimizer=opt)
            assert report.by_category["params"] == memory.block_bytes(*model.parameters())
            assert report.by_category["grads"] == memory.block_bytes(*model.parameters())
    with memory.cuda_rounding():
        assert memory.block_bytes(*model.parameters()) > tensor_bytes(*model.parameters())
    with memory.cuda_rounding(False):
        assert memory.block_bytes(*model.parameters()) == tensor_bytes(*model.parameters())


def _train_step_30(model, opt):
    F.cross_entropy(model(torch.randn(8, 30)), torch.randint(0, 10, (8,))).backward()
    opt.step()


def test_the_environment_variable_turns_the_mode_on():
    assert memory._rounding_from({"COURSE_CUDA_ROUNDING": "1"}) and memory._rounding_from({"COURSE_CUDA_ROUNDING": " 1\n"})
    assert not any(memory._rounding_from(env) for env in ({}, {"COURSE_CUDA_ROUNDING": "0"}, {"COURSE_CUDA_ROUNDING": ""}))
