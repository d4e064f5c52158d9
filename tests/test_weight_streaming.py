"""Notebook 09's weight streaming, run from the notebook's own cells (the code a learner reads is the code tested):
the same update as the recipe exactly in fp32 across accumulation and a resume, two blocks on the device at most,
each block fetched twice per micro-step, the exercise's checker rejecting wrong hooks, a whole optimizer step measured
on the CPU within 5% of its fake-tensor prediction, dynamic loss scaling, the host-RAM check of profile full, and the
CUDA engine on a GPU."""
import warnings
from pathlib import Path

import pytest
import torch

from counting import counted, counting  # noqa: F401 (a fixture)
from notebook_lessons import checker_rejects, exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "09_smaller_than_the_model.ipynb"
LESSON = {
    "checkpointing": lambda src, tags: "class Checkpointed" in src,
    "engines": lambda src, tags: "class CpuEngine" in src,
    "streamer": lambda src, tags: "class WeightStreamer" in src,
    "checker": lambda src, tags: "def check_block_hooks" in src,
    "stub": lambda src, tags: src.startswith("def before_block(") and "NotImplementedError" in src,
    "solution": lambda src, tags: "solution" in tags,
    "choice": lambda src, tags: "block_hooks = " in src,  # the learner's pair once it passes, else the solution's
    "loss": lambda src, tags: "def chunked_lm_loss" in src and "class" not in src,
    "trainer": lambda src, tags: "class StreamingTrainer" in src,
    "host_ram": lambda src, tags: "def model_for_host" in src,
    "setup": lambda src, tags: "def make_trainer" in src,
    "prediction": lambda src, tags: "def predict_step" in src,
}
# the notebook's settings for a small model in fp32 on the CPU (its settings cell picks the device and the profile)
SETTINGS = dict(PROFILE="smoke", DEVICE=torch.device("cpu"), ON_GPU=False, DTYPE=torch.float32, LOSS_SCALE=1.0,
                ACCUM=3, LR=1e-2, MICRO_BATCH=2, SEQ_LEN=16, CHUNK=8, DEMO_MICRO_BATCH=2, DEMO_SEQ=16,
                SIZE=dict(name="gpt2", vocab_size=64, n_layer=3, n_embd=32, n_head=2, n_positions=32))
SETTINGS["DEMO"] = SETTINGS["SIZE"]
TINY = dict(vocab_size=64, n_layer=3, n_embd=32, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=63, eos_token_id=63)


@pytest.fixture(scope="module")
def nb():
    prelude = ("import contextlib, copy, functools, warnings, torch\nimport torch.nn.functional as F\n"
               "from torch.utils._python_dispatch import _disable_current_modes\n"
               "from torch.utils.checkpoint import checkpoint\n"
               "from course_utils import capstone, checks, memory, models, planner\nfrom course_utils.checks import claim\n"
               "from course_utils.memory import GIB\n")
    namespace = dict(SETTINGS)
    exec(prelude, namespace)
    return exec_lesson_cells(NOTEBOOK, LESSON, namespace)


def _trainer(nb, stream, seed=0, device="cpu", engine=None, **scaling):
    from course_utils import models

    torch.manual_seed(seed)
    model = models.build_gpt2("gpt2", dtype=torch.float32, **TINY)
    fp32 = [p.detach().clone() for p in model.parameters()]
    nb["checkpoint_blocks"](model)
    engine = engine or nb["CpuEngine"]()
    return nb["StreamingTrainer"](model.to(device).train(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), fp32, engine,
                                  stream=stream, **scaling)


def _batches(n, seed=0):
    return torch.randint(0, TINY["vocab_size"], (n, 2, 16), generator=torch.Generator().manual_seed(seed))


def _train(nb, trainer, batches, first, last, accum=3):
    for step in range(first, last):
        for k in range(accum):
            x = batches[step * accum + k].to(trainer.params[0].device)
            trainer.backward(nb["chunked_lm_loss"](trainer.model, x, 8) / accum)
        trainer.step()


