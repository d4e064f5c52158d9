"""A whole run priced, not one step: loading the weights, the first optimizer step (Adam's state appears), a training
step at the worst batch the sequence lengths allow, evaluation (with or without the logits kept) and saving a
checkpoint; each phase's peak on the device and in host RAM, and the phase that sets the run's peak.

``predict_run(model, gpu, lengths=..., micro_batch=...)`` returns a :class:`RunPlan`. The training steps come from
:func:`~.model.predict` (the same model of one step); the other phases are priced here, tensor by tensor:

* **load**: ``"init"`` builds the model with random weights and then reads a state dict (two copies in host RAM);
  ``"from_pretrained"`` builds it without memory (meta device) and reads the file once, in ``load_dtype``, plus the
  tied output head, read once before it is tied to the embedding; ``"to_device"`` (``device_map``) puts each tensor on
  the card as it is read: nothing stays on the host. On a CPU the host is the device: both peaks are the host's.
* **first step**: no optimizer state yet while backward runs; the state is made inside ``optimizer.step()``.
* **evaluation** under ``no_grad``: the weights and the state that waits for the next step, the current batch's fp32
  logits and its log-softmax, and, if the loop keeps them, every earlier batch's logits (on the device, or on the host
  as Trainer's ``eval_accumulation_steps`` moves them).
* **save**: ``"host_copy"`` copies the whole state dict (weights + optimizer state) to the host before writing, key
  by key (a tied head is a second key of the embedding's tensor: copied twice);
  ``"streamed"`` writes it one tensor at a time (``torch.save`` of device tensors, safetensors). With the state
  sharded over ``save_ranks`` ranks (FSDP), the save phase is one rank's: ``"sharded"``
  (``torch.distributed.checkpoint.save``) has each rank write its own share from where it lies, one tensor at a time
  to the host from a GPU, so a rank holds its share and no more (DCP's save plans, pickled and exchanged between the
  ranks, tens of KiB, are not priced); ``"gathered"`` (``get_state_dict(..., full_state_dict=True, cpu_offload=True)``
  then ``torch.save`` on rank 0) all-gathers each tensor whole and moves it to rank 0's host: rank 0 holds its
  share and the whole state on the host (a tied head twice: a key of its own), and from a GPU one whole tensor at a
  time on the device. Measured on two gloo ranks by
  notebook 11 and ``tests/test_run_planner.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..memory import _check_args, _MultiStepMemTracker, _params
from ..units import GIB, MIB
from .model import get_gpu, get_model, predict

PHASES = ("load", "first step", "training step", "evaluation", "save")
LOADS = ("init", "from_pretrained", "to_device")
SAVES = ("host_copy", "streamed", "sharded", "gathered")
PADDINGS = ("longest", "dynamic", "bucket", "packed")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class RunPlan:
    """Each phase's predicted peak (``phases``: name -> {"device": bytes, "host": bytes, "what": text}), the phase
    that sets the run's device peak, the worst batch the lengths allow (micro-batch, length) and the step at the
    average length beside it."""

    phases: dict
    peak_phase: str
    worst_batch: tuple
    average_step_bytes: int
    device: str
    gpu: object = None
    host_budget_bytes: int | None = None
    notes: list = field(default_factory=list)

    peak_bytes = property(lambda self: self.phases[self.peak_phase]["device"])
    host_peak_bytes = property(lambda self: max(p["host"] for p in self.phases.values()))
    host_peak_phase = property(lambda self: max(self.phases, key=lambda k: self.phases[k]["host"]))

    def frame(self):
        """A pandas table: phase x (device MiB, host MiB, what it holds), the run's peak marked."""
        import pandas as pd

        rows = {name: {"device MiB": p["device"] / MIB, "host MiB": p["host"] / MIB,
                       "sets the peak": "device" if name == self.peak_phase else "", "what": p["what"]}
                for name, p in self.phases.items()}
        return pd.DataFrame.from_dict(rows, orient="index").rename_axis("phase")

    def __str__(self) -> str:
        b, t = self.worst_batch
        lines = [f"The whole run on {self.device}: the peak is in '{self.peak_phase}', {self.peak_bytes / GIB:.2f} GiB "
                 f"(the worst batch: {b} x {t} tokens; a step at the average length: "
                 f"{self.average_step_bytes / GIB:.2f} GiB); host RAM at most {self.host_peak_bytes / GIB:.2f} GiB "
                 f"('{self.host_peak_phase}')"]
        lines += [f"  {name:<14} device {p['device'] / GIB:7.2f} GiB   host {p['host'] / GIB:7.2f} GiB   {p['what']}"
                  for name, p in self.phases.items()]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _choice(value, what, options):
    if value not in options:
        raise ValueError(f"{what} must be one of {list(options)}, not {value!r}.")
    return value


def _count(value, what, *, zero=False):
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ValueError(f"{what} must be a whole number {'>= 0' if zero else '>= 1'}, not {value!r}.")
    return value


