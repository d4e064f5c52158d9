"""course_utils.checks: claim checks fail loudly with expected vs measured; exercise checkers are friendly."""
import pytest
import torch

from course_utils import checks


def test_claim_passes_and_prints(capsys):
    checks.claim("Adam keeps two states", 8, "==", 8, unit="bytes/param")
    assert "✓" in capsys.readouterr().out


def test_claim_failure_message_has_expected_and_measured():
    with pytest.raises(checks.ClaimError, match=r"Expected at most 0.25.*measured 0.4"):
        checks.claim("checkpointing cuts activations to a quarter", 0.4, "<=", 0.25)
    assert issubclass(checks.ClaimError, AssertionError)  # fails nbval like any assertion


def test_claim_nan_fails():
    with pytest.raises(checks.ClaimError, match="NaN"):
        checks.claim("loss is finite", float("nan"), "<", 10)


def test_claim_close():
    checks.claim_close("estimate", 105, 100, rel_tol=0.1)
    with pytest.raises(checks.ClaimError, match="20.0% off"):
        checks.claim_close("estimate", 120, 100, rel_tol=0.1)


def test_claim_bad_input():
    with pytest.raises(ValueError, match="op must be"):
        checks.claim("x", 1, "=>", 1)
    with pytest.raises(ValueError, match="rel_tol"):
        checks.claim_close("x", 1, 1, rel_tol=0)


def test_check_exercise(capsys):
    assert checks.check_exercise("bytes", 16, 16) is True
    assert checks.check_exercise("bytes", 15, 16, hint="count master weights") is False
    assert "Hint: count master weights" in capsys.readouterr().out
    assert checks.check_exercise("close", 104, 100, rel_tol=0.05) is True
    assert checks.check_exercise("tensor", torch.ones(3), torch.ones(3)) is True
    assert checks.check_exercise("tensor", torch.ones(3), torch.ones(4)) is False


def test_check_exercise_unanswered():
    with pytest.raises(ValueError, match="replace the"):
        checks.check_exercise("bytes", ..., 16)
