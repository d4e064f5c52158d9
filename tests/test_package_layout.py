"""The helper package stays small and its layout shows its architecture.

`course_utils` is what notebooks import (measurement, estimation, the planner, hardware, data, models, plots, claim
checks, results); `course_tools` is the maintainers' tooling, which no notebook imports. Each module stays short
enough to read: a module that outgrows the limit mixes concerns and should be split.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE_LINE_LIMIT = 600
# "a small shared helper package": what is not the lesson, readable in an afternoon. 4,500 held notebooks 00-09;
# the memory doctor (01c) and the optimizers below Adam (10) bring two new concepts to measure and plan; today's open
# LLMs priced from their configs, LoRA/QLoRA, and a plan's exports to the libraries that run it, two more; the
# planner held to published measurements (their pricing, a plan's range and counters, the largest that fits, the
# settings practitioners use: no master copy, 16-bit adapters, paged optimizers, the attention a card without flash
# runs), one more; a notebook's optional packages (installed where pip can, else each part that needs one skipped
# with a line; bitsandbytes' dynamic map for 05 without it), one more; exact bytes under CUDA's 512-byte blocks, the
# host's free RAM and a training step's kernels loaded before the CUDA context is measured, one more; a whole run
# priced phase by phase (11) and an RL step priced (12), about 200 lines each; a checkpoint saved on ranks, sharded or
# gathered, priced for a module (11), and the launch of a worker on ranks that 07 and 11 share, about 60.
PACKAGE_LINE_LIMIT = 7_160
MODULES = sorted((ROOT / "course_utils").rglob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_the_limit(path):
    assert _lines(path) <= MODULE_LINE_LIMIT, (
        f"{path.relative_to(ROOT)} has {_lines(path)} lines (limit {MODULE_LINE_LIMIT}): split it by concern")


def test_the_package_stays_small():
    total = sum(_lines(p) for p in MODULES)
    assert total <= PACKAGE_LINE_LIMIT, (
        f"course_utils has {total} lines (limit {PACKAGE_LINE_LIMIT}): a mechanism a notebook teaches belongs in its "
        "cells, code used by one notebook next to it, maintainers' tooling in course_tools")


def test_the_line_counter_sees_an_oversized_module(tmp_path):
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (MODULE_LINE_LIMIT + 1))
    assert _lines(big) > MODULE_LINE_LIMIT


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_import_course_utils_not_course_tools(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert not re.search(r"^\s*(from|import)\s+course_tools\b", code, re.M), (
        f"{path.name} imports course_tools: the maintainers' tooling is not part of a lesson; move what the "
        "notebook needs into course_utils")
    assert re.search(r"^\s*(from|import)\s+course_utils\b", code, re.M), f"{path.name} does not import course_utils"


def test_course_utils_does_not_import_course_tools():
    offenders = [str(p.relative_to(ROOT)) for p in MODULES
                 if re.search(r"^\s*(from|import)\s+course_tools\b", p.read_text(encoding="utf-8"), re.M)]
    assert not offenders, f"course_utils must not depend on the maintainers' tooling: {offenders}"
