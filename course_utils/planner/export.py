"""From a plan to what runs it: ``TrainingArguments`` (+ peft's ``LoraConfig``, + QLoRA's ``BitsAndBytesConfig``), an
``accelerate`` FSDP2 config, a DeepSpeed config and a plain PyTorch loop. A setting an export cannot express raises
ValueError naming the notebook whose loop runs it (the course's choice: no silent "closest option"); a CPU master maps
to the libraries' own offload (DeepSpeed's ZeRO-Offload, FSDP2's ``fsdp_offload_params``), as their docstrings say."""
from __future__ import annotations

from dataclasses import dataclass, field

from .adapters import targeted
from .plan import Plan

# where the course's own loop runs what a library's config cannot say
NOTEBOOK = {"master_on_cpu": "06_capstone_gpt2_xl", "stream_grads": "06_capstone_gpt2_xl",
            "stream_weights": "09_smaller_than_the_model", "offload_activations": "08_current_toolbox",
            "chunked_loss": "08_current_toolbox", "fused_update": "08_current_toolbox"}
LAYER_CLASS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "mistral":
               "MistralDecoderLayer", "gemma2": "Gemma2DecoderLayer", "phi3": "Phi3DecoderLayer", "bert": "BertLayer"}
TRAINER_OPTIM = {"adam": "adamw_torch", "adamw": "adamw_torch", "adamw_fused": "adamw_torch_fused",
                 "adam8bit": "adamw_bnb_8bit", "sgd": "sgd",
                 "sgd_momentum": "sgd", "adafactor": "adafactor", "lion": "lion_32bit"}
AMP = {"bf16_amp": "bf16", "fp16_amp": "fp16"}


@dataclass
class TrainerExport:
    """``to_trainer``'s answer: TrainingArguments, LoraConfig, BitsAndBytesConfig, the weights' dtype, the script."""

    args: object
    lora: object = None
    quantization: object = None
    dtype: str = "float32"
    script: str = ""
    peft_kwargs: dict = field(default_factory=dict)  # for get_peft_model: 16-bit adapters stay in the weights' dtype


def model_type(spec) -> str:
    """The transformers ``model_type`` of a plan's model ('gpt2', 'llama', ...), from its name."""
    found = next((k for k in LAYER_CLASS if k in "".join(c for c in spec.name.lower() if c.isalnum())), None)
    if found is None:
        raise ValueError(f"{spec.name} is no transformers model the exports know ({sorted(LAYER_CLASS)}): name it "
                         "after its family (hf_spec(config, name='llama ...')) or plan a GPT-2.")
    return found


def lora_config(plan: Plan) -> dict:
    """peft's LoraConfig for the adapters the plan priced: its rank and target layers (all the block's linear layers
    unless it names some), alpha = 2 x rank, its dropout (dropout keeps one more copy of each adapted input)."""
    names = [name for name, _, _ in targeted(plan.model, plan.settings.lora_targets)]
    return dict(r=plan.settings.lora_rank, lora_alpha=2 * plan.settings.lora_rank,
                lora_dropout=plan.settings.lora_dropout, target_modules=names,
                fan_in_fan_out=model_type(plan.model) == "gpt2")


# the settings practitioners use that only some exports express: each one's knob value that needs saying
UNUSUAL = {"paged_optimizer": True, "master_weights": False, "set_to_none": False, "adapter_dtype": "bf16"}


def _refuse(plan: Plan, kind: str, allowed=()) -> None:
    on = [k for k in NOTEBOOK if getattr(plan.settings, k) and k not in allowed]
    if on:
        where = ", ".join(sorted({NOTEBOOK[k] for k in on}))
        raise ValueError(f"{kind} cannot express {', '.join(on)}: notebook {where} runs it in the course's own loop "
                         "(start from to_script's loop), or plan without it.")
    unusual = [f"{k}={getattr(plan.settings, k)!r}" for k, v in UNUSUAL.items() if k not in allowed and (
        getattr(plan.settings, k) == v if k != "adapter_dtype" else getattr(plan.settings, k) != "fp32")
        and not (k == "master_weights" and plan.settings.precision not in ("fp16", "bf16"))]
    if unusual:
        raise ValueError(f"{kind}'s export does not express {', '.join(unusual)}: export the plan with to_trainer "
                         "(which runs pure 16-bit weights without a master, bitsandbytes' paged optimizers and 16-bit "
                         "adapters), or plan without it.")


