"""Mixed precision, measured (notebook 04).

- :func:`format_table` / :func:`plot_ranges`: fp32, tf32, fp16, bf16 from ``torch.finfo``
- :func:`underflow_fraction` / :func:`overflow_fraction`: what a cast to fp16/bf16 destroys
- :func:`autocast_op_table`: which ops autocast runs in low precision on this device
- :class:`ScaleLog`: a GradScaler's scale per step, and which steps it skipped
- :func:`recommend_precision`, :func:`decision_table`: which recipe for which GPU
- :func:`check_amp_loop`: the exercise checker (runs the learner's AMP loop against a reference)

The training loops themselves stay in the notebook.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
from torch import nn

from .validation import float_tensor

FORMATS = ("fp32", "tf32", "fp16", "bf16")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# bits of (sign, exponent, mantissa): finfo has no tf32, it is a matmul mode of fp32 tensors
_LAYOUT = {"fp32": (1, 8, 23), "tf32": (1, 8, 10), "fp16": (1, 5, 10), "bf16": (1, 8, 7)}


def _dtype(fmt) -> torch.dtype:
    if isinstance(fmt, torch.dtype):
        if fmt not in _DTYPES.values():
            raise ValueError(f"dtype must be one of torch.float32/float16/bfloat16, not {fmt}.")
        return fmt
    if isinstance(fmt, str) and fmt.lower() in _DTYPES:
        return _DTYPES[fmt.lower()]
    raise ValueError(f"Unknown format {fmt!r}; use one of {sorted(_DTYPES)} or a torch float dtype.")


def format_facts(fmt: str) -> dict:
    """Bits, range and precision of one format, from ``torch.finfo`` (tf32 derived from fp32)."""
    if not isinstance(fmt, str) or fmt.lower() not in _LAYOUT:
        raise ValueError(f"Unknown format {fmt!r}; choose one of {FORMATS}.")
    fmt = fmt.lower()
    sign, exp, man = _LAYOUT[fmt]
    info = torch.finfo(torch.float32 if fmt == "tf32" else _DTYPES[fmt])
    eps = 2.0 ** -man  # tf32 keeps fp32's exponent, fp16's 10 mantissa bits
    return {
        "format": fmt,
        "bits": sign + exp + man,
        "exponent_bits": exp,
        "mantissa_bits": man,
        "max": float(info.max),
        "smallest_normal": float(info.smallest_normal),
        "smallest_subnormal": float(info.smallest_normal) * 2.0 ** -man,
        "eps": eps,
        "decimal_digits": round(math.log10(2.0 ** (man + 1)), 1),
        "bytes_in_memory": 4 if fmt in ("fp32", "tf32") else 2,
    }


def format_table(formats=FORMATS):
    """A pandas DataFrame, one row per format (see :func:`format_facts`)."""
    import pandas as pd

    if isinstance(formats, str) or not formats:
        raise ValueError(f"formats must be a non-empty list such as {list(FORMATS)}, not {formats!r}.")
    return pd.DataFrame([format_facts(f) for f in formats]).set_index("format")


def plot_ranges(formats=FORMATS, *, ax=None, mark: dict | None = None):
    """Horizontal bars of each format's range on a log10 axis: subnormals light, normals dark.

    ``mark`` draws vertical lines, e.g. ``{"typical small gradient": 1e-8}``.
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    table = format_table(formats)
    if mark is not None and not isinstance(mark, dict):
        raise TypeError("mark must be a dict {label: value}, e.g. {'1e-8': 1e-8}.")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.6 + 0.6 * len(table)))
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
    ax.set_xlabel("log10 of |value| (representable range)")
    ax.set_title("Representable magnitudes per format")
    ax.legend(loc="lower left", fontsize=8)
    return ax


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number such as 1024, not {scale!r}.")
    return float(scale)


def underflow_fraction(tensor: torch.Tensor, dtype, *, scale: float = 1.0) -> float:
    """Share of the non-zero values of ``tensor * scale`` that become exactly 0 when cast to ``dtype``."""
    t = float_tensor(tensor, "tensor", "a gradient").detach().double().flatten() * _check_scale(scale)
    nonzero = t[(t != 0) & torch.isfinite(t)]
    if nonzero.numel() == 0:
        raise ValueError("tensor has no non-zero finite values; run a backward pass first.")
    return float((nonzero.to(_dtype(dtype)) == 0).double().mean())


