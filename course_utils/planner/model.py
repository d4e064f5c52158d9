"""The planner's two models: peak memory by category, and time per optimizer step.

Peak memory of one whole optimizer step, every micro-batch's forward and backward and then the step, as
``course_utils.memory.measure_memory`` measures it (tested for every setting). A model is a *head* (embeddings,
classifier, loss) around ``n`` *blocks* (transformer layers, CNN stages, MLP layers). For each block :mod:`.measure`
measured, per sample, the bytes autograd saves (linear in sequence length or image area, plus a sequence-length-squared
term for math attention), its input (what a checkpoint keeps) and its largest saved tensor. The peak is the highest of:

* **the start of backward**: everything forward saved + the returned logits while the loop holds the outputs
  (``keep_outputs``) + the loss's temporaries + the gradients already there (all of them from the second micro-batch
  on: with accumulation they live across micro-batches);
* **backward, block by block** (last to first): activations of the blocks not yet processed (checkpointed: their
  inputs, the segment's own until its backward ends, and the block being recomputed; offloaded: the block's saved
  tensors, back op by op) + gradients of the blocks done + backward's temporaries (2 x the largest saved tensor);
* **the optimizer step**: all gradients + the step's scratch (foreach Adam on CUDA: one copy of the model; on a CPU:
  two copies of the largest tensor; 8-bit Adam and SGD: none).

On CUDA, ``overhead`` = the caching allocator's reserve + the CUDA context (``hardware.gpu_bytes_needed``); a plan fits
when tensors + overhead fit the card. The reserve is a flat fraction, not a replay of each plan through notebook 01b's
allocator simulator (half a minute per plan; replayed fake steps of GPT-2 and GPT-2-XL reserved 2.5-4.9%). Attention:
'fused' (the default on CUDA) prices PyTorch's SDPA kernels, 'math' keeps T x T tensors (a CPU trains with it);
dropout masks are priced as the device keeps them (CUDA: 1 byte per element).

Time per optimizer step (the planner's own model, approximate) = compute + optimizer step + PCIe traffic:

* compute = training FLOPs (6 x params x tokens for transformers, 3 x the measured forward FLOPs otherwise) / (the
  GPU's peak TFLOPS for the precision x ``MFU``); checkpointing x 4/3 (one more forward); each halving of the
  micro-batch costs ``SMALL_BATCH_PENALTY`` of compute (a busy GPU needs big matrices);
* the optimizer on the GPU: the bytes it reads and writes / memory bandwidth. On the CPU: gradients down and weights
  up over PCIe once per step (streamed gradients: once per micro-batch, an upper bound) + :func:`cpu_step_ns` per
  parameter;
* notebooks 08-09's toggles: offloaded activations and streamed weights (the card keeps the embedding, the head and
  ``STREAMED_BLOCKS`` blocks) copy on a side stream, so only the part longer than compute shows; the chunked loss
  (``LOSS_CHUNKS`` checkpointed chunks of tokens) costs one more head matmul; LoRA (fp32 adapters on the blocks'
  linear layers, GPT-2's c_attn, c_proj and c_fc, frozen weights) computes 4/6 (no weight gradients); QLoRA's 4-bit
  weights are dequantized for each matmul (forward, backward, recompute): memory traffic at the card's bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..estimate import OPTIMIZERS, normalize_optimizer, optimizer_state_bytes
from ..hardware import cublas_workspace_bytes, gpu_bytes_needed, pcie_seconds
from ..memory import CATEGORIES as MEMORY_CATEGORIES
from ..results import load_notebook
from ..units import GIB
from ..validation import positive_int
from .adapters import QUANTIZATIONS, base_bytes, check_targets, lora_tensors, quantized_numel, targeted
from .llm import ADAPTER_DTYPES, adapter_coeffs, get_model
from .plan import Plan
from .state import BEYOND_ADAM, optimizer_state, paged_state_bytes, state_bytes, tensor_sizes
from .specs import GPUSpec, ModelSpec, get_gpu, presets

MFU = 0.40
SMALL_BATCH_PENALTY = 0.10
LOSS_CHUNKS = 8  # torchtune's default
STREAMED_BLOCKS = 2
LORA_WIDTHS_PER_BLOCK = 16  # r x (d + 3d) + r x 2d + r x 5d + r x 5d: GPT-2's c_attn, attn c_proj, c_fc, mlp c_proj
# The CPU optimizer's step, ns per parameter, until notebook 08 (10 for its optimizers) records the learner's own
CPU_STEP_REFERENCE = {name: d["reference_ns"] for name, d in presets()["cpu_step"].items()}
CPU_STEP_NOTEBOOK = "08_current_toolbox"

CATEGORIES = MEMORY_CATEGORIES + ("overhead",)  # what measure_memory reports, plus the card's overhead
CHECKPOINTING = ("none", "block", "sqrt")
PRECISIONS = ("fp32", "fp16_amp", "bf16_amp", "fp16", "bf16")
ATTENTIONS = ("fused", "math")


@dataclass(frozen=True)
class Settings:
    """The knobs of one training setup, and how it runs (device, attention, the loop's outputs): checked and normalized
    by :func:`make_settings`."""

    micro_batch: int
    size: int | None = None  # sequence length (transformers), image size (CNNs); None: the model's default
    accumulation: int = 1
    checkpointing: str = "none"
    precision: str = "fp32"
    optimizer: str = "adam"
    master_on_cpu: bool = False
    stream_grads: bool = False
    attention: str | None = None  # 'fused' or 'math'; None: 'fused' on CUDA, 'math' on a CPU (its dropout needs math)
    keep_outputs: bool = True  # the usual loop: `outputs = model(...)` lives until backward ends
    device: str = "cuda"
    offload_activations: bool = False
    chunked_loss: bool = False
    fused_update: bool = False
    lora_rank: int | None = None  # None: every weight trains
    stream_weights: bool = False
    lora_targets: tuple | None = None  # names of a block's linear layers the adapters wrap; None: all of them
    quantize_base: str | None = None  # QLoRA: 'nf4' (bitsandbytes' NF4) or 'nf4_double' (absmax quantized too)
    master_weights: bool = True  # pure fp16/bf16: an fp32 master copy with fp32 state; False: all in 16 bits
    adapter_dtype: str = "fp32"  # LoRA's adapters, their gradients and AdamW's state: 'fp32' (peft), 'bf16' / 'fp16'
    lora_dropout: float = 0.0  # LoRA's dropout on each adapter's input (> 0 keeps a mask and a copy per adapter)
    paged_optimizer: bool = False  # bitsandbytes' paged AdamW / 8-bit AdamW: state in CUDA unified memory
    set_to_none: bool = True  # zero_grad(set_to_none=True), PyTorch 2's default; False: gradients kept as zeros

    @property
    def cpu_step_optimizer(self) -> str:
        """The optimizer that steps on the CPU (``master_on_cpu``): bitsandbytes' for 8-bit Adam, notebook 10's own,
        else fused AdamW."""
        return "bnb_adam8bit" if self.optimizer == "adam8bit" else (
            self.optimizer if self.optimizer in BEYOND_ADAM else "adamw_fused")

    def techniques(self, base: "Settings | None" = None) -> list[str]:
        """The course's techniques this setup uses (relative to ``base`` where given)."""
        out = []
        if self.accumulation > 1 and (base is None or self.micro_batch < base.micro_batch):
            out.append("gradient accumulation")
        if self.checkpointing != "none":
            segments = " (sqrt(n) segments)" if self.checkpointing == "sqrt" else " (per block)"
            out.append("gradient checkpointing" + segments)
        if self.precision.endswith("_amp"):
            out.append(f"mixed precision ({self.precision.split('_')[0]} AMP)")
        elif self.precision in ("fp16", "bf16"):
            kept = "frozen weights" if self.lora_rank else "weights + fp32 master weights" if \
                self.master_weights else "weights, no master copy"
            out.append(f"pure {self.precision} {kept}" + (" on CPU" if self.master_on_cpu else ""))
        elif self.master_on_cpu:
            out.append("optimizer on CPU")
        flags = {"8-bit Adam": self.optimizer == "adam8bit", BEYOND_ADAM.get(self.optimizer, ""): True,
                 "paged optimizer state (bitsandbytes)": self.paged_optimizer,
                 f"{self.adapter_dtype} adapters": self.lora_rank and self.adapter_dtype != "fp32",
                 "stream gradients to CPU": self.stream_grads,
                 "stream weights from CPU": self.stream_weights, "chunked loss": self.chunked_loss,
                 "offload activations": self.offload_activations, "update fused into backward": self.fused_update,
                 f"LoRA adapters (rank {self.lora_rank})": self.lora_rank,
                 "QLoRA (frozen weights in 4-bit NF4" + (", double quantization)" if self.quantize_base ==
                                                          "nf4_double" else ")") if self.quantize_base else "": True}
        return out + [name for name, on in flags.items() if on and name]


def cpu_step_ns(cpu_optimizer: str) -> tuple[float, str]:
    """(ns per parameter, its source) of a CPU optimizer's step: the learner's own measurement when notebook 08
    recorded it (results under the course home), else the reference figure."""
    if cpu_optimizer not in CPU_STEP_REFERENCE:
        raise ValueError(f"Unknown CPU optimizer {cpu_optimizer!r}; choose one of {list(CPU_STEP_REFERENCE)}.")
    preset = presets()["cpu_step"][cpu_optimizer]
    notebook = preset.get("notebook", CPU_STEP_NOTEBOOK)
    entry = load_notebook(notebook).get(preset["recorded_as"]) or {}
    value = entry.get("value")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value), f"measured on this machine by notebook {notebook} ({entry.get('profile')})"
    return CPU_STEP_REFERENCE[cpu_optimizer], "reference: 2 cores of the course's CI machine"


