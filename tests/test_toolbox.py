"""Notebook 08 (the current toolbox): its mechanisms, exec'd from the notebook's own cells and checked
against the libraries they teach (torch's save_on_cpu, peft, torchao, bitsandbytes), and the two
things course_utils.memory needed for them (tensor subclasses, frozen parameters)."""
import contextlib
import copy
import functools
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_utils import bootstrap, checks, memory, models, planner
from course_utils.checks import claim
from counting import counting  # noqa: F401 (a fixture)
from notebook_lessons import checker_rejects, exec_lesson_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "08_current_toolbox.ipynb"
LESSON = {  # a name the notebook defines -> which of its code cells defines it
    "OffloadActivations": lambda src, tags: src.startswith("class OffloadActivations"),
    "plain_cross_entropy": lambda src, tags: src.startswith("def plain_cross_entropy"),
    "check_chunked_loss": lambda src, tags: src.startswith("def check_chunked_loss"),
    "chunked_cross_entropy_solution": lambda src, tags: "solution" in tags and "def chunked_cross_entropy_solution" in src,
    "fuse_update_into_backward": lambda src, tags: src.startswith("def fuse_update_into_backward"),
    "quantize_4bit": lambda src, tags: src.startswith("def quantize_4bit"),
    "LoRA": lambda src, tags: src.startswith("class LoRA"),
    "to_nf4": lambda src, tags: src.startswith("def to_nf4"),
    "check_qlora_weights": lambda src, tags: src.startswith("def check_qlora_weights"),
    "qlora_weight_bytes_solution": lambda src, tags: "solution" in tags and "def qlora_weight_bytes_solution" in src,
}
RECORDED = {}


@functools.lru_cache(maxsize=1)
def lesson() -> dict:
    """Exec the notebook's lesson cells (in notebook order) and return their namespace."""
    import bitsandbytes as bnb

    results = types.SimpleNamespace(record=lambda name, value, unit: RECORDED.__setitem__(name, value))
    return exec_lesson_cells(NOTEBOOK, LESSON, {
        "torch": torch, "nn": nn, "F": F, "checkpoint": checkpoint, "memory": memory, "checks": checks, "claim": claim,
        "results": results, "bnb": bnb, "bootstrap": bootstrap, "weakref": weakref, "DEVICE": torch.device("cpu"), "planner": planner,
        "GIB": 2**30, "EIGHT_B": "llama-3.1-8b", "n_8b": planner.get_model("llama-3.1-8b").n_params})


def mlp(layers=4, width=32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 3))


