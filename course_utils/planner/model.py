"""The planner's two models: peak memory by category, and time per optimizer step.

How the peak is predicted (tested against ``course_utils.memory.measure_memory``)
--------------------------------------------------------------------------------
A model is a *head* (embeddings, classifier, loss) around ``n`` *blocks* (transformer layers,
CNN stages, MLP layers). For each block we know, per sample, the bytes autograd saves (measured
with saved-tensor hooks, see :mod:`.measure`: linear in sequence length or image area, plus a
sequence-length-squared term for math attention), the bytes of its input (what a checkpoint
keeps) and its largest saved tensor. A training step has three high points; the peak is the
largest:

* **start of backward**: everything forward saved + the returned logits while the loop holds
  the outputs (``keep_outputs``) + the loss's temporaries (2 fp32 copies of the logits) + the
  gradients already there (with accumulation they live across micro-batches);
* **during backward, block by block** (from the last block to the first): activations of the
  blocks not yet processed (with checkpointing: their inputs, plus the block being recomputed)
  + gradients of the blocks done + 2 x the block's largest saved tensor (backward temporaries);
* **optimizer step**: all gradients + the step's scratch (PyTorch's foreach Adam on CUDA: one
  copy of the model; on CPU: two copies of the largest tensor; 8-bit Adam and SGD: none).

On CUDA, ``overhead`` = what the card needs beyond the tensors: the caching allocator's reserve
and the CUDA context (``course_utils.hardware.gpu_bytes_needed``). A plan fits when tensors +
overhead fit the card's memory. The reserve stays a flat fraction of the tensors
(``hardware.ALLOCATOR_RESERVE_FRACTION``, 5%) rather than a replay of each plan through the allocator
simulator (``course_utils.allocator``, notebook 01b): replayed, fake training steps of GPT-2 (124M,
8 x 512) and GPT-2-XL (1 x 1024) reserved 2.5% and 4.9% above their tensor peaks, so 5% holds for the
models the planner is for, and a replay costs about half a minute per plan. Small models differ
(their reserve is a few fixed 2 MiB / 20 MiB segments, not a fraction), which matters little
against a card's gigabytes.

Attention (transformers): ``attention='fused'`` (the default on CUDA) prices PyTorch's SDPA
kernels, ``'math'`` the written-out attention that keeps T x T tensors; a CPU trains with the math
path. Dropout masks are priced at the size the device keeps them (CUDA: 1 byte per element).

Time-cost model (the planner's own; stated, approximate)
--------------------------------------------------------
Seconds per optimizer step = compute + optimizer step + PCIe traffic:

* compute = training FLOPs (6 x params x tokens for transformers, 3 x the measured forward FLOPs
  for CNNs/MLPs) / (GPU peak TFLOPS for the precision x ``MFU`` = 40%); fp16/bf16 use the tensor
  core rate (a GTX 1080 Ti has none: its fp16 is 1/64 rate);
* gradient checkpointing: compute x 4/3 (one extra forward: forward is ~1/3 of forward+backward);
* gradient accumulation: the same samples in smaller micro-batches; each halving of the
  micro-batch costs ``SMALL_BATCH_PENALTY`` = 10% of compute (a busy GPU needs big matrices);
* optimizer step on the GPU: bytes it reads and writes / GPU memory bandwidth;
* optimizer (and fp32 master weights) on the CPU: gradients down and weights up over the GPU's
  PCIe link once per step, plus ``CPU_STEP_NS_PER_PARAM`` = 2 ns per parameter for the CPU's update;
* streaming gradients to the CPU: gradients cross PCIe once per *micro-batch* (counted in full:
  an upper bound, copies can overlap with backward, notebook 06).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..estimate import normalize_optimizer, optimizer_state_bytes
from ..hardware import gpu_bytes_needed
from ..memory import CATEGORIES as MEMORY_CATEGORIES
from ..units import GIB
from ..validation import positive_int
from .specs import GPUSpec, ModelSpec, get_gpu, get_model

MFU = 0.40
SMALL_BATCH_PENALTY = 0.10
CHECKPOINT_COMPUTE_FACTOR = 4 / 3
CPU_STEP_NS_PER_PARAM = 2.0

CATEGORIES = MEMORY_CATEGORIES + ("overhead",)  # what measure_memory reports, plus the card's overhead
CHECKPOINTING = ("none", "block", "sqrt")
PRECISIONS = ("fp32", "fp16_amp", "bf16_amp", "fp16", "bf16")
ATTENTIONS = ("fused", "math")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Settings:
    """The knobs of one training setup, and how it runs (device, attention, the loop's outputs)."""

    micro_batch: int
    size: int  # sequence length (transformers), image size (CNNs); ignored otherwise
    accumulation: int = 1
    checkpointing: str = "none"
    precision: str = "fp32"
    optimizer: str = "adam"
    master_on_cpu: bool = False
    stream_grads: bool = False
    attention: str = "fused"
    keep_outputs: bool = True  # the usual loop: `outputs = model(...)` lives until backward ends
    device: str = "cuda"

    def techniques(self, base: "Settings | None" = None) -> list[str]:
        """The course's techniques this setup uses (relative to ``base`` where given)."""
        out = []
        if self.accumulation > 1 and (base is None or self.micro_batch < base.micro_batch):
            out.append("gradient accumulation")
        if self.checkpointing != "none":
            out.append("gradient checkpointing" + (" (sqrt(n) segments)" if self.checkpointing == "sqrt" else " (per block)"))
        if self.precision.endswith("_amp"):
            out.append(f"mixed precision ({self.precision.split('_')[0]} AMP)")
        elif self.precision in ("fp16", "bf16"):
            out.append(f"pure {self.precision} weights" + (" + fp32 master weights on CPU" if self.master_on_cpu else " + fp32 master weights"))
        elif self.master_on_cpu:
            out.append("optimizer on CPU")
        if self.optimizer == "adam8bit":
            out.append("8-bit Adam")
        if self.stream_grads:
            out.append("stream gradients to CPU")
        return out


def technique_notebook(technique: str) -> str:
    """The course notebook that teaches a technique named by :meth:`Settings.techniques`."""
    t = technique.lower()
    for key, nb in (("accumulation", "02_gradient_accumulation.ipynb"), ("checkpointing", "03_gradient_checkpointing.ipynb"),
                    ("mixed precision", "04_mixed_precision.ipynb"), ("8-bit", "05_8bit_adam.ipynb"),
                    ("stream", "06_capstone_gpt2_xl.ipynb"), ("pure", "06_capstone_gpt2_xl.ipynb"),
                    ("optimizer on cpu", "06_capstone_gpt2_xl.ipynb")):
        if key in t:
            return nb
    raise ValueError(f"No notebook for technique {technique!r}.")


@dataclass
class Plan:
    """Predicted peak GPU memory of one training step, by category, and the time model's verdict."""

    model: ModelSpec
    gpu: GPUSpec
    settings: Settings
    by_category: dict
    phase: str
    step_seconds: float
    notes: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """What the card must hold: tensors + overhead (allocator reserve + CUDA context)."""
        return int(sum(self.by_category.values()))

    @property
    def tensor_peak_bytes(self) -> int:
        """The peak of PyTorch's tensors (what measure_memory / max_memory_allocated report)."""
        return int(sum(v for k, v in self.by_category.items() if k != "overhead"))

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu.memory_bytes

    @property
    def techniques(self) -> list[str]:
        return self.settings.techniques()

    def as_gib(self) -> dict:
        return {k: v / GIB for k, v in self.by_category.items()}

    def verdict(self) -> str:
        """One line: the total the card needs against its memory, and whether it fits."""
        return (f"{self.model.name} on {self.gpu.name}: {self.peak_bytes / GIB:.2f} GiB of {self.gpu.memory_gib:.1f} GiB "
                f"-> {'fits' if self.fits else 'does NOT fit'}")

    def summary(self) -> str:
        s = self.settings
        lines = [f"{self.verdict()} (micro-batch {s.micro_batch} x {s.accumulation} accumulation steps, {s.precision}, "
                 f"{s.optimizer}, checkpointing {s.checkpointing}; peak {self.phase})"]
        for k, v in self.by_category.items():
            lines.append(f"  {k:<12}{v / GIB:8.2f} GiB")
        lines.append(f"  predicted time per optimizer step: {self.step_seconds:.2f} s")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    __str__ = summary


def _choice(value, what: str, options, aliases: dict) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be one of {options}, not {type(value).__name__}.")
    key = value.lower().replace(" ", "_").replace("-", "_")
    key = aliases.get(key, key)
    if key not in options:
        raise ValueError(f"Unknown {what} {value!r}; choose one of {options}.")
    return key


_PRECISION_ALIASES = {"fp16amp": "fp16_amp", "amp": "fp16_amp", "fp16_autocast": "fp16_amp", "bf16amp": "bf16_amp",
                      "pure_fp16": "fp16", "pure_bf16": "bf16", "half": "fp16", "float32": "fp32", "float16": "fp16",
                      "bfloat16": "bf16", "pure_half": "fp16"}
_CKPT_ALIASES = {"per_block": "block", "perblock": "block", "sqrt(n)": "sqrt", "sqrtn": "sqrt", "off": "none",
                 "no": "none"}
_ATTENTION_ALIASES = {"sdpa": "fused", "flash": "fused", "memory_efficient": "fused", "eager": "math"}


def make_settings(model: ModelSpec, *, micro_batch, size=None, accumulation=1, checkpointing="none",
                  precision="fp32", optimizer="adam", master_on_cpu=False, stream_grads=False, attention=None,
                  keep_outputs=True, device="cuda") -> Settings:
    """Check and normalize the knobs; raises ValueError/TypeError saying what to change.

    ``attention=None``: 'fused' on CUDA, 'math' on a CPU (which trains attention with dropout on
    the math path: 'fused' is refused there).
    """
    micro_batch = positive_int(micro_batch, "micro_batch", "e.g. 8", whole_floats=True)
    accumulation = positive_int(accumulation, "accumulation", "1 means no accumulation", whole_floats=True)
    if size is None:
        size = model.default_size
    what = "sequence length" if model.unit == "token" else "image size"
    size = positive_int(size, what, "e.g. 1024 tokens or 224 pixels", whole_floats=True)
    if model.max_size is not None and size > model.max_size:
        raise ValueError(f"{model.name} reads at most {model.max_size} tokens; set the sequence length to "
                         f"{model.max_size} or less (got {size}).")
    for flag, label in ((master_on_cpu, "master_on_cpu"), (stream_grads, "stream_grads"), (keep_outputs, "keep_outputs")):
        if not isinstance(flag, bool):
            raise TypeError(f"{label} must be True or False, not {flag!r}.")
    if stream_grads and not master_on_cpu:
        raise ValueError("stream_grads=True accumulates gradients on the CPU and steps there: "
                         "turn on master_on_cpu=True as well.")
    if device not in DEVICES:
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}.")
    attention = ("fused" if device == "cuda" else "math") if attention is None else _choice(
        attention, "attention", ATTENTIONS, _ATTENTION_ALIASES)
    if device == "cpu" and attention == "fused":
        raise ValueError("A CPU trains attention with dropout on the math path: use attention='math' with "
                         "device='cpu' (fused kernels are priced for CUDA).")
    return Settings(micro_batch=micro_batch, size=size, accumulation=accumulation,
                    checkpointing=_choice(checkpointing, "checkpointing", CHECKPOINTING, _CKPT_ALIASES),
                    precision=_choice(precision, "precision", PRECISIONS, _PRECISION_ALIASES),
                    optimizer=normalize_optimizer(optimizer), master_on_cpu=master_on_cpu, stream_grads=stream_grads,
                    attention=attention, keep_outputs=keep_outputs, device=device)


