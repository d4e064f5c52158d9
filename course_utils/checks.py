"""Claim checks (a sentence of the lesson as an assertion: the notebook fails under nbval, saying what was expected
and what was measured, when a measurement stops supporting it), predictions and exercise checkers."""
from __future__ import annotations

import operator
from typing import Any, Callable

from . import results

_OPS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "<=": (operator.le, "at most"), "<": (operator.lt, "below"), ">=": (operator.ge, "at least"),
    ">": (operator.gt, "above"), "==": (operator.eq, "exactly")}


class ClaimError(AssertionError):
    """A lesson's claim did not hold on this machine."""


def claim(claim_text: str, measured, op: str, expected, *, unit: str = "") -> None:
    """Assert ``measured <op> expected``; on failure say what the lesson claims and what was measured."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, not {op!r}.")
    if not isinstance(claim_text, str) or not claim_text:
        raise ValueError("claim_text must say, in words, what the lesson claims.")
    (compare, words), suffix = _OPS[op], f" {unit}" if unit else ""
    if not compare(measured, expected):
        raise ClaimError(f"Claim failed: {claim_text}. Expected {words} {_fmt(expected)}{suffix}, "
                         f"measured {_fmt(measured)}{suffix}.")
    print(f"✓ {claim_text}: {_fmt(measured)}{suffix} ({words} {_fmt(expected)})")


def claim_close(claim_text: str, measured: float, expected: float, *, rel_tol: float = 0.1, unit: str = "") -> None:
    """Assert ``measured`` is within ``rel_tol`` (relative) of ``expected``."""
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be positive, e.g. 0.1 for 10%, not {rel_tol}.")
    error = abs(measured - expected) / max(abs(expected), 1e-30)
    suffix = f" {unit}" if unit else ""
    if not error <= rel_tol:
        raise ClaimError(f"Claim failed: {claim_text}. Expected {_fmt(expected)}{suffix} within {rel_tol:.0%}, "
                         f"measured {_fmt(measured)}{suffix} ({error:.1%} off).")
    print(f"✓ {claim_text}: {_fmt(measured)}{suffix} vs {_fmt(expected)}{suffix} ({error:.1%} off)")


def check_exercise(name: str, learner_value, reference_value, *, rel_tol: float = 0.0, hint: str = "") -> bool:
    """Compare a learner's answer with the reference; print a friendly verdict and return True/False."""
    if learner_value is None or learner_value is Ellipsis:
        raise ValueError(f"Exercise '{name}': replace the `...` / None with your answer, then run the cell again.")
    try:
        ok = _matches(learner_value, reference_value, rel_tol)
    except (TypeError, ValueError) as err:
        print(f"✗ {name}: your answer could not be compared with the reference ({err}).")
        return False
    tol = f" within {rel_tol:.3g} (relative)" if rel_tol else ""
    print(f"✓ {name}: correct ({_fmt(learner_value)})." if ok else
          f"✗ {name}: expected {_fmt(reference_value)}{tol}, got {_fmt(learner_value)}." + (f" Hint: {hint}" if hint else ""))
    return ok


def _matches(a, b, rel_tol: float) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a_t, b_t = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        if a_t.shape != b_t.shape:
            raise ValueError(f"shape {tuple(a_t.shape)} vs {tuple(b_t.shape)}")
        scale = b_t.abs().max().clamp_min(1e-30)
        return bool(((a_t - b_t).abs().max() / scale) <= max(rel_tol, 1e-12))
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return abs(float(a) - b) <= rel_tol * max(abs(b), 1e-30) if rel_tol else float(a) == b
    if isinstance(b, (set, frozenset)):
        return set(a) == b
    return a == b


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6) else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return repr(value) if isinstance(value, str) else str(value)


_predictions: dict[str, bool] = {}  # name -> whether the learner typed a number


def compare_prediction(name: str, predicted, measured, *, unit: str = "", why_off: str = "") -> float | None:
    """Print the learner's prediction beside the measurement and how far off it was (``why_off`` when off by more
    than 25%); returns the relative error. A prediction left at ``None`` (the predict cell as shipped) prints what to
    type, records nothing and returns None, so a notebook still runs top to bottom."""
    if not isinstance(name, str) or not name:
        raise ValueError("name must say what was predicted, e.g. 'peak memory of one step'.")
    if isinstance(measured, bool) or not isinstance(measured, (int, float)):
        raise TypeError(f"measured must be a number, not {measured!r}.")
    _predictions.setdefault(name, False)
    results.record_reveal(name, measured, unit)  # the tests search the saved course for it
    suffix = f" {unit}" if unit else ""
    if predicted is None or predicted is Ellipsis:
        print(f"Prediction ({name}): none yet. Type your number (in {unit or 'the unit asked'}) in the `predict` cell "
              f"above, run it, then this cell again. Measured: {_fmt(measured)}{suffix}")
        return None
    if isinstance(predicted, bool) or not isinstance(predicted, (int, float)):
        raise TypeError(f"Prediction '{name}' must be a number (in {unit or 'the unit asked'}), not {predicted!r}.")
    error = (predicted - measured) / max(abs(measured), 1e-30)
    verdict = "spot on" if abs(error) < 0.02 else f"{abs(error):.0%} {'too high' if error > 0 else 'too low'}"
    print(f"Prediction ({name}): {_fmt(predicted)}{suffix} | measured: {_fmt(measured)}{suffix} | {verdict}")
    if abs(error) > 0.25 and why_off:
        print(f"  The usual reason for a miss: {why_off}")
    _predictions[name] = True
    return float(error)


def prediction_count(*, made: bool = False) -> int:
    """How many distinct predictions this kernel asked for (compared with a measurement); ``made=True``: how many
    of them the learner actually typed."""
    return sum(typed or not made for typed in _predictions.values())
