"""course_utils.bootstrap: installs only what is missing, on Colab only, never torch."""
import subprocess

import pytest

from course_utils import bootstrap, hardware
from stand_ins import stand_in


def test_nothing_missing_here():
    assert bootstrap.ensure_packages(["timm", "seaborn", "bitsandbytes"]) == []


def test_unknown_package_name():
    with pytest.raises(ValueError, match="knows"):
        bootstrap.missing_packages(["not_a_course_package"])


def test_missing_off_colab_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(bootstrap, "missing_packages", lambda names: ["mlxtend"])
    monkeypatch.setattr(hardware, "in_colab", lambda: False)
    with pytest.raises(ImportError, match="make lab"):
        bootstrap.ensure_packages(["mlxtend"])


def test_colab_installs_only_the_missing_and_never_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(bootstrap, "missing_packages", lambda names: ["mlxtend", "timm"])
    monkeypatch.setattr(hardware, "in_colab", lambda: True)
    monkeypatch.setattr(bootstrap, "subprocess", stand_in(subprocess, run=lambda cmd, check: calls.append(cmd)))
    assert bootstrap.ensure_packages(["mlxtend", "timm", "seaborn"]) == ["mlxtend", "timm"]
    (cmd,) = calls
    assert "mlxtend>=0.23" in cmd and "timm>=1.0" in cmd
    assert not any(part.startswith("torch") for part in cmd)


def test_missing_torch_is_never_installed(monkeypatch):
    monkeypatch.setattr(bootstrap, "missing_packages", lambda names: ["torch"])
    monkeypatch.setattr(hardware, "in_colab", lambda: True)
    with pytest.raises(ImportError, match="never installs torch"):
        bootstrap.ensure_packages(["torch"])


def test_what_colab_installs_matches_requirements_txt():
    """The bootstrap's pip specs are the learner install's, so Colab gets the same lower bounds."""
    import re
    from pathlib import Path

    lines = (Path(__file__).resolve().parent.parent / "requirements.txt").read_text().splitlines()
    specs = {re.split(r"[<>=!~ ]", s)[0].lower(): s for s in (line.split("#")[0].strip() for line in lines) if s}
    for requirement in bootstrap.COURSE_PACKAGES.values():
        name = re.split(r"[<>=!~ ]", requirement)[0].lower()
        assert specs.get(name) == requirement, f"bootstrap asks {requirement!r}, requirements.txt {specs.get(name)!r}"