def to_trainer(plan: Plan, model_name_or_path: str, output_dir: str, **overrides) -> TrainerExport:
    """TrainingArguments (+ LoraConfig, + BitsAndBytesConfig for QLoRA) that run the plan's step, and a script;
    ``overrides`` go to TrainingArguments. Trainer's step is the plan's with ``keep_outputs=False`` (its loss comes
    without the logits; with True the plan is an upper bound), clipping's norms are scalars, LoRA adapters are fp32 and
    dropout-free. What Trainer cannot run (host-side settings, sqrt(n), an fp32 master) raises, naming the notebook."""
    from transformers import TrainingArguments

    s = plan.settings
    _refuse(plan, "Trainer", allowed=("paged_optimizer", "master_weights", "adapter_dtype"))
    if s.checkpointing == "sqrt" or (s.precision in ("fp16", "bf16") and not s.lora_rank and s.master_weights):
        raise ValueError("Trainer checkpoints every block, not sqrt(n) segments (03_gradient_checkpointing), and "
                         "keeps no fp32 master for 16-bit weights (06_capstone_gpt2_xl): plan with checkpointing "
                         "'block' and precision 'bf16_amp' or 'fp16_amp', or pure 16-bit weights with "
                         "master_weights=False (the state in 16 bits too), or LoRA.")
    if s.optimizer not in TRAINER_OPTIM:
        raise ValueError(f"Trainer has no optimizer {s.optimizer!r} (notebook 10_beyond_adam builds it): choose one of "
                         f"{sorted(TRAINER_OPTIM)}.")
    if s.paged_optimizer and s.optimizer not in ("adam", "adamw", "adam8bit"):
        raise ValueError("Trainer's paged optimizers are bitsandbytes' AdamW: optimizer 'adamw' or 'adam8bit'.")
    ckpt = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else \
        "gradient_checkpointing"  # transformers 5's name, 4's
    optim = ("paged_adamw_8bit" if s.optimizer == "adam8bit" else "paged_adamw_32bit") if s.paged_optimizer else \
        TRAINER_OPTIM[s.optimizer]
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=s.micro_batch,
                  gradient_accumulation_steps=s.accumulation, optim=optim, report_to="none",
                  save_strategy="no", use_cpu=s.device == "cpu", **{AMP.get(s.precision, "fp16"): s.precision in AMP})
    if s.checkpointing == "block":
        kwargs.update({ckpt: True, ckpt + "_kwargs": {"use_reentrant": False}})
    kwargs.update(dict(optim_args="momentum=0.9") if s.optimizer == "sgd_momentum" else {}, **overrides)
    out = TrainerExport(TrainingArguments(**kwargs), dtype={"fp16": "float16", "bf16": "bfloat16"}.get(s.precision,
                                                                                                       "float32"))
    if s.lora_rank:
        from peft import LoraConfig

        out.lora = LoraConfig(**lora_config(plan), task_type="CAUSAL_LM")
        out.peft_kwargs = {"autocast_adapter_dtype": False} if s.adapter_dtype != "fp32" else {}
    quant = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=s.quantize_base != "nf4")
    if s.quantize_base:
        from transformers import BitsAndBytesConfig

        out.quantization = BitsAndBytesConfig(**quant, bnb_4bit_compute_dtype=out.dtype)
    lines = [f'"""Train {model_name_or_path} as planned: {plan.model.name}, {s.micro_batch} x {s.size} tokens x '
             f'{s.accumulation} micro-batches, {", ".join(s.techniques()) or "fp32"}."""', "import torch",
             "from peft import LoraConfig, get_peft_model" if s.lora_rank else "",
             "from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments\n",
             f"model = AutoModelForCausalLM.from_pretrained({model_name_or_path!r}, dtype=torch.{out.dtype}" + (
                 f", quantization_config=BitsAndBytesConfig(**{quant!r}, bnb_4bit_compute_dtype=torch.{out.dtype})"
                 if s.quantize_base else "") + ")\nmodel.config.use_cache = False",
             f"model = get_peft_model(model, LoraConfig(**{lora_config(plan)!r}, task_type='CAUSAL_LM')"
             + (", autocast_adapter_dtype=False)  # adapters in the weights' 16 bits" if s.adapter_dtype != "fp32"
                else ")") if s.lora_rank else "", f"args = TrainingArguments(**{kwargs!r})",
             f"train_dataset = [dict(input_ids=ids, labels=ids) for ids in torch.randint(0, model.config.vocab_size, "
             f"(64, {s.size}))]  # random tokens: put your tokenized data here",
             "Trainer(model=model, args=args, train_dataset=train_dataset).train()\n"]
    out.script = "\n".join(line for line in lines if line)
    return out


