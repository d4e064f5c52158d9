"""Argument checks shared by every course_utils module: ``TypeError`` for the wrong kind of value, ``ValueError``
for one out of range, with a message that names the argument and, through ``hint``, says what to pass instead."""
from __future__ import annotations

import math


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""


def positive_int(value, what: str, hint: str = "", *, whole_floats: bool = False, allow_zero: bool = False) -> int:
    """``value`` as an int > 0 (>= 0 with ``allow_zero``). With ``whole_floats=True`` 8.0 is accepted too."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_whole_float = whole_floats and isinstance(value, float) and value.is_integer()
    if not (is_int or is_whole_float):
        raise TypeError(f"{what} must be a whole number{_hint(hint)}, not {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else 'positive'}{_hint(hint)}, got {value}.")
    return int(value)


def byte_counts(**named) -> None:
    """Each keyword's value must be a whole number of bytes >= 0 (ValueError otherwise)."""
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a whole number of bytes >= 0, not {value!r}.")


def callable_arg(fn, what: str = "fn", hint: str = "a zero-argument callable, e.g. `lambda: step(batch)`"):
    """``fn`` if it is callable."""
    if not callable(fn):
        raise TypeError(f"{what} must be {hint}, not {type(fn).__name__}.")
    return fn


def positive_number(value, what: str, hint: str = "", *, allow_zero: bool = False) -> float:
    """``value`` as a finite number > 0 (>= 0 with ``allow_zero=True``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number{_hint(hint)}, not {value!r}.")
    in_range = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and in_range):
        kind = "a finite number >= 0" if allow_zero else "a positive finite number"
        raise ValueError(f"{what} must be {kind}{_hint(hint)}, got {value}.")
    return float(value)


def float_tensor(x, what: str, hint: str = ""):
    """``x`` if it is a non-empty floating-point torch.Tensor."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(x).__name__}.")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor{_hint(hint)}, not {x.dtype}.")
    if x.numel() == 0:
        raise ValueError(f"{what} is empty{_hint(hint)}.")
    return x
