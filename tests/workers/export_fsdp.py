"""One rank of tests/test_planner_export.py's FSDP2 runs: the accelerate config ``planner.to_accelerate_fsdp``
exported, applied with ``torch.distributed.fsdp.fully_shard`` as accelerate applies it on GPUs (accelerate's FSDP needs
accelerators: on a CPU, ``accelerate launch`` runs plain multi-CPU data parallelism and leaves ``fsdp_config`` unused).
Optimizer steps of a tiny model: the first makes the optimizer's state, the next ``MEASURED_STEPS`` are each measured
whole with ``measure_memory``'s tracker, and the smallest of their peaks is reported (all of them are written too).
Why more than one: gloo runs each collective on a worker thread, and that thread keeps the collective's tensors until
it lets go of the finished work, a moment after the caller's ``wait`` returns. On a loaded machine the thread can be
kept off a core long enough for that moment to overlap the step's peak: a CI run once measured the peak 524,544 bytes
higher on one rank, exactly the Llama twin's root group (embeddings, head and final norm) once more. The algorithm's
own peak is the one no such delay inflates, the smallest.

Usage (under course_tools.launcher, 2 ranks): export_fsdp.py RUN_DIR...; each RUN_DIR holds config.yaml and
inputs.json (the model's transformers config, micro_batch, size, accumulation); each rank writes RUN_DIR/rank<r>.json.
"""
import json
import sys

import torch
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from course_utils import capstone, memory

MEASURED_STEPS = 3


def run(run_dir, rank, world):
    with open(f"{run_dir}/config.yaml") as f:
        config = yaml.safe_load(f)
    with open(f"{run_dir}/inputs.json") as f:
        inputs = json.load(f)
    fsdp = config["fsdp_config"]
    assert world == config["num_processes"] and fsdp["fsdp_version"] == 2, (world, config)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**inputs["config"]), attn_implementation="eager")
    if fsdp["fsdp_activation_checkpointing"]:
        capstone.enable_checkpointing(model)
    shard = dict(mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=fsdp["fsdp_reshard_after_forward"])
    if fsdp["fsdp_offload_params"]:
        shard["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if config["mixed_precision"] != "no":
        shard["mp_policy"] = MixedPrecisionPolicy(param_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[
            config["mixed_precision"]], reduce_dtype=torch.float32)
    for module in list(model.modules()):  # TRANSFORMER_BASED_WRAP: each block its own group, then the root
        if type(module).__name__ == fsdp["fsdp_transformer_layer_cls_to_wrap"]:
            fully_shard(module, **shard)
    fully_shard(model, **shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1 + rank)  # each rank its own data
    batches = [torch.randint(0, model.config.vocab_size, (inputs["micro_batch"], inputs["size"]))
               for _ in range(inputs["accumulation"])]
    losses = []

    def step():  # the Trainer's loop: the loss alone outlives forward
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(batches)).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step makes the optimizer's state
    peaks = []
    for _ in range(MEASURED_STEPS):
        # measure_memory's own tracker: measure_memory sums the model's state with tensor_bytes, which does not open a
        # sharded parameter (a DTensor) yet
        tracker = memory._MultiStepMemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            step()
        peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    local = [p.to_local() for p in model.parameters()]
    with open(f"{run_dir}/rank{rank}.json", "w") as f:
        json.dump({"peak_bytes": min(peaks), "step_peaks": peaks, "losses": losses,
                   "param_bytes": sum(t.numel() * t.element_size() for t in local)}, f)


dist.init_process_group("gloo")
for path in sys.argv[1:]:
    run(path, dist.get_rank(), dist.get_world_size())
dist.destroy_process_group()
