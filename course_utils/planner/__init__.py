"""Will it fit, and what should I turn on? A GPU memory planner for training.

``predict(model, gpu, micro_batch=..., ...)`` predicts the peak GPU memory of one whole optimizer step (every
micro-batch's forward and backward, then the optimizer's step) by category, and whether it fits; ``cheapest_fit(...)``
picks the course's techniques that fit at the lowest predicted time per step, with the notebook that teaches each. The
data (GPUs, models' measured coefficients) is ``presets.json``; :mod:`.specs` reads it, :mod:`.measure` measures
coefficients, :mod:`.llm` prices any transformers causal LM (``hf_spec``; today's open LLMs ship in ``llms.json``),
:mod:`.model` holds the memory and time models, :mod:`.plan` a plan (its range, verdict and counters), :mod:`.search`
the search (``cheapest_fit``, and ``largest_fit``: the longest sequence, largest micro-batch or highest LoRA rank that
fits), :mod:`.published` the peaks others measured on real GPUs, priced (``published.json``), :mod:`.export` turns a
plan into what runs it (Hugging Face TrainingArguments + peft, an accelerate FSDP2 config, a DeepSpeed config, a plain
PyTorch loop) and :mod:`.widget` draws notebook 00's tables, charts and interactive planner.
"""
from . import published
from .export import TrainerExport, fsdp_rank_bytes, to_accelerate_fsdp, to_deepspeed, to_script, to_trainer
from .llm import get_model, hf_spec, llm_presets
from .measure import gpt2_spec, small_cnn
from .model import BEYOND_ADAM, CATEGORIES, CPU_STEP_REFERENCE, cpu_step_ns, lora_params, make_settings, predict, step_seconds
from .plan import FIGURES, Plan, plan_spread
from .rl import RLStepPrice, engine_pool_bytes, price_grpo_step
from .search import LargestFit, cheapest_fit, largest_fit
from .specs import custom_gpu, custom_model, get_gpu, gpu_presets, model_presets, presets
from .widget import plan_frame, planner_widget, plot_plans

__all__ = ["BEYOND_ADAM", "CATEGORIES", "CPU_STEP_REFERENCE", "FIGURES", "LargestFit", "Plan", "RLStepPrice", "TrainerExport", "cheapest_fit", "cpu_step_ns", "custom_gpu", "engine_pool_bytes", "custom_model",
           "fsdp_rank_bytes", "get_gpu", "get_model", "gpt2_spec", "gpu_presets", "hf_spec", "largest_fit", "llm_presets", "lora_params", "make_settings",
           "model_presets", "plan_frame", "plan_spread", "planner_widget", "published", "plot_plans", "predict", "presets", "price_grpo_step", "small_cnn",
           "step_seconds", "to_accelerate_fsdp", "to_deepspeed", "to_script", "to_trainer"]
from .run import RunPlan, measure_phase, predict_run, price_save, worst_batch
from .widget import plot_run

__all__ += ["RunPlan", "measure_phase", "plot_run", "predict_run", "price_save", "worst_batch"]
