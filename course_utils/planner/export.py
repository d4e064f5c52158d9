"""From a plan to what runs it: Hugging Face ``TrainingArguments`` (+ ``peft``), an ``accelerate`` FSDP2 config, a
DeepSpeed config and a plain PyTorch loop, each holding the plan's knobs (micro-batch, accumulation, checkpointing,
precision, optimizer, offload, LoRA).

A setting an export cannot express raises ValueError naming the notebook whose loop runs it (the course's choice: no
silent "closest option"); the one mapping to a near option is a CPU master, which DeepSpeed (ZeRO-Offload) and FSDP2
(``fsdp_offload_params``, which also keeps the weights on the host) run, said in the export's ``notes``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .model import Plan

from .adapters import targeted

# where the course's own loop runs what a library's config cannot say
NOTEBOOK = {"master_on_cpu": "06_capstone_gpt2_xl", "stream_grads": "06_capstone_gpt2_xl",
            "stream_weights": "09_smaller_than_the_model", "offload_activations": "08_current_toolbox",
            "chunked_loss": "08_current_toolbox", "fused_update": "08_current_toolbox"}
LAYER_CLASS = {"gpt2": "GPT2Block", "bert": "BertLayer", "llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer",
               "mistral": "MistralDecoderLayer", "gemma2": "Gemma2DecoderLayer", "gemma": "GemmaDecoderLayer",
               "phi3": "Phi3DecoderLayer"}
TRAINER_OPTIM = {"adam": "adamw_torch", "adamw": "adamw_torch", "adam8bit": "adamw_bnb_8bit", "sgd": "sgd",
                 "sgd_momentum": "sgd", "adafactor": "adafactor", "lion": "lion_32bit", "galore": "galore_adamw",
                 "apollo": "apollo_adamw"}
AMP = {"bf16_amp": "bf16", "fp16_amp": "fp16"}


@dataclass
class TrainerExport:
    """``to_trainer``'s answer: real objects (TrainingArguments, peft's LoraConfig, transformers' BitsAndBytesConfig
    for QLoRA), the dtype to load the weights in, and the script a learner copies."""

    args: object
    lora: object = None
    quantization: object = None
    dtype: str = "float32"
    script: str = ""
    notes: list = field(default_factory=list)


def model_type(spec) -> str:
    """The transformers ``model_type`` of a plan's model ('gpt2', 'llama', ...), from its name."""
    name = re.sub(r"[^a-z0-9]", "", spec.name.lower())
    found = [k for k in LAYER_CLASS if k in name]
    if not found:
        raise ValueError(f"{spec.name} is no transformers model the exports know ({sorted(LAYER_CLASS)}): name it "
                         "after its family (hf_spec(config, name='llama ...')) or plan a GPT-2.")
    return max(found, key=len)  # 'gemma2' before 'gemma'


def lora_config(plan: Plan) -> dict:
    """peft's LoraConfig for the adapters the plan priced: rank, the block's linear layers it targets (all of them
    unless the plan names some), alpha = 2 x rank, no dropout (dropout keeps one more copy of each adapted input)."""
    names = [name for name, _, _ in targeted(plan.model, plan.settings.lora_targets)]
    return dict(r=plan.settings.lora_rank, lora_alpha=2 * plan.settings.lora_rank, lora_dropout=0.0,
                target_modules=names, fan_in_fan_out=model_type(plan.model) == "gpt2")


def _refuse(plan: Plan, kind: str, allowed=()) -> None:
    on = [k for k in NOTEBOOK if getattr(plan.settings, k) and k not in allowed]
    if on:
        where = ", ".join(sorted({NOTEBOOK[k] for k in on}))
        raise ValueError(f"{kind} cannot express {', '.join(on)}: notebook {where} runs it in the course's own loop "
                         f"(start from to_script's loop and add it there), or plan without it.")


