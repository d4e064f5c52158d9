"""Mixed precision, measured (notebook 04): number formats, underflow/overflow, autocast's op table, the recipe per
GPU, the AMP-step exercise checker. The training loops and the GradScaler log stay in the notebook."""
from __future__ import annotations

import functools
import math
import statistics
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .accumulation import flat_params
from .validation import callable_arg, float_tensor, positive_number

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# bits of (sign, exponent, mantissa): finfo has no tf32, it is a matmul mode of fp32 tensors
_LAYOUT = {"fp32": (1, 8, 23), "tf32": (1, 8, 10), "fp16": (1, 5, 10), "bf16": (1, 8, 7)}


def _dtype(fmt) -> torch.dtype:
    dtype = _DTYPES.get(fmt) if isinstance(fmt, str) else fmt
    if dtype not in _NAMES:
        raise ValueError(f"Unknown format {fmt!r}; use one of {sorted(_DTYPES)} or torch.float32/float16/bfloat16.")
    return dtype


def format_table():
    """Bits, range and precision of fp32, tf32, fp16 and bf16, one row each (a DataFrame), from ``torch.finfo``."""
    import pandas as pd

    rows = []
    for fmt, (sign, exp, man) in _LAYOUT.items():
        info = torch.finfo(_DTYPES.get(fmt, torch.float32))  # tf32: fp32's exponent, 10 mantissa bits
        rows.append({"format": fmt, "bits": sign + exp + man, "exponent_bits": exp, "mantissa_bits": man,
                     "max": float(info.max), "smallest_normal": float(info.smallest_normal),
                     "smallest_subnormal": float(info.smallest_normal) * 2.0 ** -man, "eps": 2.0 ** -man,
                     "decimal_digits": round(math.log10(2.0 ** (man + 1)), 1),
                     "bytes_in_memory": 4 if fmt in ("fp32", "tf32") else 2})
    return pd.DataFrame(rows).set_index("format")


def plot_ranges(*, ax=None, mark: dict | None = None):
    """Horizontal bars of each format's range on a log10 axis: subnormals light, normals dark."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    table = format_table()
    if mark is not None and not isinstance(mark, dict):
        raise TypeError("mark must be a dict {label: value}, e.g. {'1e-8': 1e-8}.")
    ax = ax or plt.subplots(figsize=(8, 0.6 + 0.6 * len(table)))[1]
    colors = sns.color_palette("deep", len(table))
    for i, (name, row) in enumerate(table.iterrows()):
        lo_sub, lo, hi = (math.log10(row[c]) for c in ("smallest_subnormal", "smallest_normal", "max"))
        ax.barh(i, lo - lo_sub, left=lo_sub, color=colors[i], alpha=0.35, label="subnormal" if i == 0 else None)
        ax.barh(i, hi - lo, left=lo, color=colors[i], label="normal" if i == 0 else None)
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
    rows = {name: {} for name in ops}
    for name, op in ops.items():
        for label, args in (("fp32 input", (x, w)), (f"{_NAMES[low]} input", (x.to(low), w.to(low)))):
            with torch.amp.autocast(device_type, dtype=low):
                rows[name][label] = _NAMES.get(op(*args).dtype)
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("op")


def recommend_precision(compute_capability: tuple[int, int] | None) -> str:
    """The course's recipe for a GPU of this compute capability (None: no CUDA GPU)."""
    if compute_capability is None:
        return "fp32 training (CPU autocast to bf16 saves memory, not always time)"
    if (not isinstance(compute_capability, tuple) or len(compute_capability) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in compute_capability)):
        raise ValueError(f"compute_capability must be a (major, minor) tuple such as (8, 0), not {compute_capability!r}.")
    if compute_capability >= (8, 0):
        return "bf16 autocast, no GradScaler"
    if compute_capability >= (7, 0):
        return "fp16 autocast + GradScaler"
    return "fp16 autocast + GradScaler (no tensor cores: memory savings only)"


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


EXERCISE_SCALE = 2.0**16     # GradScaler's default first scale
EXERCISE_STEPS = 8
EXERCISE_MAX_NORM = 0.25     # clip_grad_norm_'s max_norm in the exercise
OVERFLOW_STEP = 3            # this batch's inputs are 1000x larger: its scaled gradients overflow fp16


