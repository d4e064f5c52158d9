"""Will it fit, and what should I turn on? A GPU memory planner for training.

``predict(model, gpu, micro_batch=..., ...)`` predicts the peak GPU memory of one training step, by
category (params, grads, optimizer, activations, other = temporaries, overhead = allocator
reserve + CUDA context), for a model preset (real configs) or your own sizes, and says whether it
fits the GPU. ``cheapest_fit(...)`` searches the course's techniques and returns the set that fits
at the lowest predicted time per optimizer step, with the notebook that teaches each technique:
notebooks 02-06's, and notebook 08-09's toggles (``offload_activations``, ``chunked_loss``,
``fused_update``, ``lora_rank``, ``stream_weights``).

The package, by concern:

- ``presets.json``  the data: GPUs (memory, speeds, PCIe link) and models (measured coefficients)
- :mod:`.specs`     GPUs and models as the planner sees them: the presets, or your own
- :mod:`.measure`   how a model's activation coefficients are measured (saved-tensor hooks)
- :mod:`.model`     the memory and time models: one training step's peak, and its duration
- :mod:`.search`    the cheapest set of techniques that fits
- :mod:`.widget`    tables, charts and the interactive planner of notebook 00
"""
from .measure import gpt2_spec, measure_on_cpu, measure_spec_data, profile_activations, small_cnn
from .model import (ATTENTIONS, CATEGORIES, CHECKPOINTING, CPU_STEP_REFERENCE, PRECISIONS, Plan, Settings,
                    cpu_step_ns, lora_params, make_settings, predict, predict_settings, step_seconds,
                    technique_notebook)
from .search import Recommendation, candidate_settings, cheapest_fit
from .specs import (ActCoeffs, GPUSpec, ModelSpec, custom_gpu, custom_model, get_gpu, get_model, gpu_presets,
                    model_presets, presets)
from .widget import plan_frame, planner_widget, plot_plans, render

__all__ = [
    "ATTENTIONS", "CATEGORIES", "CHECKPOINTING", "CPU_STEP_REFERENCE", "PRECISIONS", "ActCoeffs", "GPUSpec",
    "ModelSpec", "Plan", "Recommendation", "Settings", "candidate_settings", "cheapest_fit", "cpu_step_ns",
    "custom_gpu", "custom_model", "get_gpu", "get_model", "gpt2_spec", "gpu_presets", "lora_params",
    "make_settings", "measure_on_cpu", "measure_spec_data", "model_presets", "plan_frame", "planner_widget",
    "plot_plans", "predict", "predict_settings", "presets", "profile_activations", "render", "small_cnn",
    "step_seconds", "technique_notebook",
]