def to_trainer(plan: Plan, model_name_or_path: str, output_dir: str, **overrides) -> TrainerExport:
    """``transformers.TrainingArguments`` (+ peft's ``LoraConfig``, + ``BitsAndBytesConfig`` for QLoRA) that run the
    plan's step; ``overrides`` go to TrainingArguments (``max_steps=2``, ...).

    Trainer's step is the plan's: its loss returns without the logits (plan with ``keep_outputs=False``; with True the
    plan is an upper bound), gradient clipping's norms are scalars, LoRA adapters train in fp32 without dropout. Raises
    ValueError for what Trainer cannot run (a CPU master, streamed weights or gradients, offloaded activations, the
    chunked loss, the fused update, sqrt(n) segments, pure 16-bit weights with an fp32 master), naming the notebook."""
    from transformers import TrainingArguments

    s = plan.settings
    _refuse(plan, "Trainer")
    if s.checkpointing == "sqrt" or (s.precision in ("fp16", "bf16") and not s.lora_rank):
        raise ValueError("Trainer checkpoints every block (not sqrt(n) segments: notebook 03_gradient_checkpointing) "
                         "and keeps no fp32 master for 16-bit weights (notebook 06_capstone_gpt2_xl): plan with "
                         "checkpointing 'none' or 'block' and precision 'fp32', 'bf16_amp' or 'fp16_amp' (pure 16-bit "
                         "weights with LoRA only).")
    if s.optimizer not in TRAINER_OPTIM:
        raise ValueError(f"Trainer has no optimizer {s.optimizer!r} (notebook 10_beyond_adam builds it): choose one of "
                         f"{sorted(TRAINER_OPTIM)}.")
    ckpt = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else \
        "gradient_checkpointing"  # transformers 5's name, 4's
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=s.micro_batch,
                  gradient_accumulation_steps=s.accumulation, optim=TRAINER_OPTIM[s.optimizer], report_to="none",
                  save_strategy="no", use_cpu=s.device == "cpu", **{AMP[s.precision]: True} if s.precision in AMP else {})
    if s.checkpointing == "block":
        kwargs.update({ckpt: True, ckpt + "_kwargs": {"use_reentrant": False}})
    if s.optimizer == "sgd_momentum":
        kwargs["optim_args"] = "momentum=0.9"
    kwargs.update(overrides)
    out = TrainerExport(args=TrainingArguments(**kwargs),
                        dtype={"fp16": "float16", "bf16": "bfloat16"}.get(s.precision, "float32"))
    if s.lora_rank:
        from peft import LoraConfig

        out.lora = LoraConfig(**lora_config(plan), task_type="CAUSAL_LM")
    if s.quantize_base:
        from transformers import BitsAndBytesConfig

        out.quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=out.dtype,
                                              bnb_4bit_use_double_quant=s.quantize_base == "nf4_double")
    if s.keep_outputs:
        out.notes.append("Trainer frees the logits before backward: the plan (keep_outputs=True) is an upper bound.")
    head = (f'"""Train {model_name_or_path} as the course\'s planner planned it: {plan.model.name}, {s.micro_batch} x '
            f'{s.size} tokens x {s.accumulation} micro-batches, {", ".join(s.techniques()) or "fp32"}."""')
    load = f"model = AutoModelForCausalLM.from_pretrained({model_name_or_path!r}, dtype=torch.{out.dtype}"
    lines = [head, "import torch", "from peft import LoraConfig, get_peft_model",
             "from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments", "",
             load + (f", quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                     f"bnb_4bit_compute_dtype=torch.{out.dtype}, bnb_4bit_use_double_quant="
                     f"{s.quantize_base == 'nf4_double'})" if s.quantize_base else "") + ")",
             "model.config.use_cache = False"]
    if s.lora_rank:
        lines.append(f"model = get_peft_model(model, LoraConfig(**{lora_config(plan)!r}, task_type='CAUSAL_LM'))")
    lines += [f"args = TrainingArguments(**{kwargs!r})",
              "# your tokenized data: rows of input_ids and labels; random tokens stand in for them here",
              f"train_dataset = [dict(input_ids=ids, labels=ids) for ids in torch.randint(0, model.config.vocab_size, "
              f"(64, {s.size}))]", "Trainer(model=model, args=args, train_dataset=train_dataset).train()", ""]
    out.script = "\n".join(lines)
    return out