def overflow_fraction(tensor: torch.Tensor, dtype, *, scale: float = 1.0) -> float:
    """Share of the finite values of ``tensor * scale`` that become inf when cast to ``dtype``."""
    t = float_tensor(tensor, "tensor", "a gradient").detach().double().flatten() * _check_scale(scale)
    finite = t[torch.isfinite(t)]
    if finite.numel() == 0:
        raise ValueError("tensor has no finite values.")
    return float(torch.isinf(finite.to(_dtype(dtype))).double().mean())


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All of a model's gradients as one flat fp32 tensor (after ``loss.backward()``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"flat_grads needs a torch.nn.Module, not {type(model).__name__}.")
    grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
    if not grads:
        raise ValueError("The model has no gradients yet: call loss.backward() first.")
    return torch.cat(grads)


# ---------------------------------------------------------------- autocast
def _op_zoo():
    import torch.nn.functional as F

    target = lambda x: torch.zeros(x.shape[0], dtype=torch.long, device=x.device)  # noqa: E731
    return {
        "matmul (x @ w)": lambda x, w: x @ w,
        "linear": lambda x, w: F.linear(x, w),
        "relu": lambda x, w: F.relu(x),
        "gelu": lambda x, w: F.gelu(x),
        "softmax": lambda x, w: torch.softmax(x, -1),
        "log_softmax": lambda x, w: F.log_softmax(x, -1),
        "layer_norm": lambda x, w: F.layer_norm(x, x.shape[-1:]),
        "exp": lambda x, w: x.exp(),
        "sum": lambda x, w: x.sum(),
        "cross_entropy": lambda x, w: F.cross_entropy(x, target(x)),
        "mse_loss": lambda x, w: F.mse_loss(x, x.detach() * 2),
    }