def to_accelerate_fsdp(plan: Plan, num_processes: int = 2) -> dict:
    """The config ``accelerate launch --config_file`` reads (``yaml.safe_dump`` it) for FSDP2: each transformer block
    its own shard group, activation checkpointing, mixed precision and, for a CPU master, ``fsdp_offload_params``
    (CPUOffloadPolicy: sharded weights, gradients and the step on the host, each block's weights sent for its use)."""
    s = plan.settings
    _refuse(plan, "FSDP", allowed=("master_on_cpu", "stream_grads", "stream_weights"))
    if s.precision in ("fp16", "bf16") or s.optimizer == "adam8bit":
        raise ValueError(f"FSDP2 shards fp32 weights and casts them per block: plan with precision="
                         f"'{s.precision[:4]}_amp' and optimizer='adamw' (8-bit Adam: notebook 05_8bit_adam's loop).")
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "machine_rank": 0, "num_machines": 1,
            "num_processes": num_processes, "mixed_precision": AMP.get(s.precision, "no"), "use_cpu": s.device == "cpu",
            "main_training_function": "main",
            "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "fsdp_transformer_layer_cls_to_wrap": LAYER_CLASS[model_type(plan.model)],
                            "fsdp_offload_params": s.master_on_cpu, "fsdp_reshard_after_forward": True,
                            "fsdp_activation_checkpointing": s.checkpointing != "none",
                            "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}


def fsdp_rank_bytes(plan: Plan, world_size: int = 2) -> int:
    """The fp32 plan's tensor peak on one of ``world_size`` FSDP2 ranks (no offload, no mixed precision): the state
    sharded, plus what FSDP gathers (the root's and one block's parameters) and that block's unreduced gradient."""
    by, m, w = plan.by_category, plan.model, 2 if plan.settings.precision in ("fp16", "bf16") else 4
    sharded = (by["params"] + by["grads"] + by["optimizer"]) * (1 - 1 / world_size)
    return round(plan.tensor_peak_bytes - sharded + w * (m.head_params + 2 * max(m.block_params)))


def to_deepspeed(plan: Plan, stage: int | None = None) -> dict:
    """A DeepSpeed config (``deepspeed.initialize``, ``TrainingArguments(deepspeed=...)``): ZeRO ``stage`` (default: 3
    for streamed weights, 2 with a CPU master, else 0), ``offload_optimizer`` for a CPU master (ZeRO-Offload: its CPU
    Adam steps the fp32 master), ``offload_param`` for streamed weights, bf16/fp16 (16-bit weights, fp32 master) or
    ``torch_autocast``, ``cpu_checkpointing``. 8-bit Adam, notebook 10's: pass the optimizer to deepspeed.initialize."""
    s = plan.settings
    _refuse(plan, "DeepSpeed", allowed=("master_on_cpu", "stream_grads", "stream_weights", "offload_activations"))
    if s.offload_activations and s.checkpointing == "none":
        raise ValueError("DeepSpeed offloads checkpointed activations only: plan with checkpointing='block', or "
                         "without offload_activations (notebook 08_current_toolbox offloads every saved tensor).")
    stage = stage if stage is not None else 3 if s.stream_weights else 2 if s.master_on_cpu else 0
    half, cpu = s.precision.split("_")[0], {"device": "cpu", "pin_memory": True}
    zero = {"stage": stage, **({"offload_optimizer": cpu} if s.master_on_cpu else {}),
            **({"offload_param": cpu} if s.stream_weights else {}),
            **(dict(overlap_comm=True, contiguous_gradients=True) if stage else {})}
    config = {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": s.accumulation,
              "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 100,
              "wall_clock_breakdown": False, **{k: {"enabled": s.precision == k} for k in ("bf16", "fp16")}}
    if s.precision in AMP:
        config["torch_autocast"] = {"enabled": True, "dtype": {"bf16": "bfloat16", "fp16": "float16"}[half]}
    if s.optimizer in ("adam", "adamw", "adamw_fused", "lion"):
        config["optimizer"] = {"type": "Lion" if s.optimizer == "lion" else "AdamW", "params": {"lr": 1e-4}}
    if s.checkpointing != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                              "cpu_checkpointing": s.offload_activations}
    return config