def to_accelerate_fsdp(plan: Plan, num_processes: int = 2) -> dict:
    """The config ``accelerate launch --config_file`` reads (``yaml.safe_dump`` it) for FSDP2: every transformer block
    its own shard group, activation checkpointing, mixed precision and, for a CPU master, ``fsdp_offload_params`` (FSDP2's
    CPUOffloadPolicy: the sharded weights, gradients and optimizer step live on the host; the weights come to the device
    for each block's all-gather, so it also streams them)."""
    s = plan.settings
    _refuse(plan, "FSDP", allowed=("master_on_cpu", "stream_grads", "stream_weights"))
    if s.precision in ("fp16", "bf16") or s.optimizer == "adam8bit":
        raise ValueError("FSDP2 keeps fp32 sharded weights and casts them per block (mixed precision): plan with "
                         f"precision='{s.precision.split('_')[0]}_amp' and optimizer='adamw' (8-bit Adam: notebook "
                         "05_8bit_adam's loop).")
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "machine_rank": 0, "num_machines": 1,
            "num_processes": num_processes, "mixed_precision": AMP.get(s.precision, "no"), "use_cpu": s.device == "cpu",
            "main_training_function": "main", "rdzv_backend": "static", "same_network": True,
            "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "fsdp_transformer_layer_cls_to_wrap": LAYER_CLASS[model_type(plan.model)],
                            "fsdp_offload_params": s.master_on_cpu, "fsdp_reshard_after_forward": True,
                            "fsdp_activation_checkpointing": s.checkpointing != "none",
                            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
                            "fsdp_sync_module_states": True}}


def fsdp_rank_bytes(plan: Plan, world_size: int = 2) -> int:
    """The plan's tensor peak on one of ``world_size`` FSDP2 ranks (each with the plan's micro-batch): its parameters,
    gradients and optimizer state sharded, plus what FSDP gathers whole, the root's parameters (embeddings, head) and
    one block's, and that block's whole gradient before its reduce-scatter."""
    by, m = plan.by_category, plan.model
    w = 2 if plan.settings.precision in ("fp16", "bf16") else 4
    sharded = (by["params"] + by["grads"] + by["optimizer"]) * (1 - 1 / world_size)
    return round(plan.tensor_peak_bytes - sharded + w * (m.head_params + 2 * max(m.block_params)))