def check_lengths(lengths) -> list[int]:
    """The sequence lengths as a list of positive ints (a list, a tensor or an array of them)."""
    values = lengths.tolist() if hasattr(lengths, "tolist") else lengths
    try:
        values = [int(v) for v in values if int(v) == v]
    except (TypeError, ValueError):
        raise ValueError("lengths must be the dataset's sequence lengths, a list of whole numbers (e.g. "
                         "[len(ids) for ids in documents]).") from None
    if not values or len(values) != len(list(lengths)) or min(values) < 1:
        raise ValueError("lengths must be a non-empty list of whole numbers >= 1, one per sequence in the dataset.")
    return values


def worst_batch(lengths, micro_batch: int, *, max_length: int | None = None, padding: str = "dynamic") -> tuple:
    """(micro-batch, length) of the largest batch the lengths allow: any batch may hold the longest sequence (cut at
    ``max_length``), whatever the padding; ``"packed"`` rows are always ``max_length`` long."""
    values = check_lengths(lengths)
    _count(micro_batch, "micro_batch")
    _choice(padding, "padding", PADDINGS)
    cap = _count(max_length, "max_length") if max_length is not None else max(values)
    if padding == "packed" and max_length is None:
        raise ValueError("packed rows need max_length: the length each row is filled to.")
    return micro_batch, cap if padding == "packed" else min(max(values), cap)


def _check_save(save, save_ranks) -> None:
    _choice(save, "save", SAVES)
    _count(save_ranks, "save_ranks")
    if save_ranks != 1 and save not in ("sharded", "gathered"):
        raise ValueError(f"save_ranks={save_ranks} needs a save over ranks: save='sharded' (each rank writes its share) "
                         f"or save='gathered' (rank 0 gathers the whole state), not save={save!r}.")


