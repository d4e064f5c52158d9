"""One rank of tests/test_planner_export.py's DeepSpeed runs (where DeepSpeed installs): the config
``planner.to_deepspeed`` exported, given to ``deepspeed.initialize`` on the CPU (gloo), two optimizer steps of a tiny
model (``gradient_accumulation_steps`` micro-batches each, as the engine counts them), the second measured with
``measure_memory``.

Usage (under course_tools.launcher): export_deepspeed.py RUN_DIR...; each RUN_DIR holds ds_config.json and inputs.json
(the model's transformers config, size, checkpointing); each rank writes RUN_DIR/rank<r>.json.
"""
import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from course_utils import capstone, memory


def run(run_dir, rank):
    with open(f"{run_dir}/ds_config.json") as f:
        config = json.load(f)
    with open(f"{run_dir}/inputs.json") as f:
        inputs = json.load(f)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**inputs["config"]), attn_implementation="eager")
    if inputs["checkpointing"]:  # the config's activation_checkpointing section configures DeepSpeed's own API
        capstone.enable_checkpointing(model)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(1 + rank)
    batches = [torch.randint(0, model.config.vocab_size, (config["train_micro_batch_size_per_gpu"], inputs["size"]))
               for _ in range(config["gradient_accumulation_steps"])]

    def step():  # the engine divides the loss by the accumulation and steps at the last micro-batch
        for ids in batches:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

    step()  # the first step makes the optimizer's state
    report = memory.measure_memory(step, model=model, optimizer=optimizer)
    with open(f"{run_dir}/rank{rank}.json", "w") as f:
        json.dump({"peak_bytes": report.peak_bytes, "by_category": report.by_category}, f)


dist.init_process_group("gloo")  # DeepSpeed keeps the group it finds
for path in sys.argv[1:]:
    run(path, dist.get_rank())
dist.destroy_process_group()