SCRIPT = """\"\"\"{title}

STEPS optimizer steps on random tokens, each measured with course_utils' measure_memory: plan {planned} bytes.\"\"\"
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from course_utils.capstone import enable_checkpointing
from course_utils.memory import format_bytes, measure_memory
{imports}
DEVICE, STEPS, MICRO_BATCH, SEQ_LEN, ACCUMULATION = {device!r}, {steps}, {micro_batch}, {size}, {accumulation}
MASTER = {master}  # 16-bit weights trained through an fp32 master copy
torch.manual_seed(0)
{load}
model.config.use_cache = False
{model_lines}model.to(DEVICE).train()
params = [p for p in model.parameters() if p.requires_grad]
masters = nn.ParameterList(p.detach().float() for p in params) if MASTER else params
optimizer = {optimizer}
scaler = torch.amp.GradScaler(DEVICE, enabled={scaler})  # fp16 autocast on a GPU: loss scaling
measured = nn.ModuleDict(dict(model=model, masters=masters)) if MASTER else model


def optimizer_step():
    if MASTER:  # tensor by tensor: one fp32 gradient at a time
        for p, m in zip(params, masters):
            m.grad, p.grad = p.grad.float(), None
            optimizer.step()
            m.grad = None
            p.detach().copy_(m.detach())
    else:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def step(batches):  # every micro-batch's forward and backward, then the optimizer's step: what the plan prices
    for ids in batches:
        with torch.autocast(DEVICE, dtype=torch.{amp_dtype}, enabled={amp}):
            {forward}
        scaler.scale(loss / ACCUMULATION).backward()
    optimizer_step()


for _ in range(STEPS):  # the first step makes the optimizer's state: the last one is the step the plan prices
    batches = [torch.randint(0, model.config.vocab_size, (MICRO_BATCH, SEQ_LEN), device=DEVICE)
               for _ in range(ACCUMULATION)]
    report = measure_memory(lambda: step(batches), model=measured, optimizer=optimizer)
print(f"measured peak: {{report.peak_bytes}} bytes ({{format_bytes(report.peak_bytes)}}); planned: {planned} bytes")
"""
SCRIPT_OPTIM = dict(adam="torch.optim.AdamW(masters, lr=1e-4)", adamw="torch.optim.AdamW(masters, lr=1e-4)",
                    adamw_fused="torch.optim.AdamW(masters, lr=1e-4, fused=True)",
                    adam8bit="bnb.optim.Adam8bit(masters, lr=1e-4)", sgd="torch.optim.SGD(masters, lr=1e-2)",
                    sgd_momentum="torch.optim.SGD(masters, lr=1e-2, momentum=0.9)")


def to_script(plan: Plan, model_name_or_path: str | None = None, *, config=None, steps: int = 2) -> str:
    """A .py file's text: a plain PyTorch loop of the plan's step (``model_name_or_path``, or random weights from a
    transformers ``config``; the course's checkpointing, autocast, an fp32 master stepped tensor by tensor for 16-bit
    weights, Adam8bit, peft's LoRA) that prints its last step's measured peak. 06, 08 and 09 run host-side settings."""
    s = plan.settings
    _refuse(plan, "to_script's loop", allowed=("master_weights",))
    if s.checkpointing == "sqrt" or s.optimizer not in SCRIPT_OPTIM or s.quantize_base:
        raise ValueError(f"to_script's loop runs checkpointing 'none' or 'block', optimizers {sorted(SCRIPT_OPTIM)} "
                         "and LoRA on unquantized weights; notebooks 03_gradient_checkpointing (sqrt(n) segments), "
                         "10_beyond_adam (other optimizers) and to_trainer (QLoRA) run the rest.")
    if (model_name_or_path is None) == (config is None):
        raise ValueError("Give the model: a name or path for from_pretrained, or config=<a transformers config>.")
    half, fp16 = s.precision in ("fp16", "bf16"), s.precision.startswith("fp16") and s.device == "cuda"
    kw = f"dtype=torch.{'float16' if fp16 else 'bfloat16' if half else 'float32'}, attn_implementation=" + repr(
        {"math": "eager", "fused": "sdpa"}[s.attention])
    load = (f"model = AutoModelForCausalLM.from_pretrained({model_name_or_path!r}, {kw})" if model_name_or_path else
            f"CONFIG = {dict(getattr(config, 'to_diff_dict', lambda: config)())!r}\n"
            f"model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), {kw})")
    lines = ("enable_checkpointing(model)  # every block, non-reentrant\n" if s.checkpointing == "block" else "") + (
        f"model = get_peft_model(model, LoraConfig(**{lora_config(plan)!r}))  # fp32 adapters\n" if s.lora_rank else "")
    imports = ["import bitsandbytes as bnb"] * (s.optimizer == "adam8bit") + [
        "from peft import LoraConfig, get_peft_model"] * bool(s.lora_rank)
    forward = ("outputs = model(input_ids=ids, labels=ids)  # the loop keeps the outputs (logits) until backward\n"
               "            loss = outputs.loss") if s.keep_outputs else "loss = model(input_ids=ids, labels=ids).loss"
    title = (f"{plan.model.name}: {s.micro_batch} x {s.size} tokens x {s.accumulation} micro-batches, "
             f"{', '.join(s.techniques()) or 'fp32, AdamW'} (exported by course_utils.planner.export.to_script)")
    return SCRIPT.format(title=title, planned=plan.tensor_peak_bytes, imports="\n".join(imports), device=s.device,
                         steps=steps, micro_batch=s.micro_batch, size=s.size, accumulation=s.accumulation, load=load,
                         master=half and not s.lora_rank and s.master_weights, model_lines=lines, optimizer=SCRIPT_OPTIM[s.optimizer],
                         scaler=fp16 and s.precision in AMP, amp=s.precision in AMP, forward=forward,
                         amp_dtype="float16" if fp16 else "bfloat16")