def lora_params(model: ModelSpec, rank: int, targets=None) -> int:
    """Trainable parameters of rank-``rank`` adapters on every block: on the linear layers named in ``targets`` (None:
    all of a block's, as peft's ``target_modules='all-linear'``), or GPT-2's c_attn, c_proj and c_fc."""
    if not model.linears and targets is None:
        return model.n_blocks * rank * LORA_WIDTHS_PER_BLOCK * model.hidden_size
    return model.n_blocks * sum(lora_tensors(model, rank, targets))


def _choice(value, what: str, options) -> str:
    if value not in options:
        raise ValueError(f"Unknown {what} {value!r}; choose one of {options}.")
    return value


def make_settings(model: ModelSpec, **knobs) -> Settings:
    """The knobs (the fields of :class:`Settings`; ``micro_batch`` is required) checked and normalized for ``model``;
    raises ValueError/TypeError saying what to change."""
    try:
        s = Settings(**knobs)
    except TypeError as err:  # a knob missing or unknown
        raise TypeError(f"{err}; the knobs are {[f.name for f in fields(Settings)]}.") from None
    micro_batch = positive_int(s.micro_batch, "micro_batch", "e.g. 8", whole_floats=True)
    accumulation = positive_int(s.accumulation, "accumulation", "1 means no accumulation", whole_floats=True)
    size = positive_int(model.default_size if s.size is None else s.size,
                        "sequence length" if model.unit == "token" else "image size", "e.g. 1024 tokens or 224 pixels",
                        whole_floats=True)
    if model.max_size is not None and size > model.max_size:
        raise ValueError(f"{model.name} reads at most {model.max_size} tokens; set the sequence length to "
                         f"{model.max_size} or less (got {size}).")
    for f in fields(Settings):
        if f.type == "bool" and not isinstance(getattr(s, f.name), bool):
            raise TypeError(f"{f.name} must be True or False, not {getattr(s, f.name)!r}.")
    lora = s.lora_rank is not None
    if lora:
        positive_int(s.lora_rank, "lora_rank", "e.g. 8, or None to train every weight", whole_floats=True)
    if s.stream_grads and not s.master_on_cpu:
        raise ValueError("stream_grads=True accumulates gradients on the CPU and steps there: "
                         "turn on master_on_cpu=True as well.")
    if s.stream_weights and not s.master_on_cpu:
        raise ValueError("stream_weights=True keeps the weights on the host, so their fp32 master copy and the "
                         "optimizer live there too: turn on master_on_cpu=True as well.")
    if s.fused_update and accumulation > 1:
        raise ValueError(f"fused_update=True steps every parameter in each backward, so gradients cannot accumulate "
                         f"over {accumulation} micro-batches: set accumulation=1 (one larger micro-batch) or "
                         "fused_update=False.")
    if s.fused_update and s.precision.startswith("fp16"):
        raise ValueError("fp16 needs loss scaling, and GradScaler skips a step only once backward has shown an "
                         "overflow: with fused_update=True every parameter has stepped by then (notebook 08, section "
                         "3). Use bf16 (a GPU of compute capability 8.0+) or fp32, or set fused_update=False.")
    if s.fused_update and s.master_on_cpu:
        raise ValueError("With the optimizer on the CPU, the update fused into backward is stream_grads=True: "
                         "use that, and set fused_update=False.")
    if s.chunked_loss and not model.output_per_unit:
        raise ValueError(f"chunked_loss chunks a language model's vocabulary head; {model.name} has none: "
                         "set chunked_loss=False.")
    if lora and not model.output_per_unit:  # of the presets, only GPT-2 returns logits
        raise ValueError(f"lora_rank prices adapters on GPT-2's c_attn, c_proj and c_fc; {model.name} is not a "
                         "GPT-2: use a GPT-2 preset (or gpt2_spec), or lora_rank=None.")
    key = s.optimizer.lower().replace("-", "_") if isinstance(s.optimizer, str) else s.optimizer
    if key in BEYOND_ADAM:
        if lora:
            raise ValueError(f"optimizer={key!r} is priced for full fine-tuning; with lora_rank use 'adamw'.")
        optimizer_state(model, key)  # refuses a model that is not a transformer
        if key == "adamw_bf16_sr" and (s.precision != "bf16" or s.master_on_cpu):
            raise ValueError("optimizer='adamw_bf16_sr' trains pure bf16 weights with no fp32 master copy: set "
                             "precision='bf16' and master_on_cpu=False.")
    else:
        try:
            key = normalize_optimizer(s.optimizer)
        except ValueError:
            raise ValueError(f"Unknown optimizer {s.optimizer!r}; choose one of {OPTIMIZERS + tuple(BEYOND_ADAM)}.") from None
    if s.quantize_base is not None:
        _choice(s.quantize_base, "quantize_base", QUANTIZATIONS)
        if not lora:
            raise ValueError(f"quantize_base={s.quantize_base!r} stores the frozen weights in 4 bits for QLoRA: set "
                             "lora_rank (e.g. 16) too, or quantize_base=None to train every weight.")
        if s.precision.endswith("_amp"):
            raise ValueError(f"With quantize_base the compute dtype is the precision: choose 'bf16', 'fp16' or "
                             f"'fp32' (the unquantized weights are stored in it), not {s.precision!r}.")
    if s.lora_targets is not None and not lora:
        raise ValueError("lora_targets names the layers LoRA adapts: set lora_rank too, or lora_targets=None.")
    if lora and s.master_on_cpu:
        raise ValueError("With LoRA only the small adapters train and their optimizer stays on the GPU: set "
                         "master_on_cpu=False (and stream_grads, stream_weights False), or lora_rank=None.")
    master = s.master_weights and key != "adamw_bf16_sr"  # stochastic rounding is how bf16 trains without a master
    if not master and s.precision not in ("fp16", "bf16") and not lora:
        raise ValueError(f"master_weights=False trains the 16-bit weights themselves (state in 16 bits too): set "
                         f"precision='bf16' or 'fp16', not {s.precision!r}; with fp32 weights or autocast there is "
                         "no separate master copy to drop.")
    if not master and s.master_on_cpu:
        raise ValueError("master_on_cpu=True keeps an fp32 master copy on the host: set master_weights=True, or "
                         "master_on_cpu=False to keep 16-bit weights and state on the card.")
    if s.adapter_dtype not in ADAPTER_DTYPES:
        raise ValueError(f"Unknown adapter_dtype {s.adapter_dtype!r}; choose one of {ADAPTER_DTYPES} (peft keeps "
                         "adapters in fp32 over 16-bit weights; torchtune in the weights' bf16).")
    if not isinstance(s.lora_dropout, (int, float)) or isinstance(s.lora_dropout, bool) or not 0 <= s.lora_dropout < 1:
        raise ValueError(f"lora_dropout is a probability in [0, 1), e.g. 0.05, not {s.lora_dropout!r}.")
    if not lora and (s.adapter_dtype != "fp32" or s.lora_dropout):
        raise ValueError("adapter_dtype and lora_dropout describe LoRA's adapters: set lora_rank too, or leave them "
                         "at 'fp32' and 0.")
    if s.paged_optimizer and (key not in ("adam", "adamw", "adamw_fused", "adam8bit") or s.master_on_cpu):
        raise ValueError("paged_optimizer=True is bitsandbytes' PagedAdamW (32-bit state) or PagedAdamW8bit: use "
                         "optimizer 'adamw' or 'adam8bit', on the card (master_on_cpu=False).")
    _choice(s.device, "device", ("cuda", "cpu"))
    if s.paged_optimizer and s.device != "cuda":
        raise ValueError("Paged optimizer state lives in CUDA unified memory; on a CPU bitsandbytes falls back to "
                         "ordinary tensors: set paged_optimizer=False with device='cpu'.")
    attention = _choice(s.attention or ("fused" if s.device == "cuda" else "math"), "attention", ATTENTIONS)
    if s.device == "cpu" and attention == "fused":
        raise ValueError("A CPU trains attention with dropout on the math path: use attention='math' with "
                         "device='cpu' (fused kernels are priced for CUDA).")
    return replace(s, micro_batch=micro_batch, size=size, accumulation=accumulation, attention=attention,
                   checkpointing=_choice(s.checkpointing, "checkpointing", CHECKPOINTING),
                   precision=_choice(s.precision, "precision", PRECISIONS), optimizer=key,
                   lora_rank=int(s.lora_rank) if lora else None, lora_targets=check_targets(model, s.lora_targets),
                   master_weights=master or lora or s.precision not in ("fp16", "bf16"),
                   lora_dropout=float(s.lora_dropout))