def to_deepspeed(plan: Plan, stage: int | None = None) -> dict:
    """A DeepSpeed config (``deepspeed.initialize(config=...)`` or ``TrainingArguments(deepspeed=...)``): ZeRO
    ``stage`` (default: 3 when the plan streams weights, 2 with a CPU master, else 0), ``offload_optimizer`` to the CPU
    for a CPU master (ZeRO-Offload: DeepSpeed's CPU Adam steps the fp32 master there), ``offload_param`` for streamed
    weights, bf16/fp16, the micro-batch and the accumulation; checkpointing is the model's (``cpu_checkpointing`` sends
    the kept block inputs to the host for offloaded activations). 8-bit Adam and notebook 10's optimizers have no
    section: pass the optimizer object to ``deepspeed.initialize``."""
    s = plan.settings
    _refuse(plan, "DeepSpeed", allowed=("master_on_cpu", "stream_grads", "stream_weights", "offload_activations"))
    if s.offload_activations and s.checkpointing == "none":
        raise ValueError("DeepSpeed offloads checkpointed activations only: plan with checkpointing='block', or "
                         "without offload_activations (notebook 08_current_toolbox offloads every saved tensor).")
    stage = stage if stage is not None else 3 if s.stream_weights else 2 if s.master_on_cpu else 0
    if s.master_on_cpu and stage < 2:
        raise ValueError(f"ZeRO-Offload needs stage 2 or 3, not {stage}.")
    half, cpu = s.precision.split("_")[0], {"device": "cpu", "pin_memory": True}
    zero = {"stage": stage, **({"offload_optimizer": cpu} if s.master_on_cpu else {}),
            **({"offload_param": cpu} if s.stream_weights else {}),
            **(dict(overlap_comm=True, contiguous_gradients=True) if stage else {})}
    pure = s.precision in ("fp16", "bf16")  # DeepSpeed's bf16/fp16 modes: 16-bit weights, an fp32 master
    config = {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": s.accumulation,
              "gradient_clipping": 1.0, "zero_optimization": zero, "bf16": {"enabled": pure and half == "bf16"},
              "fp16": {"enabled": pure and half == "fp16", "loss_scale": 0, "initial_scale_power": 16},
              "steps_per_print": 100, "wall_clock_breakdown": False}
    if s.precision in AMP:
        config["torch_autocast"] = {"enabled": True, "dtype": {"bf16": "bfloat16", "fp16": "float16"}[half]}
    if s.optimizer in ("adam", "adamw", "lion"):
        config["optimizer"] = {"type": "Lion" if s.optimizer == "lion" else "AdamW", "params": {"lr": 1e-4}}
    if s.checkpointing != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": s.offload_activations,
                                              "contiguous_memory_optimization": False}
    return json.loads(json.dumps(config))


SCRIPT = '''"""{title}

Run: python {{this file}}. It trains on random tokens for STEPS optimizer steps and measures the last one with
course_utils.memory.measure_memory; the plan predicted {planned} bytes of tensors for it.
"""
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from course_utils.capstone import enable_checkpointing
from course_utils.memory import format_bytes, measure_memory
{imports}
DEVICE, STEPS = {device!r}, {steps}
MICRO_BATCH, SEQ_LEN, ACCUMULATION = {micro_batch}, {size}, {accumulation}
torch.manual_seed(0)
{load}
model.config.use_cache = False
{model_lines}
model.to(DEVICE).train()
params = [p for p in model.parameters() if p.requires_grad]
{optimizer_lines}


def step(batches):
    """Every micro-batch's forward and backward, then the optimizer's step: the step the plan prices."""
    for ids in batches:
        with torch.autocast(DEVICE, dtype=torch.{amp_dtype}, enabled={amp}):
            {forward}
        (loss / ACCUMULATION).backward()
    optimizer_step()


for i in range(STEPS):
    batches = [torch.randint(0, model.config.vocab_size, (MICRO_BATCH, SEQ_LEN), device=DEVICE)
               for _ in range(ACCUMULATION)]
    if i < STEPS - 1:
        step(batches)  # the first step makes the optimizer's state
    else:
        report = measure_memory(lambda: step(batches), model=measured, optimizer=optimizer)
print(f"measured peak: {{report.peak_bytes}} bytes ({{format_bytes(report.peak_bytes)}}); planned: {planned} bytes")
'''
SCRIPT_OPTIM = {"adam": "torch.optim.AdamW({}, lr=1e-4)", "adamw": "torch.optim.AdamW({}, lr=1e-4)",
                "adam8bit": "bnb.optim.Adam8bit({}, lr=1e-4)", "sgd": "torch.optim.SGD({}, lr=1e-2)",
                "sgd_momentum": "torch.optim.SGD({}, lr=1e-2, momentum=0.9)"}