def _units(model: ModelSpec, size: int) -> float:
    if model.unit == "token":
        return float(size)
    if model.unit == "image area":
        return (size / model.ref_size) ** 2
    return 1.0


def _at(c, u):
    lin, quad = c
    return lin * u + quad * u * u


def predict(model, gpu="RTX 3060 (12 GB)", *, micro_batch, size=None, accumulation=1, checkpointing="none",
            precision="fp32", optimizer="adam", master_on_cpu=False, stream_grads=False, attention=None,
            keep_outputs=True, device: str = "cuda") -> Plan:
    """Predict one training step's peak GPU memory by category; see the module docstring.

    ``attention``: 'fused' (PyTorch's SDPA kernels; the default on CUDA) or 'math'.
    ``keep_outputs=False``: the loop drops the outputs before backward (``loss = model(...).loss``),
    so the logits are freed. ``device='cpu'`` predicts for a CPU run instead (no overhead, the
    CPU's kernels, per-tensor Adam scratch): the validation against ``measure_memory`` uses it.
    """
    model = get_model(model)
    gpu = get_gpu(gpu)
    s = make_settings(model, micro_batch=micro_batch, size=size, accumulation=accumulation,
                      checkpointing=checkpointing, precision=precision, optimizer=optimizer,
                      master_on_cpu=master_on_cpu, stream_grads=stream_grads, attention=attention,
                      keep_outputs=keep_outputs, device=device)
    return predict_settings(model, gpu, s)


