"""The capstone's pieces that are not the lesson (notebook 06: GPT-2-XL fine-tuning inside a small GPU).

The lesson (the two-copy step, the flat master copy, the gradient-streaming hook) is written in notebook 06's
cells, after "How to fine tune VERY large model if it doesn't fit on your GPU"; the sections below hold what those
cells use: the device copy's format, CPU optimizers, copy engines, the fake-tensor GPU peak, PCIe arithmetic,
checkpoints that resume bit-for-bit, and the offline corpus, tokenizers, batches and sampling.
"""
from __future__ import annotations

import contextlib
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np
import torch
from torch import nn

from . import hardware, paths
from .hardware import gpu_bytes_needed, recommend_precision
from .units import GIB
from .validation import callable_arg, positive_int, positive_number

CORPUS_FILE = "course_corpus.txt"  # in course_utils/data_files/, made by scripts/build_corpus.py
VARIANTS = ("recipe", "streamed")


# ---- which 16-bit format the device copy uses ------------------------------------------------
class Precision(NamedTuple):
    """The device copy's dtype, whether it needs loss scaling, and why (one sentence)."""

    dtype: torch.dtype
    loss_scaling: bool
    why: str


def device_precision(compute_capability) -> Precision:
    """Notebook 04's rule (:func:`course_utils.hardware.recommend_precision`) for the device copy, from
    ``hardware.compute_capability()``: bf16 from 8.0, fp16 with loss scaling below, fp32 without a GPU."""
    recipe = recommend_precision(compute_capability)  # it also checks the input
    if compute_capability is None:
        return Precision(torch.float32, False, "no CUDA GPU: an fp32 device copy (CPUs are slow at 16-bit "
                                               "kernels); fp32 needs no loss scaling")
    cc = f"{compute_capability[0]}.{compute_capability[1]}"
    if recipe.startswith("bf16"):
        return Precision(torch.bfloat16, False, f"compute capability {cc} runs bf16 natively; bf16 has fp32's "
                                                "exponent range, so no loss scaling")
    return Precision(torch.float16, True, f"compute capability {cc} has no native bf16 (T4 class): fp16 with "
                                          "dynamic loss scaling")


# ---- the CPU optimizer: the 8-bit-state Adams that can step here -----------------------------
COMPILER_BYTES = 1 * GIB   # g++ building a compiled optimizer step beside the kernel: 959 MiB measured on Binder


def cpu_compiles() -> tuple[bool, str]:
    """Whether ``torch.compile`` can build a CPU kernel here (it needs a C++ compiler, and about ``COMPILER_BYTES``
    of RAM beside the kernel: a free Binder session's 2 GiB has not that much left): ``(works, why)``."""
    free = hardware.available_ram_bytes()
    if free < COMPILER_BYTES:
        return False, (f"only {free / GIB:.2f} GiB of RAM is free here, and a C++ compiler building an optimizer step "
                       f"takes about {COMPILER_BYTES / GIB:.0f} GiB beside this kernel: nothing is compiled")
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True, dynamic=False)(torch.ones(8))
    except Exception as err:  # no compiler, a broken toolchain: all mean "no compiled step here"
        first = (str(err).strip().splitlines() or [""])[0][:160]
        return False, f"torch.compile cannot build CPU code here ({type(err).__name__}: {first})"
    return True, "torch.compile builds CPU code here (a C++ compiler is installed)"


def cpu_8bit_adams(*, compiles: bool | None = None) -> tuple[dict, str]:
    """``({name: make(params, lr)}, message)``: the libraries' 8-bit-state Adams (about 2 bytes of state per
    parameter) installed here that can step on this CPU. torchao's ``AdamFp8`` and ``Adam8bit`` compile their step
    with ``torch.compile``, so they are offered only where it works (``compiles``; None: :func:`cpu_compiles`
    decides); bitsandbytes' ``Adam8bit`` (eager on a CPU) needs no compiler. The message says what is left out, why."""
    if compiles is None:
        compiles, why = cpu_compiles()
    else:
        why = "torch.compile works here" if compiles else "torch.compile does not work here"
    adams = {}
    try:
        if compiles:
            import torchao.optim as ao

            adams = {"torchao AdamFp8": lambda ps, lr: ao.AdamFp8(ps, lr=lr),
                     "torchao Adam8bit": lambda ps, lr: ao.Adam8bit(ps, lr=lr)}
    except ImportError:
        why += "; torchao is not installed (`pip install torchao`)"
    try:
        import bitsandbytes as bnb

        adams["bitsandbytes Adam8bit"] = lambda ps, lr: bnb.optim.Adam8bit(ps, lr=lr)
    except ImportError:
        why += "; bitsandbytes is not installed (`pip install bitsandbytes`)"
    return adams, f"{why}: {', '.join(adams) or 'no library 8-bit Adam'} can step here"


