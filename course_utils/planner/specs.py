"""What the planner knows about GPUs and models: the presets in ``presets.json`` (package data: each GPU's memory,
speeds and PCIe link; each model's parameter counts and activation coefficients, measured as :mod:`.measure`
describes), and your own."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from ..hardware import CUDA_CONTEXT_BYTES, PCIE_GB_PER_S, recommend_precision
from ..units import GIB, MIB
from ..validation import positive_int, positive_number

GPU_SPEEDS = ("fp32_tflops", "half_tflops", "bf16", "mem_bandwidth_gbs", "pcie", "compute_capability")


@lru_cache(maxsize=1)
def presets() -> dict:
    """The parsed ``presets.json``: {'gpus': {...}, 'models': {...}, ...}."""
    return json.loads(resources.files(__package__).joinpath("presets.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def published_data() -> dict:
    """The parsed ``published.json``: peaks others measured on real GPUs, with their settings and sources
    (:mod:`.published` prices them), and the spread of the planner's error over them."""
    return json.loads(resources.files(__package__).joinpath("published.json").read_text(encoding="utf-8"))


@dataclass(frozen=True)
class GPUSpec:
    """A GPU: ``memory_bytes``, what PyTorch can allocate on it (``torch.cuda.get_device_properties(0).total_memory``,
    less than the advertised size nvidia-smi prints), its CUDA context (outside PyTorch's allocator, inside that
    total), and the speeds the time model uses (defaults: an RTX 3060's); ``pcie`` names the host link (a key of
    ``hardware.PCIE_GB_PER_S``; copies over it take ``hardware.pcie_seconds``)."""

    name: str
    memory_bytes: int
    fp32_tflops: float = 12.7
    half_tflops: float = 25.0  # fp16/bf16 on tensor cores, fp32 accumulate
    bf16: bool = True  # native bf16 (compute capability >= 8.0)
    mem_bandwidth_gbs: float = 360.0
    pcie: str = "PCIe 4.0 x16"
    compute_capability: tuple | None = None  # sizes cuBLAS's workspaces (hardware.cublas_workspace_bytes); None: 9.0
    context_bytes: int = CUDA_CONTEXT_BYTES  # the CUDA context: measured on this card where known
    advertised_bytes: int | None = None  # the size on the box and in nvidia-smi's total
    memory_source: str = ""  # where memory_bytes and context_bytes come from

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB



@lru_cache(maxsize=1)
def gpu_presets() -> dict:
    """{name: GPUSpec} of the preset GPUs."""
    return {name: GPUSpec(name, d["total_memory_bytes"], **{k: d[k] for k in GPU_SPEEDS},
                          context_bytes=round(d["context_mib"] * MIB), advertised_bytes=d["advertised_mib"] * MIB,
                          memory_source=d["source"])
            for name, d in presets()["gpus"].items()}


def custom_gpu(memory_gib: float, *, name: str = "custom GPU", **speeds) -> GPUSpec:
    """A GPU you describe: its memory in GiB; ``speeds`` (default: an RTX 3060's): fp32_tflops, half_tflops, bf16,
    mem_bandwidth_gbs, pcie (a link name such as 'PCIe 3.0 x16'), compute_capability (e.g. (8, 6))."""
    positive_number(memory_gib, "memory_gib", "e.g. custom_gpu(6) for a 6 GiB card")
    for key, value in speeds.items():
        if key not in GPU_SPEEDS:
            raise ValueError(f"Unknown GPU field {key!r}; use {', '.join(GPU_SPEEDS)}.")
        if key == "pcie" and value not in PCIE_GB_PER_S:
            raise ValueError(f"Unknown PCIe link {value!r}; choose one of {list(PCIE_GB_PER_S)}.")
        if key == "compute_capability":
            recommend_precision(value)  # checks it: a (major, minor) pair
        elif key not in ("bf16", "pcie"):
            positive_number(value, key, "speeds are positive numbers")
    return GPUSpec(name, int(memory_gib * GIB), **speeds)