def grads(model, x, y, hooks=None):
    model.zero_grad(set_to_none=True)
    if hooks is None:
        loss = F.cross_entropy(model(x), y)
    else:
        with hooks:
            loss = F.cross_entropy(model(x), y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------------
# course_utils.memory: what notebook 08 needed
# ------------------------------------------------------------------------------------------------

def test_tensor_bytes_counts_what_a_torchao_4bit_state_holds():
    torchao_optim = pytest.importorskip("torchao.optim")
    p = nn.Parameter(torch.randn(256, 256))
    p.grad = torch.randn_like(p)
    opt = torchao_optim.AdamW4bit([p])
    with torch.compiler.set_stance("force_eager"):
        opt.step()
    n = p.numel()
    per_state = n // 2 + 4 * (n // 128) + 4 * 16  # packed codes, fp32 scale per 128, the 16-entry map
    assert memory.tensor_bytes(opt.state[p]["exp_avg"]) == per_state
    assert memory.optimizer_state_bytes(opt) == 2 * per_state + 4  # + the step counter
    assert memory.tensor_bytes(opt.state[p]["exp_avg"]) < n * 4 / 7  # not the fp32 shape it shows


def test_measure_memory_with_frozen_parameters(counting):
    model = mlp(layers=2, width=64)
    model[0].requires_grad_(False)  # frozen, as LoRA's base weights
    x, y = torch.randn(8, 64), torch.randint(0, 3, (8,))
    report = memory.measure_memory(lambda: F.cross_entropy(model(x), y).backward(), model=model)  # used to raise
    assert report.by_category["params"] == memory.block_bytes(*model.parameters())  # frozen ones count too
    assert 0 < report.by_category["grads"] <= memory.block_bytes(*(p for p in model.parameters() if p.requires_grad))
    assert model[0].weight.grad is None and model[2].weight.grad is not None


# ------------------------------------------------------------------------------------------------
# the notebook's mechanisms
# ------------------------------------------------------------------------------------------------

def test_offload_hooks_give_the_same_gradients_and_round_trip_every_byte():
    L = lesson()
    model = mlp()
    x, y = torch.randn(16, 32), torch.randint(0, 3, (16,))
    hooks = L["OffloadActivations"](model)
    for a, b in zip(grads(model, x, y), grads(model, x, y, hooks)):
        assert torch.equal(a, b)
    assert hooks.bytes_to_host == hooks.bytes_to_device > 0
    lib = grads(model, x, y, torch.autograd.graph.save_on_cpu())
    for a, b in zip(grads(model, x, y), lib):
        assert torch.equal(a, b)


def test_offload_leaves_weights_alone_and_carries_bfloat16():
    L = lesson()
    model = nn.Linear(512, 512, bias=False)  # 1 MiB of weight, a tiny activation
    hooks = L["OffloadActivations"](model)
    x = torch.randn(2, 512, requires_grad=True)
    with hooks:
        out = model(x).sum()
    out.backward()
    assert hooks.bytes_to_host == x.numel() * 4  # the input, not the weight (saved as a view, weight.t())
    xb = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    hooks = L["OffloadActivations"](model)
    with hooks:
        yb = (xb * xb).sum()  # saves xb (bfloat16) twice: one tensor, sent once
    yb.backward()
    assert torch.equal(xb.grad, 2 * xb.detach())
    assert hooks.bytes_to_host == hooks.bytes_to_device == xb.numel() * 2


def test_offload_sends_a_tensor_saved_twice_once():
    """A ReLU's output is also the next Linear's input: the hook sends exactly the activations that stay on the
    device without it, as measure_memory counts them at the forward peak."""
    L = lesson()
    model = mlp(layers=6, width=64)
    x, y = torch.randn(32, 64), torch.randint(0, 3, (32,))
    hooks = L["OffloadActivations"](model)

    def forward(context):
        def fn():
            with context:
                model(x)
        return fn

    plain = memory.measure_memory(forward(contextlib.nullcontext()), model=model).by_category["activations"]
    memory.measure_memory(forward(hooks), model=model)
    assert hooks.bytes_to_host == plain == 7 * 32 * 64 * 4  # the input and the 6 ReLU outputs, once each
    hooks = L["OffloadActivations"](model)
    for a, b in zip(grads(model, x, y), grads(model, x, y, hooks)):
        assert torch.equal(a, b)
    assert hooks.bytes_to_device == hooks.bytes_to_host  # the copy back serves both users


def test_offload_never_mistakes_a_new_tensor_for_a_freed_one():
    """Python reuses the id of a freed tensor: a later tensor with that id must travel on its own (the hook keeps a
    weak reference and the version, and forgets everything after the forward pass)."""
    L = lesson()
    model = nn.Linear(8, 8)
    x = torch.randn(16, 8, requires_grad=True)

    def chain():
        out = model(x)
        for _ in range(50):  # each temporary is saved, then freed: its id comes back for the next one
            out = out + (out * 1.01).sin()
        return out.sum()

    chain().backward()
    want = x.grad.clone()
    x.grad = None
    hooks, ids = L["OffloadActivations"](model), []
    pack = hooks.pack
    hooks.pack = lambda t: (ids.append(id(t)), pack(t))[1]  # note each id the hook sees
    with hooks:
        loss = chain()
    loss.backward()
    assert len(set(ids)) < len(ids)  # ids did come back
    assert torch.equal(x.grad, want)
    assert hooks.bytes_to_device == hooks.bytes_to_host == 51 * 16 * 8 * 4  # x, then each temporary once
    assert hooks._sent == {}


def test_chunked_loss_solution_passes_and_the_mistakes_do_not():
    L = lesson()  # exec'ing the solution cell already claimed that it passes; check again, and the value directly
    solution, check = L["chunked_cross_entropy_solution"], L["check_chunked_loss"]
    assert check(solution, verbose=False)

    def wrong_whole_logits(hidden, weight, targets, chunk_tokens):  # chunks the loss of logits made whole
        chunks = zip((hidden @ weight.T).split(chunk_tokens), targets.split(chunk_tokens))
        return sum(F.cross_entropy(lg.float(), y, reduction="sum") for lg, y in chunks) / targets.numel()

    def wrong_no_checkpoint(hidden, weight, targets, chunk_tokens):  # right value, but backward keeps every chunk
        chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))
        return sum(F.cross_entropy((h @ weight.T).float(), y, reduction="sum") for h, y in chunks) / targets.numel()

    def wrong_mean_of_means(hidden, weight, targets, chunk_tokens):  # the short last chunk weighs as much
        chunks = list(zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)))
        return sum(checkpoint(lambda h, y: F.cross_entropy((h @ weight.T).float(), y), h, y, use_reentrant=False)
                   for h, y in chunks) / len(chunks)

    def wrong_sum(hidden, weight, targets, chunk_tokens):  # forgets to divide by the number of tokens
        return solution(hidden, weight, targets, chunk_tokens) * targets.numel()

    assert checker_rejects(lambda f: check(f, verbose=False), wrong_whole_logits, wrong_no_checkpoint,
                           wrong_mean_of_means, wrong_sum)
    torch.manual_seed(1)
    hidden, weight, targets = torch.randn(37, 8), torch.randn(50, 8), torch.randint(0, 50, (37,))
    for chunk in (1, 5, 37, 64):
        assert torch.allclose(solution(hidden, weight, targets, chunk), L["plain_cross_entropy"](hidden, weight, targets),
                              rtol=1e-5)
    assert not check(lambda h, w, t, c: L["plain_cross_entropy"](h, w, t), verbose=False)  # right value, whole logits


