"""Repros of the CUDA bugs the course fixed, end to end as the notebooks meet them; scripts/gpu_check.sh runs them on
a GPU. Each runs on ``cuda`` (marked gpu: skipped with a reason elsewhere) and, as its CPU twin, on ``cpu``:

- a fake-tensor prediction of a checkpointed GPT-2 step, made in a process where CUDA is initialised, is the one a
  process without CUDA makes, and on a GPU it is the allocator's measurement of that step;
- ``measure_memory`` without ``model=`` reads the device fn worked on (the GPU's allocator on a GPU);
- 01b's cap is lifted after its out-of-memory demo: what failed under the cap fits after it;
- Adam's ``step`` counters stay on the CPU for CUDA parameters: the allocator holds only the state on the device;
- cuBLAS's workspace lives in the caching allocator: a matmul on a new stream allocates one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from course_utils import capstone, hardware, memory, models
from course_utils.memory import MIB, measure_memory

ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])
DEVICES = ["cpu", ON_CUDA]
# a small GPT-2, checkpointed, two micro-steps of 4 x 128 tokens: the capstone's step, in seconds
SMALL = dict(n_layer=2, n_embd=128, n_head=2, n_positions=128, vocab_size=1024, bos_token_id=1023, eos_token_id=1023)
STEP = dict(variant="recipe", micro_batch=4, accum_steps=2, seq_len=128, dtype=torch.float16)
ALLOCATOR_BLOCK = 512  # the caching allocator rounds every request up to a multiple of 512 bytes


def _predict() -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capstone.predict_gpu_peak("gpt2", **STEP, **SMALL).peak_bytes


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), ON_CUDA])
def test_fake_prediction_with_cuda_initialised_is_the_cpu_only_one_and_the_measured_one(device, record_property):
    if device == "cuda":
        torch.empty(1, device="cuda")  # CUDA initialised, as in any notebook that used the GPU before predicting
        assert torch.cuda.is_initialized()
    predicted = _predict()
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_gpu_repros as t; "
            "print(json.dumps(t._predict()))")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # a process that cannot see a GPU
    proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert predicted == json.loads(proc.stdout.strip().splitlines()[-1]), "CUDA being initialised changed the prediction"
    if device != "cuda":
        return  # on a CPU the kernels keep other tensors than CUDA's: the prediction is priced as on a GPU
    model = models.build_gpt2("gpt2", dtype=STEP["dtype"], attention="fused", **SMALL).to(device)
    capstone.enable_checkpointing(model)
    model.train()

    def optimizer_step():
        for _ in range(STEP["accum_steps"]):
            ids = torch.randint(0, SMALL["vocab_size"], (STEP["micro_batch"], STEP["seq_len"]), device=device)
            model(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None

    optimizer_step()  # warm-up: kernels, cuBLAS's workspace
    measured = measure_memory(optimizer_step, model=model).peak_bytes
    record_property("small_gpt2_step_predicted_mib", round(predicted / MIB, 2))   # gpu_check's report pairs them
    record_property("small_gpt2_step_measured_mib", round(measured / MIB, 2))
    assert abs(measured - predicted) <= 0.10 * predicted, (
        f"predicted {predicted / MIB:.1f} MiB, the allocator measured {measured / MIB:.1f} MiB for the same step")


@pytest.mark.parametrize("device", DEVICES)
def test_measure_memory_without_a_model_reads_the_device_fn_used(device):
    def fn():
        big = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
        small = torch.ones(3)  # a CPU tensor too, as a loop's counters or a loss moved to the host
        return big.numel() + small.numel()

    report = measure_memory(fn)
    assert torch.device(report.device).type == device
    assert 64 * MIB <= report.peak_bytes < 64 * MIB + 2 * MIB, report
    assert (report.allocator_readings is not None) == (device == "cuda"), "on a GPU the allocator is read"


@pytest.mark.parametrize("device", DEVICES)
def test_the_cap_is_lifted_after_the_out_of_memory_demo(device):
    budget_gib = 1.0
    too_big = int((budget_gib + 0.5) * hardware.GIB)
    with hardware.gpu_memory_cap(budget_gib) as message:
        if device == "cpu":
            assert "does nothing" in message
        else:
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(too_big, dtype=torch.uint8, device=device)
    after = torch.empty(too_big, dtype=torch.uint8, device=device)  # the cap is gone: the same request fits
    assert after.numel() == too_big
    del after
    if device == "cuda":
        torch.cuda.empty_cache()


@pytest.mark.parametrize("device", DEVICES)
def test_adams_step_counters_are_not_on_the_gpu(device):
    model = models.mlp(n_layers=2, width=256, in_features=64, n_classes=10).to(device)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64, device=device)).square().mean().backward()
    params_and_grads = memory.tensor_bytes(*model.parameters(), *(p.grad for p in model.parameters()))
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    opt.step()  # creates Adam's state: exp_avg and exp_avg_sq beside each parameter, a `step` counter each
    steps = [s["step"] for s in opt.state.values()]
    assert all(t.device.type == "cpu" for t in steps), "Adam (not fused, not capturable) counts steps on the CPU"
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    on_device = memory.tensor_bytes(*moments) + (memory.tensor_bytes(*steps) if device == "cpu" else 0)
    assert memory.state_bytes(model, opt) == params_and_grads + on_device
    if device == "cuda":
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        assert grown == sum(_rounded(t.untyped_storage().nbytes()) for t in moments), (
            f"the allocator grew by {grown} bytes for {len(moments)} moment tensors")


@pytest.mark.parametrize("device", DEVICES)
def test_a_matmul_on_a_new_stream_allocates_cublas_workspace_in_the_allocator(device):
    x = torch.randn(64, 64, device=device)
    if device == "cpu":
        report = measure_memory(lambda: x @ x)
        assert report.peak_bytes == x.untyped_storage().nbytes()  # the product alone: no workspace on a CPU
        return
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        before = torch.cuda.memory_allocated()
        product = x @ x  # cuBLAS's first call on this stream: a workspace for (handle, stream)
        side.synchronize()
        grown = torch.cuda.memory_allocated() - before
    workspace = grown - _rounded(product.untyped_storage().nbytes())
    assert workspace == hardware.cublas_workspace_bytes(handles=1), (
        f"a new stream's first matmul allocated {workspace} bytes beyond its product; "
        f"hardware.cublas_workspace_bytes(handles=1) says {hardware.cublas_workspace_bytes(handles=1)}")
