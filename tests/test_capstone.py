"""Tests of notebook 06's lesson code (the two-copy step, the trainers, the streaming hook, the training loop, the
exercise's checker, the CPU twin of its GPU measurement) and of course_utils.capstone (precision rule, copy engines,
micro-batch rule, fake-tensor prediction, checkpoints, data).

The lesson lives in the notebook: the tests exec the notebook's own cells (found by what they
define) and run them on real tensors, so the code a learner reads is the code that is tested.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import random
import sys
import time
from pathlib import Path

import pytest
import torch
from tqdm.auto import tqdm

from course_utils import capstone, checks, estimate, hardware, memory, models
from course_utils.checks import claim
from notebook_lessons import checker_rejects, exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06_capstone_gpt2_xl.ipynb"
LESSON = {  # a name the notebook defines -> which of its code cells defines it
    "LossScale": lambda src, tags: src.startswith("class LossScale"),
    "check_two_copy_step": lambda src, tags: "checker" in tags and "def check_two_copy_step" in src,
    "two_copy_step": lambda src, tags: src.startswith("@torch.no_grad()\ndef two_copy_step("),  # the learner's stub
    "two_copy_step_solution": lambda src, tags: "solution" in tags and "def two_copy_step_solution" in src,  # checks itself
    "two_copy_step_used": lambda src, tags: src.startswith("try:") and "two_copy_step_used = " in src,  # stub: solution
    "TwoCopyTrainer": lambda src, tags: src.startswith("class TwoCopyTrainer"),  # with flat_master
    "StreamedTrainer": lambda src, tags: src.startswith("class StreamedTrainer"),
    "Adam8bitCPU": lambda src, tags: src.startswith("def encode(") and "class Adam8bitCPU" in src,
    "train": lambda src, tags: src.startswith("class SessionLost") and "def train(" in src,  # the training loop
    "OnTheHost": lambda src, tags: src.startswith("HOST = ") and "class OnTheHost" in src,  # the CPU twin's host
}
TOL_FP16 = 0.05  # fp16 device model vs fp32 model: update within 5% of the largest update


@functools.lru_cache(maxsize=1)
def lesson() -> dict:
    """Exec the notebook's lesson cells (in notebook order) and return their namespace."""
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    ns = {"torch": torch, "functools": functools, "capstone": capstone, "claim": claim, "checks": checks,
          "concurrent": concurrent, "time": time, "tqdm": tqdm, "LR": 1e-3, "PRECISION": capstone.device_precision(None)}
    found = []
    for cell in cells:
        src, tags = "".join(cell["source"]), cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code":
            continue
        for name, is_it in LESSON.items():
            if is_it(src, tags):
                exec(compile(src, f"{NOTEBOOK.name}:{name}", "exec"), ns)
                found.append(name)
    assert sorted(found) == sorted(LESSON), f"notebook 06 should define each of {sorted(LESSON)} once, found {found}"
    assert callable(ns.get("flat_master")), "notebook 06's trainer cell should define flat_master"
    return ns


@functools.lru_cache(maxsize=1)
def checker():
    """The exercise's checker, from the notebook's hidden `checker` cell run alone (it imports what it uses)."""
    picks = {"checker": LESSON["check_two_copy_step"]}
    return exec_lesson_cells(NOTEBOOK, picks, {})["check_two_copy_step"]


def tiny(dtype=torch.float32, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return models.build_gpt2("gpt2", dtype=dtype, n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                             resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                             bos_token_id=63, eos_token_id=63)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]


def fp32_of(model):
    return [p.detach().float() for p in model.parameters()]


def recipe(model, make_opt, scale=None, weights=None):
    L = lesson()
    scale = scale or (L["LossScale"](2.0**16) if next(model.parameters()).dtype == torch.float16
                      else L["LossScale"](1.0, dynamic=False))
    return L["TwoCopyTrainer"](model, make_opt, weights or fp32_of(model), scale)


def streamed(model, make_opt, engine=None, scale=None):
    L = lesson()
    scale = scale or (L["LossScale"](2.0**16) if next(model.parameters()).dtype == torch.float16
                      else L["LossScale"](1.0, dynamic=False))
    return L["StreamedTrainer"](model, make_opt, fp32_of(model), scale, engine or capstone.CpuCopyEngine())


def adam(lr=1e-3):
    return lambda ps: torch.optim.Adam(ps, lr=lr, foreach=False)


def adam8bit(lr=1e-3):
    bnb = pytest.importorskip("bitsandbytes")  # a bare GPU machine may not have it: the test says so and skips

    return lambda ps: bnb.optim.Adam8bit(ps, lr=lr)


# The trainers' bookkeeping tests (two copies, streaming, resuming) compare an optimizer with itself: decorated with
# torch.compiler.set_stance("force_eager"), they run torch.compile's functions eager rather than wait for the C++
# compiler on each tiny shape (06 and test_adam8bit_cpu_codes_follows_fp32_adam_and_checks_its_input compile the
# 8-bit steps).


def adam8bit_cpu(lr=1e-3):
    return lambda ps: lesson()["Adam8bitCPU"](ps, lr=lr)


def torchao_fp8(lr=1e-3):
    adams, _ = capstone.cpu_8bit_adams(compiles=True)
    return lambda ps: adams["torchao AdamFp8"](ps, lr)


def sgd(lr=0.1):
    return lambda ps: torch.optim.SGD(ps, lr=lr)


