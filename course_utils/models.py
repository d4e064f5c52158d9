"""Model builders the notebooks share: GPT-2 from its real configs (random weights, the exact
shapes and so the exact memory of the pretrained models), and fake-tensor builds of models too
big for the machine.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

# The real GPT-2 family configs (Radford et al. 2019; Hugging Face's gpt2, gpt2-medium, -large, -xl).
GPT2_SIZES = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25),
}
GPT2_XL_PARAMS = 1_557_611_200  # tied input/output embedding counted once


def gpt2_config(name: str = "gpt2-xl", **overrides):
    """A transformers GPT2Config for one of GPT2_SIZES, with optional overrides (n_layer=2, ...)."""
    from transformers import GPT2Config

    if name not in GPT2_SIZES:
        raise ValueError(f"Unknown GPT-2 size {name!r}; choose one of {sorted(GPT2_SIZES)}.")
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        value = overrides.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{key} must be a positive integer, got {value!r}.")
    settings = {**GPT2_SIZES[name], **overrides}
    vocab = settings.get("vocab_size", 50257)
    # GPT-2's <|endoftext|> is token 50256; a smaller test vocabulary needs an id inside it
    settings.setdefault("bos_token_id", min(50256, vocab - 1))
    settings.setdefault("eos_token_id", min(50256, vocab - 1))
    return GPT2Config(**settings)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules directly in ``dtype``: ``.half()`` does not work on fake parameters."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_gpt2(config_or_name="gpt2-xl", *, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A GPT2LMHeadModel with random weights from a config or a size name.

    Call it inside ``torch._subclasses.fake_tensor.FakeTensorMode()`` to get a model whose
    tensors have shapes and dtypes but no memory (see :func:`fake_mode`).
    """
    from transformers import GPT2LMHeadModel

    config = gpt2_config(config_or_name, **overrides) if isinstance(config_or_name, str) else config_or_name
    with default_dtype(dtype):
        model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # name the loss, so transformers does not warn that it guessed
    return model


def fake_mode():
    """A FakeTensorMode: tensors made inside it have shapes, dtypes and devices but no storage.

    ``allow_non_fake_inputs`` lets real scalars (a learning rate tensor, say) mix in.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def mlp(n_layers: int = 4, width: int = 512, in_features: int = 784, n_classes: int = 10) -> nn.Sequential:
    """The course's MLP: Flatten, then ``n_layers`` Linear+ReLU blocks, then a classifier."""
    for name, value in (("n_layers", n_layers), ("width", width), ("in_features", in_features), ("n_classes", n_classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    layers: list[nn.Module] = [nn.Flatten()]
    features = in_features
    for _ in range(n_layers):
        layers += [nn.Linear(features, width), nn.ReLU()]
        features = width
    layers.append(nn.Linear(features, n_classes))
    return nn.Sequential(*layers)
