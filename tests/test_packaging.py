"""requirements.txt and environment.yml name the same packages; the install commands exist."""
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}


def _requirement_names():
    names = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!~ ]", line)[0].lower())
    return names


def _conda_names():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    names = set()
    for dep in env["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            names.add(re.split(r"[<>=!~ ]", item)[0].lower())
    return names


def test_environment_yml_matches_requirements():
    conda = _conda_names()
    missing = {CONDA_NAMES.get(n, n) for n in _requirement_names()} - conda
    assert not missing, f"environment.yml lacks {sorted(missing)}"


def test_torch_is_capped_at_the_local_wheels():
    text = (ROOT / "requirements.txt").read_text()
    assert re.search(r"^torch>=[\d.]+,<=2\.14\.1", text, re.M)
    assert re.search(r"^bitsandbytes>=0\.50", text, re.M)


def test_readme_has_exactly_the_two_commands_and_ci_uses_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)