def _units(model: ModelSpec, size: int) -> float:
    if model.unit == "token":
        return float(size)
    if model.unit == "image area":
        return (size / model.ref_size) ** 2
    return 1.0


def _at(c, u):
    lin, quad = c
    return lin * u + quad * u * u


def predict(model, gpu="RTX 3060 (12 GB)", **settings) -> Plan:
    """Predict the peak GPU memory of one whole optimizer step, by category, and its time (see the module docstring):
    ``accumulation`` micro-batches of ``micro_batch`` (forward and backward each), then the optimizer's step.

    ``settings``: the fields of :class:`Settings` (``micro_batch`` is required); ``device='cpu'`` predicts a CPU run
    (no overhead, the CPU's kernels, per-tensor Adam scratch), as the validation against ``measure_memory`` does.
    """
    model = get_model(model)
    return predict_settings(model, get_gpu(gpu), make_settings(model, **settings))


def attention_kernel(model: ModelSpec, gpu: GPUSpec, s: Settings) -> str:
    """Whose attention the GPU runs for 'fused' (PyTorch's SDPA): 'fused' (flash from compute capability 8.0, else the
    memory-efficient kernel, which keeps what flash keeps: the output and a B x H x T fp32 logsumexp, T padded to a
    multiple of 32; tests/test_planner.py compares them), or 'math' where a card without flash (a T4: 7.5) meets
    grouped-query heads: the memory-efficient kernel takes no grouped key/value heads, so SDPA falls back to its math
    kernel (transformers passes enable_gqa when there is no padding mask), which keeps the T x T probabilities."""
    if s.device != "cuda" or s.attention != "fused":
        return s.attention
    cc = tuple(gpu.compute_capability) if gpu.compute_capability else (9, 0)
    return "math" if cc < (8, 0) and model.grouped_query else "fused"


