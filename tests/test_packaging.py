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


def _spec(text: str, name: str) -> str:
    match = re.search(rf"^\s*(?:- )?\"?{name}([<>=!~][^\"#\s]*)", text, re.M)
    assert match, f"no {name} requirement found"
    return match.group(1)


def test_torch_bounds_agree_and_the_lower_bound_says_why():
    """requirements.txt, pyproject.toml and environment.yml carry the same torch range; the lower bound
    is the oldest torch with FSDP2's public fully_shard (2.6), and the reasons sit next to it."""
    requirements = (ROOT / "requirements.txt").read_text()
    spec = _spec(requirements, "torch")
    assert spec == _spec((ROOT / "pyproject.toml").read_text(), "torch")
    assert spec == _spec((ROOT / "environment.yml").read_text(), "pytorch")
    assert spec.startswith(">=2.6,")
    for api in ("fully_shard", "MemTracker", "register_post_accumulate_grad_hook"):
        assert api in requirements, f"requirements.txt should say which torch has {api}"
    assert re.search(r"^ipywidgets>=7\.7\b", requirements, re.M)


def test_installed_torch_is_inside_the_bounds_and_has_the_apis():
    import torch
    from packaging.version import Version

    spec = _spec((ROOT / "requirements.txt").read_text(), "torch")
    low, high = re.fullmatch(r">=([\d.]+),<=([\d.]+)", spec).groups()
    assert Version(low) <= Version(torch.__version__.split("+")[0]) <= Version(high)
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    assert hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def _pyproject_dependencies() -> dict:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~ ]", d)[0].lower(): d for d in deps}


def test_pyproject_declares_what_course_utils_imports_with_the_requirements_bounds():
    import sys

    declared = _pyproject_dependencies()
    requirements = {re.split(r"[<>=!~ ]", s)[0].lower(): s for s in
                    (line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()) if s}
    for name, spec in declared.items():
        assert requirements.get(name) == spec, f"pyproject has {spec!r}, requirements.txt {requirements.get(name)!r}"
    import ast

    imported = set()
    for path in (ROOT / "course_utils").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"course_utils", "__future__"}
    provided_by = {"IPython": "ipywidgets", "sklearn": "scikit-learn"}  # import name -> the package that brings it
    missing = {m for m in third_party if provided_by.get(m, m).lower() not in declared}
    assert not missing, f"course_utils imports {sorted(missing)}: declare them in pyproject's dependencies"