def train_plain(model, opt, data, accum):
    for step in range(len(data) // accum):
        for x in data[step * accum:(step + 1) * accum]:
            model(input_ids=x, labels=x).loss.div(accum).backward()
        opt.step()
        opt.zero_grad()


def train_plain_flat(model, make_opt, data, accum):
    """Plain fp32 training whose optimizer steps one flat copy of the weights (the notebook's flat_master),
    as the trainer's master copy is: an 8-bit state's blocks then run across the same weight boundaries."""
    views, chunks = lesson()["flat_master"](list(model.parameters()))
    opt = make_opt(chunks)
    for step in range(len(data) // accum):
        for x in data[step * accum:(step + 1) * accum]:
            model(input_ids=x, labels=x).loss.div(accum).backward()
        with torch.no_grad():
            for v, p in zip(views, model.parameters()):
                v.grad.copy_(p.grad)
            opt.step()
            for v, p in zip(views, model.parameters()):
                p.copy_(v)
                p.grad = None


def train_trainer(trainer, data, accum):
    applied = []
    for step in range(len(data) // accum):
        for x in data[step * accum:(step + 1) * accum]:
            trainer.backward(trainer.model(input_ids=x, labels=x).loss / accum)
        applied.append(trainer.step())
    return applied


# ----------------------------------------------------------------------------------------------- the lesson
@pytest.mark.parametrize("make_opt,flat", [(adam, False), (adam8bit, True), (adam8bit_cpu, True), (torchao_fp8, True)],
                         ids=["adam-per-weight", "bnb-adam8bit-flat", "adam8bitcpu-flat", "torchao-fp8-flat"])
@torch.compiler.set_stance("force_eager")
def test_two_copy_fp32_matches_plain_training_exactly(make_opt, flat):
    """Adam is elementwise: the trainer's flat master equals per-weight training. An 8-bit state quantizes
    blocks of 256 values, so it is compared with the same optimizer on one flat vector of the weights."""
    ref = tiny()
    trainer = recipe(tiny(), make_opt(1e-3), scale=lesson()["LossScale"](2.0**16))  # 2**16: exact in fp32
    data = batches(4)
    if flat:
        train_plain_flat(ref, make_opt(1e-3), data, accum=2)
    else:
        train_plain(ref, make_opt(1e-3)(list(ref.parameters())), data, accum=2)
    assert train_trainer(trainer, data, accum=2) == [True, True]
    assert capstone.param_diff(ref.parameters(), trainer.master_params) == 0.0
    assert capstone.param_diff(ref.parameters(), trainer.model.parameters()) == 0.0  # copied back
    assert trainer.steps == 2 and trainer.skipped_steps == 0


def test_master_copy_starts_from_the_fp32_weights_not_the_rounded_copy():
    fp32 = tiny()
    weights = fp32_of(fp32)
    device = tiny(torch.float16)  # the same seed: the fp16 rounding of the same weights
    trainer = recipe(device, sgd(), weights=weights)
    assert capstone.param_diff(weights, trainer.master_params) == 0.0
    assert capstone.param_diff(device.parameters(), trainer.master_params) > 0  # fp16 rounding was not kept
    assert all(m.data_ptr() != w.data_ptr() for m, w in zip(trainer.master_params, weights))  # its own copy
    with pytest.raises(ValueError, match="one fp32 tensor per trainable parameter"):
        recipe(tiny(), sgd(), weights=weights[:-1])


def test_two_copy_fp16_one_step_within_tolerance():
    ref = tiny()
    dev = tiny(torch.float16)
    with torch.no_grad():  # both start from the same (fp16-representable) weights
        for p32, p16 in zip(ref.parameters(), dev.parameters()):
            p32.copy_(p16.float())
    start = [p.detach().clone() for p in ref.parameters()]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = recipe(dev, sgd(0.1), weights=fp32_of(ref))
    assert trainer.scaler.value == 2.0**16 and trainer.scaler.dynamic
    data = batches(2)
    train_plain(ref, opt, data, accum=2)
    assert train_trainer(trainer, data, accum=2) == [True]
    upd32 = [p.detach() - s for p, s in zip(ref.parameters(), start)]
    upd16 = [m.detach() - s for m, s in zip(trainer.master_params, start)]
    largest = max(float(u.abs().max()) for u in upd32)
    assert largest > 0
    assert capstone.param_diff(upd32, upd16) <= TOL_FP16 * largest


def test_overflow_skips_step_and_lowers_scale_then_grows():
    dev = tiny(torch.float16)
    trainer = recipe(dev, sgd(), scale=lesson()["LossScale"](2.0**16, growth_interval=2))
    before = [m.detach().clone() for m in trainer.master_params]
    x = batches(1)[0]
    trainer.backward(dev(input_ids=x, labels=x).loss)
    next(iter(dev.parameters())).grad[0, 0] = float("inf")
    assert trainer.step() is False
    assert trainer.scaler.value == 2.0**15 and trainer.skipped_steps == 1 and trainer.steps == 0
    assert capstone.param_diff(before, trainer.master_params) == 0.0  # nothing changed
    assert all(p.grad is None for p in dev.parameters())
    assert all(not m.grad.any() for m in trainer.master_params)
    for _ in range(2):
        trainer.backward(dev(input_ids=x, labels=x).loss)
        assert trainer.step() is True
    assert trainer.scaler.value == 2.0**16  # grew back after growth_interval good steps


def test_loss_scale_fixed_for_bf16_and_fp32():
    scale = lesson()["LossScale"](1.0, dynamic=False)
    for found_inf in (True, False, False):
        scale.update(found_inf)
    assert scale.value == 1.0


@pytest.mark.parametrize("dtype,make_opt,rel_tol", [(torch.float32, "bnb8", 0.0), (torch.float32, "cpu8", 0.0),
                                                     (torch.float16, sgd(), 0.01)],
                         ids=["fp32-adam8bit", "fp32-adam8bitcpu", "fp16-sgd"])
@torch.compiler.set_stance("force_eager")
def test_streamed_update_equals_two_copy_over_accumulation(dtype, make_opt, rel_tol):
    """fp32: bit-identical. fp16: the streamed sum is done in fp32 (the recipe sums in fp16 on the
    device), so SGD's update (linear in the gradient) agrees within 1% of the largest update."""
    data = batches(6)
    # made here, not at collection: a machine without bitsandbytes (a bare GPU check) still collects the module
    make_opt = {"cpu8": adam8bit_cpu, "bnb8": adam8bit}[make_opt]() if isinstance(make_opt, str) else make_opt
    rec = recipe(tiny(dtype), make_opt)
    stream = streamed(tiny(dtype), make_opt)
    start = [m.detach().clone() for m in rec.master_params]
    assert train_trainer(rec, data, accum=3) == [True] * 2
    assert train_trainer(stream, data, accum=3) == [True] * 2
    assert all(p.grad is None for p in stream.model.parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in stream.model.parameters())
    assert stream.bytes_to_host == 6 * n_bytes  # every micro-batch's gradients crossed once
    assert rec.bytes_to_host == 2 * n_bytes  # the recipe: once per step
    largest = max(float((m.detach() - s).abs().max()) for m, s in zip(rec.master_params, start))
    assert largest > 0
    assert capstone.param_diff(rec.master_params, stream.master_params) <= rel_tol * largest
    stream.remove_hooks()


def test_streamed_frees_gradients_during_backward():
    model = tiny()
    trainer = streamed(model, sgd())
    seen = []
    blocks = model.transformer.h
    blocks[0].register_full_backward_hook(
        lambda *a: seen.append(sum(p.grad is not None for p in blocks[1].parameters())))
    x = batches(1)[0]
    trainer.backward(model(input_ids=x, labels=x).loss)
    assert seen == [0]  # block 1's gradients were already gone when block 0's backward ran
    trainer.remove_hooks()


class DeferredCopyEngine(capstone.CpuCopyEngine):
    """The CPU engine with copies that wait in ``pending`` until ``wait``/``complete`` runs them, in any order; a
    handle ``[src, dst, done]`` holds the source until then (what ``record_stream`` does on CUDA)."""

    def __init__(self):
        self.pending = []

    def start_copy(self, src, dst):
        handle = [src, dst, False]
        self.pending.append(handle)
        return handle

    def ready(self, handle):
        return handle[2]

    def wait(self, handle):
        self.complete(handle)

    def complete(self, handle):
        if not handle[2]:
            handle[1].copy_(handle[0])
            handle[0], handle[2] = None, True
            self.pending = [h for h in self.pending if h is not handle]


class ShuffledCopyEngine(DeferredCopyEngine):
    """Deferred copies that finish late and out of order: each new copy completes a random pending one."""

    def __init__(self, seed=0, keep=3):
        super().__init__()
        self.rng, self.keep = random.Random(seed), keep
        self.max_pending = 0
        self.out_of_order = 0

    def start_copy(self, src, dst):
        handle = super().start_copy(src, dst)
        self.max_pending = max(self.max_pending, len(self.pending))
        while len(self.pending) > self.keep:
            pick = self.rng.randrange(len(self.pending))
            self.out_of_order += pick != 0
            self.complete(self.pending[pick])
        return handle


def test_streaming_hook_with_late_out_of_order_copies_gives_the_same_update():
    """The CPU twin of CUDA's copy engine: copies stay queued across micro-batches (the hook must add
    the previous micro-batch's copy before reusing a staging buffer) and finish out of order."""
    data = batches(6)
    eager = streamed(tiny(), adam8bit())
    engine = ShuffledCopyEngine(keep=20)  # most of the model's 28 gradients: copies outlive a micro-batch
    late = streamed(tiny(), adam8bit(), engine=engine)
    added_early, in_backward = [], []
    original = late.add_to_master

    def spy(i):
        if in_backward and i in late.in_flight and not late.engine.ready(late.in_flight[i]):
            added_early.append(i)  # the hook found last micro-batch's copy still queued: finished it first
        original(i)

    late.add_to_master = spy
    for trainer in (eager, late):
        for step in range(2):
            for x in data[step * 3:(step + 1) * 3]:
                in_backward.append(True)
                trainer.backward(trainer.model(input_ids=x, labels=x).loss / 3)  # backward does not drain
                in_backward.clear()
            assert trainer.step() is True
    assert engine.max_pending > 20 and engine.out_of_order > 0
    assert added_early, "some copy was still queued when its buffer was needed again"
    assert not late.in_flight and not engine.pending  # step() drained everything
    assert capstone.param_diff(eager.master_params, late.master_params) == 0.0
    assert capstone.param_diff(eager.model.parameters(), late.model.parameters()) == 0.0
    eager.remove_hooks()
    late.remove_hooks()


def test_cpu_copy_engine_interface():
    engine = capstone.copy_engine("cpu")
    assert isinstance(engine, capstone.CpuCopyEngine)
    dst = engine.staging_like(torch.empty(4, dtype=torch.float16))
    assert dst.dtype == torch.float16 and not dst.is_pinned()
    handle = engine.start_copy(torch.arange(4.0), dst)
    assert engine.ready(handle) and torch.equal(dst.float(), torch.arange(4.0))
    engine.wait(handle)
    deferred = DeferredCopyEngine()
    src = torch.arange(4.0)
    handle = deferred.start_copy(src, dst)
    assert not deferred.ready(handle) and deferred.pending == [handle]
    src.add_(1)  # held by the queued copy (as record_stream keeps a CUDA gradient): copied at completion
    deferred.wait(handle)
    assert deferred.ready(handle) and torch.equal(dst.float(), torch.arange(1.0, 5.0)) and not deferred.pending
    with pytest.raises(ValueError, match="CpuCopyEngine"):
        capstone.CudaCopyEngine("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copy_engine_streams_the_same_update_as_the_cpu_twin():
    engine = capstone.copy_engine("cuda")
    assert isinstance(engine, capstone.CudaCopyEngine) and engine.staging_like(torch.empty(3)).is_pinned()
    data = batches(4)
    cpu = streamed(tiny(), sgd())
    gpu = streamed(tiny().cuda(), sgd(), engine=engine)
    for trainer in (cpu, gpu):
        for x in data:
            x = x.to(next(trainer.model.parameters()).device)
            trainer.backward(trainer.model(input_ids=x, labels=x).loss / 4)
        assert trainer.step() is True
    assert gpu.bytes_to_host == cpu.bytes_to_host and not gpu.in_flight  # every copy arrived and was added
    assert capstone.param_diff(cpu.master_params, gpu.master_params) < 1e-5


# ----------------------------------------------------------------------------------------------- the CPU twin
TWIN_MODEL = dict(n_layer=2, n_embd=128, n_head=2, n_positions=64, vocab_size=256, bos_token_id=255, eos_token_id=255)
TWIN_STEP = dict(micro_batch=2, accum_steps=4, seq_len=32)  # the notebook's protocol: accumulation, then the step


def twin_step(variant, on_the_host=True):
    """Notebook 06's CPU twin: one optimizer step of the notebook's own loop (`train`: the micro-batches, then
    `trainer.step()`) with its trainer and the capstone's 8-bit Adam, the host half on the notebook's HOST thread
    (`OnTheHost`), measured by measure_memory. A fresh GPT-2 with dropout, in fp32, as the smoke run's."""
    L = lesson()
    torch.manual_seed(0)
    model = models.build_gpt2("gpt2", **TWIN_MODEL)
    capstone.enable_checkpointing(model)
    trainer_class = L["TwoCopyTrainer"] if variant == "recipe" else L["StreamedTrainer"]
    if on_the_host:
        trainer_class = type("Twin", (L["OnTheHost"], trainer_class), {})
    engine = (capstone.CpuCopyEngine(),) if variant == "streamed" else ()
    trainer = trainer_class(model.train(), adam8bit(), fp32_of(model), L["LossScale"](1.0, dynamic=False), *engine)
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    report = memory.measure_memory(lambda: L["train"](trainer, tokens, 1, desc="twin", **TWIN_STEP), model=model)
    if variant == "streamed":
        trainer.remove_hooks()
    return report


@functools.lru_cache(maxsize=None)
def twin_prediction(variant, accum_steps=TWIN_STEP["accum_steps"]):
    """The notebook's predict_run for the twin: the whole step, priced as the CPU keeps tensors."""
    step = {**TWIN_STEP, "accum_steps": accum_steps}
    return capstone.predict_gpu_peak("gpt2", variant=variant, dtype=torch.float32, priced_as="cpu", **step, **TWIN_MODEL)


@pytest.mark.parametrize("variant", capstone.VARIANTS)
def test_cpu_twin_measured_optimizer_step_matches_its_prediction(variant):
    """Notebook 06's claim, on a small GPT-2: the CPU twin's measured peak of one whole optimizer step (4 micro-batches
    accumulated, then the step) is within 5% of the fake-tensor prediction of the same step."""
    measured, predicted = twin_step(variant), twin_prediction(variant)
    assert measured.by_category["params"] == predicted.by_category["params"]
    assert measured.by_category["grads"] == predicted.by_category["grads"]  # all of them (recipe), none (streamed)
    error = abs(measured.peak_bytes - predicted.peak_bytes) / predicted.peak_bytes
    assert error <= 0.05, f"{variant}: measured {measured.peak_bytes:,} B, predicted {predicted.peak_bytes:,} B"


def test_cpu_twin_fails_one_micro_step_and_the_host_counted_as_device():
    """The twin's 5% is a test that can fail: the prediction of one micro-step (the old protocol) misses the
    recipe's accumulated gradients, and a twin that counts the host half (fp32 master gradients, staging, the
    optimizer's temporaries) as device memory measures more than the device holds."""
    measured = twin_step("recipe")
    one_micro_step = twin_prediction("recipe", accum_steps=1)
    assert one_micro_step.by_category["grads"] < measured.by_category["grads"]
    assert abs(measured.peak_bytes - one_micro_step.peak_bytes) > 0.05 * measured.peak_bytes
    for variant in capstone.VARIANTS:
        host_counted = twin_step(variant, on_the_host=False)
        assert host_counted.peak_bytes > 1.05 * twin_prediction(variant).peak_bytes, variant


# ----------------------------------------------------------------------------------------------- the exercise
def test_the_trainer_uses_the_learners_step_once_it_passes():
    """The stub raised, so the trainer steps with the solution; a step that passes the check replaces it, one
    that fails does not."""
    L = lesson()
    assert L["two_copy_step_used"] is L["two_copy_step_solution"]
    picks = {"choice": LESSON["two_copy_step_used"]}

    def mine(*args):
        return L["two_copy_step_solution"](*args)

    for learners, used in ((mine, mine), (lambda d, m, opt, scale: True, L["two_copy_step_solution"])):
        ns = exec_lesson_cells(NOTEBOOK, picks, {"check_two_copy_step": checker(), "two_copy_step": learners,
                                                 "two_copy_step_solution": L["two_copy_step_solution"]})
        assert ns["two_copy_step_used"] is used


def test_exercise_checker_accepts_the_solution_and_rejects_mistakes():
    step, check = lesson()["two_copy_step_solution"], checker()
    assert check(step) is True

    def no_unscale(d, m, opt, scale):
        return step(d, m, opt, 1.0)

    def never_skips(d, m, opt, scale):
        for p in d:
            if p.grad is not None:
                p.grad.nan_to_num_(posinf=0.0, neginf=0.0)
        return step(d, m, opt, scale)

    def no_copy_back(d, m, opt, scale):
        old = [p.detach().clone() for p in d]
        ok = step(d, m, opt, scale)
        with torch.no_grad():
            for p, w in zip(d, old):
                p.copy_(w)
        return ok

    def keeps_master_grads(d, m, opt, scale):
        saved = [x.grad.clone() for x in m]
        ok = step(d, m, opt, scale)
        for x, g in zip(m, saved):
            x.grad = g if x.grad is None else x.grad.copy_(g)
        return ok

    def ignores_streamed_grads(d, m, opt, scale):
        for x in m:
            x.grad.zero_()  # overwrites what streaming put there
        return step(d, m, opt, scale)

    assert checker_rejects(check, no_unscale, never_skips, no_copy_back,
                                  keeps_master_grads, ignores_streamed_grads)


def test_exercise_checker_reports_and_propagates_the_stub(capsys):
    check = checker()

    def stub(d, m, opt, scale):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        check(stub)

    def broken(d, m, opt, scale):
        raise KeyError("oops")

    assert check(broken) is False
    assert "raised KeyError" in capsys.readouterr().out
    with pytest.raises(TypeError, match="function"):
        check("two_copy_step")


# ----------------------------------------------------------------------------------------------- the package
@pytest.mark.parametrize("cc,dtype,scaling", [((7, 5), torch.float16, True), ((8, 0), torch.bfloat16, False),
                                              ((9, 0), torch.bfloat16, False), (None, torch.float32, False)])
def test_device_precision_rule(cc, dtype, scaling):
    rule = capstone.device_precision(cc)
    assert (rule.dtype, rule.loss_scaling) == (dtype, scaling)
    assert rule.why


def test_device_precision_bad_input():
    for bad in ((8,), "8.0", (8, "0"), 8.0):
        with pytest.raises(ValueError, match="compute_capability"):
            capstone.device_precision(bad)


def test_largest_fitting_micro_batch_counts_context_and_reserve():
    per_sample = 1 * 2**30
    peak = lambda mb: 2 * 2**30 + mb * per_sample  # noqa: E731
    tensors_only = [mb for mb in (4, 2, 1) if peak(mb) <= 6 * 2**30]
    assert tensors_only[0] == 4  # 6 GiB of tensors at 4: "fits" if the context is forgotten
    mb, result, needed = capstone.largest_fitting_micro_batch(peak, 6 * 2**30, 4)
    assert mb == 2 and result == peak(2) and needed == hardware.gpu_bytes_needed(peak(2)) <= 6 * 2**30
    with pytest.raises(ValueError, match="Not even a micro-batch of 1"):
        capstone.largest_fitting_micro_batch(peak, 2 * 2**30, 4)
    with pytest.raises(ValueError, match="bytes"):
        capstone.largest_fitting_micro_batch(lambda mb: "lots", 2**30, 1)


def test_predict_gpu_peak_tiny_fake_streamed_below_recipe():
    # few tokens and a small vocabulary: parameters and gradients dominate, as in GPT-2-XL at 4 x 1024
    h, layers = 128, 2
    kw = dict(n_layer=layers, n_embd=h, n_head=2, vocab_size=256, bos_token_id=255, eos_token_id=255,
              micro_batch=1, seq_len=16)
    recipe_report = capstone.predict_gpu_peak("gpt2", variant="recipe", **kw)
    streamed_report = capstone.predict_gpu_peak("gpt2", variant="streamed", **kw)
    assert recipe_report.fake and streamed_report.fake
    n_params = 256 * h + 1024 * h + layers * (12 * h * h + 13 * h) + 2 * h
    with torch.device("meta"):
        shapes = models.build_gpt2("gpt2", dtype=torch.float16, **{k: kw[k] for k in kw if k not in ("micro_batch",
                                                                                                  "seq_len")})
    assert estimate.count_params(shapes) == n_params
    weights = memory.block_bytes(*shapes.parameters(), as_cuda=True)  # fp16, each tensor in CUDA's 512-byte blocks
    assert 2 * n_params <= weights < 2 * n_params + len(list(shapes.parameters())) * memory.CUDA_BLOCK_BYTES
    assert recipe_report.by_category["params"] == weights
    assert streamed_report.by_category["params"] == weights
    assert recipe_report.by_category["grads"] > 0.9 * 2 * n_params  # nearly all gradients at once on the device
    assert streamed_report.by_category["grads"] < 0.25 * recipe_report.by_category["grads"]
    assert streamed_report.peak_bytes < 0.75 * recipe_report.peak_bytes


@pytest.mark.parametrize("make_opt", [adam8bit, adam8bit_cpu], ids=["bnb-adam8bit", "adam8bitcpu"])
@torch.compiler.set_stance("force_eager")
def test_checkpoint_resume_gives_identical_losses(tmp_path, make_opt):
    tokens = torch.tensor(capstone.ByteTokenizer().encode("the model does not fit; " * 20)) % 64

    def run(path, n_steps, crash_at=None):
        model = tiny(dropout=0.1)  # dropout: resumed losses match only if the RNG is restored
        trainer = recipe(model, make_opt(1e-2))
        data = capstone.TokenBatches(tokens, seq_len=16, micro_batch=2, seed=0)
        state = capstone.load_checkpoint(path, trainer)
        start = state["step"] if state else 0
        losses = state["extra"]["losses"] if state else []
        pos = state["data_position"] if state else 0
        for step in range(start, n_steps):
            if step == crash_at:
                raise KeyboardInterrupt("simulated disconnect")
            total = 0.0
            for _ in range(2):
                x = data[pos]
                pos += 1
                loss = model(input_ids=x, labels=x).loss
                trainer.backward(loss / 2)
                total += loss.item() / 2
            trainer.step()
            losses.append(total)
            if (step + 1) % 2 == 0:
                capstone.save_checkpoint(path, trainer, step=step + 1, data_position=pos, extra={"losses": losses})
        return losses

    torch.manual_seed(123)
    full = run(tmp_path / "a.pt", 5)
    torch.manual_seed(123)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b.pt", 5, crash_at=3)
    assert not (tmp_path / "b.pt.tmp").exists()  # the atomic write left no temp file
    torch.manual_seed(999)  # a different session: the checkpoint must restore everything
    resumed = run(tmp_path / "b.pt", 5)
    assert len(resumed) == 5
    assert resumed == full
    assert full[-1] < full[0]


def test_checkpoint_rejects_other_variant_and_missing(tmp_path):
    trainer = recipe(tiny(), sgd())
    assert capstone.load_checkpoint(tmp_path / "none.pt", trainer) is None
    capstone.save_checkpoint(tmp_path / "c.pt", trainer, step=0, data_position=0)
    stream = streamed(tiny(), sgd())
    with pytest.raises(ValueError, match="variant"):
        capstone.load_checkpoint(tmp_path / "c.pt", stream)
    with pytest.raises(ValueError, match="step"):
        capstone.save_checkpoint(tmp_path / "c.pt", trainer, step=-1, data_position=0)
    stream.remove_hooks()


def test_byte_tokenizer_and_offline_loading():
    tok = capstone.ByteTokenizer()
    ids = tok.encode("GPU 显存")
    assert all(0 <= i < 256 for i in ids) and len(ids) == 4 + 6
    assert tok.decode(ids) == "GPU 显存"
    tok2, message = capstone.load_tokenizer("gpt2")
    assert isinstance(message, str)
    assert tok2.vocab_size in (256, 50257)
    with pytest.raises(ValueError):
        tok.decode([300])


def test_course_corpus_is_the_notebooks_prose_and_batches():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_corpus", NOTEBOOK.parents[1] / "scripts" / "build_corpus.py")
    build_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_corpus)
    built = build_corpus.corpus_text()  # what scripts/build_corpus.py writes: markdown only, no code
    assert "## Recap" in built and "def chain_step(" not in built
    text, source = capstone.course_corpus()
    assert "shipped with the package" in source and "def chain_step(" not in text
    tokens = torch.tensor(capstone.ByteTokenizer().encode(text[:2000]))
    data = capstone.TokenBatches(tokens, seq_len=32, micro_batch=3, seed=5)
    assert data[7].shape == (3, 32) and torch.equal(data[7], data[7])
    assert data[7].untyped_storage().nbytes() == 3 * 32 * 8  # its own copy: a view would keep the corpus alive
    assert not torch.equal(data[7], data[8])


def test_pcie_arithmetic():
    n = 1_557_611_200
    rec = capstone.pcie_bytes_per_step(n, variant="recipe", accum_steps=16)
    stream = capstone.pcie_bytes_per_step(n, variant="streamed", accum_steps=16)
    assert rec["total"] == 4 * n
    assert stream["to_host"] == 16 * 2 * n and stream["to_device"] == 2 * n


def test_bad_inputs_say_what_to_change():
    with pytest.raises(ValueError, match="variant"):
        capstone.predict_gpu_peak("gpt2", variant="magic")
    with pytest.raises(ValueError, match="priced_as"):
        capstone.predict_gpu_peak("gpt2", priced_as="tpu")
    with pytest.raises(ValueError, match="context"):
        capstone.predict_gpu_peak("gpt2", seq_len=4096, n_layer=1)
    with pytest.raises(ValueError, match="positive"):
        capstone.pcie_bytes_per_step(0)
    with pytest.raises(TypeError, match="integer tensor"):
        capstone.TokenBatches(torch.randn(100), seq_len=8, micro_batch=2)
    with pytest.raises(ValueError, match="fewer than"):
        capstone.TokenBatches(torch.arange(5), seq_len=8, micro_batch=2)


def test_sample_text_is_seeded_and_checks_input():
    model = tiny()
    tok = capstone.ByteTokenizer()
    a = capstone.sample_text(model, tok, "!#", n_tokens=5, seed=3)
    assert a == capstone.sample_text(model, tok, "!#", n_tokens=5, seed=3)
    assert model.training  # train mode restored
    with pytest.raises(ValueError, match="prompt"):
        capstone.sample_text(model, tok, "", n_tokens=5)


def test_sample_text_with_a_model_wider_than_its_tokenizer():
    model = tiny()  # 64 ids
    tok = capstone.ByteTokenizer()
    tok.vocab_size = 40  # an instance attribute: a tokenizer that knows fewer ids than the model
    text = capstone.sample_text(model, tok, "!", n_tokens=20, temperature=5.0, top_k=64, seed=1)
    assert all(ord(ch) < 40 for ch in text)


def test_flat_master_views_chunks_and_padding():
    flat_master = lesson()["flat_master"]
    weights = [torch.randn(3, 100), torch.randn(7), torch.randn(300, 2).half()]
    views, chunks = flat_master(weights, block=256, chunk=512)
    n = 300 + 7 + 600
    assert [c.numel() for c in chunks] == [512, 512]  # 907 values padded to 1024, cut in chunks of 512
    assert all(v.dtype == torch.float32 and v.shape == w.shape for v, w in zip(views, weights))
    assert capstone.param_diff(views, weights) == 0.0
    base = chunks[0].data_ptr()
    assert views[1].data_ptr() == base + 300 * 4 and chunks[1].data_ptr() == base + 512 * 4  # one storage
    for v in views:
        v.grad.fill_(1.0)
    grads = torch.cat([c.grad for c in chunks])
    assert int(grads.sum()) == n and not grads[n:].any()  # the padding's gradient stays zero
    torch.optim.SGD(chunks, lr=0.5).step()  # stepping the chunks steps the views
    assert capstone.param_diff(views, [w.float() - 0.5 for w in weights]) < 1e-6
    assert float(torch.cat([c.detach() for c in chunks])[n:].abs().max()) == 0.0


def test_cpu_8bit_adams_with_and_without_a_compiler(monkeypatch):
    monkeypatch.setattr(capstone, "cpu_compiles", lambda: (False, "torch.compile cannot build CPU code here (test)"))
    adams, message = capstone.cpu_8bit_adams()
    assert list(adams) == ["bitsandbytes Adam8bit"]
    assert "cannot build" in message and "bitsandbytes Adam8bit can step here" in message
    p = torch.nn.Parameter(torch.zeros(4096))
    assert type(adams["bitsandbytes Adam8bit"]([p], 1e-3)).__name__ == "Adam8bit"
    monkeypatch.setattr(capstone, "cpu_compiles", lambda: (True, "torch.compile builds CPU code here (test)"))
    adams, message = capstone.cpu_8bit_adams()
    assert list(adams) == ["torchao AdamFp8", "torchao Adam8bit", "bitsandbytes Adam8bit"]
    assert "torchao AdamFp8, torchao Adam8bit, bitsandbytes Adam8bit can step here" in message
    assert type(adams["torchao AdamFp8"]([p], 1e-3)).__module__.startswith("torchao")
    monkeypatch.setitem(__import__("sys").modules, "torchao.optim", None)  # torchao not installed
    adams, message = capstone.cpu_8bit_adams(compiles=True)
    assert list(adams) == ["bitsandbytes Adam8bit"] and "pip install torchao" in message


def test_cpu_8bit_adams_without_bitsandbytes(monkeypatch):
    """A bare machine (no bitsandbytes): the libraries' list leaves it out and says so; notebook 06 then steps with
    its own Adam8bitCPU (where torch.compile works) or fused AdamW."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    adams, message = capstone.cpu_8bit_adams(compiles=False)
    assert adams == {} and "bitsandbytes is not installed" in message and "no library 8-bit Adam can step" in message
    adams, message = capstone.cpu_8bit_adams(compiles=True)
    assert list(adams) == ["torchao AdamFp8", "torchao Adam8bit"] and "pip install bitsandbytes" in message


def test_cpu_compiles_probe_reports_a_missing_compiler(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", no_compiler)
    works, why = capstone.cpu_compiles()
    assert works is False and "cannot build CPU code" in why and "InvalidCxxCompiler" in why and "more" not in why


def _largest_change_vs_adam(make, n=4096 * 3, lr=1e-3, steps=3):
    """Notebook 06's update check: gradients whose sizes span decades in every block of 256 values."""
    def largest(make_opt):
        gen = torch.Generator().manual_seed(0)
        sizes = torch.exp(2 * torch.randn(n, generator=gen))
        w = torch.nn.Parameter(torch.zeros(n))
        opt = make_opt([w], lr)
        for _ in range(steps):
            w.grad = torch.randn(n, generator=gen) * sizes * 1e-3
            opt.step()
        return float(w.detach().abs().max())

    return largest(make) / largest(lambda ps, lr: torch.optim.Adam(ps, lr=lr))


def test_bitsandbytes_adam8bit_keeps_adams_update_torchao_8bit_states_do_not():
    """What notebook 06's choice rests on. If torchao's second moment stops rounding to zero (a new version),
    update the notebook's prose ('Reading the table') with the new result."""
    adams, _ = capstone.cpu_8bit_adams(compiles=True)
    assert _largest_change_vs_adam(adams["bitsandbytes Adam8bit"]) <= 2
    assert _largest_change_vs_adam(lambda ps, lr: lesson()["Adam8bitCPU"](ps, lr=lr)) <= 1.2
    for name in ("torchao AdamFp8", "torchao Adam8bit"):
        assert _largest_change_vs_adam(adams[name]) > 100, f"{name} now keeps Adam's update: revisit notebook 06"


def test_adam8bit_cpu_codes_follows_fp32_adam_and_checks_its_input():
    L = lesson()
    encode, decode = L["encode"], L["decode"]
    y = torch.tensor([1.0, 0.7, 0.3, 2.0**-10, 2.0**-14.5, 2.0**-20, 2.0**-30.5, 2.0**-31.5, 0.0])
    for bits, octaves in ((4, 15), (5, 31)):
        back = decode(encode(y, bits), bits)
        kept = y >= 2.0**-octaves
        assert torch.all(((back - y).abs() <= y / 16)[kept])  # 3 mantissa bits, rounded: within 1/16
        assert not back[~kept].any() and back[-1] == 0  # below the range: zero
        assert int(encode(y, bits).max()) == 2**(bits + 3) - 8  # 1.0 is the largest code used
    torch.manual_seed(0)
    w32, w8 = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4096))
    opt32, opt8 = torch.optim.Adam([w32], lr=1e-2), L["Adam8bitCPU"]([w8], lr=1e-2)
    for _ in range(5):
        g = torch.randn(4096) * torch.exp(torch.randn(4096))
        w32.grad, w8.grad = g.clone(), g.clone()
        opt32.step()
        opt8.step()
    assert float((w8 - w32).norm() / w32.norm()) < 0.1
    state = opt8.state[w8]
    assert state["m_codes"].dtype == torch.int8 and state["r_codes"].dtype == torch.uint8
    from course_utils import memory
    assert memory.tensor_bytes(*memory.iter_tensors(opt8.state)) <= 2.05 * 4096
    bad = torch.nn.Parameter(torch.zeros(300))
    bad.grad = torch.ones(300)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        L["Adam8bitCPU"]([bad]).step()


def test_a_checkpointed_fake_prediction_runs_the_same_where_cuda_is_initialised(monkeypatch):
    """On a GPU machine CUDA is initialised before a notebook predicts; checkpoint then stashes and restores the CUDA
    RNG state of the tensors it sees. Fake CPU tensors (capstone.FAKE_DEVICE) give it none to clone inside
    FakeTensorMode, so the prediction is the one a machine without a GPU makes."""
    kwargs = dict(n_layer=2, n_embd=64, n_head=2, micro_batch=2, seq_len=32, accum_steps=2)
    without = capstone.predict_gpu_peak("gpt2", **kwargs).peak_bytes
    monkeypatch.setattr(torch.cuda, "_initialized", True)  # what checkpoint reads to decide to stash CUDA RNG state
    assert capstone.FAKE_DEVICE == "cpu"
    assert capstone.predict_gpu_peak("gpt2", **kwargs).peak_bytes == without


def test_micro_steps_after_the_second_change_no_byte_of_the_peak():
    """Why predict_gpu_peak simulates at most two micro-steps of an accumulated step: measured on a real small GPT-2
    (checkpointed, as the capstone's), the whole step's peak with four micro-steps equals the peak with two, to the
    byte; one micro-step (no gradients yet while it runs) is lower."""
    def measured_peak(accum_steps):
        torch.manual_seed(0)
        model = models.build_gpt2("gpt2", **TWIN_MODEL)
        capstone.enable_checkpointing(model)
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

        def optimizer_step():
            for _ in range(accum_steps):
                model(input_ids=ids, labels=ids).loss.backward()
            for p in model.parameters():
                p.grad = None

        return memory.measure_memory(optimizer_step, model=model.train()).peak_bytes

    assert measured_peak(4) == measured_peak(2) > measured_peak(1)


def test_nothing_is_compiled_where_the_compiler_would_not_fit_beside_the_kernel(monkeypatch):
    """A free Binder session has 2 GiB: the kernel holds about 1.1 GiB, g++ building a compiled step about 1 GiB more."""
    monkeypatch.setattr(hardware, "available_ram_bytes", lambda: int(0.8 * capstone.GIB))
    works, why = capstone.cpu_compiles()
    assert not works and "0.80 GiB of RAM is free" in why and "nothing is compiled" in why
    adams, _ = capstone.cpu_8bit_adams()
    assert not any(name.startswith("torchao") for name in adams)


def test_a_containers_memory_limit_is_what_is_available(tmp_path):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text("2147483648\n")
    usage.write_text(str(1536 * 2**20) + "\n")
    assert hardware.available_ram_bytes([(str(limit), str(usage))]) == 512 * 2**20   # 2 GiB less 1.5 GiB in use
    limit.write_text("max\n")   # no limit: the machine's available memory
    unlimited, machine = hardware.available_ram_bytes([(str(limit), str(usage))]), hardware.available_ram_bytes([])
    assert abs(unlimited - machine) < 256 * 2**20   # the same reading, taken twice
    assert hardware.available_ram_bytes([(str(tmp_path / "none"), str(usage))]) > 0