# ---- copy engines: device -> host copies that the streaming hook queues and drains -----------
class CudaCopyEngine:
    """Device -> pinned-host copies on a side CUDA stream (after the compute stream), one event per copy;
    ``record_stream`` keeps the allocator from handing the freed gradient's memory on too early."""

    def __init__(self, device="cuda"):
        if torch.device(device).type != "cuda":
            raise ValueError(f"CudaCopyEngine copies from a CUDA device, not {device}; use CpuCopyEngine there.")
        self.stream = torch.cuda.Stream(device=device)

    def staging_like(self, t: torch.Tensor) -> torch.Tensor:
        """A host buffer for ``t``'s copy: pinned (page-locked), so the copy can run asynchronously."""
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)

    def start_copy(self, src: torch.Tensor, dst: torch.Tensor):
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def ready(self, handle) -> bool:
        return handle.query()

    def wait(self, handle) -> None:
        handle.synchronize()


class CpuCopyEngine:
    """The CPU twin of :class:`CudaCopyEngine` (same interface): a copy is done when ``start_copy`` returns.
    The tests subclass it with copies that finish late and out of order."""

    def staging_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")

    def start_copy(self, src: torch.Tensor, dst: torch.Tensor):
        return dst.copy_(src)

    def ready(self, handle) -> bool:
        return True

    def wait(self, handle) -> None:
        pass


def copy_engine(device) -> CudaCopyEngine | CpuCopyEngine:
    """The copy engine for a device model on ``device``: CUDA's side stream, or its CPU twin."""
    return CudaCopyEngine(device) if torch.device(device).type == "cuda" else CpuCopyEngine()


# ---- the GPU peak, predicted with fake tensors, and the micro-batch that fits a card ---------
def largest_fitting_micro_batch(peak_for: Callable, budget_bytes: int, start: int):
    """Halve the micro-batch from ``start`` until one step fits a card of ``budget_bytes``.

    ``peak_for(micro_batch)`` gives the tensor peak (bytes, or a report with ``peak_bytes``); "fits"
    adds the allocator reserve and CUDA context (``hardware.gpu_bytes_needed``). Returns
    ``(micro_batch, what peak_for returned, bytes needed)``; ``ValueError`` if not even 1 fits.
    """
    callable_arg(peak_for, "peak_for", "a function micro_batch -> tensor peak (bytes or a report)")
    budget, micro_batch, tried = positive_int(budget_bytes, "budget_bytes"), positive_int(start, "start"), []
    while True:
        result = peak_for(micro_batch)
        needed = gpu_bytes_needed(getattr(result, "peak_bytes", result))
        tried.append(f"{micro_batch}: {needed / 2**30:.2f} GiB")
        if needed <= budget:
            return micro_batch, result, needed
        if micro_batch == 1:
            raise ValueError(f"Not even a micro-batch of 1 fits {budget / 2**30:.2f} GiB (needed: {', '.join(tried)}); "
                             "use a shorter sequence, a smaller model, or a larger card.")
        micro_batch //= 2


