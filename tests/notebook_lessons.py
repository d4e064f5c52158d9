"""Run a notebook's lesson cells in a test: the code a learner reads is the code the tests check. Also the proof
that an exercise's checker rejects plausible wrong answers (it lives here, not in the notebooks: a learner sees the
checker, not the scaffolding that tests it)."""
import ast
import contextlib
import io
import json
from pathlib import Path
from typing import Callable


def exec_lesson_cells(notebook: Path, lesson: dict, namespace: dict, *, defs_only: bool = False) -> dict:
    """Exec, in notebook order, each code cell that one of ``lesson``'s predicates ``(source, tags) -> bool``
    picks, in ``namespace``; each predicate must pick exactly one cell. ``defs_only``: run only each picked cell's
    imports, functions and classes (not its measurements). Returns the namespace."""
    found = []
    for cell in json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        source, tags = "".join(cell["source"]), cell.get("metadata", {}).get("tags", [])
        for name in (name for name, picks in lesson.items() if picks(source, tags)):
            code = source
            if defs_only:
                kinds = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
                code = ast.Module([node for node in ast.parse(source).body if isinstance(node, kinds)], [])
            exec(compile(code, f"{Path(notebook).name}:{name}", "exec"), namespace)
            found.append(name)
    assert sorted(found) == sorted(lesson), f"{Path(notebook).name} should define each of {sorted(lesson)} once, found {found}"
    return namespace


def checker_rejects(checker: Callable[..., bool], *wrong_answers) -> bool:
    """True when ``checker`` returns False for every one of ``wrong_answers`` (plausible mistakes)."""
    if not callable(checker):
        raise TypeError(f"checker must be the exercise's check function, not {checker!r}.")
    if not wrong_answers:
        raise ValueError("Pass at least one wrong answer the checker must reject.")
    with contextlib.redirect_stdout(io.StringIO()):  # its "✗ ..." verdicts are not the test's output
        return not any([bool(checker(wrong)) for wrong in wrong_answers])
