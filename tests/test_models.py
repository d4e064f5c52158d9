"""course_utils.models: real GPT-2 configs, fake builds, the course MLP."""
import pytest
import torch

from course_utils import models


def test_gpt2_xl_parameter_count_from_its_config():
    with models.fake_mode():
        model = models.build_gpt2("gpt2-xl", dtype=torch.float16)
    assert sum(p.numel() for p in model.parameters()) == models.GPT2_XL_PARAMS == 1_557_611_200
    assert next(model.parameters()).dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32  # restored


def test_small_vocab_gets_valid_special_tokens():
    config = models.gpt2_config("gpt2", n_layer=1, vocab_size=300)
    assert config.bos_token_id == config.eos_token_id == 299
    assert models.gpt2_config("gpt2").eos_token_id == 50256


def test_mlp_shape():
    net = models.mlp(n_layers=3, width=16, in_features=8, n_classes=4)
    assert net(torch.randn(2, 8)).shape == (2, 4)
    assert sum(isinstance(m, torch.nn.Linear) for m in net) == 4


@pytest.mark.parametrize("call, error, match", [
    (lambda: models.gpt2_config("gpt-5"), ValueError, "Unknown GPT-2 size"),
    (lambda: models.gpt2_config("gpt2", n_layer=0), ValueError, "n_layer must be positive"),
    (lambda: models.mlp(n_layers=-1), ValueError, "n_layers must be positive"),
    (lambda: models.mlp(width=2.5), TypeError, "width must be a whole number"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------- attention and dropout as CUDA runs them
def _saved(fn):
    """(shape, dtype, bytes) of every storage autograd saves while fn() runs."""
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage()._cdata, (tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(seen.values())


def test_build_gpt2_attention_names_transformers_implementation():
    config = models.gpt2_config("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    before = config._attn_implementation
    assert models.build_gpt2(config, attention="math").config._attn_implementation == "eager"
    assert models.build_gpt2(config, attention="fused").config._attn_implementation == "sdpa"
    assert config._attn_implementation == before  # the caller's config is left alone
    with pytest.raises(ValueError, match="attention must be one of"):
        models.build_gpt2(config, attention="flash")


def test_as_on_cuda_dropout_keeps_a_bool_mask_and_restores_the_functions():
    x = torch.randn(64, 32, requires_grad=True)
    cpu = _saved(lambda: torch.nn.functional.dropout(x, 0.1, training=True))
    with models.as_on_cuda():
        cuda = _saved(lambda: torch.nn.functional.dropout(x, 0.1, training=True))
    assert [d for _, d, _ in cpu] == [torch.float32] and [d for _, d, _ in cuda] == [torch.bool]
    assert cuda[0][2] == x.numel()  # one byte per element
    assert torch.nn.functional.dropout.__module__ == "torch.nn.functional"


@pytest.mark.parametrize("dtype,lse_len", [(torch.float32, 128), (torch.float16, 100)])
def test_fused_attention_keeps_output_and_log_sum_exp_nothing_t_by_t(dtype, lse_len):
    B, H, T, D = 2, 4, 100, 16
    with models.fake_mode(), models.as_on_cuda():
        q, k, v = (torch.randn(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
        saved = _saved(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True))
    shapes = [s for s, _, _ in saved]
    assert (B, H, T, D) in shapes  # the output (and the inputs)
    assert (B, H, lse_len) in shapes  # log-sum-exp, fp32 (memory-efficient kernel: padded to 32 rows)
    assert all(T * T > nbytes for _, _, nbytes in saved if nbytes > B * H * T * D * 4)  # nothing T x T
    assert not any(len(s) == 4 and s[-1] == T and s[-2] == T for s in shapes)


@pytest.mark.parametrize("attention", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fake_cpu_under_as_on_cuda_saves_what_fake_cuda_saves(attention, dtype):
    # A forward pass on fake CUDA tensors runs without a GPU (backward does not): the CPU twin must match it.
    config = models.gpt2_config("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=128, use_cache=False)
    totals = {}
    for device in ("cpu", "cuda"):
        with models.fake_mode(), torch.device(device), models.as_on_cuda():
            model = models.build_gpt2(config, dtype=dtype, attention=attention)
            ids = torch.randint(0, 128, (2, 64))
            totals[device] = sum(nbytes for _, _, nbytes in _saved(lambda: model(input_ids=ids, labels=ids)))
    if dtype == torch.float32:
        assert totals["cpu"] == totals["cuda"]
    else:  # CUDA's layer norm keeps its mean and 1/std in fp32 for fp16 inputs: 4 bytes a token per norm
        assert 0 < totals["cuda"] - totals["cpu"] <= 0.01 * totals["cuda"]
