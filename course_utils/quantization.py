"""8-bit optimizer state (notebook 05): error metrics, state tables, bitsandbytes round trips, GPT-2 tensor
sizes, the one-block quantizer checker. The quantizers are written in the notebook."""
from __future__ import annotations

import torch
from torch import nn

from .estimate import BNB_BLOCKSIZE
from .memory import _state_tensors, storage_key
from .validation import callable_arg, float_tensor


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
    """Element count of every parameter tensor of a GPT-2 (tied LM head counted once), from its config
    (:func:`course_utils.models.gpt2_config` with the same arguments)."""
    from . import models

    config = models.gpt2_config(name, **overrides)
    d, inner = config.n_embd, config.n_inner or 4 * config.n_embd
    # wte (tied with lm_head), wpe; per layer ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weight, bias);
    # ln_f
    layer = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * inner, inner, inner * d, d]
    return [config.vocab_size * d, config.n_positions * d] + layer * config.n_layer + [d, d]


def check_block_quantizer(quantize_fn, dequantize_fn, block: torch.Tensor, code: torch.Tensor) -> bool:
    """Check the learner's ``quantize_fn(block, code) -> (idx, absmax)`` (nearest code to value / absmax) and
    ``dequantize_fn(idx, absmax, code)`` on a real block, each against the definition."""
    from . import checks

    for fn in (quantize_fn, dequantize_fn):
        callable_arg(fn, "quantize_fn and dequantize_fn", "your two functions themselves (quantize_block, dequantize_block)")
    block = float_tensor(block, "block", "one block of optimizer state").detach().float().flatten()
    code = float_tensor(code, "code", "the 256 values of the map").detach().float().flatten().to(block.device)
    if code.numel() != 256:
        raise ValueError(f"code must hold the 256 values of an 8-bit map, not {code.numel()}.")
    out = quantize_fn(block, code)
    if out is None or out is Ellipsis:
        raise ValueError("Your quantize_block returned None: return (idx, absmax).")
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        print("✗ quantize_block must return two things: (idx, absmax).")
        return False
    idx, absmax = out
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.uint8 or idx.shape != block.shape:
        got = f"{idx.dtype}, shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        print(f"✗ idx should be a torch.uint8 tensor of shape {tuple(block.shape)} (one byte per value: an index "
              f"into the 256 codes); got {got}.")
        return False
    ref_absmax = block.abs().max()
    try:
        absmax_value = float(absmax)
    except (TypeError, ValueError, RuntimeError):
        print(f"✗ absmax should be one number (a 0-d tensor), not {absmax!r}.")
        return False
    ok_absmax = checks.check_exercise("absmax of the block", absmax_value, float(ref_absmax), rel_tol=1e-6,
                                      hint="the largest magnitude |x| in the block.")
    dist = (block[:, None] / ref_absmax.clamp_min(1e-30) - code[None, :]).abs()
    best = dist.min(dim=1).values
    chosen = dist.gather(1, idx.long()[:, None]).squeeze(1)
    nearest = float((chosen <= best + 1e-7).double().mean())
    ok_idx = checks.check_exercise("share of values stored as their nearest code", nearest, 1.0,
                                   hint="divide by absmax, then take the index of the closest code (not the "
                                        "code just below or just above).")
    ref_idx = dist.argmin(dim=1).to(torch.uint8)
    x_hat = dequantize_fn(ref_idx, ref_absmax, code)
    if not isinstance(x_hat, torch.Tensor) or x_hat.shape != block.shape:
        print(f"✗ dequantize_block must return a tensor of shape {tuple(block.shape)}.")
        return False
    expected = code[ref_idx.long()] * ref_absmax
    right = float(((x_hat.detach().float() - expected).abs() <= 1e-6 * ref_absmax).double().mean())
    ok_deq = checks.check_exercise("share of values dequantized right", right, 1.0,
                                   hint="look up each index in the code, then undo the division by absmax.")
    try:
        import bitsandbytes.functional as BF

        bnb_idx, _ = BF.quantize_blockwise(block.contiguous(), code=code, blocksize=block.numel())
        print(f"bitsandbytes' quantize_blockwise picks the same index as yours for "
              f"{float((bnb_idx.flatten() == idx).double().mean()):.1%} of the values")
    except Exception:  # noqa: BLE001 - only an illustration: no bitsandbytes, or a block size it does not take
        pass
    return ok_absmax and ok_idx and ok_deq
