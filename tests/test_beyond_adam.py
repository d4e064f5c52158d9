"""Notebook 10 (beyond Adam): its lesson cells, exec'd from the notebook, checked against the libraries they teach:
the optimizers' state formulas against torch's and the authors' packages on another GPT-2 shape, Adafactor's factored
second moment against torch's Adafactor, GaLore's step against galore-torch's GaLoreAdamW, the race's learning-rate
sweep (widened past a winning edge) and its verdicts, the stochastic rounding checker against plausible wrong answers
(and torchao's rounding), the norm pass against clip_grad_norm_."""
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
    "factored_second_moment": lambda src, tags: src.startswith("def factored_second_moment"),
    "galore_adam_step": lambda src, tags: src.startswith("def galore_adam_step"),
    "bracket_sweep": lambda src, tags: src.startswith("def bracket_sweep"),
    "nudged": lambda src, tags: src.startswith("def nudged"),
    "check_stochastic_round": lambda src, tags: src.startswith("def bf16_neighbours"),
    "stochastic_round_bf16_solution": lambda src, tags: "solution" in tags,
    "fuse_update_into_backward": lambda src, tags: src.startswith("def fuse_update_into_backward"),
}
RANK = 12


@functools.lru_cache(maxsize=1)
def lesson() -> dict:
    return exec_lesson_cells(NOTEBOOK, LESSON, {
        "torch": torch, "nn": nn, "F": F, "math": math, "memory": memory, "checks": checks, "claim": claim,
        "RANK": RANK, "PROJ_EVERY": 10, "LR_STEP": 3, "SR_UPDATES": 2000, "SR_NUDGE": 2.5e-4})


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


# ---------------------------------------------------------------- Adafactor's factored second moment, by hand
def _gradients(shape, steps, seed=0):  # gradients of changing size and structure, as training gives
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * (1 + t) for t in range(steps)]


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_the_factored_second_moment_is_torchs_adafactor_state(shape):
    grads = _gradients(shape, 7)
    rows, cols, full = lesson()["factored_second_moment"](grads)
    w = nn.Parameter(torch.zeros(shape))
    opt = torch.optim.Adafactor([w])
    for g in grads:
        w.grad = g.clone()
        opt.step()
    assert torch.allclose(rows, opt.state[w]["row_var"], rtol=1e-5, atol=0)
    assert torch.allclose(cols, opt.state[w]["col_var"], rtol=1e-5, atol=0)
    # the full running mean of g^2 with the same weights, step by step (Adam's v with torch's Adafactor decay)
    v = torch.zeros(shape)
    for t, g in enumerate(grads, start=1):
        v.lerp_(g ** 2, t ** -0.8)
    assert torch.allclose(full, v, rtol=1e-5)


def test_the_rank_one_rebuild_keeps_row_and_column_sums_and_is_exact_for_a_rank_one_square():
    rank_one = lesson()["rank_one"]
    rows, cols, full = lesson()["factored_second_moment"](_gradients((5, 8), 4))
    rebuilt = rank_one(rows, cols)
    assert torch.allclose(rebuilt.sum(1), full.sum(1), rtol=1e-5) and torch.allclose(rebuilt.sum(0), full.sum(0), rtol=1e-5)
    assert not torch.allclose(rebuilt, full, rtol=1e-2)  # a rank-1 fit, not the whole
    a, b = torch.rand(5) + 0.1, torch.rand(8) + 0.1  # g = a b^T: g^2 is rank one, and rebuilt exactly
    rows, cols, full = lesson()["factored_second_moment"]([torch.outer(a, b)])
    assert torch.allclose(rank_one(rows, cols), full, rtol=1e-5)


# ---------------------------------------------------------------- GaLore's projection, by hand
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_galore_step_is_galore_adamws_across_renewals():
    galore_torch = pytest.importorskip("galore_torch")
    step = lesson()["galore_adam_step"]
    grads = _gradients((8, 20), 9, seed=1)
    start = torch.randn(8, 20)
    mine, state, theirs = start.clone(), {}, nn.Parameter(start.clone())
    opt = galore_torch.GaLoreAdamW([{"params": [theirs], "rank": 3, "update_proj_gap": 4, "scale": 0.5,
                                     "proj_type": "std"}], lr=1e-2)
    for g in grads:  # renewals at steps 0, 4 and 8
        step(mine, g, state, lr=1e-2, rank=3, scale=0.5, every=4)
        theirs.grad = g.clone()
        opt.step()
    assert torch.allclose(mine, theirs.detach(), atol=1e-6)
    assert state["m"].shape == state["v"].shape == (3, 20) and state["P"].shape == (8, 3)
    moved = torch.zeros(8, 20)
    step(moved, grads[0], {}, lr=1e-2, rank=3)
    assert torch.linalg.matrix_rank(moved) == 3  # one step moves the weights within r directions
    with pytest.raises(ValueError, match="fewer rows than columns"):
        step(torch.zeros(20, 8), grads[0].T, {}, lr=1e-2, rank=3)


# ---------------------------------------------------------------- the race: a sweep that brackets, a verdict beyond noise
def _counted(loss):
    calls = []
    def loss_at(lr):
        calls.append(lr)
        return loss(lr)
    return loss_at, calls


def test_the_sweep_is_widened_past_a_winning_edge_until_its_best_is_inside():
    bracket_sweep = lesson()["bracket_sweep"]
    far_above = lambda lr: (math.log(lr) - math.log(100.0)) ** 2  # best at 100: above a sweep of 1, 3, 9
    loss_at, calls = _counted(far_above)
    best, losses, inside = bracket_sweep(loss_at, [1.0, 3.0, 9.0])
    assert inside and best == pytest.approx(81.0) and max(losses) == pytest.approx(243.0) and len(calls) == 6
    far_below = lambda lr: (math.log(lr) - math.log(0.02)) ** 2  # and below it
    best, losses, inside = bracket_sweep(far_below, [1.0, 3.0, 9.0])
    assert inside and best == pytest.approx(1 / 81) and min(losses) == pytest.approx(1 / 243)
    loss_at, calls = _counted(lambda lr: (math.log(lr) - math.log(3.0)) ** 2)  # already inside: nothing added
    assert bracket_sweep(loss_at, [1.0, 3.0, 9.0])[::2] == (3.0, True) and calls == [1.0, 3.0, 9.0]


def test_a_diverged_run_loses_and_a_sweep_that_never_brackets_says_so():
    bracket_sweep = lesson()["bracket_sweep"]
    diverges = lambda lr: -lr if lr < 20 else float("nan")  # better and better, until it blows up
    best, losses, inside = bracket_sweep(diverges, [1.0, 3.0, 9.0])
    assert best == 9.0 and inside and math.isnan(losses[27.0])
    best, losses, inside = bracket_sweep(lambda lr: 1.0 / lr, [1.0, 3.0, 9.0], most=5)  # keeps improving
    assert not inside and len(losses) == 5 and best == max(losses)


def test_a_verdict_only_beyond_twice_the_combined_standard_error():
    verdict = lesson()["verdict"]
    assert verdict("Lion", -0.10, 0.04).startswith("Lion ends lower than AdamW by 0.100")
    assert verdict("Lion", 0.09, 0.04).startswith("Lion ends higher than AdamW by 0.090")
    assert "no difference this run can see" in verdict("Lion", -0.07, 0.04)
    assert "no difference this run can see" in verdict("Lion", 0.0, 0.0)


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
