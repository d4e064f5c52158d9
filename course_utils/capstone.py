"""The capstone's reusable pieces: GPT-2-XL fine-tuning inside a small GPU (notebook 06).

The recipe (seed article 003, "How to fine tune VERY large model if it doesn't fit on your GPU"):

* the GPU holds a 16-bit copy of the model (the *device model*) that runs forward and backward,
  with gradient checkpointing, one micro-batch at a time;
* the CPU holds the fp32 *master* copy and the optimizer (8-bit Adam here), which steps there;
* after the micro-batches of one optimizer step, the gradients are copied GPU -> CPU master,
  unscaled by the loss scale and checked for inf/NaN (fp16 overflow: skip the step, lower the
  scale), the optimizer steps on the CPU, and the new weights are copied back to the GPU.

:class:`MasterCopyTrainer` is that recipe. :class:`StreamedGradTrainer` goes further (issue 12):
each gradient leaves the GPU the moment backward has produced it
(``Tensor.register_post_accumulate_grad_hook``), is summed into the fp32 master gradient on the
CPU across micro-batches, and its GPU memory is freed at once, so the GPU never holds all the
gradients together.

Also here: a fake-tensor prediction of the GPU peak (:func:`predict_gpu_peak`), atomic
checkpoints that resume bit-for-bit (:func:`save_checkpoint`, :func:`load_checkpoint`), an offline
corpus (the course's own prose, :func:`course_corpus`), a byte-level tokenizer used when GPT-2's
cannot be loaded offline (:class:`ByteTokenizer`, :func:`load_tokenizer`), resumable batches
(:class:`TokenBatches`) and the PCIe arithmetic of both recipes (:func:`pcie_bytes_per_step`).
The training loops themselves stay in the notebook.
"""
from __future__ import annotations

import collections
import json
import math
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from . import paths
from .validation import positive_int, positive_number

CORPUS_FILE = "course_corpus.txt"  # in course_utils/data_files/, made by scripts/build_corpus.py
OPTIMIZER_NAMES = ("adam8bit", "adam", "adamw", "sgd")
VARIANTS = ("recipe", "streamed")


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------
def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


# ----------------------------------------------------------------------------------------------
# dynamic loss scaling (what torch.amp.GradScaler does, for a model whose optimizer is elsewhere)
# ----------------------------------------------------------------------------------------------
class LossScaler:
    """Dynamic loss scale for an fp16 model (Micikevicius et al. 2017).

    The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to
    zero; gradients are divided by it before the optimizer sees them. When any gradient is
    inf/NaN (fp16 overflow), the step is skipped and the scale multiplied by ``backoff_factor``;
    after ``growth_interval`` good steps in a row it is multiplied by ``growth_factor``.
    ``dynamic=False`` keeps the scale fixed (1.0 for fp32/bf16 models, which need no scaling).
    """

    def __init__(self, init_scale: float = 2.0**16, *, dynamic: bool = True, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, min_scale: float = 1.0):
        self.scale = positive_number(init_scale, "init_scale")
        self.growth_factor = positive_number(growth_factor, "growth_factor")
        self.backoff_factor = positive_number(backoff_factor, "backoff_factor")
        self.growth_interval = positive_int(growth_interval, "growth_interval")
        self.min_scale = positive_number(min_scale, "min_scale")
        if not isinstance(dynamic, bool):
            raise TypeError(f"dynamic must be True or False, not {dynamic!r}.")
        if self.growth_factor <= 1:
            raise ValueError(f"growth_factor must be above 1 (got {growth_factor}), e.g. 2.0.")
        if self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be below 1 (got {backoff_factor}), e.g. 0.5.")
        self.dynamic = dynamic
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        """After a step: lower the scale on overflow, raise it after ``growth_interval`` good steps."""
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not {"scale", "good_steps"} <= set(state):
            raise ValueError("A LossScaler state must be the dict state_dict() returned (keys scale, good_steps).")
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.dynamic = bool(state.get("dynamic", self.dynamic))

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale:g}, dynamic={self.dynamic}, good_steps={self.good_steps})"


