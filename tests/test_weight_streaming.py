"""Notebook 09's weight streaming, run from the notebook's own cells (the code a learner reads is the code tested):
the same update as the recipe exactly in fp32 across accumulation and a resume, two blocks on the device at most,
each block fetched twice per micro-step, the exercise's checker rejecting wrong hooks, and the CUDA engine on a GPU."""
import warnings
from pathlib import Path

import pytest
import torch

from notebook_lessons import exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "09_smaller_than_the_model.ipynb"
LESSON = {
    "checkpointing": lambda src, tags: "class Checkpointed" in src,
    "engines": lambda src, tags: "class CpuEngine" in src,
    "streamer": lambda src, tags: "class WeightStreamer" in src,
    "checker": lambda src, tags: "def check_block_hooks" in src,
    "solution": lambda src, tags: "solution" in tags,
    "loss": lambda src, tags: "def chunked_lm_loss" in src and "class" not in src,
    "trainer": lambda src, tags: "class StreamingTrainer" in src,
}
TINY = dict(vocab_size=64, n_layer=3, n_embd=32, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=63, eos_token_id=63)


@pytest.fixture(scope="module")
def nb():
    prelude = ("import copy, functools, torch\nimport torch.nn.functional as F\nfrom torch.utils.checkpoint import checkpoint\n"
               "from course_utils import checks, models\nfrom course_utils.checks import claim\n")
    namespace = {}
    exec(prelude, namespace)
    return exec_lesson_cells(NOTEBOOK, LESSON, namespace)


def _trainer(nb, stream, seed=0, device="cpu", engine=None):
    from course_utils import models

    torch.manual_seed(seed)
    model = models.build_gpt2("gpt2", dtype=torch.float32, **TINY)
    fp32 = [p.detach().clone() for p in model.parameters()]
    nb["checkpoint_blocks"](model)
    engine = engine or nb["CpuEngine"]()
    return nb["StreamingTrainer"](model.to(device).train(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), fp32, engine,
                                  stream=stream)


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
    from course_utils import checks

    check = nb["check_block_hooks"]
    assert check(nb["before_block"], nb["after_block"], verbose=False)

    def keeps_all(streamer, i):
        pass

    def late_fetch(streamer, i):
        streamer.start_fetch(i)
        streamer.install(i)

    def evicts_before_use(streamer, i):
        nb["before_block"](streamer, i)
        streamer.evict(i)

    assert checks.checker_rejects(lambda pair: check(*pair, verbose=False), (nb["before_block"], keeps_all),
                                  (late_fetch, nb["after_block"]), (evicts_before_use, nb["after_block"]))


def test_fake_engine_prices_a_streamed_step_without_memory(nb):
    """Under fake tensors the engine only resizes storages: the device holds two blocks' weights at most."""
    from course_utils import models

    namespace = dict(nb)
    exec(_cell_source("class ShapeOnlyEngine").split("@functools")[0], namespace)
    with models.fake_mode():
        model = models.build_gpt2("gpt2", dtype=torch.float16, **TINY)
        nb["checkpoint_blocks"](model)
        trainer = nb["StreamingTrainer"](model.train(), lambda ps: torch.optim.SGD(ps, lr=0.0),
                                         [p.detach() for p in model.parameters()], namespace["ShapeOnlyEngine"]())
        ids = torch.randint(0, TINY["vocab_size"], (2, 16))
        trainer.backward(nb["chunked_lm_loss"](model, ids, 8))
    block_bytes = sum(p.numel() * 2 for p in trainer.streamer.params[0])
    assert trainer.streamer.peak_device_bytes == 2 * block_bytes
    assert trainer.streamer.fetched_bytes == 2 * len(trainer.streamer.blocks) * block_bytes


def _cell_source(marker):
    import json

    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    (source,) = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    return source


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
