"""course_utils.validation: the argument checks every module shares."""
import math

import pytest
import torch

from course_utils.validation import float_tensor, positive_int, positive_number


def test_positive_int():
    assert positive_int(3, "n") == 3
    assert positive_int(8.0, "n", whole_floats=True) == 8
    with pytest.raises(TypeError, match=r"n must be a whole number \(e.g. 8\), not 8.0"):
        positive_int(8.0, "n", "e.g. 8")
    with pytest.raises(TypeError, match="whole number"):
        positive_int(True, "n")
    with pytest.raises(TypeError, match="whole number"):
        positive_int(2.5, "n", whole_floats=True)
    with pytest.raises(ValueError, match=r"n must be positive, got 0"):
        positive_int(0, "n")


def test_positive_number():
    assert positive_number(2, "lr") == 2.0
    assert positive_number(0, "lr", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match="lr must be a positive finite number"):
        positive_number(0, "lr")
    with pytest.raises(ValueError, match=">= 0"):
        positive_number(-1, "lr", allow_zero=True)
    with pytest.raises(ValueError, match="finite"):
        positive_number(math.inf, "lr")
    with pytest.raises(TypeError, match=r"lr must be a number \(e.g. 1e-3\)"):
        positive_number("1e-3", "lr", "e.g. 1e-3")


def test_float_tensor():
    t = torch.ones(3)
    assert float_tensor(t, "grad") is t
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        float_tensor([1.0], "grad")
    with pytest.raises(TypeError, match="floating-point"):
        float_tensor(torch.ones(3, dtype=torch.long), "grad")
    with pytest.raises(ValueError, match="grad is empty"):
        float_tensor(torch.ones(0), "grad")


def test_positive_int_allow_zero_and_callable_arg():
    from course_utils.validation import callable_arg

    assert positive_int(0, "warmup", allow_zero=True) == 0
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        positive_int(-1, "warmup", allow_zero=True)
    f = lambda: None  # noqa: E731
    assert callable_arg(f) is f
    with pytest.raises(TypeError, match="fn must be a zero-argument callable"):
        callable_arg(3)