# ----------------------------------------------------------------------------------------------
# the two-copy recipe
# ----------------------------------------------------------------------------------------------
def _make_optimizer(spec, params: list, lr: float, weight_decay: float):
    if callable(spec) and not isinstance(spec, str):
        opt = spec(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer factory must return a torch.optim.Optimizer, not {type(opt).__name__}; "
                "e.g. optimizer=lambda params: torch.optim.Adam(params, lr=1e-4)."
            )
        return opt
    if not isinstance(spec, str):
        raise TypeError(f"optimizer must be one of {OPTIMIZER_NAMES} or a callable params -> Optimizer, not {spec!r}.")
    name = spec.lower().replace("-", "").replace("_", "")
    if name == "adam8bit":
        import bitsandbytes as bnb  # 0.50.2 steps on the CPU

        return bnb.optim.Adam8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"Unknown optimizer {spec!r}; choose one of {OPTIMIZER_NAMES} or pass a callable params -> Optimizer.")


class MasterCopyTrainer:
    """The article's two-copy scheme: a 16-bit device model, an fp32 CPU master copy that steps.

    Use it like this (the loop stays yours)::

        trainer = MasterCopyTrainer(model, optimizer="adam8bit", lr=1e-4)
        for step in range(n_steps):
            for micro in range(accum_steps):
                loss = model(input_ids=x, labels=x).loss
                trainer.backward(loss / accum_steps)   # scaled by the loss scale
            applied = trainer.step()                   # False: fp16 overflow, step skipped

    Args:
        model: the device model (fp16 on a GPU; fp16, bf16 or fp32 on the CPU).
        optimizer: ``'adam8bit'`` (bitsandbytes, steps on the CPU), ``'adam'``, ``'adamw'``, ``'sgd'``,
            or a callable ``params -> torch.optim.Optimizer`` built on the master parameters.
        lr, weight_decay: used by the named optimizers.
        loss_scale: ``None`` chooses: dynamic scaling from 2**16 for an fp16 model, a fixed 1.0
            otherwise; ``'dynamic'`` forces dynamic; a number fixes the scale.
        growth_interval: good steps before a dynamic scale doubles.
        host_device: where the master copy lives: ``'cpu'``. A fake-tensor prediction whose fake
            "GPU" is the CPU passes ``'meta'`` so the host side stays apart from the measured device.
    """

    variant = "recipe"

    def __init__(self, model: nn.Module, optimizer="adam8bit", *, lr: float = 1e-4, weight_decay: float = 0.0,
                 loss_scale=None, init_scale: float = 2.0**16, growth_interval: int = 1000,
                 host_device: str = "cpu"):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (the device model), not {type(model).__name__}.")
        self.model = model
        self.device_params = [p for p in model.parameters() if p.requires_grad]
        if not self.device_params:
            raise ValueError("The model has no trainable parameters (requires_grad=True); nothing to train.")
        self.lr = positive_number(lr, "lr")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"weight_decay must be a number >= 0, not {weight_decay!r}.")
        self.weight_decay = float(weight_decay)
        self.param_dtype = self.device_params[0].dtype
        if not self.param_dtype.is_floating_point:
            raise TypeError(f"The device model's parameters must be floating point, not {self.param_dtype}.")
        if loss_scale is None:
            dynamic = self.param_dtype == torch.float16
            self.scaler = LossScaler(init_scale if dynamic else 1.0, dynamic=dynamic, growth_interval=growth_interval)
        elif loss_scale == "dynamic":
            self.scaler = LossScaler(init_scale, dynamic=True, growth_interval=growth_interval)
        elif isinstance(loss_scale, str):
            raise ValueError(f"loss_scale must be None, 'dynamic' or a positive number, not {loss_scale!r}.")
        else:
            self.scaler = LossScaler(positive_number(loss_scale, "loss_scale"), dynamic=False)
        if host_device not in ("cpu", "meta"):
            raise ValueError(f"host_device must be 'cpu' (or 'meta' for fake-tensor predictions), not {host_device!r}.")
        self.host_device = host_device
        # the fp32 master copy on the CPU, with its gradient buffers allocated once
        with torch.no_grad():
            self.master_params = []
            for p in self.device_params:
                master = nn.Parameter(p.detach().to(device=host_device, dtype=torch.float32, copy=True))
                master.grad = torch.zeros_like(master)
                self.master_params.append(master)
        self._optimizer_spec = optimizer
        if not (callable(optimizer) or isinstance(optimizer, str)):
            raise TypeError(f"optimizer must be one of {OPTIMIZER_NAMES} or a callable params -> Optimizer, not {optimizer!r}.")
        if isinstance(optimizer, str):
            key = optimizer.lower().replace("-", "").replace("_", "")
            if key not in OPTIMIZER_NAMES:
                raise ValueError(f"Unknown optimizer {optimizer!r}; choose one of {OPTIMIZER_NAMES}.")
        self._optimizer = None  # built on first use: a fake-tensor prediction never needs it
        self.steps = 0  # optimizer steps applied
        self.skipped_steps = 0  # skipped for inf/NaN gradients

    # the optimizer is built lazily so that building a trainer on fake tensors costs nothing
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = _make_optimizer(self._optimizer_spec, self.master_params, self.lr, self.weight_decay)
        return self._optimizer

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * loss_scale).backward()``. Divide the loss by the accumulation steps yourself."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("backward() takes the scalar loss tensor of one micro-batch (e.g. `out.loss / accum`).")
        if not loss.requires_grad:
            raise ValueError("The loss does not require grad: was it computed under torch.no_grad() or model.eval()?")
        scale = self.scaler.scale
        (loss * scale if scale != 1.0 else loss).backward()

    # -- the step, in the article's three moves ------------------------------------------------
    def _collect_grads(self) -> None:
        """Device gradients -> fp32 master gradients on the CPU (still scaled)."""
        with torch.no_grad():
            for p, m in zip(self.device_params, self.master_params):
                if p.grad is None:
                    m.grad.zero_()  # a parameter the loss did not use
                else:
                    m.grad.copy_(p.grad)

    def _found_inf(self) -> bool:
        return any(not bool(torch.isfinite(m.grad).all()) for m in self.master_params)

    def _unscale(self) -> None:
        scale = self.scaler.scale
        if scale != 1.0:
            inv = 1.0 / scale
            for m in self.master_params:
                m.grad.mul_(inv)

    def _copy_weights_back(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.device_params, self.master_params):
                # cast on the CPU first, so the GPU never holds a temporary fp32 copy
                src = m.detach() if m.dtype == p.dtype else m.detach().to(p.dtype)
                p.copy_(src, non_blocking=False)

    def _zero_grads(self) -> None:
        for p in self.device_params:
            p.grad = None
        for m in self.master_params:
            m.grad.zero_()

    def step(self) -> bool:
        """Copy grads to the CPU master, unscale, check overflow, step, copy weights back.

        Returns True when the optimizer stepped, False when the step was skipped because a
        gradient was inf/NaN (the loss scale is then lowered). Gradients are zeroed either way.
        """
        self._collect_grads()
        found_inf = self._found_inf()
        if not found_inf:
            self._unscale()
            self.optimizer.step()
            self._copy_weights_back()
            self.steps += 1
        else:
            self.skipped_steps += 1
        self.scaler.update(found_inf)
        self._zero_grads()
        return not found_inf

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Master weights (fp32, CPU), optimizer state (8-bit included), loss scale, counters."""
        return {
            "variant": self.variant,
            "master_params": [m.detach() for m in self.master_params],  # no copy (RAM): save it now
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved and copy the master weights to the device model."""
        if not isinstance(state, dict) or "master_params" not in state:
            raise ValueError("load_state_dict needs the dict that state_dict() returned (it has 'master_params').")
        saved = state["master_params"]
        if len(saved) != len(self.master_params):
            raise ValueError(
                f"The checkpoint holds {len(saved)} parameter tensors, this model {len(self.master_params)}: "
                "it was saved from a different model. Delete the checkpoint folder or use the same config."
            )
        for m, s in zip(self.master_params, saved):
            if tuple(m.shape) != tuple(s.shape):
                raise ValueError(f"Checkpoint tensor of shape {tuple(s.shape)} does not fit parameter {tuple(m.shape)}.")
        with torch.no_grad():
            for m, s in zip(self.master_params, saved):
                m.copy_(s)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.steps = int(state.get("steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._copy_weights_back()
        self._zero_grads()

    def __repr__(self) -> str:
        n = sum(m.numel() for m in self.master_params)
        return (f"{type(self).__name__}({n:,} params, device {self.param_dtype} on "
                f"{self.device_params[0].device.type}, master fp32 on cpu, {self.scaler})")


class StreamedGradTrainer(MasterCopyTrainer):
    """The recipe with gradients streamed to the CPU during backward (issue 12).

    A ``register_post_accumulate_grad_hook`` on every device parameter fires as soon as backward
    has finished that parameter's gradient. The hook copies the gradient into a CPU staging
    buffer (pinned memory on CUDA, on a side CUDA stream so the copy overlaps the rest of
    backward), adds it to the fp32 master gradient (accumulating across micro-batches in fp32),
    and sets ``param.grad = None`` so its GPU memory is freed at once. ``step()`` then has no
    copy to do: it unscales, checks for inf/NaN, steps and copies the weights back, exactly like
    :class:`MasterCopyTrainer`. Call :meth:`remove_hooks` when done with the trainer.
    """

    variant = "streamed"

    def __init__(self, model: nn.Module, optimizer="adam8bit", **kwargs):
        super().__init__(model, optimizer, **kwargs)
        real_cuda = (torch.cuda.is_available() and self.device_params[0].is_cuda
                     and not _is_fake(self.device_params[0]))
        # staging buffers: one per parameter, in the device dtype, allocated once
        self._staging = [
            torch.empty(p.shape, dtype=p.dtype, device=self.host_device, pin_memory=real_cuda) for p in self.device_params
        ]
        self._copy_stream = torch.cuda.Stream(device=self.device_params[0].device) if real_cuda else None
        self._pending: collections.deque = collections.deque()  # (index, cuda event) copies in flight
        self._pending_ids: set[int] = set()
        self.bytes_to_host = 0  # bytes of gradient copied device -> host so far
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.device_params)
        ]

    def _make_hook(self, index: int) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)

        return hook

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # pragma: no cover - the hook only fires with a gradient
            return
        buf = self._staging[i]
        self.bytes_to_host += grad.numel() * grad.element_size()
        with torch.no_grad():
            if self._copy_stream is None:
                buf.copy_(grad)
                self.master_params[i].grad.add_(buf)  # fp32 += fp16/bf16/fp32, in place
            else:
                if i in self._pending_ids:  # the previous micro-batch's copy of this tensor is still queued
                    self._drain(block=True)
                compute = torch.cuda.current_stream(grad.device)
                self._copy_stream.wait_stream(compute)  # the gradient is ready on the compute stream
                with torch.cuda.stream(self._copy_stream):
                    buf.copy_(grad, non_blocking=True)
                grad.record_stream(self._copy_stream)  # keep its memory until the copy is done
                event = torch.cuda.Event()
                event.record(self._copy_stream)
                self._pending.append((i, event))
                self._pending_ids.add(i)
                self._drain(block=False)  # sum on the CPU whatever has already arrived
        param.grad = None  # free the device gradient now

    def _drain(self, block: bool) -> None:
        while self._pending and (block or self._pending[0][1].query()):
            i, event = self._pending.popleft()
            event.synchronize()
            self._pending_ids.discard(i)
            self.master_params[i].grad.add_(self._staging[i])

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        self._drain(block=True)

    def _collect_grads(self) -> None:
        self._drain(block=True)  # the master gradients already hold the sum
        for p in self.device_params:  # a loss.backward() without the hooks would leave grads here
            if p.grad is not None:
                raise RuntimeError("A device gradient was not streamed: were the hooks removed before backward?")

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the device model (the trainer can no longer train it)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ----------------------------------------------------------------------------------------------
# fake-tensor prediction of the GPU peak
# ----------------------------------------------------------------------------------------------
def enable_checkpointing(model: nn.Module) -> None:
    """Gradient (activation) checkpointing on a transformers model, non-reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable({"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise TypeError(f"{type(model).__name__} has no gradient checkpointing switch; pass a transformers model.")
    if hasattr(model, "config"):
        model.config.use_cache = False


def fake_device() -> str:
    """The device a fake-tensor prediction claims: 'cuda' where a GPU is present, else 'cpu'.

    Fake CUDA tensors can be created without a GPU (CUDA build of torch), but autograd's
    backward asks the CUDA driver for a context and fails there, so without a GPU the
    prediction runs its fake tensors on 'cpu': the same shapes, dtypes and memory.
    """
    return "cuda" if torch.cuda.is_available() else "cpu"


def predict_gpu_peak(config_or_name="gpt2-xl", *, variant: str = "recipe", micro_batch: int = 4,
                     seq_len: int = 1024, dtype: torch.dtype = torch.float16, device: str | None = None,
                     **overrides):
    """Predict the GPU peak of one micro-step (forward + backward) of the capstone, with fake tensors.

    Builds the GPT-2 model under ``FakeTensorMode`` (shapes, no memory) in ``dtype`` with
    gradient checkpointing, wraps it in :class:`MasterCopyTrainer` (``variant='recipe'``: every
    gradient stays on the GPU until the step) or :class:`StreamedGradTrainer` (``'streamed'``:
    gradients leave during backward), and measures one forward + backward with
    :func:`course_utils.memory.measure_memory`. The CPU side (master copy, staging buffers) is
    allocated before the measurement and is not counted. GPT-2-XL costs about 75 s on 2 cores.

    Returns the :class:`course_utils.memory.MemoryReport`.
    """
    from . import models
    from .memory import measure_memory

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}.")
    positive_int(micro_batch, "micro_batch")
    positive_int(seq_len, "seq_len")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.float16, not {dtype!r}.")
    device = device or fake_device()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}.")
    config = models.gpt2_config(config_or_name, **overrides) if isinstance(config_or_name, str) else config_or_name
    if seq_len > config.n_positions:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context ({config.n_positions} tokens).")
    cls = MasterCopyTrainer if variant == "recipe" else StreamedGradTrainer
    with models.fake_mode():
        with torch.device(device):
            model = models.build_gpt2(config, dtype=dtype)
        enable_checkpointing(model)
        model.train()
        # with a fake "GPU" on the CPU, keep the host side on 'meta' so it is not measured as device memory
        trainer = cls(model, optimizer="adam8bit", host_device="meta" if device == "cpu" else "cpu")

        def micro_step():
            ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
            loss = model(input_ids=ids, labels=ids).loss
            trainer.backward(loss)

        with warnings.catch_warnings():  # MemTracker warns about the `param.grad = None` the hooks leave
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            report = measure_memory(micro_step, model=model)
    if variant == "streamed":
        trainer.remove_hooks()
    return report


# ----------------------------------------------------------------------------------------------
# PCIe arithmetic
# ----------------------------------------------------------------------------------------------
PCIE_GBPS = {"PCIe 3.0 x16": 16.0, "PCIe 4.0 x16": 32.0}  # nominal, GB/s per direction (1e9 bytes)


def pcie_bytes_per_step(n_params: int, *, variant: str = "recipe", accum_steps: int = 16,
                        grad_bytes: int = 2, weight_bytes: int = 2) -> dict:
    """Bytes crossing PCIe per optimizer step: gradients device->host, weights host->device.

    The recipe copies the accumulated gradients once per step; the streamed variant copies
    every micro-batch's gradients (``accum_steps`` times). Both copy the new weights back once.
    """
    n = positive_int(n_params, "n_params")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}.")
    accum = positive_int(accum_steps, "accum_steps")
    positive_int(grad_bytes, "grad_bytes")
    positive_int(weight_bytes, "weight_bytes")
    copies = 1 if variant == "recipe" else accum
    to_host = copies * n * grad_bytes
    to_device = n * weight_bytes
    return {"to_host": to_host, "to_device": to_device, "total": to_host + to_device}


def transfer_seconds(n_bytes: int, gb_per_s: float) -> float:
    """Seconds to move ``n_bytes`` at ``gb_per_s`` (1e9 bytes per second)."""
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, int) or n_bytes < 0:
        raise ValueError(f"n_bytes must be a whole number >= 0, not {n_bytes!r}.")
    return n_bytes / (positive_number(gb_per_s, "gb_per_s") * 1e9)


# ----------------------------------------------------------------------------------------------
# checkpoints that survive a disconnect
# ----------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """Every random generator a training run draws from: Python, NumPy, torch CPU and CUDA."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise ValueError("set_rng_state needs the dict rng_state() returned.")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path, trainer: MasterCopyTrainer, *, step: int, data_position: int, extra: dict | None = None) -> Path:
    """Write trainer state + step + RNG + data position to ``path`` atomically.

    The file is written to ``path.tmp`` and renamed with ``os.replace``: a session that dies
    mid-write leaves the previous checkpoint whole.
    """
    if not isinstance(trainer, MasterCopyTrainer):
        raise TypeError(f"trainer must be a MasterCopyTrainer or StreamedGradTrainer, not {type(trainer).__name__}.")
    for name, value in (("step", step), ("data_position", data_position)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, not {value!r}.")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (e.g. {{'losses': [...]}}) or None, not {type(extra).__name__}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"trainer": trainer.state_dict(), "step": step, "data_position": data_position,
               "rng": rng_state(), "extra": extra or {}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path, trainer: MasterCopyTrainer) -> dict | None:
    """Resume from ``path`` if it exists: restores the trainer and the RNGs.

    Returns ``{'step', 'data_position', 'extra'}``, or None when there is no checkpoint yet.
    Only load checkpoints you wrote: the file holds pickled Python objects (RNG states).
    """
    if not isinstance(trainer, MasterCopyTrainer):
        raise TypeError(f"trainer must be a MasterCopyTrainer or StreamedGradTrainer, not {type(trainer).__name__}.")
    path = Path(path)
    if not path.exists():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or "trainer" not in payload:
        raise ValueError(f"{path.name} is not a capstone checkpoint; delete it to start over.")
    if payload["trainer"].get("variant") != trainer.variant:
        raise ValueError(
            f"{path.name} was saved by the {payload['trainer'].get('variant')!r} trainer, not {trainer.variant!r}; "
            "use a separate checkpoint file per variant."
        )
    trainer.load_state_dict(payload["trainer"])
    set_rng_state(payload["rng"])
    return {"step": payload["step"], "data_position": payload["data_position"], "extra": payload["extra"]}