def _activations(model: ModelSpec, s: Settings, kernel: str | None = None) -> dict:
    """Per micro-batch bytes of what forward saves (stem, each block, head), kept, and the loss's temporaries;
    ``kernel``: the attention the card runs (:func:`attention_kernel`; default the settings')."""
    half, amp = s.precision in ("fp16", "bf16"), s.precision.endswith("_amp")
    lora = s.lora_rank is not None
    kind = "half" if half else "amp" if amp else "fp32"
    kernel = kernel or s.attention
    names = [x[0] for x in targeted(model, s.lora_targets)]
    if lora and ((s.lora_targets is not None and model.config) or s.adapter_dtype != "fp32" or s.lora_dropout):
        # adapters on some layers, in 16 bits or with dropout: what each adapted layer saves, measured from the config
        c = adapter_coeffs(model, names, s.adapter_dtype, s.lora_dropout,
                           "cpu" if s.device == "cpu" else f"cuda-{kernel}", kind)
        measured = len(names)
    else:  # stored: rank-1 fp32 adapters on every linear layer (or, for GPT-2, the full model's activations)
        c = model.coeffs(s.device, kernel, kind, lora)
        measured = len(model.linears) if lora and model.lora_acts else 0
    B, u, nb = s.micro_batch, _units(model, s.size), model.n_blocks
    adapters = len(names) if model.linears or s.lora_targets else 4
    # each adapter's lora_B saves x A^T, r values a token (in autocast's 16 bits, else the adapter's dtype)
    width = 2 if amp or s.adapter_dtype != "fp32" else 4
    extra = B * u * width * (adapters * s.lora_rank - measured) if lora else 0
    a = dict(block=[B * _at(c.block[i], u) + extra for i in range(nb)],
             largest=[B * max(c.largest[i][0] * u, c.largest[i][1] * u * u) for i in range(nb)],
             stem=B * _at(c.stem, u))
    vocab = model.output_per_unit
    if s.chunked_loss:  # the model returns hidden states; one chunk's logits, log-softmax and 2 gradients at a time,
        # and the running sum of the head's weight gradient: each chunk adds its share (sum, share, new sum at once)
        a["head"] = B * (_at(c.head, u) - 4 * vocab * u)
        chunk = math.ceil(B * u / LOSS_CHUNKS)
        head_grad = 0 if s.lora_rank else vocab * model.hidden_size * (2 if half else 4)
        a["loss"] = max(chunk * vocab * ((2 if half or amp else 4) + 4 + 8), 2 * head_grad) + head_grad
    else:
        a["head"] = B * (_at(c.head, u) + (_at(c.output, u) if s.keep_outputs else 0.0))
        # offloaded, the head's saved tensors come back one at a time: at most the fp32 logits (Gemma-2's soft-capped
        # logits save three of them)
        a["head_back"] = min(a["head"], a["head"] - B * _at(c.head, u) + B * 4 * vocab * u) if vocab else a["head"]
        a["loss"] = B * 8 * vocab * u  # d(loss)/d(logits) in fp32, twice
    size_seg = math.ceil(nb / math.ceil(math.sqrt(nb))) if s.checkpointing == "sqrt" else 1
    a["segments"] = [list(range(i, min(nb, i + size_seg))) for i in range(0, nb, size_seg)]
    a["kept"] = list(a["block"]) if s.checkpointing == "none" else [  # checkpoints keep each segment's input
        B * c.boundary[i] * u if i % size_seg == 0 else 0.0 for i in range(nb)]
    a["saved"] = a["stem"] + a["head"] + sum(a["kept"])  # what offloading sends to the host and back
    return a


