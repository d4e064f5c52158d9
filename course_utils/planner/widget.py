"""What the learner sees: the plans as a table, as a chart, and the interactive planner.

``planner_widget()`` returns a box of controls and an output area (basic widgets only, so it
works with ipywidgets 7.7, which Colab ships, and 8): pick a model and a GPU, set the
micro-batch, sequence length or image size and the techniques, and see the predicted memory by
category against the GPU's capacity, whether it fits, and the cheapest set of techniques that
fits. Bad input shows a message in place of the chart, never a traceback. ``box.set(gpu='T4')``
changes controls from code and returns the text shown (tests drive the widget headless with it).

``render(...)`` does the work without widgets (tests and static figures use it).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..units import GIB, MIB
from .model import Plan, predict
from .search import cheapest_fit
from .specs import custom_gpu, custom_model, get_model, gpu_presets

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
ATTENTION_LABELS = {"fused (SDPA)": "fused", "math": "math"}


def plan_frame(plans: dict):
    """A pandas table (scenario x category, GiB) of several plans, with total, capacity and fit."""
    import pandas as pd

    _check_plans(plans)
    rows = []
    for name, p in plans.items():
        row = {"scenario": name, **{k: round(v / GIB, 2) for k, v in p.by_category.items()}}
        row.update(total=round(p.peak_bytes / GIB, 2), gpu_GiB=round(p.gpu.memory_gib, 1), fits=p.fits)
        rows.append(row)
    return pd.DataFrame(rows).set_index("scenario")


def _check_plans(plans):
    if not isinstance(plans, dict) or not plans:
        raise ValueError("plans is empty: pass {'scenario': plan, ...}.")
    for name, p in plans.items():
        if not isinstance(p, Plan):
            raise TypeError(f"{name!r} is a {type(p).__name__}, not a Plan (from predict()).")


def plot_plans(plans: dict, *, ax=None, title=None):
    """Stacked bars of several plans against the (first plan's) GPU capacity.

    The capacity is a dashed line named in the legend, and the legend sits to the right of the
    bars, so neither the title nor the bars are covered.
    """
    from ..plots import plot_ledger

    _check_plans(plans)
    gpu = next(iter(plans.values())).gpu
    ax = plot_ledger({name: dict(p.by_category) for name, p in plans.items()}, ax=ax, title=title)
    for container in ax.containers:  # the GPU's own overhead: hatched, it is not PyTorch's tensors
        if container.get_label() == "overhead":
            for bar in container:
                bar.set_hatch("//")
    ax.axvline(gpu.memory_gib, color="black", linestyle="--", linewidth=1.5,
               label=f"{gpu.name}: {gpu.memory_gib:.1f} GiB")
    widest = max(p.peak_bytes for p in plans.values()) / GIB
    ax.set_xlim(0, 1.05 * max(widest, gpu.memory_gib))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return ax


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
        if isinstance(custom_params_m, bool) or not isinstance(custom_params_m, (int, float)) or custom_params_m <= 0:
            raise ValueError(f"The custom model needs a positive number of parameters (got {custom_params_m} million): "
                             "move the 'params (M)' slider above 0.")
        if isinstance(custom_act_mib, bool) or not isinstance(custom_act_mib, (int, float)) or custom_act_mib <= 0:
            raise ValueError(f"The custom model needs positive activation memory per sample (got {custom_act_mib} MiB): "
                             "measure it with course_utils.estimate.activation_bytes(model, one_sample).")
        return custom_model(int(custom_params_m * 1e6), custom_act_mib * MIB)
    key = {v: k for k, v in MODEL_LABELS.items()}.get(model, model)
    return get_model(key)


def render(*, model="gpt2-xl", gpu="RTX 3060 (12 GB)", custom_gpu_gib=8, custom_params_m=100, custom_act_mib=50,
           micro_batch=4, size=None, accumulation=1, checkpointing="none", precision="fp32", optimizer="adam",
           master_on_cpu=False, stream_grads=False, attention="fused", offload_activations=False, chunked_loss=False,
           fused_update=False, stream_weights=False, lora_rank=0, search=True, show=True) -> RenderResult:
    """Plan (and search) for these settings; returns a figure or the message to show instead.

    Never raises for bad settings: the error's message says what to change. ``lora_rank=0``: every weight trains.
    """
    import matplotlib.pyplot as plt

    try:
        spec = _model_spec(model, custom_params_m, custom_act_mib)
        gpu_spec = custom_gpu(custom_gpu_gib, name=f"custom GPU ({custom_gpu_gib:g} GiB)") \
            if gpu == CUSTOM_GPU else gpu
        kwargs = dict(micro_batch=micro_batch, size=size, accumulation=accumulation,
                      checkpointing=CKPT_LABELS.get(checkpointing, checkpointing),
                      precision=PRECISION_LABELS.get(precision, precision),
                      optimizer=OPTIMIZER_LABELS.get(optimizer, optimizer), master_on_cpu=master_on_cpu,
                      stream_grads=stream_grads, attention=ATTENTION_LABELS.get(attention, attention),
                      offload_activations=offload_activations, chunked_loss=chunked_loss, fused_update=fused_update,
                      stream_weights=stream_weights, lora_rank=lora_rank or None)
        plan = predict(spec, gpu_spec, **kwargs)
        rec = None
        lines = [plan.summary()]
        plans = {"your settings": plan}
        if search:
            try:
                rec = cheapest_fit(spec, plan.gpu, **kwargs)
            except ValueError as err:
                lines.append(f"Search: {err}")
            else:
                lines.append(rec.summary())
                if rec.techniques:
                    plans["cheapest set that fits"] = rec.plan
        fig, ax = plt.subplots(figsize=(9, 1.4 + 0.7 * len(plans)))
        plot_plans(plans, ax=ax, title=f"{spec.name} on {plan.gpu.name}: {'fits' if plan.fits else 'does not fit'}")
        fig.tight_layout()
        if not show:
            plt.close(fig)
        return RenderResult(ok=True, message="\n".join(lines), figure=fig, plan=plan, recommendation=rec)
    except (ValueError, TypeError) as err:
        return RenderResult(ok=False, message=f"Cannot plan this: {err}")


def planner_widget():
    """The interactive planner: controls on top, the chart (or a message) below.

    The returned box has ``controls`` (name -> widget), ``last_result`` (a :class:`RenderResult`),
    ``update()`` and ``set(**values) -> str``: set controls by name (a model may be given by its
    preset name, e.g. ``set(model='gpt2', gpu='T4', micro_batch=8)``) and get the text shown.
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt

    from ..plots import show_figure

    style = {"description_width": "130px"}
    layout = w.Layout(width="460px")
    c = dict(
        model=w.Dropdown(options=list(MODEL_LABELS.values()) + [CUSTOM_MODEL], value=MODEL_LABELS["gpt2-xl"],
                         description="model", style=style, layout=layout),
        custom_params_m=w.IntSlider(value=100, min=0, max=20000, step=10, description="params (M)", style=style,
                                    layout=layout),
        custom_act_mib=w.IntSlider(value=50, min=0, max=4000, description="act. MiB/sample", style=style,
                                   layout=layout),
        gpu=w.Dropdown(options=list(gpu_presets()) + [CUSTOM_GPU], value="RTX 3060 (12 GB)",
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
        attention=w.ToggleButtons(options=list(ATTENTION_LABELS), value="fused (SDPA)", description="attention",
                                  style=style),
        master_on_cpu=w.Checkbox(value=False, description="optimizer + fp32 master weights on CPU"),
        stream_grads=w.Checkbox(value=False, description="stream gradients to CPU"),
        stream_weights=w.Checkbox(value=False, description="stream weights from CPU (09)"),
        offload_activations=w.Checkbox(value=False, description="offload activations (08)"),
        chunked_loss=w.Checkbox(value=False, description="chunked loss (08)"),
        fused_update=w.Checkbox(value=False, description="update fused into backward (08)"),
        lora_rank=w.IntSlider(value=0, min=0, max=64, description="LoRA rank (0: off)", style=style, layout=layout),
        search=w.Checkbox(value=True, description="search the cheapest set that fits"),
    )
    held = [False]  # True while set() changes several controls: one update at the end

    def on_stream(change):  # streaming needs the optimizer on the CPU
        if change["new"]:
            c["master_on_cpu"].value = True

    def on_master(change):
        if not change["new"]:
            c["stream_grads"].value = c["stream_weights"].value = False

    def on_model(change):  # sensible size for the model family
        key = {v: k for k, v in MODEL_LABELS.items()}.get(change["new"])
        if key is None:
            return
        spec = get_model(key)
        c["size"].max = 1024 if spec.unit == "token" else 512
        c["size"].value = min(spec.default_size, c["size"].max)

    c["stream_grads"].observe(on_stream, names="value")
    c["stream_weights"].observe(on_stream, names="value")
    c["master_on_cpu"].observe(on_master, names="value")
    c["model"].observe(on_model, names="value")
    out = w.Output()
    box = w.VBox([w.HBox([w.VBox([c["model"], c["custom_params_m"], c["custom_act_mib"], c["gpu"],
                                  c["custom_gpu_gib"]]),
                          w.VBox([c["micro_batch"], c["size"], c["accumulation"], c["precision"]])]),
                  c["checkpointing"], c["optimizer"], c["attention"],
                  w.HBox([c["master_on_cpu"], c["stream_grads"], c["stream_weights"]]),
                  w.HBox([c["offload_activations"], c["chunked_loss"], c["fused_update"]]),
                  w.HBox([c["lora_rank"], c["search"]]), out])
    box.last_result = None

    def update():
        result = render(show=False, **{k: v.value for k, v in c.items()})
        box.last_result = result
        out.clear_output(wait=True)
        with out:
            if result.ok:
                show_figure(result.figure)
                print(result.message)
            else:
                print("⚠ " + result.message)
        if result.figure is not None:
            plt.close(result.figure)

    def set_values(**values) -> str:
        unknown = sorted(set(values) - set(c))
        if unknown:
            raise ValueError(f"No control named {unknown}; the controls are {list(c)}.")
        held[0] = True
        try:
            for key, value in values.items():
                c[key].value = MODEL_LABELS.get(value, value) if key == "model" else value
        finally:
            held[0] = False
        update()
        return box.last_result.message

    box.update = update
    box.set = set_values
    box.controls = c
    for control in c.values():
        control.observe(lambda change: None if held[0] else update(), names="value")
    update()
    return box
