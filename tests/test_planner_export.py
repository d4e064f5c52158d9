"""A plan exports what runs it (``course_utils.planner.export``), and each export is proven by running it: two optimizer
steps on the CPU of a tiny model of the plan's architecture (GPT-2 and Llama, 2 layers, width 64), the second step
measured whole (every micro-batch, then the optimizer's step) and held within 5% of the planner's prediction for that
model with ``device='cpu'``, as tests/test_protocol.py holds the planner against ``measure_memory``.

- ``to_script``: each script is written to a tmp folder and run in its own process (all at once); it prints the peak
  ``measure_memory`` measured for its last step.
- ``to_trainer``: a real ``transformers.Trainer`` runs 2 steps (full fine-tuning, peft's LoRA, QLoRA on
  bitsandbytes' NF4 layers); a callback puts
  ``measure_memory``'s tracker around the whole second step (``on_step_begin`` to ``on_step_end``: every micro-batch,
  gradient clipping, the optimizer's step).
- ``to_accelerate_fsdp``: the YAML is read by accelerate's own config loader, then applied with ``fully_shard`` on 2
  processes (gloo) under the course's launcher, as notebook 07 runs its ranks: ``accelerate launch`` runs FSDP on
  accelerators only (on a CPU it falls back to plain data parallelism). Each rank's peak (the smallest of three
  measured steps: tests/workers/export_fsdp.py says why) is held against ``fsdp_rank_bytes`` (the plan, sharded).
- ``to_deepspeed``: checked against the keys and types of DeepSpeed's configuration reference ("DeepSpeed Configuration
  JSON"); where DeepSpeed imports (it is no course dependency), parsed by ``deepspeed.runtime.config.DeepSpeedConfig``
  and run by ``deepspeed.initialize`` on the CPU (1 process, gloo), its second step within 5% of the plan.
"""
import functools
import json
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
import yaml
from transformers import TrainerCallback

from course_tools.launcher import launch
from course_utils import memory, models, planner
from course_utils.planner import export, llm

TOLERANCE = 0.05
TINY_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256, use_cache=False,
                  tie_word_embeddings=False)
STEP = dict(micro_batch=4, size=32, accumulation=2, device="cpu")  # 2 micro-batches of 4 x 32 tokens, then the step
WORKER = "tests/workers/export_fsdp.py"
ROWS = []  # one per run: the table printed at the end
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module", autouse=True)
def print_the_table(request):
    yield
    if ROWS:
        with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            print("\nEach export run for 2 optimizer steps on the CPU: planned vs measured (the second step)")
            print(pd.DataFrame(ROWS).set_index(["export", "model", "setting"]).round(2).to_string())


@functools.lru_cache(maxsize=None)
def spec(family):
    if family == "gpt2":
        return planner.gpt2_spec("gpt2", fake=False, **TINY_GPT2)
    return planner.hf_spec(config(family), name="llama (tiny twin)", fake=False)


def config(family):
    """The tiny model's transformers config."""
    from transformers import LlamaConfig

    return models.gpt2_config("gpt2", use_cache=False, **TINY_GPT2) if family == "gpt2" else LlamaConfig(**TINY_LLAMA)


def build(family):
    torch.manual_seed(0)
    return llm.build_causal_lm(config(family), attention="math", n_layers=None)


def check(kind, family, setting, planned, measured, seconds):
    ROWS.append({"export": kind, "model": family, "setting": setting, "planned MiB": planned / 2**20,
                 "measured MiB": measured / 2**20, "err %": 100 * (planned - measured) / measured, "s": seconds})
    assert abs(planned - measured) <= TOLERANCE * measured, ROWS[-1]


def name(settings):
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "fp32, AdamW"


# ---------------------------------------------------------------- the plain PyTorch loop
SCRIPTS = [("gpt2", dict(precision="bf16_amp", checkpointing="block")),
           ("gpt2", dict(precision="bf16", optimizer="adam8bit")),
           ("llama", dict(lora_rank=8))]