def predict_settings(model: ModelSpec, gpu: GPUSpec, s: Settings) -> Plan:
    """:func:`predict` for checked :class:`Settings` (the search calls it for every candidate)."""
    n = model.n_params
    half = s.precision in ("fp16", "bf16")
    amp = s.precision.endswith("_amp")
    w = 2 if half else 4  # bytes per parameter and per gradient on the GPU
    nb = model.n_blocks
    lora = s.lora_rank is not None
    n_train = lora_params(model, s.lora_rank, s.lora_targets) if lora else n
    exact = lora and (model.linears or s.lora_targets)  # each adapter tensor known (else GPT-2's, about)
    tensors = lora_tensors(model, s.lora_rank, s.lora_targets) if exact else []
    adapter = max(tensors) if exact else n_train // (8 * nb) if lora else 0  # the largest adapter matrix (A or B)
    ab = 4 if s.adapter_dtype == "fp32" else 2  # bytes per adapter value (and its gradient)
    gw = ab if lora else w  # bytes per trainable gradient
    # the optimizer's state: fp32 (an fp32 master's, fp32 weights', bitsandbytes' 32-bit paged AdamW), or in the
    # 16-bit weights' or adapters' dtype (torch's AdamW keeps it in the parameter's dtype)
    sixteen = ab == 2 if lora else half and not s.master_weights
    state_dtype = "bf16" if sixteen and not s.paged_optimizer else "fp32"

    # persistent state
    resident = model.head_params + sum(sorted(model.block_params)[-STREAMED_BLOCKS:]) if s.stream_weights else n
    frozen = base_bytes(model, s.quantize_base, w) if s.quantize_base else resident * w
    params = frozen + (ab * n_train if lora else 0)
    sizes = (tensors * nb if exact else [adapter] * 8 * nb) if lora else tensor_sizes(model)
    paged = 0
    if s.master_on_cpu:
        optimizer = 0
    else:  # the optimizer's state, per tensor (8-bit Adam keeps small tensors' in fp32); pure half's fp32 master
        optimizer = state_bytes(model, s.optimizer, n_train, sizes, dtype=state_dtype)
        paged = paged_state_bytes(s.optimizer, sizes) if s.paged_optimizer else 0
        optimizer += 4 * n if half and not lora and s.master_weights else 0  # fp32 master weights
        optimizer -= paged  # in CUDA unified memory: outside PyTorch's allocator
    weight_copies = 2 * n if amp else 0  # autocast's fp16/bf16 copies of the weights (kept for backward)

    kernel = attention_kernel(model, gpu, s)
    a = _activations(model, s, kernel)
    grads_of = [gw * n_train // nb] * nb if lora else [bp * w for bp in model.block_params]
    g_head = 0 if lora else model.head_params * w
    g_all = n_train * gw
    # fused update, streamed gradients: one tensor's gradient, and a tied embedding's (complete only when backward
    # reaches the embedding)
    g_one = [gw * adapter if lora else model.block_largest[i] * w for i in range(nb)]
    tied = round(model.output_per_unit) * model.hidden_size * w if model.tied_head and not lora else 0
    adam = not s.master_on_cpu and s.optimizer in ("adam", "adamw") and not s.paged_optimizer  # torch's AdamW
    item = 4 if state_dtype == "fp32" else 2  # its scratch is in the state's dtype
    per_tensor_scratch = (item if s.device == "cuda" else 2 * item) if adam else 0  # values per element: CUDA 1, CPU 2
    off = s.offload_activations
    stem = 0 if off else a["stem"]
    kept = [0.0] * nb if off else a["kept"]
    # gradients alive when backward starts: accumulated ones, or last step's zeroed ones (set_to_none=False)
    grads_before = 0 if s.stream_grads or s.fused_update or (s.accumulation == 1 and s.set_to_none) else g_all

    head = a.get("head_back", a["head"]) if off else a["head"]
    saved_name = "checkpoints (each block's input)" if s.checkpointing != "none" else "every block's saved tensors"
    phases = {"at the start of backward": dict(
        grads=grads_before, activations=stem + head + sum(kept), other=a["loss"] + weight_copies,
        _named={saved_name: stem + sum(kept), "logits and loss": head + a["loss"],
                "autocast's 16-bit weight copies": weight_copies})}
    done_grads = g_head if not s.stream_grads else 0
    candidates = []
    for seg in reversed(a["segments"]):  # block by block, last to first
        alive_before = sum(kept[:seg[0]]) + a["kept"][seg[0]]  # the segment's input, kept or back, until it is done
        for i in reversed(seg):
            if grads_before:
                g_now = g_all
            elif s.fused_update or s.stream_grads:  # the same hook: each gradient leaves as soon as it is complete
                g_now = tied + g_one[i] * s.fused_update
            else:
                g_now = done_grads + grads_of[i]
            # backward's temporaries: the gradients of the block's largest saved tensor and of its input; or, after the
            # op, its input's gradient and a weight's new gradient, until it is added to the accumulated one or leaves
            temps = max(2 * a["largest"][i], a["largest"][i] + g_one[i] * bool(grads_before or s.stream_grads))
            if s.checkpointing != "none":
                live_acts = stem + alive_before + sum(a["block"][j] for j in seg if j <= i)
            else:  # offloaded: the block's saved tensors come back op by op, and the op's gradients take their place
                live_acts, temps = (a["block"][i], 0) if off else (stem + sum(a["block"][: i + 1]), temps)
            other = temps + weight_copies + (per_tensor_scratch * g_one[i] / gw if s.fused_update else 0)
            recomputed = sum(a["block"][j] for j in seg if j <= i) if s.checkpointing != "none" else 0
            candidates.append(dict(grads=g_now, activations=live_acts, other=other, _named={
                saved_name: live_acts - recomputed, "the block recomputed for backward": recomputed,
                "backward's temporaries": other - weight_copies, "autocast's 16-bit weight copies": weight_copies}))
            if not s.stream_grads:
                done_grads += grads_of[i]
    phases["in backward"] = max(candidates, key=_total)
    if s.fused_update:  # the largest tensor steps last (GPT-2's tied embedding), first (an untied head, while every
        # block's activations wait for backward) or in its block
        biggest = max(0 if lora else model.largest_tensor, max(g_one) // gw)
        first = model.output_per_unit and not model.tied_head and not lora
        phases["stepping the largest tensor"] = dict(
            grads=biggest * gw, activations=stem + sum(kept) * bool(first), other=per_tensor_scratch * biggest,
            _named={saved_name: stem + sum(kept) * bool(first), "the optimizer step's scratch": per_tensor_scratch
                    * biggest})
    elif not s.stream_grads:  # Adam's fp32 scratch: foreach on CUDA a copy of the model, on a CPU 2 x a tensor's
        scratch = item * n_train if s.device == "cuda" else 2 * item * (adapter if lora else model.largest_tensor)
        phases["in optimizer.step()"] = dict(grads=g_all, activations=0, other=scratch if adam else 0,
                                             _named={"the optimizer step's scratch": scratch if adam else 0})
    phase = max(phases, key=lambda k: _total(phases[k]))
    parts = dict(params=params, optimizer=optimizer, **phases[phase])
    by_cat = {k: int(round(parts[k])) for k in MEMORY_CATEGORIES}
    if s.quantize_base:  # the named parts of the persistent state (Plan.breakdown)
        named = {"4-bit weights": base_bytes(model, s.quantize_base, 0),
                 "16-bit embeddings, norms and head": frozen - base_bytes(model, s.quantize_base, 0)}
    else:
        named = {("frozen weights" if lora else "weights"): frozen}
    if lora:
        named["adapters, their gradients and state"] = ab * n_train + by_cat["grads"] + optimizer
    else:
        master = 4 * n if half and s.master_weights and not s.master_on_cpu else 0
        named.update({"gradients": by_cat["grads"], "optimizer state": optimizer - master,
                      "fp32 master weights": master})
    named.update(phases[phase]["_named"])
    tensor_peak = sum(by_cat.values())
    cc = tuple(gpu.compute_capability) if gpu.compute_capability else None
    by_cat["overhead"] = gpu_bytes_needed(tensor_peak, cc, gpu.context_bytes) - tensor_peak if s.device == "cuda" else 0
    overhead_parts = dict(workspaces=cublas_workspace_bytes(cc), context=gpu.context_bytes)
    overhead_parts["reserve"] = by_cat["overhead"] - sum(overhead_parts.values())
    if s.device != "cuda":
        overhead_parts = {k: 0 for k in overhead_parts}
    named.update({"cuBLAS workspaces": overhead_parts["workspaces"], "allocator reserve": overhead_parts["reserve"],
                  "CUDA context": overhead_parts["context"]})
    notes = []
    if any(key.startswith("cuda-") for key in model.acts):  # measured with attention
        flash = tuple(gpu.compute_capability or (9, 0)) >= (8, 0)
        kernels = ("flash for fp16/bf16, memory-efficient for fp32" if flash else
                   "memory-efficient: no flash below compute capability 8.0")
        notes.append("attention: " + (f"PyTorch's fused SDPA kernel ({kernels}): no T x T tensors" if kernel == "fused" else
                                      "SDPA's math kernel: this card has no flash attention (compute capability "
                                      "below 8.0) and the memory-efficient kernel takes no grouped-query heads, so "
                                      "T x T probabilities are kept" if s.attention == "fused" else
                                      "math path (T x T probabilities, dropout mask and dropped probabilities kept)"))
    if s.master_on_cpu:
        ns, source = cpu_step_ns(s.cpu_step_optimizer)
        notes.append(f"CPU optimizer step: {s.cpu_step_optimizer}, {ns:.2f} ns/parameter ({source})")
    host_state = 8 * n + state_bytes(model, s.optimizer, n) if s.master_on_cpu else 0  # fp32 master + grads
    # a paged optimizer's state beyond what the card holds beside the rest waits in host RAM between steps
    spilled = max(0, paged - max(0, gpu.memory_bytes - sum(by_cat.values()))) if s.device == "cuda" else 0
    host = int(host_state + n * w * s.stream_weights + a["saved"] * off + spilled)
    if host:  # not on the card, but the machine must have it
        notes.append(f"host RAM: {host / GIB:.1f} GiB (fp32 master weights, gradients and optimizer state on the CPU, "
                     "streamed weights, offloaded activations, paged optimizer state the card cannot hold)")
    if paged:
        notes.append(f"paged optimizer: {paged / GIB:.2f} GiB of state in CUDA unified memory, outside PyTorch's "
                     "allocator (max_memory_allocated and max_memory_reserved leave it out; nvidia-smi shows what "
                     "sits on the card)" + (f"; {spilled / GIB:.2f} GiB of it pages to the host and back each step"
                                            if spilled else ""))
    return Plan(model=model, gpu=gpu, settings=s, by_category=by_cat, phase=phase,
                step_seconds=step_seconds(model, gpu, s, spilled), notes=notes, host_bytes=host, paged_bytes=paged,
                overhead_parts=overhead_parts, named_parts={k: int(round(v)) for k, v in named.items() if round(v)})


def _total(phase: dict) -> float:
    """A phase's bytes beyond the persistent state (its named parts split the same bytes)."""
    return phase["grads"] + phase["activations"] + phase["other"]


def step_seconds(model: ModelSpec, gpu: GPUSpec, s: Settings, paged_out: int = 0) -> float:
    """The planner's time-cost model: predicted seconds per optimizer step (see the module docstring); ``paged_out``:
    bytes of a paged optimizer's state that wait in host RAM, in for the step and out again."""
    samples = s.micro_batch * s.accumulation
    u = _units(model, s.size)
    flops = (6.0 * model.n_params if model.unit == "token" else 3.0 * model.fwd_flops_per_unit) * u * samples
    # of 6 FLOPs per parameter and token: forward 2, input gradients 2, weight gradients 2 (none with LoRA);
    # checkpointing adds a forward (2)
    flops *= (6 - 2 * (s.lora_rank is not None) + 2 * (s.checkpointing != "none")) / 6
    if s.chunked_loss:  # each chunk's logits again in backward
        flops += 2 * model.output_per_unit * model.hidden_size * u * samples
    if s.precision.startswith("bf16") and not gpu.bf16:
        tflops = gpu.fp32_tflops / 4  # emulated bf16 (a T4 says it supports bf16: slowly)
    else:
        tflops = gpu.fp32_tflops if s.precision == "fp32" else gpu.half_tflops
    compute = flops / (tflops * 1e12 * MFU)
    compute *= 1 + SMALL_BATCH_PENALTY * math.log2(s.accumulation)
    n = model.n_params
    w = 2 if s.precision in ("fp16", "bf16") else 4
    if s.master_on_cpu:
        grad_trips = s.accumulation if s.stream_grads else 1
        pcie = pcie_seconds(n * w * grad_trips + n * w, gpu.pcie)   # gradients down, weights up
        opt = pcie + n * cpu_step_ns(s.cpu_step_optimizer)[0] * 1e-9
    else:
        if s.lora_rank is not None:  # the weights and gradients, the state read and written
            n_lora = lora_params(model, s.lora_rank, s.lora_targets)
            ab = 4 if s.adapter_dtype == "fp32" else 2
            touched = 2 * ab * n_lora + 2 * optimizer_state_bytes(n_lora, s.optimizer, param_dtype=s.adapter_dtype)
        else:  # the weights, gradients, an fp32 master in pure half (read and written), the state read and written
            master = 8 if w == 2 and s.master_weights else 0
            state = "fp32" if w == 4 or s.master_weights else "bf16"
            touched = n * (2 * w + master) + 2 * state_bytes(model, s.optimizer, n, dtype=state)
        opt = touched / (gpu.mem_bandwidth_gbs * 1e9)
    if s.quantize_base:  # each 4-bit weight dequantized (read, written, read) in forward, backward and any recompute
        passes = s.accumulation * (2 + (s.checkpointing != "none"))
        opt += passes * quantized_numel(model) * (0.5 + 2 * w) / (gpu.mem_bandwidth_gbs * 1e9)
    # side-stream copies beside compute: only the part longer than compute shows
    copies = s.accumulation * (2 * _activations(model, s, attention_kernel(model, gpu, s))["saved"] *
                               s.offload_activations
                               + 2 * n * w * s.stream_weights)
    return compute + opt + max(0.0, pcie_seconds(round(copies), gpu.pcie) - compute) + \
        pcie_seconds(2 * paged_out, gpu.pcie)
