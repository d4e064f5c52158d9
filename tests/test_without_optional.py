"""The notebooks that use an optional package (bitsandbytes, torchao, peft, notebook 10's optimizers) run top to
bottom on a machine that never installed them: every part that needs one is skipped with a line, and so is every
claim and recorded figure that depends on it.

A real environment without them, not a blocker: ``course_tools.installed`` builds each notebook's fresh environment
from a folder of links to this environment's site-packages; here that folder also leaves out the optional packages'
files and their ``.dist-info`` (``installed.dependency_folder(..., without=...)``), so in the kernel
``import bitsandbytes`` raises ModuleNotFoundError, ``importlib.util.find_spec`` says None and ``importlib.metadata``
does not know it, as where pip never installed it. As in every installed run: the course from its wheel, the network
off (the notebook's first cell finds that out within 1.5 s and installs nothing), profile smoke. Each run keeps what
its cells printed, which the checks read. Two environments: ``none`` (no optional package: every notebook that names
one) and ``no-bnb-torchao`` (peft but neither bitsandbytes nor torchao, as on a GPU machine lent to the course:
notebook 08, the one that uses all three).

Slow (about 05 20 s, 06 60-120 s, 08 75-170 s, 10 35 s, two at a time on two cores, plus the wheel): marked ``bare``,
which the README's test command leaves out; ``make test-bare`` runs them.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
from pathlib import Path

import pytest

from course_tools import installed, notebook_runs
from course_utils import bootstrap

pytestmark = [pytest.mark.bare, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2


def optional_packages(path: Path) -> dict:
    """The optional packages the notebook's setup cell names, with the parts that need them."""
    cells = json.loads(path.read_text())["cells"]
    source = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    match = re.search(r"ensure_packages\(\[[^\]]*\],\s*optional=(\{[^}]*\})\)", source)
    return eval(match[1]) if match else {}  # noqa: S307 - a dict literal of strings


NOTEBOOKS = {p.stem: optional_packages(p) for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
             if optional_packages(p)}
ENVIRONMENTS = {"none": (bootstrap.OPTIONAL_PACKAGES, sorted(NOTEBOOKS)),   # name: (left out, notebooks run there)
                "no-bnb-torchao": (("bitsandbytes", "torchao"), ["08_current_toolbox"])}
RUNS = [(stem, env) for env, (_, stems) in ENVIRONMENTS.items() for stem in stems]

# The figures a notebook records only when an optional package is there; the others must be recorded without any.
NEEDS = {
    "05_8bit_adam": {"bitsandbytes": ["final_loss_rel_diff_8bit", "state_bytes_ratio_8bit"]},
    "08_current_toolbox": {
        "bitsandbytes": ["final_loss_rel_diff_bnb8bit", "nf4_bytes_per_param", "qlora_peak_ratio_vs_full",
                         "cpu_bnb8bit_ns_per_param"],
        "torchao": ["torchao_4bit_state_ratio", "torchao_8bit_state_ratio", "final_loss_rel_diff_torchao8bit",
                    "final_loss_rel_diff_torchao4bit", "cpu_torchao8bit_ns_per_param", "torchao_first_step_s"]},
    "10_beyond_adam": {"bitsandbytes": ["bytes_per_param_adamw8bit"],
                       "torchao": ["bytes_per_param_bf16_sr", "bf16_sr_total_bytes_per_param"],
                       "lion_pytorch": ["bytes_per_param_lion"], "adam_mini": ["bytes_per_param_adam_mini"],
                       "galore_torch": ["bytes_per_param_galore"], "apollo_torch": ["bytes_per_param_apollo"]},
}
KEPT = {
    "05_8bit_adam": ["blockwise_error_ratio", "gpt2_xl_state_saved_gib", "prediction_cells"],
    "06_capstone_gpt2_xl": ["capstone_cpu_step_ns_per_param", "capstone_cpu_step_change_vs_adam"],
    "08_current_toolbox": ["offload_device_activation_ratio", "chunked_ce_peak_ratio", "lora_peak_ratio_vs_full",
                           "cpu_adamw_fused_ns_per_param", "prediction_cells"],
    "10_beyond_adam": ["adafactor_state_fraction_of_adam_v", "quality_loss_adamw", "prediction_cells"],
}