# ----------------------------------------------------------------------------------------------
# an offline corpus and tokenizer
# ----------------------------------------------------------------------------------------------
def course_corpus(notebooks_dir=None, *, min_chars: int = 2000) -> tuple[str, str]:
    """Text that needs no download: the markdown prose of the course's own notebooks.

    By default the copy that ships inside the package (``data_files/course_corpus.txt``, made by
    ``scripts/build_corpus.py``), so it works wherever the course is installed (Colab included).
    ``notebooks_dir=`` reads the prose of the notebooks in that folder instead. Returns ``(text, source)``.
    """
    positive_int(min_chars, "min_chars")
    if notebooks_dir is None:
        shipped = paths.data_file(CORPUS_FILE).read_text(encoding="utf-8")
        text = shipped.partition("\n\n")[2]  # the first paragraph is the credit line
        source = f"the course notebooks' prose, shipped with the package, {len(text):,} characters"
    else:
        folder = Path(notebooks_dir)
        if not folder.is_dir():
            raise ValueError(f"No folder at {str(folder)!r}; pass notebooks_dir= a folder of .ipynb notebooks, "
                             "or nothing to use the prose that ships with the package.")
        parts = []
        for nb in sorted(folder.glob("*.ipynb")):
            try:
                cells = json.loads(nb.read_text(encoding="utf-8")).get("cells", [])
            except (json.JSONDecodeError, UnicodeDecodeError, OSError):
                continue  # a notebook being written right now
            prose = ["".join(c.get("source", "")) for c in cells if c.get("cell_type") == "markdown"]
            if prose:
                parts.append("\n\n".join(prose))
        text = "\n\n".join(parts)
        source = f"markdown prose of {len(parts)} course notebook(s) in {folder.name}/, {len(text):,} characters"
    if len(text) < min_chars:
        raise ValueError(f"Found only {len(text):,} characters of offline text (need {min_chars:,}) in {source}; "
                         "pass notebooks_dir= the course's notebooks/ folder, or a smaller min_chars.")
    return text, source


