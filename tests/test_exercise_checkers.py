"""Each exercise checker of notebooks 00 and 01, taken from the notebook's cells, accepts the solution and rejects
the plausible wrong answers (the notebooks keep the learner's check; the proof that it can say no lives here). The
other notebooks' checkers are proven in their own test files (test_accumulation, test_checkpointing, test_precision,
test_quantization, test_allocator, test_capstone, test_distributed, test_toolbox, test_weight_streaming)."""
import functools
from pathlib import Path

import course_utils
from course_utils import accounting, checks, planner

from notebook_lessons import checker_rejects, exec_lesson_cells

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def test_00_largest_micro_batch_checker():
    picks = {"exercise": lambda src, tags: "def check_largest_micro_batch(" in src,
             "solution": lambda src, tags: "solution" in tags}
    nb = exec_lesson_cells(NOTEBOOKS / "00_start_here.ipynb", picks, {"planner": planner, "checks": checks},
                           defs_only=True)
    check = nb["check_largest_micro_batch"]
    reference = nb["largest_micro_batch"]("gpt2-medium", "T4", 512)  # the solution's
    assert check(reference)
    assert checker_rejects(check, reference + 1, max(1, reference // 2), 0)


@functools.lru_cache(maxsize=1)
def notebook_01() -> dict:
    """Notebook 01's exercises at its smoke sizes: settings, the training step, each exercise's checker and solution
    (the exercise cells measure what they check against; the solution cells assert that they pass)."""
    path = NOTEBOOKS / "01_memory_accounting.ipynb"
    nb = exec_lesson_cells(path, {"imports": lambda src, tags: src.startswith("import gc"),
                                  "settings": lambda src, tags: "parameters" in tags},
                           {"course_utils": course_utils, "PROFILE": "smoke"})
    nb.update(WIDTH=64, BATCH=128)  # a smaller main MLP: exercise 2's search measures a dozen steps of it
    run = {"step": lambda src, tags: src.startswith("def make_mlp("),
           "exercise 1": lambda src, tags: "def my_peak_prediction(" in src,
           "checker 1": lambda src, tags: "def check_peak(" in src,
           "solution 1": lambda src, tags: "def reference_peak_prediction(" in src,
           "exercise 2": lambda src, tags: "def my_largest_batch(" in src}
    exec_lesson_cells(path, run, nb)
    nb["budget"] = int(nb["EXERCISE_BUDGET_FACTOR"] * nb["peak_at"](nb["BATCH"]).peak_bytes)
    nb["search"] = accounting.largest_batch_that_fits(nb["peak_at"], nb["budget"], start=nb["BATCH"])
    defs = {"module outputs": lambda src, tags: src.startswith("def module_output_bytes("),
            "residual MLP": lambda src, tags: src.startswith("class ResidualMLP("),
            "checker 2": lambda src, tags: "def check_batch(" in src,
            "solution 2": lambda src, tags: "def solution_largest_batch(" in src,
            "checker 3": lambda src, tags: "def check_saved_by_module(" in src,
            "solution 3": lambda src, tags: "def solution_saved_by_module(" in src}
    return exec_lesson_cells(path, defs, nb, defs_only=True)


def test_01_peak_checker_rejects_the_state_alone_and_the_articles_formula():
    nb = notebook_01()
    assert nb["check_peak"](nb["reference_peak_prediction"])
    assert checker_rejects(nb["check_peak"], lambda n, b, w, l: 16 * n,  # the persistent state alone
                           lambda n, b, w, l: 16 * n + 2 * 4 * b * (28 * 28 + 2 * l * w + 10))  # modelsize() x2


def test_01_largest_batch_checker_rejects_off_by_one():
    nb = notebook_01()
    search = nb["search"]
    assert nb["check_batch"](search.batch)
    assert checker_rejects(nb["check_batch"], search.batch + 1, search.batch - 1)


def test_01_saved_by_module_checker_rejects_three_wrong_counts():
    nb = notebook_01()
    solution = nb["solution_saved_by_module"]

    def module_outputs_by_module(model, x):  # what the article counts: every module's output
        return nb["module_output_bytes"](model, x)[1].groupby("module").bytes.sum().to_dict()

    assert nb["check_saved_by_module"](solution)
    assert checker_rejects(nb["check_saved_by_module"], functools.partial(solution, once=False),  # a storage each time
                           functools.partial(solution, skip_params=False), module_outputs_by_module)
