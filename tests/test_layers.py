"""The layers the code keeps (CONTRIBUTING.md), as pyproject's ``[tool.importlinter]`` contracts state them.

import-linter (``lint-imports``) checks the contracts; imports made inside functions count (grimp reads every import
in a module's source, at any depth). These tests run it on the repository, check that its contracts place every module
of course_utils and course_tools (found now, so a new module is covered or named), show that it fails with the import
that broke a layer, and find no import cycle. A few seconds in all.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# import-linter 2.17 (and grimp, which it brings) needs Python 3.11+: requirements.txt installs it there only
grimp = pytest.importorskip("grimp", reason="import-linter is installed on Python 3.11+ only (requirements.txt)")
import tomllib  # noqa: E402 - Python 3.11+, as import-linter

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("course_utils", "course_tools")  # scripts/ (no __init__.py) is a root package too: a layer of its own
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
CONTRACTS = {c["id"]: c for c in CONFIG["contracts"]}


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the packages found from ``cwd`` first (its own copy of them, if it has one), no cache."""
    env = {**os.environ, "PYTHONPATH": str(cwd), "COLUMNS": "200"}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def _layer_modules(contract: dict) -> set[str]:
    """The modules a layers contract names, full names (with its containers)."""
    names = {name.strip().strip("()") for layer in contract["layers"] for name in layer.replace("|", ":").split(":")}
    containers = contract.get("containers") or [""]
    return {f"{container}.{name}".lstrip(".") for container in containers for name in names}


def test_the_import_contracts_are_kept():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, f"a layer is broken (CONTRIBUTING.md):\n{result.stdout}{result.stderr}"
    assert "0 broken" in result.stdout


def test_the_contracts_place_every_module():
    """Every module of course_utils and course_tools, found now, sits in a layer of the package's own exhaustive
    contract (import-linter then names a new module nobody placed) and under the tools contract."""
    for package in PACKAGES:
        assert CONTRACTS[package]["containers"] == [package] and CONTRACTS[package]["exhaustive"] is True
    assert {"course_utils", "course_tools", "scripts"} <= _layer_modules(CONTRACTS["tools"])
    placed = set().union(*(_layer_modules(c) for c in CONTRACTS.values() if c["type"] == "layers"))
    unplaced = [m for m in sorted(_graph().modules) if m not in PACKAGES
                and not any(m == p or m.startswith(p + ".") for p in placed - set(PACKAGES))]
    assert not unplaced, f"{unplaced}: give each a layer in pyproject's [tool.importlinter] (CONTRIBUTING.md)"
    assert "course_utils.planner" in placed  # new planner modules (run.py, rl.py, ...) are the planner's layer


def _copy(tmp_path: Path) -> Path:
    """The packages' Python files and pyproject.toml, in ``tmp_path``."""
    for name in (*PACKAGES, "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=lambda d, names: [
            n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir() or n == "__pycache__"])
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def _add(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def test_lint_imports_fails_with_the_import_that_breaks_a_layer(tmp_path):
    """In a copy: a core module imports a lesson helper, the planner a memory reader, the core a lesson helper that
    imports it back (a cycle), each inside a function; a new module has no layer. Each is named."""
    tree = _copy(tmp_path)
    _add(tree / "course_utils" / "results.py", "\n\ndef _late():\n    from . import distributed  # noqa: F401\n")
    _add(tree / "course_utils" / "planner" / "plan.py", "\n\ndef _late():\n    from ..doctor import doctor\n")
    _add(tree / "course_utils" / "hardware.py", "\n\ndef _late():\n    from .precision import format_table\n")
    (tree / "course_utils" / "unplaced_helper.py").write_text("from .units import GIB\n")
    result = _lint_imports(tree)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    for line in ("course_utils.results -> course_utils.distributed (l.",
                 "course_utils.planner.plan -> course_utils.doctor (l.",
                 "course_utils.hardware -> course_utils.precision (l.",
                 "- course_utils.unplaced_helper",
                 "No cycles are allowed in course_utils."):
        assert line in out, f"{line!r} not in lint-imports' output:\n{out}"
    assert "The planner uses only the core BROKEN" in out and "No import cycles BROKEN" in out


def _function_level_imports(package: str, modules) -> set[tuple[str, str]]:
    """(importer, imported module) for each relative import made inside a function: ``from .x import y`` imports
    ``.x.y`` where that is a module, else ``.x``."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for func in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = parts[:len(parts) - node.level]
                    stem = ".".join(base + ((node.module,) if node.module else ()))
                    found |= {(module, f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem)
                              for a in node.names}
    return found


def test_grimp_counts_imports_made_inside_functions():
    graph = _graph()
    inside = _function_level_imports("course_utils", graph.modules)
    assert ("course_utils.timeline", "course_utils.allocator") in inside  # timeline's allocator, imported late
    assert len(inside) > 10
    missing = [(a, b) for a, b in sorted(inside) if not graph.direct_import_exists(importer=a, imported=b)]
    assert not missing, f"grimp does not see these imports made inside functions: {missing}"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.d")):
        graph.add_import(importer=importer, imported=imported)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycle_counting_imports_inside_functions():
    cycles = _cycles(_graph())
    assert not cycles, ("import cycles (imports inside functions count): move what the lower module needs into it "
                        f"or below it: {cycles}")
