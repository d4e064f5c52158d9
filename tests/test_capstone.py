"""Tests of course_utils.capstone: the two-copy recipe, streamed gradients, checkpoints, data."""
from __future__ import annotations

import math

import pytest
import torch

from course_utils import capstone, models

TOL_FP16 = 0.05  # fp16 device model vs fp32 model: update within 5% of the largest update


def tiny(dtype=torch.float32, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return models.build_gpt2("gpt2", dtype=dtype, n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                             resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                             bos_token_id=63, eos_token_id=63)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]


def train_plain(model, opt, data, accum):
    for step in range(len(data) // accum):
        for x in data[step * accum:(step + 1) * accum]:
            model(input_ids=x, labels=x).loss.div(accum).backward()
        opt.step()
        opt.zero_grad()


def train_trainer(trainer, data, accum):
    applied = []
    for step in range(len(data) // accum):
        for x in data[step * accum:(step + 1) * accum]:
            trainer.backward(trainer.model(input_ids=x, labels=x).loss / accum)
        applied.append(trainer.step())
    return applied


@pytest.mark.parametrize("opt_name", ["adam", "adam8bit"])
def test_two_copy_fp32_matches_plain_training_exactly(opt_name):
    ref = tiny()
    opt = capstone._make_optimizer(opt_name, list(ref.parameters()), 1e-3, 0.0)
    trainer = capstone.MasterCopyTrainer(tiny(), opt_name, lr=1e-3, loss_scale="dynamic")  # 2**16: exact in fp32
    data = batches(4)
    train_plain(ref, opt, data, accum=2)
    assert train_trainer(trainer, data, accum=2) == [True, True]
    assert capstone.param_diff(ref.parameters(), trainer.master_params) == 0.0
    assert capstone.param_diff(ref.parameters(), trainer.model.parameters()) == 0.0  # copied back


def test_two_copy_fp16_one_step_within_tolerance():
    ref = tiny()
    dev = tiny(torch.float16)
    with torch.no_grad():  # both start from the same (fp16-representable) weights
        for p32, p16 in zip(ref.parameters(), dev.parameters()):
            p32.copy_(p16.float())
    start = [p.detach().clone() for p in ref.parameters()]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = capstone.MasterCopyTrainer(dev, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert trainer.loss_scale == 2.0**16 and trainer.scaler.dynamic
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
    trainer = capstone.MasterCopyTrainer(dev, "sgd", lr=0.1, growth_interval=2)
    before = [m.detach().clone() for m in trainer.master_params]
    x = batches(1)[0]
    trainer.backward(dev(input_ids=x, labels=x).loss)
    next(iter(dev.parameters())).grad[0, 0] = float("inf")
    assert trainer.step() is False
    assert trainer.loss_scale == 2.0**15 and trainer.skipped_steps == 1 and trainer.steps == 0
    assert capstone.param_diff(before, trainer.master_params) == 0.0  # nothing changed
    assert all(p.grad is None for p in dev.parameters())
    for _ in range(2):
        trainer.backward(dev(input_ids=x, labels=x).loss)
        assert trainer.step() is True
    assert trainer.loss_scale == 2.0**16  # grew back after growth_interval good steps


@pytest.mark.parametrize("dtype,opt_name,rel_tol", [(torch.float32, "adam8bit", 0.0), (torch.float16, "sgd", 0.01)])
def test_streamed_update_equals_two_copy_over_accumulation(dtype, opt_name, rel_tol):
    """fp32: bit-identical. fp16: the streamed sum is done in fp32 (the recipe sums in fp16 on the
    device), so SGD's update (linear in the gradient) agrees within 1% of the largest update."""
    data = batches(6)
    recipe = capstone.MasterCopyTrainer(tiny(dtype), opt_name, lr=0.1 if opt_name == "sgd" else 1e-3)
    streamed = capstone.StreamedGradTrainer(tiny(dtype), opt_name, lr=0.1 if opt_name == "sgd" else 1e-3)
    start = [m.detach().clone() for m in recipe.master_params]
    assert train_trainer(recipe, data, accum=3) == [True] * 2
    assert train_trainer(streamed, data, accum=3) == [True] * 2
    assert all(p.grad is None for p in streamed.model.parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in streamed.model.parameters())
    assert streamed.bytes_to_host == 6 * n_bytes  # every micro-batch's gradients crossed once
    largest = max(float((m.detach() - s).abs().max()) for m, s in zip(recipe.master_params, start))
    assert largest > 0
    assert capstone.param_diff(recipe.master_params, streamed.master_params) <= rel_tol * largest
    streamed.remove_hooks()


def test_streamed_frees_gradients_during_backward():
    model = tiny()
    trainer = capstone.StreamedGradTrainer(model, "sgd", lr=0.1)
    seen = []
    blocks = model.transformer.h
    blocks[0].register_full_backward_hook(
        lambda *a: seen.append(sum(p.grad is not None for p in blocks[1].parameters())))
    x = batches(1)[0]
    trainer.backward(model(input_ids=x, labels=x).loss)
    assert seen == [0]  # block 1's gradients were already gone when block 0's backward ran
    trainer.remove_hooks()


def test_predict_gpu_peak_tiny_fake_streamed_below_recipe():
    # few tokens and a small vocabulary: parameters and gradients dominate, as in GPT-2-XL at 4 x 1024
    h, layers = 128, 2
    kw = dict(n_layer=layers, n_embd=h, n_head=2, vocab_size=256, bos_token_id=255, eos_token_id=255,
              micro_batch=1, seq_len=16)
    recipe = capstone.predict_gpu_peak("gpt2", variant="recipe", **kw)
    streamed = capstone.predict_gpu_peak("gpt2", variant="streamed", **kw)
    assert recipe.fake and streamed.fake
    n_params = 256 * h + 1024 * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert recipe.by_category["params"] == 2 * n_params  # fp16
    assert streamed.by_category["params"] == 2 * n_params
    assert recipe.by_category["grads"] > 0.9 * 2 * n_params  # nearly all gradients at once on the device
    assert streamed.by_category["grads"] < 0.25 * recipe.by_category["grads"]
    assert streamed.peak_bytes < 0.75 * recipe.peak_bytes


def test_checkpoint_resume_gives_identical_losses(tmp_path):
    tokens = torch.tensor(capstone.ByteTokenizer().encode("the model does not fit; " * 20)) % 64

    def run(path, n_steps, crash_at=None):
        model = tiny(dropout=0.1)  # dropout: resumed losses match only if the RNG is restored
        trainer = capstone.MasterCopyTrainer(model, "adam8bit", lr=1e-2)
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
    trainer = capstone.MasterCopyTrainer(tiny(), "sgd")
    assert capstone.load_checkpoint(tmp_path / "none.pt", trainer) is None
    capstone.save_checkpoint(tmp_path / "c.pt", trainer, step=0, data_position=0)
    streamed = capstone.StreamedGradTrainer(tiny(), "sgd")
    with pytest.raises(ValueError, match="variant"):
        capstone.load_checkpoint(tmp_path / "c.pt", streamed)
    with pytest.raises(ValueError, match="step"):
        capstone.save_checkpoint(tmp_path / "c.pt", trainer, step=-1, data_position=0)


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


def test_course_corpus_and_batches(tmp_path):
    import json

    nb = {"cells": [{"cell_type": "markdown", "source": ["# Title\n", "Some prose. " * 50]},
                    {"cell_type": "code", "source": ["print('code is not prose')"]}]}
    (tmp_path / "01_x.ipynb").write_text(json.dumps(nb))
    (tmp_path / "02_broken.ipynb").write_text("{not json")
    text, source = capstone.course_corpus(tmp_path, min_chars=100)
    assert "Some prose." in text and "code is not prose" not in text and "1 course notebook" in source
    tokens = torch.tensor(capstone.ByteTokenizer().encode(text))
    data = capstone.TokenBatches(tokens, seq_len=32, micro_batch=3, seed=5)
    assert data[7].shape == (3, 32) and torch.equal(data[7], data[7])
    assert not torch.equal(data[7], data[8])


def test_pcie_arithmetic():
    n = 1_557_611_200
    recipe = capstone.pcie_bytes_per_step(n, variant="recipe", accum_steps=16)
    streamed = capstone.pcie_bytes_per_step(n, variant="streamed", accum_steps=16)
    assert recipe["total"] == 4 * n
    assert streamed["to_host"] == 16 * 2 * n and streamed["to_device"] == 2 * n
    assert math.isclose(capstone.transfer_seconds(16 * 10**9, 16.0), 1.0)


def test_bad_inputs_say_what_to_change():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        capstone.MasterCopyTrainer("model")
    with pytest.raises(ValueError, match="Unknown optimizer"):
        capstone.MasterCopyTrainer(tiny(), "lion")
    with pytest.raises(ValueError, match="positive"):
        capstone.MasterCopyTrainer(tiny(), "sgd", lr=-1)
    with pytest.raises(ValueError, match="loss_scale"):
        capstone.MasterCopyTrainer(tiny(), "sgd", loss_scale="auto")
    with pytest.raises(ValueError, match="variant"):
        capstone.predict_gpu_peak("gpt2", variant="magic")
    with pytest.raises(ValueError, match="context"):
        capstone.predict_gpu_peak("gpt2", seq_len=4096, n_layer=1)
    with pytest.raises(ValueError, match="positive"):
        capstone.pcie_bytes_per_step(0)
    with pytest.raises(ValueError, match="backoff_factor"):
        capstone.LossScaler(backoff_factor=2.0)
    with pytest.raises(TypeError, match="integer tensor"):
        capstone.TokenBatches(torch.randn(100), seq_len=8, micro_batch=2)
    with pytest.raises(ValueError, match="fewer than"):
        capstone.TokenBatches(torch.arange(5), seq_len=8, micro_batch=2)
    with pytest.raises(TypeError, match="scalar loss"):
        capstone.MasterCopyTrainer(tiny(), "sgd").backward(torch.ones(3))
    with pytest.raises(ValueError, match="different model"):
        capstone.MasterCopyTrainer(tiny(), "sgd").load_state_dict({"master_params": []})


def test_sample_text_is_seeded_and_checks_input():
    model = tiny()
    tok = capstone.ByteTokenizer()
    a = capstone.sample_text(model, tok, "!#", n_tokens=5, seed=3)
    assert a == capstone.sample_text(model, tok, "!#", n_tokens=5, seed=3)
    assert model.training  # train mode restored
    with pytest.raises(ValueError, match="prompt"):
        capstone.sample_text(model, tok, "", n_tokens=5)
