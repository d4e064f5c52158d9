"""The planner's interactive front end (ipywidgets 7.7 and 8: basic widgets only).

``planner_widget()`` returns a box of controls and an output area: pick a model and a GPU, set
the micro-batch, sequence length or image size and the techniques, and see the predicted memory
by category against the GPU's capacity, whether it fits, and the cheapest set of techniques
that fits. Bad input (a custom model of 0 parameters, a budget nothing fits) shows a message in
place of the chart, never a traceback.

``render(...)`` does the work without widgets (tests and static figures use it).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import planner

CUSTOM_MODEL = "custom (parameters + activations)"
CUSTOM_GPU = "custom GPU (GiB below)"
MODEL_LABELS = {
    "mlp": "MLP (course, 4 x 512)",
    "small-cnn": "small CNN (course, 28 x 28 digits)",
    "resnet18": "ResNet-18 (timm)",
    "resnet50": "ResNet-50 (timm)",
    "efficientnet_b0": "EfficientNet-B0 (timm)",
    "bert-base": "BERT-base (110M)",
    "bert-large": "BERT-large (340M)",
    "gpt2": "GPT-2 small (124M)",
    "gpt2-medium": "GPT-2 medium (355M)",
    "gpt2-large": "GPT-2 large (774M)",
    "gpt2-xl": "GPT-2 XL (1.56B)",
}
PRECISION_LABELS = {"fp32": "fp32", "fp16 AMP": "fp16_amp", "bf16 AMP": "bf16_amp", "pure fp16": "fp16",
                    "pure bf16": "bf16"}
OPTIMIZER_LABELS = {"SGD": "sgd", "SGD+momentum": "sgd_momentum", "Adam": "adam", "AdamW": "adamw",
                    "8-bit Adam": "adam8bit"}
CKPT_LABELS = {"none": "none", "per block": "block", "sqrt(n)": "sqrt"}


@dataclass
class RenderResult:
    """What the output area shows: a figure, or a message saying what to change."""

    ok: bool
    message: str
    figure: object = None
    plan: object = None
    recommendation: object = None


def _model_spec(model, custom_params_m, custom_act_mib):
    if model == CUSTOM_MODEL:
        if not isinstance(custom_params_m, (int, float)) or custom_params_m <= 0:
            raise ValueError(f"The custom model needs a positive number of parameters (got {custom_params_m} million): "
                             "move the 'params (M)' slider above 0.")
        if not isinstance(custom_act_mib, (int, float)) or custom_act_mib <= 0:
            raise ValueError(f"The custom model needs positive activation memory per sample (got {custom_act_mib} MiB): "
                             "measure it with course_utils.estimate.activation_bytes(model, one_sample).")
        return planner.custom_model(int(custom_params_m * 1e6), custom_act_mib * planner.MIB)
    key = {v: k for k, v in MODEL_LABELS.items()}.get(model, model)
    return planner.get_model(key)


def render(*, model="gpt2-xl", gpu="RTX 3060 (12 GB)", custom_gpu_gib=8, custom_params_m=100, custom_act_mib=50,
           micro_batch=4, size=None, accumulation=1, checkpointing="none", precision="fp32", optimizer="adam",
           master_on_cpu=False, stream_grads=False, search=True, show=True) -> RenderResult:
    """Plan (and search) for these settings; returns a figure or the message to show instead.

    Never raises for bad settings: the error's message says what to change.
    """
    import matplotlib.pyplot as plt

    try:
        spec = _model_spec(model, custom_params_m, custom_act_mib)
        gpu_spec = planner.custom_gpu(custom_gpu_gib, name=f"custom GPU ({custom_gpu_gib:g} GiB)") \
            if gpu == CUSTOM_GPU else planner.get_gpu(gpu)
        precision = PRECISION_LABELS.get(precision, precision)
        optimizer = OPTIMIZER_LABELS.get(optimizer, optimizer)
        checkpointing = CKPT_LABELS.get(checkpointing, checkpointing)
        kwargs = dict(micro_batch=micro_batch, size=size, accumulation=accumulation, checkpointing=checkpointing,
                      precision=precision, optimizer=optimizer, master_on_cpu=master_on_cpu, stream_grads=stream_grads)
        plan = planner.predict(spec, gpu_spec, **kwargs)
        rec = None
        lines = [plan.summary()]
        plans = {"your settings": plan}
        if search:
            try:
                rec = planner.cheapest_fit(spec, gpu_spec, **kwargs)
            except ValueError as err:
                lines.append(f"Search: {err}")
            else:
                lines.append(rec.summary())
                if rec.techniques:
                    plans["cheapest set that fits"] = rec.plan
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.7 * len(plans)))
        planner.plot_plans(plans, ax=ax, title=f"{spec.name} on {gpu_spec.name}: "
                                                f"{'fits' if plan.fits else 'does not fit'}")
        fig.tight_layout()
        if not show:
            plt.close(fig)
        return RenderResult(ok=True, message="\n".join(lines), figure=fig, plan=plan, recommendation=rec)
    except (ValueError, TypeError) as err:
        return RenderResult(ok=False, message=f"Cannot plan this: {err}")


def planner_widget():
    """The interactive planner: controls on top, the chart (or a message) below."""
    import ipywidgets as w
    from IPython.display import display
    import matplotlib.pyplot as plt

    style = {"description_width": "130px"}
    layout = w.Layout(width="460px")
    c = dict(
        model=w.Dropdown(options=list(MODEL_LABELS.values()) + [CUSTOM_MODEL], value=MODEL_LABELS["gpt2-xl"],
                         description="model", style=style, layout=layout),
        custom_params_m=w.IntSlider(value=100, min=0, max=20000, step=10, description="params (M)", style=style,
                                    layout=layout),
        custom_act_mib=w.IntSlider(value=50, min=0, max=4000, description="act. MiB/sample", style=style,
                                   layout=layout),
        gpu=w.Dropdown(options=list(planner.GPU_PRESETS) + [CUSTOM_GPU], value="RTX 3060 (12 GB)",
                       description="GPU", style=style, layout=layout),
        custom_gpu_gib=w.IntSlider(value=8, min=0, max=192, description="custom GPU GiB", style=style,
                                   layout=layout),
        micro_batch=w.IntSlider(value=4, min=0, max=256, description="micro-batch", style=style, layout=layout),
        size=w.IntSlider(value=1024, min=0, max=1024, step=16, description="seq. length / image", style=style,
                         layout=layout),
        accumulation=w.IntSlider(value=8, min=1, max=64, description="accumulation", style=style, layout=layout),
        checkpointing=w.ToggleButtons(options=list(CKPT_LABELS), value="none", description="checkpointing",
                                      style=style),
        precision=w.Dropdown(options=list(PRECISION_LABELS), value="fp32", description="precision", style=style,
                             layout=layout),
        optimizer=w.ToggleButtons(options=list(OPTIMIZER_LABELS), value="Adam", description="optimizer",
                                  style=style),
        master_on_cpu=w.Checkbox(value=False, description="optimizer + fp32 master weights on CPU"),
        stream_grads=w.Checkbox(value=False, description="stream gradients to CPU"),
        search=w.Checkbox(value=True, description="search the cheapest set that fits"),
    )

    def on_stream(change):  # streaming needs the optimizer on the CPU
        if change["new"]:
            c["master_on_cpu"].value = True

    def on_master(change):
        if not change["new"]:
            c["stream_grads"].value = False

    def on_model(change):  # sensible size for the model family
        key = {v: k for k, v in MODEL_LABELS.items()}.get(change["new"])
        if key is None:
            return
        spec = planner.get_model(key)
        c["size"].max = 1024 if spec.unit == "token" else 512
        c["size"].value = min(spec.default_size, c["size"].max)

    c["stream_grads"].observe(on_stream, names="value")
    c["master_on_cpu"].observe(on_master, names="value")
    c["model"].observe(on_model, names="value")
    out = w.Output()
    box = w.VBox([w.HBox([w.VBox([c["model"], c["custom_params_m"], c["custom_act_mib"], c["gpu"],
                                  c["custom_gpu_gib"]]),
                          w.VBox([c["micro_batch"], c["size"], c["accumulation"], c["precision"]])]),
                  c["checkpointing"], c["optimizer"], w.HBox([c["master_on_cpu"], c["stream_grads"], c["search"]]),
                  out])
    box.last_result = None

    def update(**values):
        result = render(show=False, **values)
        box.last_result = result
        out.clear_output(wait=True)
        with out:
            if result.ok:
                display(result.figure)
                print(result.message)
            else:
                print("⚠ " + result.message)
        if result.figure is not None:
            plt.close(result.figure)

    box.update = lambda: update(**{k: v.value for k, v in c.items()})
    box.controls = c
    for control in c.values():
        control.observe(lambda change: box.update(), names="value")
    box.update()
    return box