def _exercise_setup(device: torch.device):
    """A small model, SGD and batches (identical every call); batch OVERFLOW_STEP overflows fp16."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    w = torch.randn(32, 4, generator=gen)
    batches = []
    for k in range(EXERCISE_STEPS):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ w).argmax(-1)
        batches.append(((x * 1e3 if k == OVERFLOW_STEP else x).to(device), y.to(device)))
    return model, optimizer, batches


@functools.lru_cache(maxsize=4)
def _reference_run(device: str):
    """Loss scaling done by hand (no GradScaler): the checker's reference weights and norms."""
    import torch.nn.functional as F

    device = torch.device(device)
    model, optimizer, batches = _exercise_setup(device)
    scale, norms = EXERCISE_SCALE, []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        with torch.amp.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        (loss * scale).backward()
        grads = [p.grad for p in model.parameters()]
        if all(bool(torch.isfinite(g).all()) for g in grads):
            for g in grads:
                g.mul_(1.0 / scale)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), EXERCISE_MAX_NORM)))
            optimizer.step()
        else:              # overflow: skip the update, halve the scale
            norms.append(math.inf)
            scale *= 0.5
    return flat_params(model), norms


def check_amp_step(step_fn: Callable, *, device: torch.device | str = "cpu") -> bool:
    """Run the learner's ``step_fn(model, optimizer, scaler, x, y, max_norm) -> (loss, norm)`` on 8 batches (the
    4th overflows fp16) and compare with loss scaling done by hand; NotImplementedError propagates."""
    from . import checks

    callable_arg(step_fn, "step_fn", "your step function itself (amp_step)")
    device = torch.device(device)
    model, optimizer, batches = _exercise_setup(device)
    scaler = torch.amp.GradScaler(device.type, init_scale=EXERCISE_SCALE, growth_interval=1000)
    seen = []
    hook = model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    norms, skip = [], {}
    try:
        for k, (x, y) in enumerate(batches):
            before = flat_params(model)
            try:
                out = step_fn(model, optimizer, scaler, x, y, EXERCISE_MAX_NORM)
            except NotImplementedError:
                raise
            except Exception as err:  # a wrong order of GradScaler's calls raises in PyTorch
                print(f"✗ step {k + 1} raised {type(err).__name__}: {err}\n  GradScaler's calls must come in "
                      "a fixed order within a step; the message names the call that came too early or too late.")
                return False
            if out is None or out is Ellipsis:
                raise ValueError("Your step returned None: return (loss, norm), norm being what clip_grad_norm_ returned.")
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                print("✗ amp_step must return (loss, norm).")
                return False
            norms.append(float(out[1]))
            if k == OVERFLOW_STEP:
                after = flat_params(model)
                skip = {"moved": not torch.equal(before, after), "finite": bool(torch.isfinite(after).all())}
    finally:
        hook.remove()
    ref_w, ref_norms = _reference_run(str(device))
    problems = []
    if torch.float16 not in seen:
        problems.append("the forward pass did not run in fp16: wrap the model and the loss in "
                        "torch.amp.autocast(x.device.type, dtype=torch.float16).")
    if skip["moved"] or not skip["finite"]:
        problems.append(f"at step {OVERFLOW_STEP + 1} the scaled gradients overflowed, yet the weights changed"
                        f"{'' if skip['finite'] else ' (to inf/NaN)'}: that step must be skipped. "
                        "scaler.step(optimizer) skips it; optimizer.step() does not.")
    ratios = [mine / ref for mine, ref in zip(norms, ref_norms) if math.isfinite(ref) and ref > 0]
    median_ratio = statistics.median(ratios) if ratios else math.nan
    if skip["finite"] and not abs(median_ratio - 1) <= 1e-3:  # NaN weights give NaN norms: reported above
        why = (f" (of the order of the loss scale, {EXERCISE_SCALE:g}): clipping measured the scaled gradients"
               if median_ratio > 100 else "")
        problems.append(f"clip_grad_norm_ returned norms {median_ratio:.3g}x the true gradient norms{why}. "
                        "Clip the gradients once they are back to their true size.")
    for problem in problems:
        print(f"✗ {problem}")
    same = checks.check_exercise(f"weights after {EXERCISE_STEPS} steps match loss scaling done by hand",
                                 flat_params(model), ref_w, rel_tol=1e-4,
                                 hint="check the order of the scaler's calls and where clipping goes.")
    return not problems and same
