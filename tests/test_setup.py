"""course_utils.setup and seed_everything: the first call of every notebook."""
import pytest
import torch

import course_utils
from course_utils import results


def test_setup_names_notebook_prints_banner_and_returns_profile(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_PROFILE", "smoke")
    assert course_utils.setup("99_test_notebook") == "smoke"
    assert results._current_notebook == "99_test_notebook"
    assert "[course] device=" in capsys.readouterr().out


def test_seed_everything_repeats():
    course_utils.seed_everything(3)
    a = torch.rand(3)
    course_utils.seed_everything(3)
    assert torch.equal(a, torch.rand(3))


@pytest.mark.parametrize("bad", [-1, 1.5, "0"])
def test_seed_bad_input(bad):
    with pytest.raises(ValueError, match="seed"):
        course_utils.seed_everything(bad)


def test_setup_bad_name():
    with pytest.raises(ValueError, match="notebook name"):
        course_utils.setup("01 memory accounting")
