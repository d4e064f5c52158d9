"""8-bit optimizer state, measured (notebook 05).

The notebook writes the teaching quantizers itself (absmax, block-wise, dynamic map: a few
lines each). This module holds what would distract from the lesson:

- :func:`error_metrics`: how far a quantized round trip is from the original
- :func:`state_bytes`, :func:`state_table`: the bytes an optimizer's state tensors really hold
- :func:`bnb_roundtrip`: bitsandbytes' own block-wise quantization, to compare with
- :func:`blockwise_quantize` / :func:`blockwise_dequantize`: a reference block-wise absmax
  quantizer (used by the exercise checker and the tests)
- :func:`gpt2_tensor_sizes`: the element count of every GPT-2 parameter tensor, from its config
- :func:`check_blockwise_exercise`: the exercise checker
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .memory import storage_key, tensor_bytes
from .validation import float_tensor

BNB_BLOCKSIZE = 256
INT8_LEVELS = 127  # symmetric int8: values -127..127


def _check_blocksize(blocksize) -> int:
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 2:
        raise ValueError(f"blocksize must be an integer >= 2 (bitsandbytes uses 256), not {blocksize!r}.")
    return blocksize


def error_metrics(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """Mean/max absolute error, RMSE and relative mean error (mean |error| / mean |x|) of a round trip."""
    x, x_hat = float_tensor(x, "x"), float_tensor(x_hat, "x_hat")
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat must have the same shape, not {tuple(x.shape)} and {tuple(x_hat.shape)}.")
    x, x_hat = x.detach().double().flatten().cpu(), x_hat.detach().double().flatten().cpu()
    err = (x - x_hat).abs()
    return {
        "mean_abs_error": float(err.mean()),
        "max_abs_error": float(err.max()),
        "rmse": float(err.pow(2).mean().sqrt()),
        "rel_mean_error": float(err.mean() / x.abs().mean().clamp_min(1e-30)),
    }


# ---------------------------------------------------------------- optimizer state bytes
def _state_tensors(optimizer):
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (bitsandbytes' are), not {type(optimizer).__name__}.")
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield param, key, value


def state_bytes(optimizer) -> int:
    """Bytes held by the optimizer's state tensors, each storage counted once.

    bitsandbytes shares its quantization maps (``qmap1``/``qmap2``) between parameters; they
    count once. Zero before the first ``optimizer.step()`` (state is created lazily).
    """
    return tensor_bytes(*(t for _, _, t in _state_tensors(optimizer)))


def state_table(optimizer, model: nn.Module | None = None):
    """One row per parameter: name, numel, the dtype of its main state, bytes per state key.

    Columns: ``param, numel, state dtype, bytes, bytes/param`` plus one column per state key
    (``exp_avg``/``exp_avg_sq`` for torch, ``state1/state2/absmax1/absmax2/qmap1/qmap2`` for
    bitsandbytes). A shared storage is counted in the first row that holds it.
    """
    import pandas as pd

    names = {}
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
        names = {id(p): n for n, p in model.named_parameters()}
    rows, seen = {}, set()
    for param, key, t in _state_tensors(optimizer):
        row = rows.setdefault(id(param), {"param": names.get(id(param), f"param {len(rows)}"),
                                          "numel": param.numel(), "state dtype": None})
        if row["state dtype"] is None and t.numel() == param.numel():
            row["state dtype"] = str(t.dtype).replace("torch.", "")
        skey = storage_key(t)
        row[key] = 0 if skey in seen else t.untyped_storage().nbytes()
        seen.add(skey)
    if not rows:
        raise ValueError("The optimizer has no state yet: run one optimizer.step() first.")
    df = pd.DataFrame(list(rows.values())).fillna(0)
    keys = [c for c in df.columns if c not in ("param", "numel", "state dtype")]
    df[keys] = df[keys].astype("int64")
    df["bytes"] = df[keys].sum(axis=1)
    df["bytes/param"] = df["bytes"] / df["numel"]
    return df


# ---------------------------------------------------------------- quantizers
def bnb_roundtrip(x: torch.Tensor, *, blocksize: int = BNB_BLOCKSIZE, code: str = "dynamic") -> torch.Tensor:
    """Quantize ``x`` with ``bitsandbytes.functional.quantize_blockwise`` and dequantize it back.

    ``code='dynamic'`` is bitsandbytes' default signed dynamic map (what 8-bit Adam uses for
    its first state ``m``), ``'dynamic_unsigned'`` the unsigned one (for ``v >= 0``);
    ``code='linear'`` is a signed linear map (block-wise absmax int8).
    """
    import bitsandbytes.functional as BF

    x = float_tensor(x, "x")
    blocksize = _check_blocksize(blocksize)
    maps = {"dynamic": lambda: BF.create_dynamic_map(signed=True),
            "dynamic_unsigned": lambda: BF.create_dynamic_map(signed=False),
            "linear": lambda: BF.create_linear_map(signed=True)}
    if code not in maps:
        raise ValueError(f"code must be one of {sorted(maps)}, not {code!r}.")
    qmap = maps[code]().to(x.device)
    flat = x.detach().float().contiguous()
    q, qstate = BF.quantize_blockwise(flat, code=qmap, blocksize=blocksize)
    return BF.dequantize_blockwise(q, qstate).reshape(x.shape).to(x.dtype)


def blockwise_quantize(x: torch.Tensor, blocksize: int = BNB_BLOCKSIZE):
    """Reference block-wise absmax int8 quantization: returns ``(q int8 [n], absmax fp32 [n_blocks])``.

    The flat tensor is cut into blocks of ``blocksize`` (the last one zero-padded); each block
    is divided by its largest magnitude and mapped to the integers -127..127.
    """
    x = float_tensor(x, "x")
    blocksize = _check_blocksize(blocksize)
    flat = x.detach().float().flatten()
    n = flat.numel()
    pad = (-n) % blocksize
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    q = torch.round(scaled * INT8_LEVELS).to(torch.int8)
    return q.flatten()[:n], absmax


def blockwise_dequantize(q: torch.Tensor, absmax: torch.Tensor, blocksize: int = BNB_BLOCKSIZE,
                         shape=None) -> torch.Tensor:
    """Inverse of :func:`blockwise_quantize` (fp32 result, reshaped to ``shape`` if given)."""
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32):
        raise TypeError("q must be an integer tensor, as returned by blockwise_quantize.")
    absmax = float_tensor(absmax, "absmax")
    blocksize = _check_blocksize(blocksize)
    n = q.numel()
    if absmax.numel() != math.ceil(n / blocksize):
        raise ValueError(f"{n} values in blocks of {blocksize} need {math.ceil(n / blocksize)} absmax values, "
                         f"got {absmax.numel()}; use the same blocksize as for quantizing.")
    pad = (-n) % blocksize
    blocks = torch.nn.functional.pad(q.flatten().float(), (0, pad)).view(-1, blocksize)
    x = (blocks / INT8_LEVELS * absmax.float()[:, None]).flatten()[:n]
    return x.reshape(shape) if shape is not None else x


# ---------------------------------------------------------------- GPT-2 arithmetic
def gpt2_tensor_sizes(name_or_config="gpt2-xl") -> list[int]:
    """Element count of every parameter tensor of a GPT-2 (tied LM head counted once), from its config."""
    from . import models

    config = models.gpt2_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    if not all(hasattr(config, a) for a in ("n_embd", "n_layer", "vocab_size", "n_positions")):
        raise TypeError("Pass a GPT-2 size name ('gpt2-xl') or a transformers GPT2Config.")
    d, inner = config.n_embd, config.n_inner or 4 * config.n_embd
    sizes = [config.vocab_size * d, config.n_positions * d]  # wte (tied with lm_head), wpe
    for _ in range(config.n_layer):
        sizes += [d, d,                    # ln_1
                  d * 3 * d, 3 * d,        # attn.c_attn
                  d * d, d,                # attn.c_proj
                  d, d,                    # ln_2
                  d * inner, inner,        # mlp.c_fc
                  inner * d, d]            # mlp.c_proj
    sizes += [d, d]  # ln_f
    return sizes


# ---------------------------------------------------------------- exercise
def check_blockwise_exercise(quantize_fn, dequantize_fn, x: torch.Tensor, blocksize: int = BNB_BLOCKSIZE) -> bool:
    """Run the learner's block-wise quantizer on ``x`` and compare with the reference and bitsandbytes.

    ``quantize_fn(x, blocksize) -> (q, absmax)``, ``dequantize_fn(q, absmax, blocksize, shape) -> x_hat``.
    Passes when ``q`` holds 8-bit integers, there is one absmax per block, and the round-trip
    error matches the reference's within 5% (bitsandbytes' error with a linear map is printed
    beside it). A ``NotImplementedError`` from the learner's function propagates.
    """
    from . import checks

    if not callable(quantize_fn) or not callable(dequantize_fn):
        raise TypeError("Pass your two functions themselves (my_quantize, my_dequantize), not their results.")
    x = float_tensor(x, "x")
    blocksize = _check_blocksize(blocksize)
    out = quantize_fn(x, blocksize)
    if out is None or out is Ellipsis:
        raise ValueError("Your quantize function returned None: return (q, absmax).")
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        print("✗ quantize must return two tensors: (q, absmax).")
        return False
    q, absmax = out
    ok = True
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.int8, torch.uint8):
        print(f"✗ q should be an int8 (or uint8) tensor: 1 byte per value; got {getattr(q, 'dtype', type(q))}.")
        ok = False
    n_blocks = math.ceil(x.numel() / blocksize)
    if not isinstance(absmax, torch.Tensor) or absmax.numel() != n_blocks:
        print(f"✗ expected one absmax per block: {n_blocks} values for {x.numel()} values in blocks of {blocksize}.")
        ok = False
    if not ok:
        return False
    x_hat = dequantize_fn(q, absmax, blocksize, x.shape)
    if not isinstance(x_hat, torch.Tensor) or x_hat.shape != x.shape:
        print(f"✗ dequantize must return a tensor of shape {tuple(x.shape)}.")
        return False
    learner = error_metrics(x, x_hat.float())["mean_abs_error"]
    ref_q, ref_absmax = blockwise_quantize(x, blocksize)
    reference = error_metrics(x, blockwise_dequantize(ref_q, ref_absmax, blocksize, x.shape))["mean_abs_error"]
    bnb = error_metrics(x, bnb_roundtrip(x, blocksize=blocksize, code="linear"))["mean_abs_error"]
    print(f"mean |error|: yours {learner:.3g}, reference {reference:.3g}, bitsandbytes (linear map) {bnb:.3g}")
    return checks.check_exercise(f"block-wise (blocksize {blocksize}) round-trip error", learner, reference,
                                 rel_tol=0.05, hint="divide each block by its own absmax, round to -127..127, "
                                                    "store int8; multiply back by absmax/127.")
