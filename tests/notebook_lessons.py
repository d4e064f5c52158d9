"""Run a notebook's lesson cells in a test: the code a learner reads is the code the tests check."""
import json
from pathlib import Path


def exec_lesson_cells(notebook: Path, lesson: dict, namespace: dict) -> dict:
    """Exec, in notebook order, each code cell that one of ``lesson``'s predicates ``(source, tags) -> bool``
    picks, in ``namespace``; each predicate must pick exactly one cell. Returns the namespace."""
    found = []
    for cell in json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        source, tags = "".join(cell["source"]), cell.get("metadata", {}).get("tags", [])
        for name in (name for name, picks in lesson.items() if picks(source, tags)):
            exec(compile(source, f"{Path(notebook).name}:{name}", "exec"), namespace)
            found.append(name)
    assert sorted(found) == sorted(lesson), f"{Path(notebook).name} should define each of {sorted(lesson)} once, found {found}"
    return namespace
