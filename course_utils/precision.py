"""Mixed precision, measured (notebook 04): number formats, underflow/overflow, autocast's op table, the recipe per
GPU. The training loops, the GradScaler log and the AMP-step exercise's checker stay in the notebook."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .estimate import dtype_of
from .hardware import recommend_precision  # noqa: F401 - the recipe per GPU is a hardware fact; taught here
from .validation import float_tensor, positive_number

_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# bits of (sign, exponent, mantissa): finfo has no tf32, it is a matmul mode of fp32 tensors
_LAYOUT = {"fp32": (1, 8, 23), "tf32": (1, 8, 10), "fp16": (1, 5, 10), "bf16": (1, 8, 7)}


def _dtype(fmt) -> torch.dtype:
    dtype = dtype_of(fmt)
    if dtype not in _NAMES:
        raise ValueError(f"Unknown format {fmt!r}; use 'fp32', 'fp16', 'bf16' or torch.float32/float16/bfloat16.")
    return dtype


def format_table():
    """Bits, range and precision of fp32, tf32, fp16 and bf16, one row each (a DataFrame), from ``torch.finfo``."""
    import pandas as pd

    rows = []
    for fmt, (sign, exp, man) in _LAYOUT.items():
        info = torch.finfo(dtype_of("fp32" if fmt == "tf32" else fmt))  # tf32: fp32's exponent, 10 mantissa bits
        rows.append({"format": fmt, "bits": sign + exp + man, "exponent_bits": exp, "mantissa_bits": man,
                     "max": float(info.max), "smallest_normal": float(info.smallest_normal),
                     "smallest_subnormal": float(info.smallest_normal) * 2.0 ** -man, "eps": 2.0 ** -man,
                     "decimal_digits": round(math.log10(2.0 ** (man + 1)), 1),
                     "bytes_in_memory": info.bits // 8})
    return pd.DataFrame(rows).set_index("format")


def plot_ranges(*, ax=None, mark: dict | None = None):
    """Horizontal bars of each format's range on a log10 axis: subnormals light, normals dark."""
    import matplotlib.pyplot as plt

    table = format_table()
    if mark is not None and not isinstance(mark, dict):
        raise TypeError("mark must be a dict {label: value}, e.g. {'1e-8': 1e-8}.")
    ax = ax or plt.subplots(figsize=(8, 0.6 + 0.6 * len(table)))[1]
    for i, (name, row) in enumerate(table.iterrows()):
        lo_sub, lo, hi = (math.log10(row[c]) for c in ("smallest_subnormal", "smallest_normal", "max"))
        ax.barh(i, lo - lo_sub, left=lo_sub, color=f"C{i}", alpha=0.35, label="subnormal" if i == 0 else None)
        ax.barh(i, hi - lo, left=lo, color=f"C{i}", label="normal" if i == 0 else None)
        ax.text(hi + 0.5, i, f"max {row['max']:.3g}", va="center", fontsize=9)
    for (label, value), style in zip((mark or {}).items(), ("--", ":", "-.", (0, (5, 5)))):
        ax.axvline(math.log10(value), color="black", ls=style, lw=1, label=label)
    ax.set_yticks(range(len(table)), table.index)
    ax.invert_yaxis()
    ax.set(xlabel="log10 of |value| (representable range)", title="Representable magnitudes per format")
    ax.legend(loc="lower left", fontsize=8)
    return ax


def _finite_and_cast(tensor, dtype, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The finite values of ``tensor * scale`` (float64), and the same values cast to ``dtype``."""
    positive_number(scale, "scale", "e.g. 1024")
    t = float_tensor(tensor, "tensor", "a gradient").detach().double().flatten() * scale
    t = t[torch.isfinite(t)]
    return t, t.to(_dtype(dtype))


def underflow_fraction(tensor: torch.Tensor, dtype, *, scale: float = 1.0) -> float:
    """Share of the non-zero values of ``tensor * scale`` that become exactly 0 when cast to ``dtype``."""
    t, cast = _finite_and_cast(tensor, dtype, scale)
    if not t.count_nonzero():
        raise ValueError("tensor has no non-zero finite values; run a backward pass first.")
    return float((cast[t != 0] == 0).double().mean())


def overflow_fraction(tensor: torch.Tensor, dtype, *, scale: float = 1.0) -> float:
    """Share of the finite values of ``tensor * scale`` that become inf when cast to ``dtype``."""
    t, cast = _finite_and_cast(tensor, dtype, scale)
    if t.numel() == 0:
        raise ValueError("tensor has no finite values.")
    return float(torch.isinf(cast).double().mean())


def autocast_op_table(device_type: str, dtype=torch.bfloat16):
    """What dtype each op returns under ``torch.amp.autocast(device_type, dtype)``, fed fp32 tensors (autocast casts
    down its low-precision list) and fed ``dtype`` tensors (it casts up its fp32 list)."""
    import pandas as pd
    import torch.nn.functional as F

    if device_type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda' (or 'mps'), not {device_type!r}.")
    low = _dtype(dtype)
    if low == torch.float32:
        raise ValueError("dtype must be a 16-bit format (torch.bfloat16 or torch.float16).")
    x, w = torch.randn(8, 16, device=device_type), torch.randn(16, 16, device=device_type)
    target = torch.zeros(8, dtype=torch.long, device=device_type)
    ops = {"matmul (x @ w)": lambda x, w: x @ w, "linear": F.linear, "relu": lambda x, w: F.relu(x),
           "gelu": lambda x, w: F.gelu(x), "softmax": lambda x, w: torch.softmax(x, -1),
           "log_softmax": lambda x, w: F.log_softmax(x, -1), "layer_norm": lambda x, w: F.layer_norm(x, x.shape[-1:]),
           "exp": lambda x, w: x.exp(), "sum": lambda x, w: x.sum(),
           "cross_entropy": lambda x, w: F.cross_entropy(x, target), "mse_loss": lambda x, w: F.mse_loss(x, x * 2)}
    inputs = {"fp32 input": (x, w), f"{_NAMES[low]} input": (x.to(low), w.to(low))}
    with torch.amp.autocast(device_type, dtype=low):
        rows = {name: {label: _NAMES.get(op(*args).dtype) for label, args in inputs.items()}
                for name, op in ops.items()}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("op")


def decision_table():
    """Example GPUs, their compute capability, native bf16, and the recipe (pandas DataFrame)."""
    import pandas as pd

    gpus = [("CPU only", None), ("P100 (Pascal)", (6, 0)), ("V100 (Volta)", (7, 0)), ("T4 / RTX 20xx (Turing)", (7, 5)),
            ("A100 (Ampere)", (8, 0)), ("RTX 30xx (Ampere)", (8, 6)), ("L4 / RTX 40xx (Ada)", (8, 9)),
            ("H100 (Hopper)", (9, 0))]
    rows = [{"hardware": name, "compute capability": "-" if cc is None else f"{cc[0]}.{cc[1]}",
             "native bf16": cc is not None and cc >= (8, 0), "recipe": recommend_precision(cc)} for name, cc in gpus]
    return pd.DataFrame(rows).set_index("hardware")


def cpu_bf16_features(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str] | None:
    """The CPU's bf16 instruction sets (e.g. ``['amx_bf16', 'avx512_bf16']``), read from ``/proc/cpuinfo``."""
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except (OSError, TypeError):
        return None
    flags = {flag for line in lines if line.startswith(("flags", "Features"))  # x86 / ARM
             for flag in line.partition(":")[2].split()}
    return sorted(f for f in flags if "bf16" in f)
