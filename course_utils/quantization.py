"""8-bit optimizer state (notebook 05): error metrics, state tables, bitsandbytes' dynamic map and round trips,
GPT-2 tensor sizes. The quantizers and the exercise's checker are written in the notebook."""
from __future__ import annotations

import torch
from torch import nn

from .estimate import BNB_BLOCKSIZE
from .memory import _state_tensors, storage_key
from .validation import float_tensor


def error_metrics(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """Mean/max absolute error, RMSE and relative mean error (mean |error| / mean |x|) of a round trip."""
    x, x_hat = float_tensor(x, "x"), float_tensor(x_hat, "x_hat")
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat must have the same shape, not {tuple(x.shape)} and {tuple(x_hat.shape)}.")
    x, x_hat = x.detach().double().flatten().cpu(), x_hat.detach().double().flatten().cpu()
    err = (x - x_hat).abs()
    return {"mean_abs_error": float(err.mean()), "max_abs_error": float(err.max()), "rmse": float(err.pow(2).mean().sqrt()),
            "rel_mean_error": float(err.mean() / x.abs().mean().clamp_min(1e-30))}


def state_table(optimizer, model: nn.Module | None = None):
    """One row per parameter: name, numel, the dtype of its main state, bytes per state key."""
    import pandas as pd

    names = {}
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
        names = {id(p): n for n, p in model.named_parameters()}
    rows, seen = {}, set()
    _state_tensors(optimizer)  # checks it is an optimizer
    for param, key, t in ((p, k, v) for p, st in optimizer.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)):
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


def create_dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 256 sorted values of bitsandbytes' dynamic 8-bit map, value for value what
    ``bitsandbytes.functional.create_dynamic_map(signed)`` returns (for notebook 05 where bitsandbytes is not
    installed): for each of 7 exponents i, the midpoints of an even split of [0.1, 1] times 10**(i - 6), 2**i of them
    (signed: also their negatives) or 2**(i + 1) (unsigned); then 0 and 1, and zeros up to 256 values (Dettmers 2015,
    "8-Bit Approximations for Parallelism in Deep Learning")."""
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be True (a map for m) or False (for v >= 0), not {signed!r}.")
    data = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2 ** (i + (0 if signed else 1)) + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += (10 ** (i - 6) * means).tolist() + ((-(10 ** (i - 6)) * means).tolist() if signed else [])
    data += [0, 1.0]
    return torch.tensor(sorted(data + [0] * (256 - len(data))), dtype=torch.float32)


def bnb_roundtrip(x: torch.Tensor, *, blocksize: int = BNB_BLOCKSIZE, code: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``x`` with ``bitsandbytes.functional.quantize_blockwise`` and dequantize it back; ``code`` is the
    256-value map (None: bitsandbytes' signed dynamic map)."""
    import bitsandbytes.functional as BF

    x = float_tensor(x, "x")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 2:
        raise ValueError(f"blocksize must be an integer >= 2 (bitsandbytes uses 256), not {blocksize!r}.")
    if code is not None:
        code = float_tensor(code, "code", "a 256-value map such as BF.create_dynamic_map(signed=False)").to(x.device)
    q, qstate = BF.quantize_blockwise(x.detach().float().contiguous(), code=code, blocksize=blocksize)
    return BF.dequantize_blockwise(q, qstate).reshape(x.shape).to(x.dtype)


def gpt2_tensor_sizes(name: str = "gpt2-xl", **overrides) -> list[int]:
    """Element count of each parameter tensor (the tied LM head once) of ``models.gpt2_config(name, **overrides)``."""
    from . import models

    config = models.gpt2_config(name, **overrides)
    d, inner = config.n_embd, config.n_inner or 4 * config.n_embd
    # per layer, weight and bias of ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj
    layer = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * inner, inner, inner * d, d]
    return [config.vocab_size * d, config.n_positions * d] + layer * config.n_layer + [d, d]
