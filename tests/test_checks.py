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
    with pytest.raises(checks.ClaimError, match="measured nan"):  # every comparison with NaN is False
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


# ---------------------------------------------------------------------------- predict, then measure
def test_compare_prediction_prints_both_and_direction(capsys):
    error = checks.compare_prediction("peak of one step", 150, 100, unit="MiB", why_off="activations were forgotten")
    out = capsys.readouterr().out
    assert error == pytest.approx(0.5)
    assert "150 MiB" in out and "100 MiB" in out and "50% too high" in out
    assert "activations were forgotten" in out  # off by more than 25%: the usual reason is explained


def test_compare_prediction_close_needs_no_explanation(capsys):
    checks.compare_prediction("ratio", 0.99, 1.0, why_off="never printed")
    out = capsys.readouterr().out
    assert "spot on" in out and "never printed" not in out


def test_compare_prediction_counts_distinct_names():
    before = checks.prediction_count()
    checks.compare_prediction("a fresh prediction name", 1, 1)
    checks.compare_prediction("a fresh prediction name", 2, 1)
    assert checks.prediction_count() == before + 1


def test_an_unfilled_prediction_says_what_to_type_and_records_nothing(capsys):
    asked, made = checks.prediction_count(), checks.prediction_count(made=True)
    assert checks.compare_prediction("an unfilled prediction", None, 100, unit="MiB") is None
    out = capsys.readouterr().out
    assert "none yet" in out and "`predict` cell" in out and "MiB" in out
    assert checks.prediction_count() == asked + 1 and checks.prediction_count(made=True) == made
    checks.compare_prediction("an unfilled prediction", 90, 100, unit="MiB")  # typed later: now it counts as made
    assert checks.prediction_count() == asked + 1 and checks.prediction_count(made=True) == made + 1


@pytest.mark.parametrize("bad", ["100", True])
def test_compare_prediction_wrong_type_is_explained(bad):
    with pytest.raises(TypeError, match="number"):
        checks.compare_prediction("peak", bad, 100)


def test_checker_rejects():
    """The tests' proof that an exercise checker rejects wrong answers (tests/notebook_lessons.py)."""
    from notebook_lessons import checker_rejects

    def checker(value):
        return checks.check_exercise("answer", value, 42)

    assert checker_rejects(checker, 41, 43)
    assert not checker_rejects(checker, 41, 42)  # 42 is accepted, so the "wrong" list is not all rejected
    with pytest.raises(ValueError, match="at least one"):
        checker_rejects(checker)
    with pytest.raises(TypeError, match="check function"):
        checker_rejects(42, 1)