def autocast_op_table(device_type: str, dtype=torch.bfloat16):
    """What dtype each op returns under ``torch.amp.autocast(device_type, dtype)``.

    Two columns: the op fed fp32 tensors (autocast casts *down* only the ops on its
    low-precision list), and fed tensors already in ``dtype`` (autocast casts *up* the ops on
    its fp32 list; other ops simply run in their input's dtype).
    """
    import pandas as pd

    if device_type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda' (or 'mps'), not {device_type!r}.")
    low = _dtype(dtype)
    if low == torch.float32:
        raise ValueError("dtype must be a 16-bit format (torch.bfloat16 or torch.float16).")
    x = torch.randn(8, 16, device=device_type)
    w = torch.randn(16, 16, device=device_type)
    rows = []
    for name, op in _op_zoo().items():
        row = {"op": name}
        for label, (xi, wi) in (("fp32 input", (x, w)), (f"{_short(low)} input", (x.to(low), w.to(low)))):
            with torch.amp.autocast(device_type, dtype=low):
                row[label] = _short(op(xi, wi).dtype)
        rows.append(row)
    return pd.DataFrame(rows).set_index("op")


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def median_seconds(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs after ``warmup`` runs (CUDA synchronised)."""
    if not callable(fn):
        raise TypeError("fn must be a zero-argument callable.")
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, not {value!r}.")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- loss scaling
class ScaleLog:
    """Record a ``torch.amp.GradScaler``'s scale after every ``scaler.update()``.

    A step was *skipped* (``scaler.step`` found inf/NaN gradients and did not call
    ``optimizer.step``) exactly when ``update()`` backed the scale off, i.e. when the scale
    went down. Use it in the loop::

        log = ScaleLog(scaler)
        ...
        scaler.step(optimizer); scaler.update(); log.update(loss)
    """

    def __init__(self, scaler):
        if not hasattr(scaler, "get_scale") or not hasattr(scaler, "update"):
            raise TypeError(f"ScaleLog needs a torch.amp.GradScaler, not {type(scaler).__name__}.")
        if not scaler.is_enabled():
            raise ValueError("This GradScaler is disabled (enabled=False): it has no scale to record.")
        self.scaler = scaler
        self.scales: list[float] = []
        self.skipped: list[bool] = []
        self.losses: list[float] = []
        self._last = float(scaler.get_scale())
        self.init_scale = self._last

    def update(self, loss=None) -> bool:
        """Call right after ``scaler.update()``; returns True if this step was skipped."""
        scale = float(self.scaler.get_scale())
        skipped = scale < self._last
        self.scales.append(scale)
        self.skipped.append(skipped)
        self.losses.append(float(loss) if loss is not None else float("nan"))
        self._last = scale
        return skipped

    @property
    def skipped_steps(self) -> int:
        return int(sum(self.skipped))

    def frame(self):
        import pandas as pd

        return pd.DataFrame({"step": range(1, len(self.scales) + 1), "scale": self.scales,
                             "skipped": self.skipped, "loss": self.losses})

    def plot(self, ax=None, title: str = "GradScaler: loss scale per step"):
        import matplotlib.pyplot as plt
        import seaborn as sns

        if not self.scales:
            raise ValueError("Nothing recorded yet: call log.update() after each scaler.update().")
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.5))
        df = self.frame()
        sns.lineplot(data=df, x="step", y="scale", drawstyle="steps-post", ax=ax, label="scale after update()")
        skipped = df[df.skipped]
        if len(skipped):
            ax.scatter(skipped.step, skipped.scale, color="crimson", zorder=3, label="skipped step (inf/NaN grads)")
        ax.set_yscale("log", base=2)
        ax.set_title(title)
        ax.legend()
        return ax


# ---------------------------------------------------------------- which recipe
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


# ---------------------------------------------------------------- exercise
EXERCISE_INIT_SCALE = 2.0**24  # large enough that the first steps overflow fp16 and are skipped


def reference_amp_train(model, optimizer, batches, scaler, *, device_type: str, max_norm: float,
                        dtype=torch.float16):
    """The solution of the exercise: fp16 autocast, GradScaler, unscale before clipping."""
    import torch.nn.functional as F

    losses, norms = [], []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        with torch.amp.autocast(device_type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses, norms


def exercise_setup(device: torch.device | str = "cpu", *, steps: int = 24, seed: int = 0):
    """Model, optimizer, batches and a GradScaler for the AMP exercise (identical every call)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2, not {steps!r}.")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    w = torch.randn(32, 4, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ w).argmax(-1)
        batches.append((x.to(device), y.to(device)))
    scaler = torch.amp.GradScaler(device.type, init_scale=EXERCISE_INIT_SCALE)
    return model, optimizer, batches, scaler


def check_amp_loop(learner_fn: Callable, *, device: torch.device | str = "cpu", steps: int = 24,
                   max_norm: float = 0.25) -> bool:
    """Run the learner's AMP loop and the reference on the same model, data and scaler; compare.

    ``learner_fn(model, optimizer, batches, scaler, device_type=..., max_norm=...)`` must return
    ``(losses, norms)``: the loss of each step and what ``clip_grad_norm_`` returned. The scaler
    starts at 2**24, so the first steps overflow and must be skipped. Passes when the forward
    ran in fp16, the scaler was used, clipping saw unscaled gradients and the final weights
    match the reference's. A ``NotImplementedError`` from the learner's function propagates.
    """
    from . import checks

    if not callable(learner_fn):
        raise TypeError("Pass your function itself (amp_train), not its result.")
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, not {max_norm!r}.")
    device = torch.device(device)
    results = {}
    for who, fn in (("reference", reference_amp_train), ("learner", learner_fn)):
        model, optimizer, batches, scaler = exercise_setup(device, steps=steps)
        seen = []
        hook = model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        out = fn(model, optimizer, batches, scaler, device_type=device.type, max_norm=max_norm)
        hook.remove()
        if out is None or out is Ellipsis:
            raise ValueError("Your function returned None: return (losses, norms).")
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            print("✗ amp_train must return (losses, norms): two lists of floats.")
            return False
        losses, norms = out
        weights = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
        results[who] = (list(map(float, losses)), list(map(float, norms)), weights, seen, scaler.get_scale())
    _, _, ref_w, _, _ = results["reference"]
    losses, norms, w, seen, final_scale = results["learner"]
    ok = True
    if len(losses) != steps:
        print(f"✗ expected one loss per batch ({steps}), got {len(losses)}.")
        ok = False
    if torch.float16 not in seen:
        print("✗ the forward pass did not run in fp16: wrap it in torch.amp.autocast(device_type, dtype=torch.float16).")
        ok = False
    if final_scale >= EXERCISE_INIT_SCALE:
        print("✗ the GradScaler's scale never changed: use scaler.scale(loss).backward(), scaler.step(optimizer) "
              "and scaler.update().")
        ok = False
    finite = [n for n in norms if math.isfinite(n)]
    if finite and max(finite) > 1e3:
        print(f"✗ clip_grad_norm_ saw a gradient norm of {max(finite):.3g}: it clipped the *scaled* gradients. "
              "Call scaler.unscale_(optimizer) before clipping.")
        ok = False
    same = checks.check_exercise("final weights match the reference AMP loop", w, ref_w, rel_tol=1e-3,
                                 hint="autocast the forward and the loss, scaler.scale(loss).backward(), "
                                      "scaler.unscale_(optimizer), clip, scaler.step(optimizer), scaler.update().")
    return ok and same