def enable_checkpointing(model: nn.Module) -> None:
    """Gradient (activation) checkpointing on a transformers model, non-reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


# Fake tensors live on the CPU on every machine and are priced as CUDA keeps them (``models.as_on_cuda``): one code path
# with and without a GPU. Fake CUDA tensors fail twice: backward asks the driver for a context, and where CUDA is
# initialised checkpoint's recompute clones the CUDA RNG state inside FakeTensorMode (a fake tensor it cannot set).
FAKE_DEVICE = "cpu"


def predict_gpu_peak(config_or_name="gpt2-xl", *, variant: str = "recipe", micro_batch: int = 4, accum_steps: int = 1,
                     seq_len: int = 1024, dtype: torch.dtype = torch.float16, attention: str = "fused",
                     priced_as: str = "cuda", **overrides):
    """The device's :class:`~course_utils.memory.MemoryReport` for one whole optimizer step of the capstone's loop under
    ``FakeTensorMode``: ``accum_steps`` checkpointed micro-steps of GPT-2 in ``dtype`` (logits freed before backward),
    then the step's device side (gradients freed); priced as CUDA keeps tensors (``attention`` 'fused' or 'math', every
    storage rounded up to the allocator's 512-byte blocks) or, ``priced_as='cpu'``, as a CPU does. 'recipe': gradients stay until the step (all there from the second micro-step
    on); 'streamed': each leaves once produced. The host side is not counted. GPT-2-XL: seconds per micro-step."""
    from . import models
    from .memory import cuda_rounding, measure_memory

    for name, value, options in (("variant", variant, VARIANTS), ("priced_as", priced_as, ("cuda", "cpu"))):
        if value not in options:
            raise ValueError(f"{name} must be one of {options}, not {value!r}.")
    positive_int(micro_batch, "micro_batch")
    positive_int(accum_steps, "accum_steps", "1 means no accumulation")
    positive_int(seq_len, "seq_len")
    config = models.gpt2_config(config_or_name, **overrides) if isinstance(config_or_name, str) else config_or_name
    if seq_len > config.n_positions:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context ({config.n_positions} tokens).")
    with models.fake_mode():
        with torch.device(FAKE_DEVICE):
            model = models.build_gpt2(config, dtype=dtype, attention=attention)
        enable_checkpointing(model)
        model.train()
        for p in model.parameters() if variant == "streamed" else ():  # the gradient leaves once it is complete
            p.register_post_accumulate_grad_hook(lambda param: setattr(param, "grad", None))

        def optimizer_step():
            # From the second micro-step on, each repeats the one before exactly (the same parameters, complete
            # gradients and activations), so the step's peak is within the first two; more would cost seconds each
            # and change no byte (tests/test_protocol.py measures the accumulated step against this prediction).
            for _ in range(min(accum_steps, 2)):
                ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=FAKE_DEVICE)
                model(input_ids=ids, labels=ids).loss.backward()
            for p in model.parameters():  # the step: gradients leave for the host, the device frees them
                p.grad = None

        on_cuda = priced_as == "cuda"
        kernels = models.as_on_cuda() if on_cuda else contextlib.nullcontext()
        blocks = cuda_rounding() if on_cuda else contextlib.nullcontext()
        with warnings.catch_warnings(), kernels, blocks:  # MemTracker warns about the hooks' `grad = None`
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            return measure_memory(optimizer_step, model=model)  # the fake model and its hooks go with this call


# ---- PCIe arithmetic -------------------------------------------------------------------------
def pcie_bytes_per_step(n_params: int, *, variant: str = "recipe", accum_steps: int = 16, grad_bytes: int = 2) -> dict:
    """Bytes crossing PCIe per optimizer step: gradients device->host (the recipe once, the streamed
    variant every micro-batch's, ``accum_steps`` times), the new 16-bit weights host->device once."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}.")
    n = positive_int(n_params, "n_params")
    copies = 1 if variant == "recipe" else positive_int(accum_steps, "accum_steps")
    to_host, to_device = copies * n * positive_int(grad_bytes, "grad_bytes"), n * 2
    return {"to_host": to_host, "to_device": to_device, "total": to_host + to_device}


# ---- checkpoints that survive a disconnect ---------------------------------------------------
def save_checkpoint(path, trainer, *, step: int, data_position: int, extra: dict | None = None) -> Path:
    """Write ``trainer.state_dict()``, step, data position and every RNG a run draws from (Python, NumPy, torch,
    CUDA) to ``path`` atomically (``path.tmp``, then ``os.replace``: a session dying mid-write leaves the previous
    checkpoint whole), with ``trainer.variant``."""
    positive_int(step, "step", allow_zero=True)
    positive_int(data_position, "data_position", allow_zero=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    payload = {"trainer": trainer.state_dict(), "variant": getattr(trainer, "variant", None), "step": step,
               "data_position": data_position, "rng": rng, "extra": extra or {}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path, trainer) -> dict | None:
    """Resume from ``path`` if it exists (``trainer.load_state_dict`` and the RNGs): ``{'step', 'data_position',
    'extra'}``, or None when there is no checkpoint yet. Only load checkpoints you wrote (they hold pickled objects)."""
    path = Path(path)
    if not path.exists():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or "trainer" not in payload:
        raise ValueError(f"{path.name} is not a capstone checkpoint; delete it to start over.")
    if payload["variant"] != getattr(trainer, "variant", None):
        raise ValueError(f"{path.name} was saved by the {payload['variant']!r} trainer, not "
                         f"{getattr(trainer, 'variant', None)!r}; use a separate checkpoint file per variant.")
    trainer.load_state_dict(payload["trainer"])
    rng = payload["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return {"step": payload["step"], "data_position": payload["data_position"], "extra": payload["extra"]}


# ---- an offline corpus and tokenizer ---------------------------------------------------------
def course_corpus() -> tuple[str, str]:
    """``(text, source)`` that needs no download: the course notebooks' markdown prose, as shipped in the
    package (``data_files/course_corpus.txt``, made by ``scripts/build_corpus.py``)."""
    text = paths.data_file(CORPUS_FILE).read_text(encoding="utf-8").partition("\n\n")[2]  # after the credit line
    return text, f"the course notebooks' prose, shipped with the package, {len(text):,} characters"


class ByteTokenizer:
    """The tokenizer that needs no file: each UTF-8 byte (0-255) is one token id (about 4x as many tokens as
    GPT-2's BPE for English, and the model must learn spelling)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(name: str = "gpt2", *, allow_download: bool = False):
    """``(tokenizer, message)``: GPT-2's BPE tokenizer if it can be loaded (from the local cache, or the hub when
    ``allow_download``), else :class:`ByteTokenizer`."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(name, local_files_only=not allow_download)
        return tok, f"loaded the {name!r} BPE tokenizer ({len(tok):,} tokens)"
    except Exception as err:  # offline, no cache, no transformers: all mean the same here
        return ByteTokenizer(), (f"could not load the {name!r} tokenizer offline ({type(err).__name__}): using the "
                                 "byte-level tokenizer, UTF-8 bytes 0-255 as token ids (vocabulary 256)")


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
        positive_int(self.micro_batch, "micro_batch")
        if len(self.tokens) < positive_int(self.seq_len, "seq_len") + 1:
            raise ValueError(f"The corpus has {len(self.tokens)} tokens, fewer than seq_len + 1 = {self.seq_len + 1}; "
                             "use a shorter seq_len or more text.")

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, len(self.tokens) - self.seq_len + 1, (self.micro_batch,), generator=gen)
        return self.tokens[starts[:, None] + torch.arange(self.seq_len)]  # a copy: no view keeps the corpus alive


def param_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """Largest absolute difference between two lists of tensors of equal shapes."""
    a, b = list(a), list(b)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise ValueError(f"Cannot compare these {len(a)} tensors with those {len(b)}: the shapes differ.")
    return max((float((x.detach().float().cpu() - y.detach().float().cpu()).abs().max()) for x, y in zip(a, b)),
               default=0.0)


@torch.no_grad()
def sample_text(model: nn.Module, tokenizer, prompt: str, *, n_tokens: int = 60, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0) -> str:
    """The ``n_tokens`` sampled after ``prompt`` (top-k, seeded), in eval mode without a KV cache (train mode
    restored after). A model wider than its tokenizer samples only ids the tokenizer can decode."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string.")
    top_k, temperature = positive_int(top_k, "top_k"), positive_number(temperature, "temperature")
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer.encode(prompt)], device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training, new = model.training, []
    model.eval()
    for _ in range(n_tokens):
        logits = model(input_ids=ids[:, -model.config.n_positions:]).logits[0, -1].float().cpu() / temperature
        logits = logits[:tokenizer.vocab_size]  # a model wider than its tokenizer samples only ids it can decode
        values, indices = torch.topk(logits, min(top_k, logits.numel()))
        choice = indices[torch.multinomial(torch.softmax(values, dim=-1), 1, generator=gen)]
        new.append(int(choice))
        ids = torch.cat([ids, choice.view(1, 1).to(device)], dim=1)
    model.train(was_training)
    return tokenizer.decode(new)