def test_the_notebooks_with_optional_packages_are_the_ones_checked_here():
    assert set(NOTEBOOKS) >= {"05_8bit_adam", "06_capstone_gpt2_xl", "08_current_toolbox", "10_beyond_adam"}
    assert set(NEEDS) | set(KEPT) <= set(NOTEBOOKS)
    assert all(set(packages) <= set(NOTEBOOKS[stem]) for stem, packages in NEEDS.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """Each (notebook, environment) of RUNS started in its fresh environment, WORKERS at a time, the longest first;
    {(stem, environment): future of its result}."""
    if "bare" not in (request.config.option.markexpr or ""):   # the course's pytest plugin deselects them already
        pytest.skip("minutes of notebook runs: `make test-bare` (pytest -m bare) runs them")
    base = tmp_path_factory.mktemp("without-optional")
    for name in ("dist", "src"):
        (base / name).mkdir()
    wheel = installed.build_wheel(base / "dist", base / "src")
    isolation = installed.choose_isolation()
    folders = {}
    for env, (left_out, _) in ENVIRONMENTS.items():
        (base / f"deps-{env}").mkdir()
        (base / f"runs-{env}").mkdir()
        folders[env] = installed.dependency_folder(base / f"deps-{env}", without=left_out)
    threads = max(1, (os.cpu_count() or 1) // WORKERS)
    pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="without-optional")
    futures = {(stem, env): pool.submit(installed.run_one, ROOT / "notebooks" / f"{stem}.ipynb", base / f"runs-{env}",
                                        wheel, folders[env], isolation, threads, profile="smoke", keep_output=True)
               for stem, env in sorted(RUNS, key=lambda run: -notebook_runs.BUDGETS.get(run[0], 0))}
    yield futures
    pool.shutdown(wait=False, cancel_futures=True)
    installed.stop_all()


@pytest.mark.parametrize("stem, env", RUNS, ids=[f"{stem}-{env}" for stem, env in RUNS])
def test_runs_top_to_bottom_without_its_optional_packages(runs, stem, env):
    r = runs[stem, env].result()
    assert r["visible_before_install"].get("torch"), r["visible_before_install"]
    assert r["passed"], f"{stem} failed without {ENVIRONMENTS[env][0]}:\n{r['error']}\n--- runner ---\n" \
                        f"{r.get('runner_log', '')}"
    assert r["report"] and r["report"]["network"] is False, "the network was reachable"
    output, left_out = r["output"], ENVIRONMENTS[env][0]
    for name, parts in NOTEBOOKS[stem].items():   # the first cell's line for each missing one, none for the others
        line = f"[course] {bootstrap.pip_name(name)} is not installed: skipping {parts}"
        assert (line in output) == (name in left_out), f"{stem} ({env}): {line!r} {'not ' * (name in left_out)}said"
    assert "Traceback" not in output and "is installed but does not import here" not in output, output[-3000:]
    results = json.loads((Path(r["home"]) / "when-the-model-does-not-fit" / "results" / f"{stem}.json").read_text())
    skipped = [f for name, figures in NEEDS.get(stem, {}).items() if name in left_out for f in figures]
    recorded = [f for f in skipped if f in results]
    assert not recorded, f"{stem} recorded figures of parts it skipped: {recorded}"
    kept = KEPT.get(stem, []) + [f for name, figures in NEEDS.get(stem, {}).items() if name not in left_out
                                 for f in figures]
    lost = [f for f in kept if f not in results]
    assert not lost, f"{stem} did not record figures that need no missing package: {lost}"
