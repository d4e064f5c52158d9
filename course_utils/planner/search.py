"""The search: the cheapest set of the course's techniques that fits a GPU.

Every combination of smaller micro-batches (more accumulation steps), checkpointing, lower precision, 8-bit Adam, the
optimizer and fp32 master weights on the CPU, streamed gradients and notebooks 08-09's toggles (offloaded activations,
chunked loss, the update fused into backward, weights streamed from the CPU; with LoRA, QLoRA's 4-bit frozen weights)
is predicted; of those that fit, the one
with the lowest predicted time per optimizer step wins (ties: fewer techniques). The device, the attention, the loop
(``keep_outputs``) and the goal (``lora_rank``: adapters or every weight) stay as given.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ..units import GIB
from ..validation import positive_number
from .model import BEYOND_ADAM, CHECKPOINTING, Plan, Settings, make_settings, predict_settings
from .specs import GPUSpec, get_gpu, get_model, presets


@dataclass
class Recommendation:
    """The plan the search picked, what it turns on, and the notebooks that teach it."""

    plan: Plan
    baseline: Plan
    techniques: list
    notebooks: dict
    slowdown: float  # predicted step time / the baseline's

    def __str__(self) -> str:
        if not self.techniques:
            head = f"{self.baseline.model.name} fits {self.baseline.gpu.name} as it is: nothing to turn on."
        else:
            head = (f"Cheapest set that fits (by the planner's time model, {self.slowdown:.2f}x the baseline's "
                    f"predicted step time):")
        lines = [head] + [f"  - {t}  ->  notebooks/{self.notebooks[t]}" for t in self.techniques]
        lines.append(f"  predicted peak {self.plan.peak_bytes / GIB:.2f} GiB of {self.plan.gpu.memory_gib:.1f} GiB "
                     f"(baseline {self.baseline.peak_bytes / GIB:.2f} GiB)")
        return "\n".join(lines)


def candidate_settings(base: Settings, gpu: GPUSpec, model, optimizers=("adam8bit",)):
    """Every combination the search tries from the user's ``base`` settings (for ``model``, a ModelSpec: the chunked
    loss needs a vocabulary head); ``optimizers``: those it may switch Adam to."""
    splits = [f for f in (1, 2, 4, 8, 16, 32, 64, 128) if f <= base.micro_batch and base.micro_batch % f == 0]
    precisions = [base.precision]
    for p in (("bf16_amp", "bf16") if gpu.bf16 else ("fp16_amp", "fp16")):
        if base.precision == "fp32" or (base.precision.endswith("_amp") and p in ("fp16", "bf16")):
            precisions.append(p)
    optimizers = [base.optimizer] + [o for o in optimizers if base.optimizer in ("adam", "adamw") and (
        o not in BEYOND_ADAM or (model.unit == "token" and not model.linears and base.lora_rank is None))]
    ckpts = [base.checkpointing] if base.checkpointing != "none" else list(CHECKPOINTING)
    offloads = [(base.master_on_cpu, base.stream_grads)] + [
        o for o in ((True, False), (True, True)) if o != (base.master_on_cpu, base.stream_grads) and
        (not base.master_on_cpu or o[0]) and (not base.stream_grads or o[1]) and base.lora_rank is None]
    chunked = {base.chunked_loss, bool(model.output_per_unit)}
    quantized = {base.quantize_base} | ({"nf4_double"} if base.lora_rank and model.unit == "token" else set())
    for f, p, o, c, (m, st), off, ch, fu, sw, q in itertools.product(
            splits, precisions, optimizers, ckpts, offloads, {base.offload_activations, True}, chunked,
            {base.fused_update, True}, {base.stream_weights, True}, quantized):
        acc = base.accumulation * f
        if ((fu and (acc > 1 or m or p.startswith("fp16"))) or (sw and not m)
                or (o == "adamw_bf16_sr" and (p != "bf16" or m)) or (q and p.endswith("_amp"))):
            continue  # combinations make_settings refuses
        yield replace(base, micro_batch=base.micro_batch // f, accumulation=acc, precision=p, optimizer=o,
                      checkpointing=c, master_on_cpu=m, stream_grads=st, offload_activations=off, chunked_loss=ch,
                      fused_update=fu, stream_weights=sw, quantize_base=q)


def cheapest_fit(model, gpu="RTX 3060 (12 GB)", *, host_gib=None, optimizers=("adam8bit",),
                 **settings) -> Recommendation:
    """The set of the course's techniques that fits ``gpu`` at the lowest predicted step time (see the module
    docstring), keeping the effective batch (micro_batch x accumulation). ``settings``: the fields of
    :class:`.model.Settings`; ``host_gib``: the host RAM a plan may use (its ``host_bytes``; default: no limit);
    ``optimizers``: those Adam may be replaced by (default: 8-bit Adam; notebook 10's: ``tuple(BEYOND_ADAM)``).
    "Fits" means tensors + allocator reserve + CUDA context fit the card. Raises ValueError when nothing fits, saying
    what to change.
    """
    model = get_model(model)
    gpu = get_gpu(gpu)
    base = make_settings(model, **settings)
    unknown = [o for o in optimizers if o not in ("adam8bit", *BEYOND_ADAM)] if isinstance(optimizers, (list, tuple)) \
        else [optimizers]
    if unknown:
        raise ValueError(f"optimizers must be a tuple of {('adam8bit', *BEYOND_ADAM)}, not {unknown!r} in it.")
    host_limit = float("inf") if host_gib is None else GIB * positive_number(
        host_gib, "host_gib", "the machine's RAM in GiB, e.g. 32, or None for no limit")
    baseline = predict_settings(model, gpu, base)
    if baseline.fits:  # nothing to turn on; faster options are the learner's choice
        return Recommendation(plan=baseline, baseline=baseline, techniques=[], notebooks={}, slowdown=1.0)
    plans = [predict_settings(model, gpu, s) for s in candidate_settings(base, gpu, model, optimizers)]
    fitting = [p for p in plans if p.fits and p.host_bytes <= host_limit]
    on_card = [p for p in plans if p.fits]
    if on_card and not fitting:  # the card could hold a plan: the host RAM limit is what rules them all out
        least = min(on_card, key=lambda p: p.host_bytes)
        raise ValueError(
            f"Nothing fits in {host_gib:g} GiB of host RAM: {model.name} on {gpu.name} fits only with the host holding "
            f"{least.host_bytes / GIB:.1f} GiB or more ({', '.join(least.settings.techniques(base))}): allow more host "
            f"RAM than {host_gib:g} GiB, or train fewer weights (lora_rank, with quantize_base for QLoRA), or choose "
            "a GPU with more memory.")
    if not fitting:
        smallest = min(plans, key=lambda p: p.peak_bytes)
        raise ValueError(
            f"Nothing fits: {model.name} needs at least {smallest.peak_bytes / GIB:.2f} GiB even with every technique "
            f"({', '.join(smallest.settings.techniques(base))}) and micro-batch {smallest.settings.micro_batch}, "
            f"but {gpu.name} has {gpu.memory_gib:.1f} GiB. Choose a GPU with more memory, a shorter sequence / "
            f"smaller image, or a smaller model; or shard across GPUs (notebooks/07_beyond_one_gpu.ipynb)"
            + (f"; or allow more host RAM than {host_gib:g} GiB." if host_gib is not None else "."))
    # the fastest; ties go to fewer techniques, then to the smaller peak
    plan = min(fitting, key=lambda p: (round(p.step_seconds, 6), len(p.settings.techniques(base)), p.peak_bytes))
    techniques = plan.settings.techniques(base)
    notebooks = {t: next(nb for words, nb in presets()["technique_notebooks"] if words in t.lower())
                 for t in techniques}  # each technique's notebook: the first whose words its name contains
    return Recommendation(plan=plan, baseline=baseline, techniques=techniques, notebooks=notebooks,
                          slowdown=plan.step_seconds / baseline.step_seconds)
