"""Notebook 10 (beyond Adam): its lesson cells, exec'd from the notebook, checked against the libraries they teach:
the optimizers' state formulas against torch's and the authors' packages on another GPT-2 shape, the stochastic
rounding checker against plausible wrong answers (and torchao's rounding), the norm pass against clip_grad_norm_."""
import copy
import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import checks, memory, models
from course_utils.checks import claim
from notebook_lessons import checker_rejects, exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "10_beyond_adam.ipynb"
LESSON = {  # a name the notebook defines -> which of its code cells defines it
    "state_formula": lambda src, tags: src.startswith("def state_formula"),
    "check_stochastic_round": lambda src, tags: src.startswith("def bf16_neighbours"),
    "stochastic_round_bf16_solution": lambda src, tags: "solution" in tags,
    "fuse_update_into_backward": lambda src, tags: src.startswith("def fuse_update_into_backward"),
}
RANK = 12


@functools.lru_cache(maxsize=1)
def lesson() -> dict:
    return exec_lesson_cells(NOTEBOOK, LESSON, {
        "torch": torch, "nn": nn, "F": F, "math": math, "memory": memory, "checks": checks, "claim": claim,
        "RANK": RANK, "SR_UPDATES": 2000, "SR_NUDGE": 2.5e-4})


# ---------------------------------------------------------------- stochastic rounding
def _bits(x):
    return x.view(torch.int32)


def round_to_nearest(x):
    return x.to(torch.bfloat16)


def truncate(x):  # drops the low bits: always toward zero
    return (_bits(x) & -65536).view(torch.float32).to(torch.bfloat16)


def fifteen_bit_noise(x):  # half the range: rounds away from zero half as often as it should
    noise = torch.randint(0, 1 << 15, x.shape, dtype=torch.int32)
    return ((_bits(x) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def always_away(x):  # the largest noise every time: up whenever a low bit is set
    return ((_bits(x) + 0xFFFF) & -65536).view(torch.float32).to(torch.bfloat16)


def fp16_output(x):
    return lesson()["stochastic_round_bf16_solution"](x).to(torch.float16)


def test_the_solution_and_torchaos_rounding_pass_the_checker():
    check = lesson()["check_stochastic_round"]
    assert check(lesson()["stochastic_round_bf16_solution"], verbose=False)
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    assert check(quant_utils._fp32_to_bf16_sr, verbose=False)


def test_the_checker_rejects_plausible_mistakes():
    check = lesson()["check_stochastic_round"]
    assert checker_rejects(lambda fn: check(fn, verbose=True), round_to_nearest, truncate, fifteen_bit_noise,
                           always_away, fp16_output)


def test_round_to_nearest_never_moves_the_weight():
    nudged = lesson()["nudged"]
    assert nudged(round_to_nearest) == 0.0
    assert nudged(lesson()["stochastic_round_bf16_solution"]) == pytest.approx(0.5, abs=0.05)


# ---------------------------------------------------------------- each optimizer's state, by its formula
def _small_gpt2(dtype=torch.float32):
    torch.manual_seed(0)  # a shape the notebook does not use: the formulas are not fitted to it
    return models.build_gpt2("gpt2", n_layer=1, n_embd=48, n_head=3, vocab_size=128, n_positions=24,
                             dtype=dtype, attention="math")


def _low_rank_groups(model):
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "wpe" not in n]
    return [{"params": [p for p in model.parameters() if all(p is not m for m in mats)]},
            {"params": mats, "rank": RANK, "update_proj_gap": 50, "scale": 0.25, "proj_type": "std"}]


def _held(opt):  # the state's tensors, and those inside objects in it (the projectors)
    tensors = []
    for state in opt.state.values():
        for v in state.values():
            tensors += [v] if torch.is_tensor(v) else [t for t in getattr(v, "__dict__", {}).values()
                                                         if torch.is_tensor(t)]
    return memory.tensor_bytes(*tensors)


OPTIMIZERS = {
    "AdamW": lambda m: torch.optim.AdamW(m.parameters()),
    "Adafactor": lambda m: torch.optim.Adafactor(m.parameters()),
    "8-bit AdamW": lambda m: pytest.importorskip("bitsandbytes").optim.AdamW8bit(m.parameters()),
    "Lion": lambda m: pytest.importorskip("lion_pytorch").Lion(m.parameters()),
    "Adam-mini": lambda m: pytest.importorskip("adam_mini").Adam_mini(m.named_parameters(), dim=48, n_heads=3,
                                                                      verbose=False),
    "GaLore": lambda m: pytest.importorskip("galore_torch").GaLoreAdamW(_low_rank_groups(m)),
    "APOLLO": lambda m: pytest.importorskip("apollo_torch").APOLLOAdamW(
        [dict(g, proj="random", scale_type="channel") if "rank" in g else g for g in _low_rank_groups(m)]),
    "bf16 AdamW + SR": lambda m: pytest.importorskip("torchao.optim")._AdamW(m.parameters(),
                                                                             bf16_stochastic_round=True),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("method", list(OPTIMIZERS))
def test_each_formula_is_the_librarys_state(method):
    model = _small_gpt2(torch.bfloat16 if method == "bf16 AdamW + SR" else torch.float32)
    opt = OPTIMIZERS[method](model)
    x = torch.randint(0, 128, (2, 24))
    with torch.compiler.set_stance("force_eager"):
        for _ in range(2):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert _held(opt) == pytest.approx(lesson()["state_formula"](method, shapes), rel=0.02)
    with pytest.raises(ValueError, match="unknown method"):
        lesson()["state_formula"]("Sophia", shapes)


# ---------------------------------------------------------------- clipping with the update fused into backward
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def test_the_norm_pass_is_clip_grad_norm_with_one_gradient_alive():
    ns = lesson()
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    usual, fused = _mlp(), _mlp()
    usual_opt = torch.optim.AdamW(usual.parameters(), lr=1e-2)
    norm_first = ns["NormPassThenStep"](fused, lambda ps: torch.optim.AdamW(ps, lr=1e-2), max_norm=0.05)
    alive = []
    for p in fused.parameters():  # registered after the norm pass's hooks: sees what they left
        p.register_post_accumulate_grad_hook(lambda p: alive.append(sum(q.grad is not None for q in fused.parameters())))
    for _ in range(3):
        F.cross_entropy(usual(x), y).backward()
        assert torch.nn.utils.clip_grad_norm_(usual.parameters(), 0.05) > 0.05  # clipping acts
        usual_opt.step()
        usual_opt.zero_grad(set_to_none=True)
        norm_first.step(lambda: F.cross_entropy(fused(x), y))
    for a, b in zip(usual.parameters(), fused.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert max(alive) == 0  # each gradient left before the next one was complete
    # clipping each tensor alone is another rule
    per_tensor = _mlp()
    ns["fuse_update_into_backward"](per_tensor, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                    before_step=lambda p: torch.nn.utils.clip_grad_norm_([p], 0.05))
    for _ in range(3):
        F.cross_entropy(per_tensor(x), y).backward()
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(usual.parameters(), per_tensor.parameters()))