class ByteTokenizer:
    """The simplest tokenizer there is: each UTF-8 byte (0-255) is one token id.

    Used when GPT-2's BPE tokenizer cannot be loaded offline. A byte sequence is about 4x
    longer than GPT-2 tokens for English, and the model must learn spelling, but it needs no file.
    """

    name = "byte-level (UTF-8 bytes 0-255 -> ids 0-255)"
    vocab_size = 256
    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}.")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if any(i < 0 or i > 255 for i in ids):
            raise ValueError("ByteTokenizer ids must be in 0..255.")
        return bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer({self.name})"


class _HFTokenizer:
    def __init__(self, tok, name: str):
        self._tok = tok
        self.name = f"{name} (Hugging Face BPE)"
        self.vocab_size = len(tok)
        self.eos_token_id = tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids) -> str:
        return self._tok.decode(ids.tolist() if isinstance(ids, torch.Tensor) else list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.name})"


def load_tokenizer(name: str = "gpt2", *, allow_download: bool = False):
    """GPT-2's tokenizer if it can be loaded (from the local cache, or the hub when
    ``allow_download``), else :class:`ByteTokenizer`. Returns ``(tokenizer, message)``."""
    if not isinstance(name, str) or not name:
        raise ValueError("name must be a tokenizer name such as 'gpt2'.")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(name, local_files_only=not allow_download)
        return _HFTokenizer(tok, name), f"loaded the {name!r} BPE tokenizer ({len(tok):,} tokens)"
    except Exception as err:  # offline, no cache, no transformers: all mean the same here
        reason = type(err).__name__
        return ByteTokenizer(), (
            f"could not load the {name!r} tokenizer offline ({reason}): using the byte-level tokenizer, "
            "UTF-8 bytes 0-255 as token ids (vocabulary 256)"
        )