def test_fused_update_matches_optimizer_step_and_frees_each_gradient():
    L = lesson()
    normal, fused = mlp(), mlp()
    x, y = torch.randn(16, 32), torch.randint(0, 3, (16,))
    opt = torch.optim.AdamW(normal.parameters(), lr=1e-2)
    optimizers = L["fuse_update_into_backward"](fused, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert len(optimizers) == len(list(fused.parameters()))
    for _ in range(2):
        F.cross_entropy(normal(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(fused(x), y).backward()
    assert all(p.grad is None for p in fused.parameters())
    for a, b in zip(normal.parameters(), fused.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_4bit_storage_matches_torchao():
    subclass = pytest.importorskip("torchao.optim.subclass_4bit")
    L = lesson()
    torch.manual_seed(0)
    x = torch.randn(64, 128) * torch.rand(64, 1)  # blocks with different scales
    state = subclass.OptimState4bit.zeros(x.shape, signed=True, block_size=128)
    state.copy_(x)  # torchao quantizes
    ours = L["dequantize_4bit"](state.codes, state.scale, state.qmap, state.shape)
    assert torch.equal(ours, state.dequantize())
    packed, scale = L["quantize_4bit"](x, state.qmap)
    assert torch.allclose(scale, state.scale)
    assert (packed == state.codes).float().mean() >= 0.99
    assert memory.tensor_bytes(state) == L["state_bytes_4bit"](x.numel())
    error = (L["dequantize_4bit"](packed, scale, state.qmap, x.shape) - x).abs().max()
    assert error <= scale.max() / 4  # 16 codes in [-1, 1]: never more than a coarse step away


@pytest.mark.parametrize("size", [dict(n_layer=1, n_embd=32, n_head=2), dict(n_layer=3, n_embd=48, n_head=4)])
def test_lora_matches_peft_and_its_parameter_count(size):
    peft = pytest.importorskip("peft")
    L = lesson()
    torch.manual_seed(0)
    base = models.build_gpt2("gpt2", vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, **size)
    targets = ["c_attn", "c_proj", "c_fc"]
    ours = L["add_lora"](copy.deepcopy(base), targets, 4, 8)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                         lora_dropout=0.0, fan_in_fan_out=True))
    mine = [m for m in ours.modules() if isinstance(m, L["LoRA"])]
    their = [m for m in theirs.modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)]
    assert len(mine) == len(their) == 4 * size["n_layer"]
    with torch.no_grad():
        for a, b in zip(mine, their):
            b.lora_B["default"].weight.normal_(0, 0.1)
            a.A.copy_(b.lora_A["default"].weight)
            a.B.copy_(b.lora_B["default"].weight)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.allclose(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, atol=1e-5)
    trainable = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (ours, theirs)]
    assert trainable[0] == trainable[1] == L["lora_params"](size["n_layer"], size["n_embd"], 4)
    assert all(not p.requires_grad for n, p in ours.named_parameters() if not n.endswith((".A", ".B")))


def test_to_nf4_keeps_the_model_close_and_stores_4_bits():
    L = lesson()
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = models.build_gpt2("gpt2", n_layer=1, n_embd=64, n_head=2, vocab_size=64, n_positions=16,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        q = L["to_nf4"](copy.deepcopy(model), ["c_attn", "c_proj", "c_fc"])
        after = q(input_ids=ids).logits
    layers = [m for m in q.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 4
    assert all(m.weight.dtype == torch.uint8 for m in layers)
    assert (after - before).abs().max() <= 0.1 * before.abs().max()


def test_the_qlora_weights_exercise_rejects_the_usual_mistakes():
    L = lesson()
    check, layer, model = L["check_qlora_weights"], L["nf4_layer_bytes_solution"], L["qlora_weight_bytes_solution"]
    assert check(layer, model, verbose=False)

    def no_absmax(d_in, d_out):  # the codes alone
        return (d_in * d_out + 1) // 2 + 64

    def a_byte_a_value(d_in, d_out):  # 4 bits counted as a byte
        return d_in * d_out + 4 * -(-(d_in * d_out) // 64) + 64

    def everything_in_4_bits(spec):  # the embeddings and the head quantized too
        return layer(spec.n_params, 1)

    def forgets_the_rest(spec):  # only the quantized layers
        return spec.n_blocks * sum(layer(d_in, d_out) for _, d_in, d_out in spec.linears)

    assert checker_rejects(lambda fn: check(fn, model, verbose=False), no_absmax, a_byte_a_value)
    assert checker_rejects(lambda fn: check(layer, fn, verbose=False), everything_in_4_bits, forgets_the_rest)