def get_gpu(gpu) -> GPUSpec:
    """A GPUSpec from a preset name ('RTX 3060 (12 GB)', '3060', 'T4', ...), a number of GiB, or a GPUSpec."""
    if isinstance(gpu, GPUSpec):
        return gpu
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        return custom_gpu(gpu, name=f"custom GPU ({gpu:g} GiB)")
    if not isinstance(gpu, str):
        raise TypeError(f"gpu must be a preset name, a memory size in GiB or a GPUSpec, not {type(gpu).__name__}.")
    key = "".join(ch for ch in gpu.lower() if ch.isalnum())
    for name, d in presets()["gpus"].items():
        if gpu == name or key in d["aliases"]:
            return gpu_presets()[name]
    raise ValueError(f"Unknown GPU {gpu!r}; choose one of {list(gpu_presets())}, or pass its memory in GiB (e.g. 6).")


@dataclass(frozen=True)
class ActCoeffs:
    """Activation bytes per sample at one precision, each as ``(lin, quad)``: ``lin * u + quad * u**2``, where ``u``
    is the sequence length (transformers), (image size / reference size)**2 (CNNs) or 1.

    Per block: ``block`` (saved by the block), ``boundary`` (its input, ``lin`` only: what a checkpoint keeps),
    ``largest`` (its largest saved tensor). ``stem``: saved before the first block (embeddings, a CNN's first
    convolution); ``head``: saved after (classifier, loss); ``output``: what forward returns that autograd does not
    keep (the logits), alive through backward only while the training loop holds the outputs.
    """

    block: tuple
    boundary: tuple
    largest: tuple
    head: tuple
    stem: tuple = (0.0, 0.0)
    output: tuple = (0.0, 0.0)


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model; ``acts[pricing][kind]`` as :mod:`.measure` describes (pricing
    'any': a model you describe)."""

    name: str
    n_params: int
    block_params: tuple  # parameters of each block
    block_largest: tuple  # numel of each block's largest parameter
    largest_tensor: int  # numel of the largest parameter tensor
    acts: dict  # pricing -> precision kind -> ActCoeffs
    output_per_unit: float  # elements of the model's output (logits) per sample per unit u
    fwd_flops_per_unit: float  # forward FLOPs per sample per unit u (transformers: per token)
    unit: str = "sample"  # what u is: 'token', 'image area' or 'sample'
    ref_size: int = 1  # reference image size for vision models (u = (size/ref)**2)
    default_size: int = 1  # default sequence length or image size
    max_size: int | None = None  # longest sequence the model reads (transformers)
    hidden: int | None = None  # a transformer's width; None: from GPT-2's and BERT's 12 d**2 + 13 d per block
    tied: bool | None = None  # the head shares the input embedding; None: as GPT-2 (tied if it returns logits)
    linears: tuple = ()  # one block's linear layers (name, in, out): what LoRA targets; (): GPT-2's Conv1D
    lora_acts: dict | None = None  # as acts, measured with the weights frozen and rank-1 adapters on ``linears``
    config: str | None = None  # a transformers model's config (JSON): adapters on other layers are measured from it

    @property
    def grouped_query(self) -> bool:
        """Fewer key/value heads than query heads (grouped-query attention), as its transformers config says."""
        if not self.config:
            return False
        values = json.loads(self.config)
        heads = values.get("num_attention_heads")
        return bool(heads and values.get("num_key_value_heads") and values["num_key_value_heads"] < heads)

    @property
    def hidden_size(self) -> int:
        """A transformer's width d (given, or from its block's 12 d**2 + 13 d parameters: GPT-2 and BERT)."""
        return self.hidden or round((-13 + math.sqrt(169 + 48 * max(self.block_params))) / 24)

    @property
    def tied_head(self) -> bool:
        return bool(self.output_per_unit) if self.tied is None else self.tied

    @property
    def n_blocks(self) -> int:
        return len(self.block_params)

    @property
    def head_params(self) -> int:
        return self.n_params - sum(self.block_params)

    def coeffs(self, device: str, attention: str, kind: str, lora: bool = False) -> ActCoeffs:
        """The coefficients for a device ('cuda' or 'cpu'), an attention ('math' or 'fused') and a kind; ``lora``:
        those measured with frozen weights and adapters, where the model has them."""
        acts = self.lora_acts if lora and self.lora_acts else self.acts
        for key in (f"{device}-{attention}", device, "any"):
            if key in acts:
                if kind not in acts[key]:
                    raise ValueError(f"{self.name} was measured for {sorted(acts[key])} only, not {kind!r}: "
                                     f"measure it with kinds including {kind!r}, or choose another precision.")
                return acts[key][kind]
        raise ValueError(f"{self.name} was measured for {sorted(self.acts)} only, not for {device} with {attention} "
                         "attention: measure it for that device, or choose another.")


def custom_model(n_params: int, activation_bytes_per_sample: float, *, n_blocks: int = 12,
                 name: str = "custom model") -> ModelSpec:
    """A model you describe by its parameter count and its fp32 activation bytes per sample.

    The activations are spread evenly over ``n_blocks`` blocks (inputs = 1/8 of a block's activations, largest saved
    tensor = 1/4: typical of a transformer layer); under mixed precision or pure half they are assumed to halve
    (measured: 0.55-0.6 for GPT-2).
    """
    n_params = positive_int(n_params, "n_params", "e.g. 350_000_000", whole_floats=True)
    positive_number(activation_bytes_per_sample, "activation_bytes_per_sample",
                    "measure it with course_utils.estimate.activation_bytes(model, one_sample)")
    n_blocks = positive_int(n_blocks, "n_blocks", "e.g. 12", whole_floats=True)
    per_block = activation_bytes_per_sample / n_blocks

    def coeffs(scale):
        a = per_block * scale
        return ActCoeffs(block=((a, 0.0),) * n_blocks, boundary=(a / 8,) * n_blocks,
                         largest=((a / 4, 0.0),) * n_blocks, head=(0.0, 0.0))

    return ModelSpec(name=name, n_params=n_params, block_params=(n_params // n_blocks,) * n_blocks,
                     largest_tensor=max(n_params // n_blocks, 1), block_largest=(n_params // n_blocks,) * n_blocks,
                     acts={"any": {"fp32": coeffs(1.0), "amp": coeffs(0.5), "half": coeffs(0.5)}},
                     output_per_unit=0.0, fwd_flops_per_unit=2.0 * n_params, unit="sample")


def model_presets() -> list[str]:
    """Names of the model presets."""
    return list(presets()["models"])


@lru_cache(maxsize=None)
def _preset_spec(name: str) -> ModelSpec:
    return spec_from_data(name, presets()["models"][name])


def act_coeffs(measured: dict, n_blocks: int, uniform: bool = True) -> dict:
    """``{pricing: {kind: ActCoeffs}}`` from measured data as ``presets.json`` keeps it (a transformer's uniform data
    holds one value for its identical blocks)."""

    def per_block(x, convert):
        return (convert(x),) * n_blocks if uniform else tuple(map(convert, x))

    def pair(x):
        return tuple(map(float, x))

    def blocks(c):  # the first block's own where measured (adapters on some layers: it saves less)
        every = per_block(c["block"], pair)
        return (pair(c["first"]),) + every[1:] if "first" in c else every

    return {pricing: {kind: ActCoeffs(block=blocks(c), boundary=per_block(c["boundary"], float),
                                      largest=per_block(c["largest"], pair), head=pair(c["head"]),
                                      stem=pair(c["stem"]), output=pair(c["output"]))
                      for kind, c in by_kind.items()}
            for pricing, by_kind in measured.items()}


def spec_from_data(name: str, d: dict) -> ModelSpec:
    """A ModelSpec from a preset's data (``presets.json``, or :func:`.measure.gpt2_data`)."""

    def per_block(x, convert):  # a transformer's data holds one value for its (identical) blocks
        return (convert(x),) * d["n_blocks"] if d["uniform"] else tuple(map(convert, x))

    def coeffs(measured):
        return act_coeffs(measured, d["n_blocks"], d["uniform"])

    acts = coeffs(d["acts"])
    return ModelSpec(name=name, n_params=d["n_params"], block_params=per_block(d["block_params"], int),
                     largest_tensor=d["largest_tensor"], acts=acts, output_per_unit=d["output_per_unit"],
                     fwd_flops_per_unit=d["fwd_flops_per_unit"], unit=d["unit"], ref_size=d.get("ref_size", 1),
                     default_size=d["default_size"], max_size=d.get("max_size"),
                     block_largest=per_block(d["block_largest"], int), hidden=d.get("hidden"), tied=d.get("tied"),
                     linears=tuple(tuple(x) for x in d.get("linears", ())),
                     lora_acts=coeffs(d["lora_acts"]) if d.get("lora_acts") else None, config=d.get("config"))