def _save_phase(checkpoint: int, largest: int, tied: int, save: str, save_ranks: int, on_cpu: bool) -> dict:
    """The save phase (see the module docstring) from the bytes of the whole checkpoint (weights + optimizer state),
    of its largest tensor and of a tied head's second key."""
    held = checkpoint if save in ("host_copy", "streamed") else -(-checkpoint // save_ranks)   # what a rank holds
    staged = {"host_copy": checkpoint + tied, "streamed": 0 if on_cpu else largest,
              "sharded": 0 if on_cpu else -(-largest // save_ranks), "gathered": checkpoint + tied}[save]
    # from a GPU, each tensor all-gathered on the device before it moves to the host; on a CPU it is the host's copy
    on_device = largest if save == "gathered" and not on_cpu else 0
    return dict(device=held + on_device + (staged if on_cpu else 0), host=staged,
                what={"host_copy": "the whole state dict copied to the host", "streamed": "one tensor at a time",
                      "sharded": f"one of {save_ranks} ranks: its share, written where it lies",
                      "gathered": f"rank 0 of {save_ranks}: its share, and the whole state gathered to its host"}[save])


def price_save(model: torch.nn.Module, *, save: str = "host_copy", save_ranks: int = 1, device: str = "cuda") -> dict:
    """The save phase of :func:`predict_run` for a module you built (its parameters, as they are, and Adam's fp32
    state: 8 bytes per parameter): ``{"device": bytes, "host": bytes, "what": text}``, one rank's when ``save`` is
    "sharded" or "gathered" over ``save_ranks`` ranks. The module may live on the meta device (nothing allocated)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (price a preset or a spec with predict_run), not "
                        f"{type(model).__name__}.")
    _choice(device, "device", ("cuda", "cpu"))
    _check_save(save, save_ranks)
    params = list(model.parameters())            # a tied weight once
    if not params:
        raise ValueError("the model has no parameters: nothing to save.")
    keys = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    tied = sum(p.numel() * p.element_size() * (keys.count(id(p)) - 1) for p in params)   # a second key, copied twice
    checkpoint = sum(p.numel() * (p.element_size() + 8) for p in params)
    phase = _save_phase(checkpoint, max(p.numel() * p.element_size() for p in params), tied, save, save_ranks,
                        device == "cpu")
    if device == "cpu":
        phase["host"] = phase["device"]
    return phase


def predict_run(model, gpu="RTX 3060 (12 GB)", *, lengths, micro_batch: int, max_length: int | None = None,
                padding: str = "dynamic", load: str = "from_pretrained", load_dtype: str = "fp32",
                eval_batch: int | None = None, eval_batches: int = 1, keep_logits: str | None = None,
                save: str = "host_copy", save_ranks: int = 1, device: str = "cuda", host_gib: float | None = None,
                **settings) -> RunPlan:
    """Price a whole run (see the module docstring): ``lengths`` of the dataset's sequences, ``micro_batch`` and
    ``max_length`` (sequences cut there; packed rows filled to it) for training; ``eval_batch`` (default
    ``micro_batch``) x the longest length for ``eval_batches`` evaluation batches, with ``keep_logits`` None, "device" or
    "host"; ``load``, ``load_dtype``, ``save`` and ``save_ranks``; ``settings``: :func:`predict`'s other knobs (fp32
    training only here)."""
    spec, card = get_model(model), get_gpu(gpu)
    _choice(load, "load", LOADS)
    _check_save(save, save_ranks)
    _choice(keep_logits, "keep_logits", (None, "device", "host"))
    wl = DTYPE_BYTES[_choice(load_dtype, "load_dtype", DTYPE_BYTES)]
    _count(eval_batches, "eval_batches")
    if settings.get("precision", "fp32") != "fp32":
        raise ValueError("predict_run prices fp32 training; leave precision out (or 'fp32').")
    if host_gib is not None and not (isinstance(host_gib, (int, float)) and host_gib > 0):
        raise ValueError(f"host_gib must be a positive number of GiB, not {host_gib!r}.")
    b, t = worst_batch(lengths, micro_batch, max_length=max_length, padding=padding)
    values = check_lengths(lengths)
    step = predict(spec, card, micro_batch=b, size=t, device=device, **settings)
    average = round(sum(min(v, t) for v in values) / len(values)) if padding != "packed" else t
    average_step = predict(spec, card, micro_batch=b, size=average, device=device, **settings)
    cat = step.by_category
    n, params, state = spec.n_params, cat["params"], cat["optimizer"]
    on_cpu = device == "cpu"
    tied = spec.output_per_unit * spec.hidden_size if spec.tied_head else 0

    host_load = {"init": 2 * 4 * n, "from_pretrained": (n + tied) * wl, "to_device": 0}[load]
    device_load = host_load if on_cpu else params + ((n + tied) * wl if load == "to_device" else 0)
    phases = {"load": dict(device=device_load, host=host_load, what={
        "init": "random weights + the state dict read", "from_pretrained": f"the file read once in {load_dtype}",
        "to_device": "each tensor straight to the device"}[load])}

    grads = 4 * n  # fp32 gradients; Adam's scratch in optimizer.step(): as predict() prices it
    scratch = 4 * n if not on_cpu else 2 * 4 * spec.largest_tensor
    in_step = params + grads + state + scratch
    phases["first step"] = dict(device=max(step.tensor_peak_bytes - state, in_step), host=step.host_bytes,
                                what="backward without Adam's state; the state made in optimizer.step()")
    phases["training step"] = dict(device=step.tensor_peak_bytes, host=step.host_bytes,
                                   what=f"the worst batch, {b} x {t} tokens: {step.phase}")

    logits = (eval_batch or micro_batch) * t * spec.output_per_unit * 4  # fp32 logits of one evaluation batch
    kept = (eval_batches - 1) * logits if keep_logits == "device" else 0
    on_host = eval_batches * logits if keep_logits == "host" else 0
    phases["evaluation"] = dict(device=params + state + kept + 2 * logits + (on_host if on_cpu else 0),
                                host=on_host, what={None: "no_grad; the loss reduced per batch", "device": "no_grad; every batch's logits kept on the device",
                                      "host": "no_grad; every batch's logits moved to the host"}[keep_logits])

    phases["save"] = _save_phase(params + state, 4 * spec.largest_tensor, 4 * tied, save, save_ranks, on_cpu)
    for p in phases.values():
        p["device"], p["host"] = int(p["device"]), int(p["host"])
        if on_cpu:
            p["host"] = p["device"]  # one memory
    peak = max(phases, key=lambda k: phases[k]["device"])
    run = RunPlan(phases=phases, peak_phase=peak, worst_batch=(b, t), average_step_bytes=average_step.tensor_peak_bytes,
                  device=device, gpu=card, host_budget_bytes=None if host_gib is None else int(host_gib * GIB))
    if not on_cpu and phases[peak]["device"] > card.memory_bytes:
        run.notes.append(f"'{peak}' does not fit {card.name} ({card.memory_gib:.1f} GiB that PyTorch can allocate)")
    if run.host_budget_bytes is not None and run.host_peak_bytes > run.host_budget_bytes:
        run.notes.append(f"'{run.host_peak_phase}' needs more host RAM than {host_gib} GiB")
    return run


def measure_phase(fn, *, model=None, optimizer=None) -> dict:
    """Run ``fn()`` once and return its peak tensor bytes on the device (the model's) and on the host (the CPU), each
    with the model's and optimizer's state counted where it lives (on a CPU both are the same memory)."""
    _check_args(fn, model, optimizer)
    params = _params(model, optimizer)
    device = params[0].device if params else torch.device("cpu")
    tracker = _MultiStepMemTracker()
    tracker.track_external(*(obj for obj in (model, optimizer) if obj is not None))
    with tracker:
        fn()
    peaks = {torch.device(d).type: int(s.get("Total", 0)) for d, s in tracker.get_tracker_snapshot("peak").items()}
    host = peaks.get("cpu", 0) + peaks.get("meta", 0)
    return {"device": host if device.type == "cpu" else peaks.get(device.type, 0), "host": host}