@pytest.mark.slow  # processes of their own (tens of seconds): make test runs it, make test-fast does not
def test_the_plain_loop_script_runs_the_plans_step(tmp_path):
    # beside them, the script to_trainer writes for a learner, on a tiny GPT-2 saved here (LoRA, 2 steps)
    build("gpt2").save_pretrained(tmp_path / "model")
    plan = planner.predict(spec("gpt2"), **STEP, lora_rank=8)
    trainer_script = tmp_path / "train.py"
    trainer_script.write_text(export.to_trainer(plan, str(tmp_path / "model"), str(tmp_path / "out"), max_steps=2,
                                                logging_steps=1).script)
    trainer = subprocess.Popen([sys.executable, str(trainer_script)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    plans, paths = [], []
    for i, (family, settings) in enumerate(SCRIPTS):
        plans.append((family, settings, planner.predict(spec(family), **STEP, **settings)))
        paths.append(tmp_path / f"plan{i}.py")
        paths[-1].write_text(export.to_script(plans[-1][2], config=config(family)))
    # the three scripts one after another in one process (torch and transformers imported once), each as __main__
    runner = ("import contextlib, gc, io, runpy, sys\n"
              "for path in sys.argv[1:]:\n"
              "    out = io.StringIO()\n"
              "    with contextlib.redirect_stdout(out):\n"
              "        runpy.run_path(path, run_name='__main__')\n"
              "    gc.collect()\n"
              "    print('measured peak: ' + out.getvalue().split('measured peak: ')[1].split(' bytes')[0] + ' bytes',"
              " flush=True)\n")
    start = time.perf_counter()
    scripts = subprocess.run([sys.executable, "-c", runner, *map(str, paths)], capture_output=True, text=True,
                             timeout=600)
    assert scripts.returncode == 0, scripts.stdout[-3000:] + scripts.stderr[-3000:]
    peaks = [int(line.split("measured peak: ")[1].split(" bytes")[0]) for line in scripts.stdout.splitlines()
             if line.startswith("measured peak: ")]
    assert len(peaks) == len(plans), scripts.stdout[-3000:]
    for (family, settings, plan), measured in zip(plans, peaks):
        check("to_script", family, name(settings), plan.tensor_peak_bytes, measured, time.perf_counter() - start)
    out, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 0 and out.count("'loss'") == 2, out[-3000:]  # a loss logged at each of 2 steps


# ---------------------------------------------------------------- transformers' Trainer (+ peft)
class MeasureSecondStep(TrainerCallback):
    """measure_memory's tracker from the start of the second optimizer step to its end."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.peak = model, optimizer, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.tracker = memory._MultiStepMemTracker()
            self.tracker.track_external(self.model, self.optimizer)
            self.tracker.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.tracker.__exit__(None, None, None)
            self.peak = self.tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("family,settings", [("gpt2", dict(precision="bf16_amp", checkpointing="block")),
                                             ("gpt2", dict(lora_rank=8)), ("llama", dict(lora_rank=8)),
                                             ("llama", dict(lora_rank=8, quantize_base="nf4", precision="bf16")),
                                             # pure bf16 without a master copy, fused AdamW (torchtune's, PEFT's)
                                             ("llama", dict(precision="bf16", master_weights=False,
                                                            optimizer="adamw_fused")),
                                             # bf16 adapters on q and v only, with dropout
                                             ("llama", dict(lora_rank=8, precision="bf16", adapter_dtype="bf16",
                                                            lora_targets=("q_proj", "v_proj"), lora_dropout=0.1))])
def test_the_trainer_export_runs_the_plans_step(tmp_path, family, settings):
    from transformers import AutoModelForCausalLM, Trainer

    start = time.perf_counter()
    plan = planner.predict(spec(family), keep_outputs=False, **STEP, **settings)  # Trainer's loss frees the logits
    out = export.to_trainer(plan, str(tmp_path), str(tmp_path / "out"), max_steps=2, disable_tqdm=True,
                            logging_strategy="no")
    assert out.args.per_device_train_batch_size == 4 and out.args.gradient_accumulation_steps == 2
    compile(out.script, "train.py", "exec")
    net = build(family).to(getattr(torch, out.dtype))  # the weights' dtype, as from_pretrained(dtype=...) loads them
    if out.quantization is not None:  # QLoRA: the weights saved, then loaded in NF4 as the exported script loads them
        net.save_pretrained(tmp_path)
        net = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, out.dtype),
                                                   attn_implementation="eager", quantization_config=out.quantization)
        assert type(net.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    if out.lora is not None:
        import peft

        net = peft.get_peft_model(net, out.lora, **out.peft_kwargs)
        assert sum(p.numel() for p in net.parameters() if p.requires_grad) == planner.lora_params(
            plan.model, 8, plan.settings.lora_targets)
    data = [dict(input_ids=x, labels=x) for x in torch.randint(0, net.config.vocab_size, (16, STEP["size"]))]
    trainer = Trainer(model=net, args=out.args, train_dataset=data)
    callback = MeasureSecondStep(net, trainer.create_optimizer())
    trainer.add_callback(callback)
    trainer.train()
    check("to_trainer", family, name(settings), plan.tensor_peak_bytes, callback.peak, time.perf_counter() - start)


# ---------------------------------------------------------------- accelerate's FSDP2 config, on 2 processes
FSDP = [("gpt2", {}), ("gpt2", dict(checkpointing="block")), ("llama", {})]


@pytest.mark.slow  # processes of their own (tens of seconds): make test runs it, make test-fast does not
def test_the_fsdp2_config_runs_on_two_processes(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    runs = []
    for i, (family, settings) in enumerate(FSDP):
        plan = planner.predict(spec(family), keep_outputs=False, **STEP, **settings)
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(yaml.safe_dump(export.to_accelerate_fsdp(plan)))
        read = load_config_from_file(str(run_dir / "config.yaml"))  # accelerate's own reader
        assert read.distributed_type == "FSDP" and read.fsdp_config["fsdp_version"] == 2, read
        assert read.fsdp_config["fsdp_activation_checkpointing"] == (settings.get("checkpointing") == "block")
        (run_dir / "inputs.json").write_text(json.dumps(dict(config=config(family).to_diff_dict(), **{
            k: STEP[k] for k in ("micro_batch", "size", "accumulation")})))
        runs.append((family, settings, plan, run_dir))
    start = time.perf_counter()
    launch(WORKER, *[str(r[-1]) for r in runs], nproc=2, timeout_s=300)
    for family, settings, plan, run_dir in runs:
        ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]
        assert all(r["param_bytes"] == pytest.approx(plan.by_category["params"] / 2, rel=0.01) for r in ranks), ranks
        for r in ranks:  # each rank: half of the state, the gathered blocks, its own micro-batches
            check("to_accelerate_fsdp", family, name(settings), export.fsdp_rank_bytes(plan, 2), r["peak_bytes"],
                  time.perf_counter() - start)


# ---------------------------------------------------------------- DeepSpeed's config
BOOL, INT, NUM, STR = bool, int, (int, float), str
OFFLOAD = {"device": ("cpu", "nvme", "none"), "pin_memory": BOOL}
# the keys this export writes, with the types DeepSpeed's configuration reference gives them
DOCUMENTED = {"train_micro_batch_size_per_gpu": INT, "gradient_accumulation_steps": INT, "gradient_clipping": NUM,
              "steps_per_print": INT, "wall_clock_breakdown": BOOL,
              "bf16": {"enabled": BOOL}, "fp16": {"enabled": BOOL, "loss_scale": NUM, "initial_scale_power": INT},
              "torch_autocast": {"enabled": BOOL, "dtype": ("bfloat16", "float16")},
              "optimizer": {"type": ("Adam", "AdamW", "Lion"), "params": {"lr": NUM}},
              "zero_optimization": {"stage": (0, 1, 2, 3), "offload_optimizer": OFFLOAD, "offload_param": OFFLOAD,
                                    "overlap_comm": BOOL, "contiguous_gradients": BOOL},
              "activation_checkpointing": {"partition_activations": BOOL, "cpu_checkpointing": BOOL,
                                           "contiguous_memory_optimization": BOOL}}


def documented(config, schema=DOCUMENTED, where="config"):
    for key, value in config.items():
        assert key in schema, f"{where}.{key} is not among the documented keys {sorted(schema)}"
        kind = schema[key]
        if isinstance(kind, dict):
            assert isinstance(value, dict), f"{where}.{key} must be a section"
            documented(value, kind, f"{where}.{key}")
        elif isinstance(kind, tuple) and not isinstance(kind[0], type):
            assert value in kind, f"{where}.{key} = {value!r}, not one of {kind}"
        else:
            assert isinstance(value, kind) and (kind is BOOL or not isinstance(value, bool)), (where, key, value)


DEEPSPEED = [(dict(), 0, None), (dict(precision="bf16_amp", checkpointing="block"), 0, None),
             (dict(precision="bf16", master_on_cpu=True), 2, "offload_optimizer"),
             (dict(precision="bf16", master_on_cpu=True, stream_grads=True, stream_weights=True, checkpointing="block",
                   keep_outputs=False), 3, "offload_param"),
             (dict(checkpointing="block", offload_activations=True), 0, None)]


def test_the_deepspeed_config_is_what_deepspeed_documents():
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        DeepSpeedConfig = None
        print("DeepSpeed is not installed here (it is no course dependency): the configs are checked against its "
              "documented keys and types only, not parsed by DeepSpeedConfig.")
    for settings, stage, offload in DEEPSPEED:
        plan = planner.predict(spec("gpt2"), **STEP, **settings)
        config = export.to_deepspeed(plan)
        documented(config)
        zero = config["zero_optimization"]
        assert zero["stage"] == stage and (offload is None or zero[offload]["device"] == "cpu"), config
        assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (4, 2)
        assert config["bf16"]["enabled"] == (plan.settings.precision == "bf16"), config
        assert ("torch_autocast" in config) == (plan.settings.precision == "bf16_amp"), config
        if DeepSpeedConfig is not None:
            parsed = DeepSpeedConfig(config)
            assert parsed.zero_optimization_stage == stage and parsed.gradient_accumulation_steps == 2


DEEPSPEED_RUNS = [("gpt2", dict(checkpointing="block")), ("llama", dict())]  # fp32 AdamW, ZeRO stage 0


def test_the_deepspeed_config_runs_where_deepspeed_installs(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed here (no course dependency): its configs are "
                        "checked against the documented keys only (the test above)")
    runs = []
    for i, (family, settings) in enumerate(DEEPSPEED_RUNS):
        plan = planner.predict(spec(family), keep_outputs=False, **STEP, **settings)  # loss = engine(...).loss
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        (run_dir / "ds_config.json").write_text(json.dumps(export.to_deepspeed(plan)))
        (run_dir / "inputs.json").write_text(json.dumps(dict(config=config(family).to_diff_dict(), size=STEP["size"],
                                                             checkpointing=settings.get("checkpointing") == "block")))
        runs.append((family, settings, plan, run_dir))
    start = time.perf_counter()
    launch("tests/workers/export_deepspeed.py", *[str(r[-1]) for r in runs], nproc=1, timeout_s=300)
    for family, settings, plan, run_dir in runs:
        measured = json.loads((run_dir / "rank0.json").read_text())["peak_bytes"]
        check("to_deepspeed", family, name(settings), plan.tensor_peak_bytes, measured, time.perf_counter() - start)


# ---------------------------------------------------------------- what an export cannot express
@pytest.mark.parametrize("exporter,settings,notebook", [
    (functools.partial(export.to_trainer, model_name_or_path="m", output_dir="o"), dict(master_on_cpu=True),
     "06_capstone_gpt2_xl"),
    (functools.partial(export.to_trainer, model_name_or_path="m", output_dir="o"), dict(precision="bf16"),
     "06_capstone_gpt2_xl"),
    (functools.partial(export.to_script, config={}), dict(master_on_cpu=True, stream_weights=True,
                                                           checkpointing="block"), "09_smaller_than_the_model"),
    (export.to_accelerate_fsdp, dict(offload_activations=True), "08_current_toolbox"),
    (export.to_deepspeed, dict(fused_update=True, accumulation=1), "08_current_toolbox"),
])
def test_what_an_export_cannot_run_names_the_notebook_that_does(exporter, settings, notebook):
    plan = planner.predict(spec("gpt2"), **{**STEP, **settings})
    with pytest.raises(ValueError, match=notebook):
        exporter(plan)


def test_the_exports_know_the_families_layers_and_adapters():
    assert export.to_accelerate_fsdp(planner.predict(spec("llama"), **STEP))["fsdp_config"][
        "fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    lora = export.lora_config(planner.predict(spec("llama"), **STEP, lora_rank=8, lora_targets=("q_proj", "v_proj")))
    assert lora["target_modules"] == ["self_attn.q_proj", "self_attn.v_proj"] and not lora["fan_in_fan_out"]
    qlora = export.to_trainer(planner.predict(spec("llama"), **STEP, precision="bf16", lora_rank=8,
                                              quantize_base="nf4_double"), "m", "o")
    assert qlora.quantization.load_in_4bit and qlora.quantization.bnb_4bit_use_double_quant
    assert qlora.dtype == "bfloat16" and "quantization_config=BitsAndBytesConfig" in qlora.script
    compile(qlora.script, "train.py", "exec")
    # the settings practitioners use: paged 8-bit AdamW over pure bf16 weights, bf16 adapters
    on_gpu = dict(STEP, device="cuda", attention="fused")  # paged state is CUDA unified memory
    paged = export.to_trainer(planner.predict("llama-3.2-1b", **on_gpu, precision="bf16", master_weights=False,
                                              optimizer="adam8bit", paged_optimizer=True), "m", "o")
    assert paged.args.optim == "paged_adamw_8bit" and paged.dtype == "bfloat16" and not paged.args.bf16
    bf16_lora = export.to_trainer(planner.predict(spec("llama"), **STEP, precision="bf16", lora_rank=8,
                                                  adapter_dtype="bf16", lora_dropout=0.05), "m", "o")
    assert bf16_lora.peft_kwargs == {"autocast_adapter_dtype": False} and bf16_lora.lora.lora_dropout == 0.05
    assert "autocast_adapter_dtype=False" in bf16_lora.script
    compile(bf16_lora.script, "train.py", "exec")
    for exporter in (export.to_accelerate_fsdp, export.to_deepspeed, functools.partial(export.to_script, config={})):
        with pytest.raises(ValueError, match="to_trainer"):
            exporter(planner.predict("llama-3.2-1b", **on_gpu, precision="bf16", master_weights=False,
                                     optimizer="adam8bit", paged_optimizer=True))