def predict_settings(model: ModelSpec, gpu: GPUSpec, s: Settings) -> Plan:
    """:func:`predict` for checked :class:`Settings` (the search calls it for every candidate)."""
    n = model.n_params
    half = s.precision in ("fp16", "bf16")
    amp = s.precision.endswith("_amp")
    kind = "half" if half else "amp" if amp else "fp32"
    c = model.coeffs(s.device, s.attention, kind)
    w = 2 if half else 4  # bytes per parameter and per gradient on the GPU
    B, u = s.micro_batch, _units(model, s.size)
    nb = model.n_blocks

    # persistent state
    params = n * w
    if s.master_on_cpu:
        optimizer = 0
    else:
        state_dtype = "fp32" if (half or w == 4) else "fp16"
        sizes = [model.largest_tensor] + [max(1, (n - model.largest_tensor) // max(nb, 1))] * max(nb, 1)
        optimizer = optimizer_state_bytes(n, s.optimizer, param_dtype=state_dtype, tensor_sizes=sizes)
        if half:
            optimizer += 4 * n  # fp32 master weights on the GPU
    weight_copies = 2 * n if amp else 0  # autocast's fp16/bf16 copies of the weights (kept for backward)

    grads_of = [bp * w for bp in model.block_params]
    g_head = model.head_params * w
    g_all = n * w
    g_live = max(max(grads_of, default=0), model.largest_tensor * w)  # streaming: about one block's gradients
    acts_block = [B * _at(c.block[i], u) for i in range(nb)]
    bnd = [B * c.boundary[i] * u for i in range(nb)]
    largest = [B * max(c.largest[i][0] * u, c.largest[i][1] * u * u) for i in range(nb)]
    head = B * (_at(c.head, u) + (_at(c.output, u) if s.keep_outputs else 0.0))
    stem = B * _at(c.stem, u)  # saved before the first block: alive until backward ends
    loss_temps = B * 8 * model.output_per_unit * u  # d(loss)/d(logits) in fp32, twice

    # what forward keeps, block by block, depending on checkpointing
    if s.checkpointing == "none":
        segments = [[i] for i in range(nb)]
        kept = list(acts_block)
    else:
        size_seg = 1 if s.checkpointing == "block" else max(1, math.ceil(nb / max(1, math.ceil(math.sqrt(nb)))))
        segments = [list(range(i, min(nb, i + size_seg))) for i in range(0, nb, size_seg)]
        kept = [0.0] * nb
        for seg in segments:
            kept[seg[0]] = bnd[seg[0]]
    grads_before = 0 if (s.stream_grads or s.accumulation == 1) else g_all

    phases = {"at the start of backward": dict(grads=grads_before, activations=stem + head + sum(kept),
                                               other=loss_temps + weight_copies)}
    done_grads = g_head if not s.stream_grads else 0
    best = dict(grads=0, activations=0, other=0)
    for seg in reversed(segments):  # block by block, last to first
        alive_before = sum(kept[:seg[0]])
        for i in reversed(seg):
            if grads_before:
                g_now = g_all
            else:
                g_now = g_live if s.stream_grads else done_grads + grads_of[i]
            live_acts = stem + (alive_before + sum(acts_block[j] for j in seg if j <= i) if s.checkpointing != "none"
                                else sum(acts_block[: i + 1]))
            cand = dict(grads=g_now, activations=live_acts, other=2 * largest[i] + weight_copies)
            if sum(cand.values()) > sum(best.values()):
                best = cand
            if not s.stream_grads:
                done_grads += grads_of[i]
    phases["in backward"] = best
    if s.master_on_cpu or s.optimizer not in ("adam", "adamw"):
        scratch = 0
    elif s.device == "cuda":
        scratch = n * (4 if half else w)
    else:
        scratch = 2 * model.largest_tensor * (4 if half else w)
    if not s.stream_grads:
        phases["in optimizer.step()"] = dict(grads=g_all, activations=0, other=scratch)
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    dyn = phases[phase]
    by_cat = {"params": params, "grads": dyn["grads"], "optimizer": optimizer,
              "activations": dyn["activations"], "other": dyn["other"]}
    by_cat = {k: int(round(v)) for k, v in by_cat.items()}
    tensor_peak = sum(by_cat.values())
    by_cat["overhead"] = gpu_bytes_needed(tensor_peak) - tensor_peak if s.device == "cuda" else 0
    notes = []
    if model.has_attention:
        notes.append("attention: " + ("PyTorch's fused SDPA kernel (flash for fp16/bf16, memory-efficient for fp32): "
                                      "no T x T tensors" if s.attention == "fused" else
                                      "math path (T x T probabilities, dropout mask and dropped probabilities kept)"))
    return Plan(model=model, gpu=gpu, settings=s, by_category=by_cat, phase=phase,
                step_seconds=step_seconds(model, gpu, s), notes=notes)


def step_seconds(model: ModelSpec, gpu: GPUSpec, s: Settings) -> float:
    """The planner's time-cost model: predicted seconds per optimizer step (see the module docstring)."""
    samples = s.micro_batch * s.accumulation
    u = _units(model, s.size)
    if model.unit == "token":
        flops = 6.0 * model.n_params * u * samples
    else:
        flops = 3.0 * model.fwd_flops_per_unit * u * samples
    half = s.precision != "fp32"
    if s.precision.startswith("bf16") and not gpu.bf16:
        tflops = gpu.fp32_tflops / 4  # emulated bf16 (a T4 says it supports bf16: slowly)
    else:
        tflops = gpu.half_tflops if half else gpu.fp32_tflops
    compute = flops / (tflops * 1e12 * MFU)
    if s.checkpointing != "none":
        compute *= CHECKPOINT_COMPUTE_FACTOR
    compute *= 1 + SMALL_BATCH_PENALTY * max(0.0, math.log2(max(1, s.accumulation)))
    n = model.n_params
    w = 2 if s.precision in ("fp16", "bf16") else 4
    if s.master_on_cpu:
        grad_trips = s.accumulation if s.stream_grads else 1
        pcie = (n * w * grad_trips + n * w) / (gpu.pcie_gbs * 1e9)
        opt = pcie + n * CPU_STEP_NS_PER_PARAM * 1e-9
    else:
        state = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8, "adam8bit": 2}[s.optimizer]
        touched = n * (2 * w + 2 * state + (8 if w == 2 else 0))
        opt = touched / (gpu.mem_bandwidth_gbs * 1e9)
    return compute + opt
