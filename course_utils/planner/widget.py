"""What the learner sees: the plans as a table, as a chart, and notebook 00's interactive planner.

``planner_widget()`` returns a box of controls and an output area (basic widgets only, so it works with ipywidgets 7.7,
which Colab ships, and 8): pick a model and a GPU, set the sizes and the techniques, and see the predicted memory by
category with its range against what PyTorch can allocate on the GPU, the verdict (fits, tight, does not fit), the
largest sequence length, micro-batch and LoRA rank that fit, and the cheapest set of techniques that fits within the
host RAM (default: this machine's). Bad input shows a message in place of the chart, never a traceback. ``render(...)`` does the work without widgets (tests use it).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware import host_ram_bytes
from ..units import GIB, MIB
from .llm import get_model, llm_data
from .model import predict
from .plan import Plan
from .run import RunPlan, predict_run
from .search import VARIES, cheapest_fit, largest_fit
from .specs import custom_model, gpu_presets, presets

CUSTOM_MODEL = "custom (parameters + activations)"
CUSTOM_GPU = "custom GPU (GiB below)"
LABELS = presets()["labels"]  # per control: what the widget shows -> what predict() takes
MODEL_CHOICES = {**LABELS["model"], **{d["label"]: name for name, d in llm_data()["configs"].items()}}  # + the LLMs
MODEL_LABELS = {key: label for label, key in MODEL_CHOICES.items()}


def plan_frame(plans: dict):
    """A pandas table (scenario x category, GiB) of several plans, with the total, its range, the card's memory (what
    PyTorch can allocate), the verdict (fits, tight, does not fit) and the host RAM each needs."""
    import pandas as pd

    _check_plans(plans)
    rows = {name: {**{k: round(v / GIB, 2) for k, v in p.by_category.items()}, "total": round(p.peak_bytes / GIB, 2),
                   "low": round(p.range_bytes[0] / GIB, 2), "high": round(p.range_bytes[2] / GIB, 2),
                   "gpu_GiB": round(p.gpu.memory_gib, 2), "fits": p.fits, "verdict": p.verdict,
                   "host_GiB": round(p.host_bytes / GIB, 1)} for name, p in plans.items()}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("scenario")


def _check_plans(plans):
    if not isinstance(plans, dict) or not plans:
        raise ValueError("plans is empty: pass {'scenario': plan, ...}.")
    for name, p in plans.items():
        if not isinstance(p, Plan):
            raise TypeError(f"{name!r} is a {type(p).__name__}, not a Plan (from predict()).")


def plot_plans(plans: dict, *, ax=None, title=None):
    """Stacked bars of several plans against the (first plan's) GPU capacity: a dashed line named in the legend, which
    sits to the right of the bars, so neither the title nor the bars are covered."""
    from ..plots import plot_ledger

    _check_plans(plans)
    gpu = next(iter(plans.values())).gpu
    ax = plot_ledger(plans, budget_bytes=gpu.memory_bytes, budget_label=f"{gpu.name}: {gpu.memory_gib:.2f} GiB", ax=ax,
                     title=title)
    for container in ax.containers:  # the GPU's own overhead: hatched, it is not PyTorch's tensors
        if container.get_label() == "overhead":
            for bar in container:
                bar.set_hatch("//")
    for y, p in enumerate(plans.values()):  # the range: how far published measurements fell from predictions
        low, expected, high = (b / GIB for b in p.range_bytes)
        ax.errorbar(expected, y, xerr=[[expected - low], [high - expected]], fmt="none", ecolor="black", capsize=4,
                    label="range" if y == 0 else None)
    ax.set_xlim(0, 1.05 * max(max(p.range_bytes[2] for p in plans.values()), gpu.memory_bytes) / GIB)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)  # with the hatch
    return ax


def plot_run(run: RunPlan, *, ax=None, title=None):
    """A whole run's phases (:func:`~.run.predict_run`): each one's device and host peak as bars, the phase that sets
    the run's peak marked, the card's memory (and the host budget, when given) as dashed lines."""
    import matplotlib.pyplot as plt

    if not isinstance(run, RunPlan):
        raise ValueError(f"plot_run draws a RunPlan (from planner.predict_run), not a {type(run).__name__}.")
    names = list(run.phases)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(names)))
    y = range(len(names))
    ax.barh([i - 0.2 for i in y], [run.phases[n]["device"] / GIB for n in names], height=0.4, label=run.device)
    ax.barh([i + 0.2 for i in y], [run.phases[n]["host"] / GIB for n in names], height=0.4, label="host RAM")
    ax.set_yticks(list(y), [f"{n} (peak)" if n == run.peak_phase else n for n in names])
    ax.invert_yaxis()
    if run.device == "cuda" and run.gpu is not None:
        ax.axvline(run.gpu.memory_gib, color="black", ls="--", label=f"{run.gpu.name}: {run.gpu.memory_gib:.2f} GiB")
    if run.host_budget_bytes:
        ax.axvline(run.host_budget_bytes / GIB, color="grey", ls=":", label=f"host {run.host_budget_bytes / GIB:.1f} GiB")
    b, t = run.worst_batch
    ax.set(xlabel="GiB", title=title or f"The whole run, phase by phase (worst batch {b} x {t})")
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
    run: object = None  # the whole run's phases (predict_run), when render() was given lengths


def largest_lines(spec, gpu, host_gib, settings: dict) -> list[str]:
    """The largest sequence length (or image size), micro-batch and, with LoRA, rank that fit the card and the host with
    the other settings as they are (``largest_fit``, safe by the high end of the range)."""
    lines = []
    for vary in ("size", "micro_batch", "lora_rank"):
        if vary == "lora_rank" and not settings.get("lora_rank"):
            continue
        knobs = {k: v for k, v in settings.items() if k != vary}
        step = 16 if vary == "size" and spec.unit == "token" else 1
        found = largest_fit(spec, gpu, vary, host_gib=host_gib, step=step, **knobs)
        lines.append(f"  {VARIES[vary]}: {found.value if found.value else 'none fits'}"
                     + (f" (expected {found.expected})" if found.expected != found.value else ""))
    return ["The largest that fits, the rest as set:"] + lines


def render(*, model="gpt2-xl", gpu="RTX 3060 (12 GB)", custom_gpu_gib=8, custom_params_m=100, custom_act_mib=50,
           lora_rank=0, qlora=False, search=True, host_gib=None, largest=True, lengths=None, eval_batches=1,
           **settings) -> RenderResult:
    """Plan (and search) for ``settings``, the knobs of ``predict`` (or the widget's labels for them); returns a figure
    (closed: the widget shows it as an image), or the message to show instead: it never raises for bad settings.
    ``lora_rank=0``: every weight trains; ``qlora``: the frozen weights in 4-bit NF4 (with a LoRA rank); ``host_gib``:
    the host RAM the search may use (default: this machine's); ``largest``: also the largest sequence length,
    micro-batch and LoRA rank that fit (``largest_fit``); ``lengths`` (a dataset's sequence lengths): also the whole
    run's phases (``predict_run``: loading, the first step, the worst batch, ``eval_batches`` of evaluation, saving),
    with the sequence length as the longest a batch may hold."""
    import matplotlib.pyplot as plt

    try:
        if model == CUSTOM_MODEL:
            spec = custom_model(int(custom_params_m * 1e6), custom_act_mib * MIB)
        else:
            spec = get_model(MODEL_CHOICES.get(model, model))
        gpu = custom_gpu_gib if gpu == CUSTOM_GPU else gpu  # get_gpu(GiB) names it "custom GPU (8 GiB)"
        kwargs = {k: LABELS.get(k, {}).get(v, v) for k, v in settings.items()}
        kwargs["quantize_base"] = "nf4" if qlora else None
        plan = predict(spec, gpu, lora_rank=lora_rank or None, **kwargs)
        rec = None
        lines = [str(plan)]
        plans = {"your settings": plan}
        if largest:
            lines += largest_lines(spec, plan.gpu, host_gib, dict(kwargs, lora_rank=lora_rank or None))
        if search:
            try:
                rec = cheapest_fit(spec, plan.gpu, host_gib=host_gib, lora_rank=lora_rank or None, **kwargs)
            except ValueError as err:
                lines.append(f"Search: {err}")
            else:
                lines.append(str(rec))
                if rec.techniques:
                    plans["cheapest set that fits"] = rec.plan
        run = None
        if lengths is not None:
            knobs = {k: v for k, v in kwargs.items() if k not in ("micro_batch", "size", "quantize_base")}
            try:
                run = predict_run(spec, plan.gpu, lengths=lengths, micro_batch=kwargs.get("micro_batch", 1),
                                  max_length=kwargs.get("size"), eval_batches=eval_batches, host_gib=host_gib, **knobs)
            except ValueError as err:
                lines.append(f"The whole run: {err}")
            else:
                lines.append(str(run))
        fig, axes = plt.subplots(1 + (run is not None), 1, figsize=(9, 1.4 + 0.7 * len(plans) + 3 * (run is not None)),
                                 squeeze=False)
        plot_plans(plans, ax=axes[0][0], title=f"{spec.name} on {plan.gpu.name}: {plan.verdict}")
        if run is not None:
            plot_run(run, ax=axes[1][0])
        fig.tight_layout()
        plt.close(fig)
        return RenderResult(ok=True, message="\n".join(lines), figure=fig, plan=plan, recommendation=rec, run=run)
    except (ValueError, TypeError) as err:
        return RenderResult(ok=False, message=f"Cannot plan this: {err}")


def planner_widget(lengths=None):
    """The interactive planner: controls on top, the chart (or a message) below; with ``lengths`` (a dataset's
    sequence lengths) also the whole run's phases (``predict_run``), the sequence length as the longest a batch holds.

    The returned box has ``controls`` (name -> widget), ``last_result`` (a :class:`RenderResult`) and
    ``set(**values) -> str``: set controls by name (a model may be given by its preset name, e.g.
    ``set(model='gpt2', gpu='T4', micro_batch=8)``) and get the text shown.
    """
    import ipywidgets as w

    from ..plots import show_figure

    style, layout = {"description_width": "130px"}, w.Layout(width="460px")

    def slider(value, top, description, low=0, step=1):
        return w.IntSlider(value=value, min=low, max=top, step=step, description=description, style=style,
                           layout=layout)

    def pick(widget, name, options, value, **kw):
        return widget(options=options, value=value, description=name, style=style, **kw)

    c = dict(
        model=pick(w.Dropdown, "model", list(MODEL_CHOICES) + [CUSTOM_MODEL], MODEL_LABELS["gpt2-xl"], layout=layout),
        custom_params_m=slider(100, 20000, "params (M)", step=10),
        custom_act_mib=slider(50, 4000, "act. MiB/sample"),
        gpu=pick(w.Dropdown, "GPU", list(gpu_presets()) + [CUSTOM_GPU], "RTX 3060 (12 GB)", layout=layout),
        custom_gpu_gib=slider(8, 192, "custom GPU GiB"),
        micro_batch=slider(4, 256, "micro-batch"),
        size=slider(1024, 1024, "seq. length / image", step=16),
        accumulation=slider(8, 64, "accumulation", low=1),
        checkpointing=pick(w.ToggleButtons, "checkpointing", list(LABELS["checkpointing"]), "none"),
        precision=pick(w.Dropdown, "precision", list(LABELS["precision"]), "fp32", layout=layout),
        optimizer=pick(w.ToggleButtons, "optimizer", list(LABELS["optimizer"]), "Adam"),
        attention=pick(w.ToggleButtons, "attention", list(LABELS["attention"]), "fused (SDPA)"),
        lora_rank=slider(0, 64, "LoRA rank (0: off)"),
        host_gib=w.FloatSlider(value=round(host_ram_bytes() / GIB, 1), min=1, max=512, step=0.1,
                               description="host RAM (GiB)", style=style, layout=layout),
        **{name: w.Checkbox(value=name == "search", description=text) for name, text in LABELS["checkboxes"].items()},
    )
    held = [False]  # True while set() changes several controls: one update at the end

    def on_stream(change):  # streaming needs the optimizer on the CPU
        if change["new"]:
            c["master_on_cpu"].value = True

    def on_master(change):
        if not change["new"]:
            c["stream_grads"].value = c["stream_weights"].value = False

    def on_model(change):  # sensible size for the model family
        if change["new"] in MODEL_CHOICES:
            spec = get_model(MODEL_CHOICES[change["new"]])
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
                  w.HBox([c["lora_rank"], c["qlora"], c["search"]]), c["host_gib"], out])

    def update():
        result = box.last_result = render(**{k: v.value for k, v in c.items()}, lengths=lengths)
        out.clear_output(wait=True)
        with out:
            if result.ok:
                show_figure(result.figure)
            print(result.message if result.ok else "⚠ " + result.message)

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

    box.set = set_values
    box.controls = c
    for control in c.values():
        control.observe(lambda change: None if held[0] else update(), names="value")
    update()
    return box