@dataclass
class TokenBatches:
    """Micro-batches of ``seq_len`` tokens cut at random offsets from one token stream.

    Batch ``i`` depends only on ``(seed, i)``, so the data position after ``k`` micro-batches
    is just the integer ``k``: a resumed run continues with exactly the batches it would have seen.
    """

    tokens: torch.Tensor
    seq_len: int
    micro_batch: int
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 1 or self.tokens.dtype.is_floating_point:
            raise TypeError("tokens must be a 1-D integer tensor of token ids.")
        positive_int(self.seq_len, "seq_len")
        positive_int(self.micro_batch, "micro_batch")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a whole number >= 0, not {self.seed!r}.")
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(
                f"The corpus has {len(self.tokens)} tokens, fewer than seq_len + 1 = {self.seq_len + 1}; "
                "use a shorter seq_len or more text."
            )

    def __getitem__(self, index: int) -> torch.Tensor:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"batch index must be a whole number >= 0, not {index!r}.")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, len(self.tokens) - self.seq_len + 1, (self.micro_batch,), generator=gen)
        return torch.stack([self.tokens[s:s + self.seq_len] for s in starts.tolist()])


def param_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """Largest absolute difference between two lists of tensors of equal shapes."""
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise ValueError(f"Cannot compare {len(a)} tensors with {len(b)}.")
    worst = 0.0
    for x, y in zip(a, b):
        if tuple(x.shape) != tuple(y.shape):
            raise ValueError(f"Shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}.")
        worst = max(worst, float((x.detach().float().cpu() - y.detach().float().cpu()).abs().max()))
    return worst


@torch.no_grad()
def sample_text(model: nn.Module, tokenizer, prompt: str, *, n_tokens: int = 60, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0) -> str:
    """Sample ``n_tokens`` after ``prompt`` (top-k, seeded: the same weights give the same text).

    Runs the model in eval mode without a KV cache (simple and fine for a short sample), then
    restores train mode if it was on. Returns only the new text.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string.")
    positive_int(n_tokens, "n_tokens")
    positive_int(top_k, "top_k")
    temperature = positive_number(temperature, "temperature")
    device = next(model.parameters()).device
    context = getattr(getattr(model, "config", None), "n_positions", 1024)
    ids = torch.tensor([tokenizer.encode(prompt)], device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        new = []
        for _ in range(n_tokens):
            logits = model(input_ids=ids[:, -context:]).logits[0, -1].float().cpu() / temperature
            k = min(top_k, logits.numel())
            values, indices = torch.topk(logits, k)
            choice = indices[torch.multinomial(torch.softmax(values, dim=-1), 1, generator=gen)]
            new.append(int(choice))
            ids = torch.cat([ids, choice.view(1, 1).to(device)], dim=1)
    finally:
        model.train(was_training)
    return tokenizer.decode(new)
