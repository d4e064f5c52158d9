"""LoRA and QLoRA arithmetic for a model's blocks: which linear layers the adapters wrap, their tensors, and the bytes
of frozen weights stored in bitsandbytes' 4-bit NF4.

NF4 (``bitsandbytes.nn.Linear4bit``, ``quant_type='nf4'``, blocks of 64 values), as bitsandbytes lays it out: the
codes packed two per byte (a uint8 tensor of n/2), one absmax per block (fp32), and the 16-value code map (fp32).
Double quantization (``bnb_4bit_use_double_quant=True``, ``compress_statistics=True``) stores those absmax values in
8 bits (one uint8 per block, after subtracting their mean, an fp32 offset) with one fp32 absmax per 256 of them and a
256-value fp32 code map.
"""
from __future__ import annotations

import math

from .specs import ModelSpec

NF4_BLOCK = 64  # values per absmax (bitsandbytes' 4-bit blocksize)
NF4_BLOCK2 = 256  # absmax values per second-level absmax (double quantization)
QUANTIZATIONS = ("nf4", "nf4_double")


def nf4_bytes(numel: int, double: bool) -> int:
    """Bytes bitsandbytes keeps for one weight of ``numel`` values in NF4: codes + quantization state."""
    blocks = math.ceil(numel / NF4_BLOCK)
    codes = (numel + 1) // 2 + 4 * 16  # packed codes, the NF4 map
    if not double:
        return codes + 4 * blocks
    return codes + blocks + 4 * math.ceil(blocks / NF4_BLOCK2) + 4 * 256 + 4


def block_linears(model: ModelSpec) -> tuple:
    """One block's linear layers ``(name, in, out)``; for a GPT-2 preset (no list), its Conv1D's (d = width)."""
    if model.linears:
        return model.linears
    d = model.hidden_size
    return (("attn.c_attn", d, 3 * d), ("attn.c_proj", d, d), ("mlp.c_fc", d, 4 * d), ("mlp.c_proj", 4 * d, d))


def targeted(model: ModelSpec, targets=None) -> tuple:
    """The block's linear layers whose name is, or ends with, one of ``targets`` (None: all of them)."""
    layers = block_linears(model)
    if targets is None:
        return layers
    return tuple(x for x in layers if any(x[0] == t or x[0].endswith("." + t) for t in targets))


def check_targets(model: ModelSpec, targets) -> tuple | None:
    """``targets`` as a tuple of names, each matching a linear layer of ``model``'s blocks; raises ValueError."""
    if targets is None:
        return None
    names = [x[0] for x in block_linears(model)]
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    unknown = [t for t in targets if not targeted(model, (t,))]
    if unknown or not targets:
        raise ValueError(f"lora_targets {unknown or targets!r} match none of {model.name}'s linear layers {names}; "
                         "name some of them (e.g. ('q_proj', 'v_proj')), or None for all.")
    return targets


def lora_tensors(model: ModelSpec, rank: int, targets=None) -> list[int]:
    """Numel of each adapter tensor of one block: A (rank x in) and B (out x rank) per targeted linear layer."""
    return [n for _, d_in, d_out in targeted(model, targets) for n in (rank * d_in, rank * d_out)]


def quantized_numel(model: ModelSpec) -> int:
    """Weights QLoRA stores in 4 bits: every block's linear layers (embeddings, norms and the head stay as they are)."""
    return model.n_blocks * sum(d_in * d_out for _, d_in, d_out in block_linears(model))


def base_bytes(model: ModelSpec, quantize: str, w: int) -> int:
    """The frozen model's bytes under QLoRA: the blocks' linear weights in NF4, the rest at ``w`` bytes a value."""
    double = quantize == "nf4_double"
    nf4 = model.n_blocks * sum(nf4_bytes(d_in * d_out, double) for _, d_in, d_out in block_linears(model))
    return nf4 + (model.n_params - quantized_numel(model)) * w