def to_script(plan: Plan, model_name_or_path: str | None = None, *, config: dict | None = None, steps: int = 2) -> str:
    """The text of a .py file: a plain PyTorch loop that runs the plan's step (the model from ``model_name_or_path``,
    or random weights from a transformers ``config`` dict; the course's checkpointing, ``torch.autocast``, an fp32
    master copy stepped tensor by tensor for pure 16-bit weights, bitsandbytes' Adam8bit, peft's LoRA) and prints the
    peak ``measure_memory`` measured for its last step. Notebooks 06, 08 and 09 run the host-side settings."""
    s = plan.settings
    _refuse(plan, "to_script's loop")
    if s.checkpointing == "sqrt" or s.optimizer not in SCRIPT_OPTIM or s.quantize_base:
        raise ValueError("to_script's loop runs checkpointing 'none' or 'block', optimizers "
                         f"{sorted(SCRIPT_OPTIM)} and LoRA without 4-bit weights; notebooks 03_gradient_checkpointing "
                         "(sqrt(n) segments), 10_beyond_adam (other optimizers) and to_trainer (QLoRA) run the rest.")
    if (model_name_or_path is None) == (config is None):
        raise ValueError("Give the model: a name or path for from_pretrained, or config=<a transformers config dict>.")
    half = s.precision in ("fp16", "bf16")
    dtype = "float16" if s.precision == "fp16" and s.device == "cuda" else "bfloat16" if half else "float32"
    attn = {"math": "eager", "fused": "sdpa"}[s.attention]
    load = (f"model = AutoModelForCausalLM.from_pretrained({model_name_or_path!r}, dtype=torch.{dtype}, "
            f"attn_implementation={attn!r})" if model_name_or_path else
            f"CONFIG = {dict(getattr(config, 'to_diff_dict', lambda: config)())!r}\nmodel = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), "
            f"dtype=torch.{dtype}, attn_implementation={attn!r})")
    model_lines = ["enable_checkpointing(model)  # every block, non-reentrant"] if s.checkpointing == "block" else []
    imports = ["import bitsandbytes as bnb"] if s.optimizer == "adam8bit" else []
    if s.lora_rank:
        imports.append("from peft import LoraConfig, get_peft_model")
        model_lines.append(f"model = get_peft_model(model, LoraConfig(**{lora_config(plan)!r}))  # fp32 adapters")
    master = half and not s.lora_rank
    opt = SCRIPT_OPTIM[s.optimizer].format("masters" if master else "params")
    if master:
        optimizer_lines = f"""masters = nn.ParameterList(p.detach().float() for p in params)  # the fp32 master copy
optimizer = {opt}
measured = nn.ModuleDict(dict(model=model, masters=masters))


def optimizer_step():  # tensor by tensor: one fp32 gradient at a time
    for p, m in zip(params, masters):
        m.grad, p.grad = p.grad.float(), None
        optimizer.step()
        m.grad = None
        p.detach().copy_(m.detach())"""
    else:
        optimizer_lines = f"""optimizer = {opt}
measured = model


def optimizer_step():
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)"""
    forward = ("outputs = model(input_ids=ids, labels=ids)  # the loop keeps the outputs (logits) until backward\n"
               "            loss = outputs.loss") if s.keep_outputs else "loss = model(input_ids=ids, labels=ids).loss"
    amp = s.precision in AMP
    amp_dtype = "float16" if s.precision == "fp16_amp" and s.device == "cuda" else "bfloat16"
    title = (f"{plan.model.name}: {s.micro_batch} x {s.size} tokens x {s.accumulation} micro-batches, "
             f"{', '.join(s.techniques()) or 'fp32, Adam'} (exported by course_utils.planner.to_script)")
    return SCRIPT.format(title=title, planned=plan.tensor_peak_bytes, imports="\n".join(imports), device=s.device,
                         steps=steps, micro_batch=s.micro_batch, size=s.size, accumulation=s.accumulation, load=load,
                         model_lines="\n".join(model_lines), optimizer_lines=optimizer_lines, forward=forward,
                         amp=amp, amp_dtype=amp_dtype)
