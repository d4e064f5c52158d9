"""Tests of course_utils.accounting (notebook 01's helpers) and of the functions notebook 01 writes in its cells
(the article's modelsize(), the module-output count, the saved-tensor hook: the notebook's own code is run here).
Small models only: the file runs in seconds."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils import accounting as A
from course_utils import memory
from course_utils.memory import MIB, measure_memory, optimizer_state_bytes, storage_key, tensor_bytes
from stand_ins import stand_in

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01_memory_accounting.ipynb"


def _mlp(width=32, inplace=False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, width), nn.ReLU(inplace=inplace), nn.Linear(width, width),
                         nn.ReLU(inplace=inplace), nn.Linear(width, 4))


# ---------------------------------------------------------------- monitoring

def test_gpu_monitor_never_fails_and_explains_missing_tools(monkeypatch):
    monkeypatch.setattr(A, "shutil", stand_in(shutil, which=lambda name: None))
    reports = A.gpu_monitor()
    tools = ("nvidia-smi", "gpustat", "nvtop")
    assert [r.split("\n")[0] for r in reports] == [f"$ {t}  (not installed here)" for t in tools]
    assert all(r.split("\n")[1].startswith("Would show:") for r in reports)
    assert "caching allocator" in reports[0] and "CUDA context" in reports[0]
    assert "watch --color -n1 gpustat -cpu" in reports[1]


def test_gpu_monitor_reports_a_failing_tool_instead_of_raising(monkeypatch):
    monkeypatch.setattr(A, "shutil", stand_in(shutil, which=lambda name: "/usr/bin/" + name))

    def broken(*args, **kwargs):
        raise OSError("no driver")

    monkeypatch.setattr(A, "subprocess", stand_in(subprocess, run=broken))
    smi, nvtop = A.gpu_monitor(["nvidia-smi", "nvtop"])
    assert smi.startswith("$ nvidia-smi  (found)") and "could not run (OSError: no driver)" in smi
    assert nvtop.startswith("$ nvtop  (found)") and "interactive" in nvtop  # nvtop is never run


def test_gpu_monitor_runs_an_installed_tool(monkeypatch):
    monkeypatch.setattr(A, "shutil", stand_in(shutil, which=lambda name: "/usr/bin/" + name))

    class Done:
        returncode, stdout, stderr = 0, "0, Fake GPU, 10 MiB, 16384 MiB, 0 %\n", ""

    monkeypatch.setattr(A, "subprocess", stand_in(subprocess, run=lambda *a, **k: Done()))
    assert A.gpu_monitor("nvidia-smi") == ["$ nvidia-smi  (found)\n0, Fake GPU, 10 MiB, 16384 MiB, 0 %"]


@pytest.mark.parametrize("bad", [["htop"], [], ["nvidia-smi", "top"]])
def test_gpu_monitor_rejects_unknown_tools(bad):
    with pytest.raises(ValueError, match="choose from"):
        A.gpu_monitor(bad)


# ---------------------------------------------------------------- state and the n rule

@pytest.mark.parametrize("name,opt,n", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1), 2),
    ("sgd_momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 3),
    ("adam", lambda p: torch.optim.Adam(p), 4),
])
def test_measured_state_matches_the_article_rule(name, opt, n):
    model = _mlp()
    optimizer = opt(model.parameters())
    F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
    optimizer.step()
    params = list(model.parameters())
    state = {"params": tensor_bytes(*params), "grads": tensor_bytes(*(p.grad for p in params)),
             "optimizer": optimizer_state_bytes(optimizer)}  # as notebook 01 counts them
    n_params = sum(p.numel() for p in params)
    assert state["params"] == 4 * n_params
    assert state["grads"] == 4 * n_params
    # Adam also keeps one 4-byte step counter per parameter tensor
    extra = 4 * len(list(model.parameters())) if name == "adam" else 0
    assert state["optimizer"] == (n - 2) * 4 * n_params + extra


# ---------------------------------------------------------------- activations

def test_notebook_modelsize_reproduces_the_article():
    modelsize = _notebook_function("modelsize")
    model = _mlp(width=32)
    x = torch.randn(5, 16)
    ms = modelsize(model, x)
    assert ms.params_bytes == 4 * sum(p.numel() for p in model.parameters())
    # Flatten (5x16) + Linear (5x32) + ReLU (5x32) + Linear (5x32) + ReLU (5x32) + Linear (5x4)
    assert ms.outputs_bytes == 4 * 5 * (16 + 32 * 4 + 4)
    assert ms.with_backward_bytes == 2 * ms.outputs_bytes
    assert ms.n_outputs == 6
    inplace = modelsize(_mlp(width=32, inplace=True), x)  # the article skips in-place ReLUs
    assert inplace.outputs_bytes == 4 * 5 * (16 + 32 * 2 + 4) and inplace.n_outputs == 4


def _notebook_function(name: str):
    """The function ``name`` as notebook 01 defines it in a cell (the lesson's own code, not a copy)."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    (source,) = [src for src in sources if f"def {name}(" in src]
    namespace = {"torch": torch, "nn": nn, "pd": pd, "storage_key": storage_key, "memory": memory}
    exec(compile(source, f"{NOTEBOOK.name}:{name}", "exec"), namespace)
    return namespace[name]


def test_notebook_hook_sees_what_autograd_saves_not_module_outputs():
    saved_by_autograd = _notebook_function("saved_by_autograd")
    module_output_bytes = _notebook_function("module_output_bytes")
    model = _mlp(width=32)
    x = torch.randn(5, 16)
    total, frame = module_output_bytes(model, x)
    assert total == _notebook_function("modelsize")(model, x).outputs_bytes and len(frame) == 6
    out, saved = saved_by_autograd(lambda: model(x), model.parameters())
    assert out.shape == (5, 4)
    # each Linear saves its input (x: 5x16, then the two ReLU outputs: 5x32), once each; ReLU saves its output
    assert int(saved.bytes.sum()) == 4 * 5 * (16 + 32 + 32)
    assert list(saved.made_by) == ["(input or mask: no graph)", "Relu", "Relu"]
    # in-place ReLU: the article's count drops, autograd saves the same bytes
    inplace = _mlp(width=32, inplace=True)
    assert int(saved_by_autograd(lambda: inplace(x.clone()), inplace.parameters())[1].bytes.sum()) == int(saved.bytes.sum())
    assert module_output_bytes(inplace, x)[0] < total
    # without leaving the parameters out, the weights (saved by each Linear) appear too
    assert int(saved_by_autograd(lambda: model(x))[1].bytes.sum()) > int(saved.bytes.sum())


def test_functional_ops_are_invisible_to_the_module_count():
    saved_by_autograd = _notebook_function("saved_by_autograd")
    module_output_bytes = _notebook_function("module_output_bytes")

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x + F.relu(self.fc(x))

    model, x = Res(), torch.randn(4, 8)
    total, frame = module_output_bytes(model, x)
    assert total == 4 * 4 * 8 and list(frame.type) == ["Linear"]
    _, saved = saved_by_autograd(lambda: model(x), model.parameters())
    assert "Relu" in set(saved.made_by)  # F.relu's result: no module's output


# ---------------------------------------------------------------- largest batch

def test_largest_batch_that_fits_finds_the_exact_boundary():
    calls = []

    def peak(b):
        calls.append(b)
        return 1000 + 10 * b

    result = A.largest_batch_that_fits(peak, budget_bytes=1000 + 10 * 37)
    assert result.batch == 37 and result.peak_bytes == 1370
    assert result.tried[38] == 1380
    assert len(calls) <= 12
    frame = result.frame()
    assert frame.loc[frame.batch == 37, "fits"].item() and not frame.loc[frame.batch == 38, "fits"].item()


def test_largest_batch_with_measure_memory_and_oom():
    model = nn.Linear(64, 64)

    def peak(b):
        return measure_memory(lambda: model(torch.randn(b, 64)).sum().backward(), model=model)

    result = A.largest_batch_that_fits(peak, budget_bytes=int(0.1 * MIB), start=8)
    assert peak(result.batch).peak_bytes <= 0.1 * MIB < peak(result.batch + 1).peak_bytes

    def oom(b):
        if b > 20:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return b

    assert A.largest_batch_that_fits(oom, budget_bytes=10**9).batch == 20
    assert A.largest_batch_that_fits(lambda b: b, budget_bytes=10**9).batch == A.MAX_BATCH


def test_largest_batch_rejects_bad_input_and_impossible_budgets():
    with pytest.raises(ValueError, match="Even batch 1 does not fit"):
        A.largest_batch_that_fits(lambda b: 10**6, budget_bytes=10)
    with pytest.raises(ValueError, match="budget_bytes"):
        A.largest_batch_that_fits(lambda b: b, budget_bytes=-1)
    with pytest.raises(ValueError, match="start"):
        A.largest_batch_that_fits(lambda b: b, budget_bytes=10, start=0)
    with pytest.raises(TypeError, match="function"):
        A.largest_batch_that_fits(5, budget_bytes=10)
    with pytest.raises(TypeError, match="MemoryReport or a number"):
        A.largest_batch_that_fits(lambda b: "big", budget_bytes=10)


def test_largest_batch_of_a_linear_peak():
    result = A.largest_batch_that_fits(lambda b: 20_000_000 + 15_432 * b, budget_bytes=36 * MIB, start=1024)
    assert result.batch == (36 * MIB - 20_000_000) // 15_432


def test_largest_batch_handles_a_kinked_peak():
    # flat (optimizer-step peak) up to 600, then linear
    def peak(b):
        return max(10_000, 4_000 + 10 * b)

    for budget in (10_000, 10_005, 12_345, 40_000):
        result = A.largest_batch_that_fits(peak, budget_bytes=budget, start=1)
        assert peak(result.batch) <= budget < peak(result.batch + 1)