def test_streamed_update_equals_the_recipe_exactly_across_accumulation_and_a_resume(nb, tmp_path):
    batches = _batches(12)
    recipe = _trainer(nb, stream=False)
    _train(nb, recipe, batches, 0, 4)
    first = _trainer(nb, stream=True)
    _train(nb, first, batches, 0, 2)
    torch.save(first.state_dict(), tmp_path / "resume.pt")
    resumed = _trainer(nb, stream=True, seed=5)          # other random weights: the checkpoint must restore them
    resumed.load_state_dict(torch.load(tmp_path / "resume.pt", weights_only=False))
    _train(nb, resumed, batches, 2, 4)
    start = _trainer(nb, stream=False).master
    assert max(float((m - s).detach().abs().max()) for m, s in zip(recipe.master, start)) > 1e-4, "the weights must move"
    for a, b in zip(recipe.master, resumed.master):
        assert torch.equal(a, b)
    # the device copy the next forward uses is the master's: streamed blocks come back from their host copies
    streamer = resumed.streamer
    for i in range(len(streamer.blocks)):
        streamer.start_fetch(i)
        streamer.install(i)
    for p, q in zip(recipe.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_two_blocks_at_most_each_fetched_twice_and_a_lower_peak(nb):
    from course_utils import memory

    x = _batches(1)[0]
    recipe, streamed = _trainer(nb, stream=False), _trainer(nb, stream=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = memory.measure_memory(lambda: recipe.backward(nb["chunked_lm_loss"](recipe.model, x, 8)),
                                      model=recipe.model)
        ours = memory.measure_memory(lambda: streamed.backward(nb["chunked_lm_loss"](streamed.model, x, 8)),
                                     model=streamed.model)
    block_bytes = sum(p.numel() * 4 for p in streamed.streamer.params[0])
    assert streamed.streamer.peak_device_bytes == 2 * block_bytes
    assert streamed.streamer.fetched_bytes == 2 * len(streamed.streamer.blocks) * block_bytes
    assert streamed.streamer.on_device == set() and streamed.streamer.in_flight == {}, "everything evicted after"
    assert all(p.untyped_storage().nbytes() == 0 for ps in streamed.streamer.params for p in ps)
    assert ours.peak_bytes < plain.peak_bytes
    assert ours.by_category["params"] < plain.by_category["params"]


def test_the_exercise_checker_accepts_the_solution_and_rejects_mistakes(nb):
    check = nb["check_block_hooks"]
    before, after = nb["before_block_solution"], nb["after_block_solution"]
    assert check(before, after, verbose=False)

    def keeps_all(streamer, i):  # forward keeps every block: the GPU holds the whole model
        pass

    def late_fetch(streamer, i):  # fetches only when needed: correct, but nothing overlaps
        streamer.start_fetch(i)
        streamer.install(i)

    def evicts_before_use(streamer, i):
        before(streamer, i)
        streamer.evict(i)

    def prefetch_one_way(streamer, i):  # prefetches i + 1 in backward too: the wrong block, fetched again
        late_fetch(streamer, i)
        streamer.start_fetch(i + 1)

    assert checker_rejects(lambda pair: check(*pair, verbose=False), (before, keeps_all), (late_fetch, after),
                           (evicts_before_use, after), (prefetch_one_way, after))


def test_the_trainer_streams_with_the_learners_hooks_once_they_pass(nb):
    """The stub raised, so the trainer uses the solution's pair; a pair that passes the check replaces it."""
    assert nb["block_hooks"] == (nb["before_block_solution"], nb["after_block_solution"])
    picks = {"choice": LESSON["choice"]}
    mine = (lambda s, i: nb["before_block_solution"](s, i), lambda s, i: nb["after_block_solution"](s, i))
    for pair, used in ((mine, mine), ((lambda s, i: None, lambda s, i: None), nb["block_hooks"])):
        ns = exec_lesson_cells(NOTEBOOK, picks, {**nb, "before_block": pair[0], "after_block": pair[1]})
        assert ns["block_hooks"] == used


def test_fake_engine_prices_a_streamed_step_without_memory(nb):
    """Under fake tensors the engine only resizes storages: the device holds two blocks' weights at most."""
    from course_utils import models

    with models.fake_mode():
        model = models.build_gpt2("gpt2", dtype=torch.float16, **TINY)
        nb["checkpoint_blocks"](model)
        trainer = nb["StreamingTrainer"](model.train(), lambda ps: torch.optim.SGD(ps, lr=0.0),
                                         [p.detach() for p in model.parameters()], nb["ShapeOnlyEngine"]())
        ids = torch.randint(0, TINY["vocab_size"], (2, 16))
        trainer.backward(nb["chunked_lm_loss"](model, ids, 8))
    block_bytes = sum(p.numel() * 2 for p in trainer.streamer.params[0])
    assert trainer.streamer.peak_device_bytes == 2 * block_bytes
    assert trainer.streamer.fetched_bytes == 2 * len(trainer.streamer.blocks) * block_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_gives_the_cpu_twins_update(nb):
    batches = _batches(6)
    cpu = _trainer(nb, stream=True)
    _train(nb, cpu, batches, 0, 2)
    gpu = _trainer(nb, stream=True, device="cuda", engine=nb["CudaEngine"](torch.device("cuda")))
    _train(nb, gpu, batches, 0, 2)
    torch.cuda.synchronize()
    diff = max(float((a - b).abs().max()) for a, b in zip(cpu.master, gpu.master))
    assert diff < 1e-4, f"the CUDA engine's update differs from the CPU twin's by {diff}"
    assert gpu.streamer.peak_device_bytes <= 2 * sum(p.numel() * 4 for p in gpu.streamer.params[0])


def test_checkpoints_wait_on_the_host(nb):
    """With offload, each block's checkpointed input goes through the engine once in forward and comes back once."""
    trainer = _trainer(nb, stream=True)
    engine, moved = trainer.engine, {"pack": 0, "unpack": 0}
    pack, unpack = engine.pack, engine.unpack

    def counting_pack(t):
        moved["pack"] += 1
        return pack(t)

    def counting_unpack(packed):
        moved["unpack"] += 1
        return unpack(packed)

    engine.pack, engine.unpack = counting_pack, counting_unpack
    x = _batches(1)[0]
    loss = nb["chunked_lm_loss"](trainer.model, x, 8)
    assert moved == {"pack": TINY["n_layer"], "unpack": 0}
    trainer.backward(loss)
    assert moved == {"pack": TINY["n_layer"], "unpack": TINY["n_layer"]}


def test_a_whole_step_measured_on_the_cpu_is_within_5_percent_of_its_fake_tensor_prediction(nb, counting):
    """The CPU twin of section 4's check: the notebook's trainer and loop, ACCUM micro-steps and then the step, measured
    by tracking tensors (the host's side kept out by the engine's on_host), against the same step under fake tensors."""
    from course_utils import memory

    size = SETTINGS["SIZE"]
    for stream in (False, True):
        trainer = nb["make_trainer"](stream=stream)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            measured = memory.measure_memory(lambda: nb["train"](trainer, 0, 1), model=trainer.model)
            predicted = nb["predict_step"](size, stream=stream, as_cuda=False)[0]
        error = abs(measured.peak_bytes - predicted.peak_bytes) / predicted.peak_bytes
        assert error <= 0.05, f"stream={stream}: measured {measured.peak_bytes}, predicted {predicted.peak_bytes}"
        assert measured.by_category["params"] == predicted.by_category["params"]
        assert measured.by_category["optimizer"] == 0, "the optimizer's state lives on the host: not counted"
        assert all(p.grad is None for p in trainer.params), "after the step the device holds no gradient"
        weights = counted(*(p.numel() * 4 for p in trainer.params))
        if stream:   # every gradient left as backward made it
            assert measured.by_category["grads"] == 0 and measured.by_category["params"] < weights
        else:        # accumulation: every gradient is alive on the device while the last micro-step adds to it
            assert measured.by_category["grads"] == weights


def test_the_host_side_is_what_on_host_hides_and_nothing_else(nb, counting):
    """on_host hides the host's work from the tracker; a device tensor made outside it is counted in full."""
    from course_utils import memory

    engine = nb["CpuEngine"]()

    def host_then_device():
        with engine.on_host():
            host = torch.zeros(1_000_000)            # the master copy's kind of work: 4 MB, host memory
        device = torch.zeros(250_000)                # 1 MB on the device
        return host, device

    report = memory.measure_memory(host_then_device)
    assert report.peak_bytes == counted(250_000 * 4)


def test_an_overflow_skips_the_step_and_halves_a_dynamic_loss_scale(nb):
    trainer = _trainer(nb, stream=True, loss_scale=2.0**16, dynamic_scale=True)
    trainer.GROWTH_INTERVAL = 2
    before = [m.detach().clone() for m in trainer.master]
    x = _batches(1)[0]
    trainer.backward(nb["chunked_lm_loss"](trainer.model, x, 8) * float("inf"))   # every gradient inf or NaN
    assert trainer.step() is False and trainer.skipped == 1 and trainer.scale == 2.0**15
    assert all(torch.equal(a, m) for a, m in zip(before, trainer.master)), "a skipped step changes no weight"
    assert all(float(m.grad.abs().sum()) == 0 for m in trainer.master), "and leaves no gradient behind"
    for _ in range(2):
        trainer.backward(nb["chunked_lm_loss"](trainer.model, x, 8))
        assert trainer.step() is True
    assert trainer.scale == 2.0**16 and trainer.good_steps == 0, "two good steps (the interval here) double it back"
    assert any(not torch.equal(a, m) for a, m in zip(before, trainer.master)), "good steps move the weights"
    fixed = _trainer(nb, stream=True)                 # bf16 and fp32: a scale of 1 that never moves
    fixed.backward(nb["chunked_lm_loss"](fixed.model, x, 8) * float("inf"))
    assert fixed.step() is False and fixed.scale == 1.0


@pytest.mark.parametrize("free_gb, model", [(64, "gpt2-medium"), (12.7, "gpt2-medium"), (6, "gpt2")])
def test_the_host_ram_check_picks_the_largest_model_whose_trainer_fits(nb, free_gb, model):
    name, why = nb["model_for_host"](free_gb * 1e9)
    assert name == model and name in why


def test_the_host_ram_check_says_what_to_do_when_nothing_fits(nb):
    with pytest.raises(ValueError, match="COURSE_PROFILE=smoke"):
        nb["model_for_host"](1e9)


def test_profile_full_falls_back_to_gpt2_small_when_host_ram_is_short(nb, monkeypatch, capsys):
    """The notebook's own cell, in profile full, with psutil reporting a 6 GB machine."""
    import sys
    import types

    from notebook_lessons import exec_lesson_cells

    fake_psutil = types.SimpleNamespace(virtual_memory=lambda: types.SimpleNamespace(available=6e9))
    monkeypatch.setitem(sys.modules, "psutil", fake_psutil)
    namespace = dict(nb, PROFILE="full", SIZE=dict(name="gpt2-medium", vocab_size=50257))
    exec_lesson_cells(NOTEBOOK, {"host_ram": LESSON["host_ram"]}, namespace)
    assert namespace["SIZE"] == dict(name="gpt2", vocab_size=50257)
    assert "instead of gpt2-medium" in capsys.readouterr().out


def test_a_dropped_streamed_trainer_lives_on_until_its_hooks_are_removed(nb):
    """A tensor's post-accumulate-grad hooks are held by C++, out of the garbage collector's sight, and they refer back
    to the trainer: `del trainer` and a collection free nothing, and the next trainer would land on top of this one
    (on Colab's host, two fp32 masters). `remove_hooks()` lets it go. The notebook removes them before each drop."""
    import gc
    import json
    import re
    import weakref

    def dropped(remove):
        trainer = _trainer(nb, stream=True)
        trainer.backward(nb["chunked_lm_loss"](trainer.model, _batches(1)[0], 8))
        if remove:
            trainer.remove_hooks()
        alive = weakref.ref(trainer)
        del trainer
        gc.collect()
        return alive() is not None

    assert dropped(remove=False), "a hook no longer keeps the trainer: the notebook's remove_hooks() can go"
    assert not dropped(remove=True)
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    drops = [src for src in cells if re.search(r"^\s*del trainer\b", src, re.M)]   # a statement, not a comment
    assert len(drops) == 2 and all("trainer.remove_hooks()" in src.split("del trainer", 1)[0] for src in drops)
