"""Models the notebooks share: GPT-2 from its real configs (random weights, exact shapes), fake-tensor builds of
models too big for the machine, and the course MLP. ``attention='math'`` keeps the T x T softmax for backward;
``'fused'`` (sdpa) keeps nothing T x T. :func:`as_on_cuda` lets fake CPU tensors choose kernels as CUDA would."""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from .validation import positive_int

ATTENTION = {"math": "eager", "fused": "sdpa"}  # the course's name -> transformers' attn_implementation

# The real GPT-2 family configs (Radford et al. 2019; Hugging Face's gpt2, gpt2-medium, -large, -xl).
GPT2_SIZES = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12), "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
              "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20), "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25)}
GPT2_XL_PARAMS = 1_557_611_200  # tied input/output embedding counted once


def gpt2_config(name: str = "gpt2-xl", **overrides):
    """A transformers GPT2Config for one of GPT2_SIZES, with optional overrides (n_layer=2, ...)."""
    from transformers import GPT2Config

    if name not in GPT2_SIZES:
        raise ValueError(f"Unknown GPT-2 size {name!r}; choose one of {sorted(GPT2_SIZES)}.")
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        if overrides.get(key) is not None:
            positive_int(overrides[key], key)
    settings = {**GPT2_SIZES[name], **overrides}
    # GPT-2's <|endoftext|> is token 50256; a smaller test vocabulary needs an id inside it
    end = min(50256, settings.get("vocab_size", 50257) - 1)
    return GPT2Config(**{"bos_token_id": end, "eos_token_id": end, **settings})


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules directly in ``dtype``: ``.half()`` does not work on fake parameters."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_gpt2(config_or_name="gpt2-xl", *, dtype: torch.dtype = torch.float32, attention: str | None = None,
               **overrides) -> nn.Module:
    """A GPT2LMHeadModel with random weights from a config or a size name; ``attention`` 'math' or 'fused'.
    Built inside ``fake_mode()``, its tensors have shapes and dtypes but no memory."""
    from transformers import GPT2LMHeadModel

    if attention is not None and attention not in ATTENTION:
        raise ValueError(f"attention must be one of {sorted(ATTENTION)} (or None for transformers' default), "
                         f"not {attention!r}.")
    config = gpt2_config(config_or_name, **overrides) if isinstance(config_or_name, str) else config_or_name
    if attention is not None:
        config = copy.deepcopy(config)  # the caller's config stays as it was
        config._attn_implementation = ATTENTION[attention]
    with default_dtype(dtype):
        model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # name the loss, so transformers does not warn that it guessed
    return model


def fake_mode():
    """A FakeTensorMode: tensors made inside it have shapes, dtypes and devices but no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def as_on_cuda():
    """Inside ``with as_on_cuda():``, fake tensors save for backward what CUDA's kernels save: ``F.dropout`` runs
    ``torch.native_dropout`` (a bool mask, as on CUDA; a CPU keeps one in the input's dtype), and fake tensors'
    ``F.scaled_dot_product_attention`` calls the kernel a GPU picks (flash for fp16/bf16 without a mask, else
    memory-efficient; the padding mask transformers builds for fake tensors is dropped). Both restored on exit."""
    functional = nn.functional
    dropout, sdpa = functional.dropout, functional.scaled_dot_product_attention

    def attention(query, key, value, *args, **kwargs):
        return (_fused_attention if _is_fake(query) else sdpa)(query, key, value, *args, **kwargs)

    functional.dropout, functional.scaled_dot_product_attention = _native_dropout, attention
    try:
        yield
    finally:
        functional.dropout, functional.scaled_dot_product_attention = dropout, sdpa


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _native_dropout(input, p=0.5, training=True, inplace=False):
    return torch.native_dropout(input, p, True)[0] if training and p != 0 else input


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa:
        raise NotImplementedError("as_on_cuda prices attention without grouped-query heads (GPT-2, BERT).")
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # transformers builds this boolean mask only because it cannot read a fake tensor's values; for a
        # batch without padding a real run passes none (the kernels save the same, causal or not)
        attn_mask = None
    aten = torch.ops.aten
    if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None:  # flash attention
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, needs_grad, dropout_p,
                                                        is_causal, scale=scale)[0]


def mlp(n_layers: int = 4, width: int = 512, in_features: int = 784, n_classes: int = 10) -> nn.Sequential:
    """The course's MLP: Flatten, then ``n_layers`` Linear+ReLU blocks, then a classifier."""
    sizes = {"n_layers": n_layers, "width": width, "in_features": in_features, "n_classes": n_classes}
    for name, value in sizes.items():
        positive_int(value, name)
    blocks = [m for i in range(n_layers) for m in (nn.Linear(in_features if i == 0 else width, width), nn.ReLU())]
    return nn.Sequential(nn.Flatten(), *blocks, nn.Linear(width, n_classes))
