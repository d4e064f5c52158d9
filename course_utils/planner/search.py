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
import math
from dataclasses import dataclass, replace

from ..hardware import host_ram_bytes
from ..units import GIB
from ..validation import positive_int, positive_number
from .llm import get_model
from .model import BEYOND_ADAM, CHECKPOINTING, Settings, make_settings, predict_settings
from .plan import Plan
from .specs import GPUSpec, get_gpu, presets


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
    # every micro-batch that divides the user's (down to 1 and 2 with accumulation, as practitioners run large models)
    splits = [f for f in range(1, base.micro_batch + 1) if base.micro_batch % f == 0]
    precisions = [base.precision]
    for p in (("bf16_amp", "bf16") if gpu.bf16 else ("fp16_amp", "fp16")):
        if base.precision == "fp32" or (base.precision.endswith("_amp") and p in ("fp16", "bf16")):
            precisions.append(p)
    optimizers = [base.optimizer] + [o for o in optimizers if base.optimizer in ("adam", "adamw", "adamw_fused") and (
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


def host_limit_bytes(host_gib=None) -> float:
    """The host RAM a plan may use, in bytes: ``host_gib`` GiB (``math.inf``: no limit, said on purpose), or by default
    this machine's RAM (``hardware.host_ram_bytes``: on free Colab 12.7 GiB)."""
    if host_gib is None:
        return float(host_ram_bytes())
    if host_gib == math.inf:
        return math.inf
    return GIB * positive_number(host_gib, "host_gib", "the host's RAM in GiB, e.g. 32 (12.7 on free Colab), or "
                                 "None for this machine's")


def cheapest_fit(model, gpu="RTX 3060 (12 GB)", *, host_gib=None, optimizers=("adam8bit",),
                 **settings) -> Recommendation:
    """The set of the course's techniques that fits ``gpu`` at the lowest predicted step time (see the module
    docstring), keeping the effective batch (micro_batch x accumulation). ``settings``: the fields of
    :class:`.model.Settings`; ``host_gib``: the host RAM a plan may use (its ``host_bytes``; default: this machine's
    RAM; ``math.inf``: no limit); ``optimizers``: those Adam may be replaced by (default: 8-bit Adam; notebook 10's:
    ``tuple(BEYOND_ADAM)``). "Fits" means the high end of the plan's range (tensors + allocator reserve + cuBLAS's
    workspaces + the CUDA context, widened by the planner's measured error) fits what PyTorch can allocate on the
    card. Raises ValueError when nothing fits, saying what to change.
    """
    model = get_model(model)
    gpu = get_gpu(gpu)
    base = make_settings(model, **settings)
    unknown = [o for o in optimizers if o not in ("adam8bit", *BEYOND_ADAM)] if isinstance(optimizers, (list, tuple)) \
        else [optimizers]
    if unknown:
        raise ValueError(f"optimizers must be a tuple of {('adam8bit', *BEYOND_ADAM)}, not {unknown!r} in it.")
    host_limit = host_limit_bytes(host_gib)
    host_gib = host_limit / GIB
    baseline = predict_settings(model, gpu, base)
    if baseline.fits and baseline.host_bytes <= host_limit:  # nothing to turn on; faster options are the learner's choice
        return Recommendation(plan=baseline, baseline=baseline, techniques=[], notebooks={}, slowdown=1.0)
    plans = [predict_settings(model, gpu, s) for s in candidate_settings(base, gpu, model, optimizers)]
    fitting = [p for p in plans if p.fits and p.host_bytes <= host_limit]
    on_card = [p for p in plans if p.fits]
    if on_card and not fitting:  # the card could hold a plan: the host RAM limit is what rules them all out
        least = min(on_card, key=lambda p: p.host_bytes)
        raise ValueError(
            f"Nothing fits in {host_gib:.1f} GiB of host RAM: {model.name} on {gpu.name} fits only with the host holding "
            f"{least.host_bytes / GIB:.1f} GiB or more ({', '.join(least.settings.techniques(base))}): allow more host "
            f"RAM than {host_gib:.1f} GiB, or train fewer weights (lora_rank, with quantize_base for QLoRA), or choose "
            "a GPU with more memory.")
    if not fitting:
        smallest = min(plans, key=lambda p: p.peak_bytes)
        low, expected, high = smallest.range_bytes
        raise ValueError(
            f"Nothing fits: {model.name} needs at least {expected / GIB:.2f} GiB (range {low / GIB:.2f}-"
            f"{high / GIB:.2f}) even with every technique ({', '.join(smallest.settings.techniques(base))}) and "
            f"micro-batch {smallest.settings.micro_batch}, but PyTorch can allocate {gpu.memory_gib:.2f} GiB on "
            f"{gpu.name}. Choose a GPU with more memory, a shorter sequence / "
            f"smaller image, or a smaller model; or shard across GPUs (notebooks/07_beyond_one_gpu.ipynb)"
            + (f"; or allow more host RAM than {host_gib:.1f} GiB." if host_limit < math.inf else "."))
    # the fastest; ties go to fewer techniques, then to the smaller peak
    plan = min(fitting, key=lambda p: (round(p.step_seconds, 6), len(p.settings.techniques(base)), p.peak_bytes))
    techniques = plan.settings.techniques(base)
    notebooks = {t: next(nb for words, nb in presets()["technique_notebooks"] if words in t.lower())
                 for t in techniques}  # each technique's notebook: the first whose words its name contains
    return Recommendation(plan=plan, baseline=baseline, techniques=techniques, notebooks=notebooks,
                          slowdown=plan.step_seconds / baseline.step_seconds)


VARIES = {"size": "the sequence length (tokens) or image size", "micro_batch": "the micro-batch",
          "lora_rank": "LoRA's rank"}


@dataclass
class LargestFit:
    """``largest_fit``'s answer: the largest value of ``vary`` whose plan fits, by the high end of the plan's range
    (``value``: safe), by its expected peak (``expected``) and by its low end (``optimistic``); None where even the
    smallest does not fit; ``plan``: the plan at ``value`` (else at ``expected``, else None)."""

    model: str
    gpu: str
    vary: str
    value: int | None
    expected: int | None
    optimistic: int | None
    plan: Plan | None
    limit: int

    def __str__(self) -> str:
        what = VARIES[self.vary]
        if self.optimistic is None:
            return f"{self.model} on {self.gpu}: nothing fits, even at {self.vary}=1 (see planner.predict)."
        capped = " (the search's limit)" if self.value == self.limit else ""
        head = (f"{self.model} on {self.gpu}: the largest {what} that fits is {self.value}{capped}" if self.value
                else f"{self.model} on {self.gpu}: no {what} fits by the high end of the range")
        return (f"{head}; by the expected peak {self.expected}, by the low end {self.optimistic} "
                f"(the range: how far published measurements fell from the planner's predictions)"
                + (f"\n{self.plan}" if self.plan else ""))


def largest_fit(model, gpu="RTX 3060 (12 GB)", vary: str = "size", *, host_gib=None, step: int = 1,
                limit: int | None = None, **settings) -> LargestFit:
    """The question users ask most: the largest sequence length (``vary='size'``), micro-batch (``'micro_batch'``) or
    LoRA rank (``'lora_rank'``) whose plan fits ``gpu`` and the host RAM (``host_gib``, default this machine's), with
    the other ``settings`` as given (the fields of :class:`.model.Settings`, without ``vary``'s). Searched in
    multiples of ``step`` up to ``limit`` (default: the model's longest sequence, 4096 samples, or the model's width)
    by bisection: memory grows with each of them. Returns a :class:`LargestFit` with the answer by the high end of
    the range (the safe one), the expected peak and the low end."""
    model = get_model(model)
    gpu = get_gpu(gpu)
    if vary not in VARIES:
        raise ValueError(f"vary must be one of {list(VARIES)}, not {vary!r}.")
    if vary in settings:
        raise ValueError(f"largest_fit finds {vary} itself: leave it out of the settings (got {vary}={settings[vary]!r}).")
    step = positive_int(step, "step", "e.g. 128 tokens, or 1")
    if vary == "lora_rank" and model.linears:
        default_limit = min(min(d_in, d_out) for _, d_in, d_out in model.linears)
    else:
        default_limit = {"size": model.max_size or 1 << 20, "micro_batch": 4096, "lora_rank": model.hidden_size}[vary]
    limit = positive_int(default_limit if limit is None else limit, "limit", "the largest value to try")
    host_limit = host_limit_bytes(host_gib)
    knobs = dict({"micro_batch": 1} if vary != "micro_batch" and "micro_batch" not in settings else {}, **settings)
    make_settings(model, **knobs, **{vary: step})  # says what to change before the search

    def plan_at(k: int) -> Plan:
        return predict_settings(model, gpu, make_settings(model, **knobs, **{vary: k * step}))

    def largest(index: int) -> int | None:  # the largest multiple whose (low, expected, high)[index] fits
        def ok(k):
            p = plan_at(k)
            return p.range_bytes[index] <= gpu.memory_bytes and p.host_bytes <= host_limit
        lo, hi = 0, limit // step  # ok(lo) holds (lo = 0: nothing tried yet), the answer is in [lo, hi]
        if hi == 0 or not ok(1):
            return None
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
        return lo * step

    value, expected, optimistic = (largest(i) for i in (2, 1, 0))
    at = value or expected
    return LargestFit(model=model.name, gpu=gpu.name, vary=vary, value=value, expected=expected,
                      optimistic=optimistic, plan=plan_at(at // step) if at else None, limit=limit // step * step)
