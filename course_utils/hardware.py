"""What machine is this, which course profile applies, and what a card holds beyond the tensors."""
from __future__ import annotations

import contextlib
import os
import platform
import re
import sys

import psutil
import torch

from .units import GIB, KIB, MIB
from .validation import byte_counts, positive_int, positive_number

# smoke: small sizes, minutes on a CPU; gpu-check: sizes between, every GPU code path within a short GPU check
# (scripts/gpu_check.sh); full: the articles' sizes, on a GPU
PROFILES = ("smoke", "gpu-check", "full")

# What a CUDA card holds beyond PyTorch's tensors: the CUDA context (kernels, driver state), outside the caching
# allocator, so max_memory_allocated() never sees it but nvidia-smi does (typically 0.3-0.5 GiB; cuda_context_bytes()
# measures it); inside the allocator, its reserve (rounding, cached free blocks) and cuBLAS's workspaces
# (cublas_workspace_bytes()). The context and the reserve are stated assumptions until a GPU measures them.
CUDA_CONTEXT_BYTES = 512 * MIB
ALLOCATOR_RESERVE_FRACTION = 0.05

# Host <-> device links, one direction, GB/s (1e9 bytes/s): the bus's theoretical rate. Pinned copies
# reach about PCIE_EFFICIENCY of it; pageable copies less. The one table the course uses.
PCIE_GB_PER_S = {"PCIe 3.0 x16": 15.75, "PCIe 4.0 x16": 31.5, "PCIe 5.0 x16": 63.0}
PCIE_EFFICIENCY = 0.8

# A free Colab runtime's RAM as Python sees it (psutil.virtual_memory().total): MemTotal 13,297,192 kB, printed in
# Hugging Face's blog "Running IF with diffusers on a Free Tier Google Colab"; Colab's "12.7 GB" is this in GiB.
COLAB_HOST_BYTES = 13_297_192 * KIB


def pcie_seconds(n_bytes: int, link: str = "PCIe 3.0 x16", *, gb_per_s: float | None = None) -> float:
    """Seconds to copy ``n_bytes`` one way between host and GPU: at ``gb_per_s`` (a measured rate, 1e9 bytes/s), else
    at PCIE_EFFICIENCY of ``link``'s rate in PCIE_GB_PER_S. The course's one formula for a copy's time."""
    byte_counts(n_bytes=n_bytes)
    if gb_per_s is None:
        if link not in PCIE_GB_PER_S:
            raise ValueError(f"Unknown PCIe link {link!r}; choose one of {list(PCIE_GB_PER_S)}.")
        gb_per_s = PCIE_GB_PER_S[link] * PCIE_EFFICIENCY
    return n_bytes / (positive_number(gb_per_s, "gb_per_s", "a copy rate in GB/s, e.g. 12.6") * 1e9)


def pcie_table(n_bytes: int):
    """The course's table of PCIe generations (a pandas DataFrame, one row per link): the bus's rate, what pinned
    copies reach, and :func:`pcie_seconds` for ``n_bytes``."""
    import pandas as pd

    return pd.DataFrame({link: {"bus GB/s": gbs, "pinned copies GB/s": gbs * PCIE_EFFICIENCY,
                                "seconds": pcie_seconds(n_bytes, link)} for link, gbs in PCIE_GB_PER_S.items()}).T


def gpu_bytes_needed(tensor_peak_bytes: int, compute_capability: tuple[int, int] | None = None,
                     context_bytes: int = CUDA_CONTEXT_BYTES) -> int:
    """Bytes a card must have for a step whose tensors peak at ``tensor_peak_bytes``: tensors + the allocator's reserve
    + cublas_workspace_bytes(compute_capability) + the CUDA context (``context_bytes``: a card's own, measured, else
    CUDA_CONTEXT_BYTES). Every "fits in N GiB" compares it with the card."""
    byte_counts(tensor_peak_bytes=tensor_peak_bytes, context_bytes=context_bytes)
    return int(tensor_peak_bytes + round(ALLOCATOR_RESERVE_FRACTION * tensor_peak_bytes)
               + cublas_workspace_bytes(compute_capability) + context_bytes)


def recommend_precision(compute_capability: tuple[int, int] | None) -> str:
    """The course's recipe for a GPU of this compute capability (None: no CUDA GPU). A fact about the card, so it
    lives here; notebook 04 teaches it (``course_utils.precision`` re-exports it)."""
    if compute_capability is None:
        return "fp32 training (CPU autocast to bf16 saves memory, not always time)"
    if (not isinstance(compute_capability, tuple) or len(compute_capability) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in compute_capability)):
        raise ValueError(f"compute_capability must be a (major, minor) tuple such as (8, 0), not {compute_capability!r}.")
    if compute_capability >= (8, 0):
        return "bf16 autocast, no GradScaler"
    if compute_capability >= (7, 0):
        return "fp16 autocast + GradScaler"
    return "fp16 autocast + GradScaler (no tensor cores: memory savings only)"


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None = None, handles: int = 2) -> int:
    """cuBLAS's workspaces in the caching allocator: one per handle (a thread running matmuls: the loop's, autograd's),
    ``:4096:8`` (32 MiB) on compute capability 9-12, else ``:4096:2:16:8`` (8 MiB + 128 KiB), or CUBLAS_WORKSPACE_CONFIG
    (PyTorch's CublasHandlePool.cpp). cuBLASLt shares it in PyTorch's builds (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on
    unless set to 0); with it off, cuBLASLt keeps a workspace of its own per handle, CUBLASLT_WORKSPACE_SIZE KiB
    (1024 by default), counted here too. ``compute_capability`` None: this GPU's, else 9.0."""
    positive_int(handles, "handles", "threads that run matmuls on the GPU, e.g. 2", allow_zero=True)
    cc = compute_capability
    if cc is None:
        cc = tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else (9, 0)
    recommend_precision(cc)  # it checks the input
    pattern, default = r":(\d+):(\d+)", ":4096:8" if 9 <= cc[0] <= 12 else ":4096:2:16:8"
    pairs = re.findall(pattern, os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")) or re.findall(pattern, default)
    separate_lt = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower() in ("0", "false", "off", "no")
    lt_kib = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024").strip()
    lt = int(lt_kib) * KIB if separate_lt and lt_kib.isdigit() else 1024 * KIB if separate_lt else 0
    return handles * (sum(int(kib) * KIB * int(count) for kib, count in pairs) + lt)


def device_type() -> str:
    """'cuda', 'mps' or 'cpu': the best accelerator PyTorch can use here."""
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def get_device() -> torch.device:
    return torch.device(device_type())


def gpu_name() -> str | None:
    """The CUDA device's marketing name, or None without a CUDA GPU."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the CUDA GPU, or None without one."""
    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def supports_bf16() -> bool:
    """True only where bf16 runs natively: CUDA compute capability >= 8.0 (Ampere and newer).
    (``torch.cuda.is_bf16_supported()`` says True on a T4, which emulates bf16 slowly.)"""
    cc = compute_capability()
    return cc is not None and cc >= (8, 0)


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def host_ram_bytes() -> int:
    """This machine's RAM (what a plan's host side may use): psutil's total; on Colab, where Python sees the
    runtime's own RAM, that total too (COLAB_HOST_BYTES on the free tier)."""
    return int(psutil.virtual_memory().total)


CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),   # cgroup v2 (Binder, Docker)
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_ram_bytes(cgroup_files=CGROUP_FILES) -> int:
    """RAM a new process could still take: psutil's available memory, or less where a container's memory limit
    (a free Binder session's 2 GiB) leaves less. psutil sees the machine; the limit is in the cgroup's files."""
    available = int(psutil.virtual_memory().available)
    for limit_file, usage_file in cgroup_files:
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                text = limit.read().strip()
                if text != "max":
                    available = min(available, max(0, int(text) - int(usage.read().strip())))
        except (OSError, ValueError):
            continue
    return available


def course_profile() -> str:
    """'smoke' (small sizes, minutes on a CPU), 'gpu-check' (sizes between that take every GPU code path, for
    scripts/gpu_check.sh) or 'full' (the articles' sizes, on a GPU); COURSE_PROFILE chooses, else full on a CUDA GPU
    and smoke elsewhere."""
    value = os.environ.get("COURSE_PROFILE", "").strip().lower()
    if value and value not in PROFILES:
        raise ValueError(f"COURSE_PROFILE={value!r} is not a profile; set it to one of {', '.join(PROFILES)} "
                         "(or unset it to choose automatically: full on a CUDA GPU, smoke elsewhere; gpu-check is "
                         "the short GPU check's sizes).")
    return value or ("full" if torch.cuda.is_available() else "smoke")


def cuda_context_from_counters(device_free: int, device_total: int, reserved: int) -> int:
    """The card's memory in use outside PyTorch's caching allocator: total - free - reserved, never below 0.
    ``mem_get_info`` is the whole card's, so other processes on a shared card count here too."""
    byte_counts(device_free=device_free, device_total=device_total, reserved=reserved)
    if device_free > device_total:
        raise ValueError(f"device_free ({device_free}) exceeds device_total ({device_total}): pass mem_get_info()'s (free, total).")
    return max(0, device_total - device_free - reserved)


def cuda_context_bytes() -> int | None:
    """The CUDA context measured on this card (see :func:`cuda_context_from_counters`); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return cuda_context_from_counters(int(free), int(total), int(torch.cuda.memory_reserved()))


def load_training_kernels(device="cuda") -> None:
    """Run once, on tiny tensors, the kinds of kernel a training step loads: matrix products in fp32, fp16 and bf16
    (cuBLAS and cuBLASLt with their workspaces), fused attention, a loss and a fused AdamW step. CUDA loads kernels
    lazily, each into the context on its first use, so a context measured before them grows during the run."""
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device_type() != "cuda" or supports_bf16() else [])
    for dtype in dtypes:
        x = torch.randn(2, 4, 64, 32, device=device, dtype=dtype, requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        logits = out.flatten(0, 2) @ torch.randn(32, 50, device=device, dtype=dtype)
        torch.nn.functional.cross_entropy(logits.float(), torch.zeros(len(logits), dtype=torch.long, device=device)
                                          ).backward()
        weight = torch.nn.Parameter(torch.randn(8, device=device))
        weight.grad = torch.randn(8, device=device)
        torch.optim.AdamW([weight], fused=True).step()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cap_gpu_memory(budget_gib: float) -> str:
    """Make a larger GPU behave like one with ``budget_gib`` GiB, so "fits in 12 GB" is proven: the allocator gets
    the budget less the CUDA context, measured once the kernels of a training step are loaded
    (:func:`load_training_kernels`; a card's own run would load them too), so that the context a check reads after
    the run is the one the cap left room for. Returns a sentence saying what happened (nothing on CPU/MPS)."""
    positive_number(budget_gib, "budget_gib", "the lesson's GPU budget in GiB, e.g. 12")
    if not torch.cuda.is_available():
        return (f"No CUDA GPU here: the {budget_gib:g} GiB cap does nothing on {device_type()}. "
                "Memory is measured by tracking tensors instead.")
    load_training_kernels("cuda")
    torch.cuda.empty_cache()   # the warm-up's tensors are not the context
    total, measured, budget = int(torch.cuda.get_device_properties(0).total_memory), cuda_context_bytes(), int(budget_gib * GIB)
    context, how = (measured, "measured") if measured else (CUDA_CONTEXT_BYTES, "assumed")
    if budget >= total:
        return f"{gpu_name()} has {total / GIB:.1f} GiB, not more than the {budget_gib:g} GiB budget: no cap needed."
    if budget <= context:
        raise ValueError(f"A budget of {budget_gib:g} GiB leaves nothing for tensors once the CUDA context "
                         f"({context / GIB:.2f} GiB) is counted: raise the budget above the context.")
    fraction = (budget - context) / total
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return (f"Capped {gpu_name()} ({total / GIB:.1f} GiB) to {budget_gib:g} GiB: {(budget - context) / GIB:.2f} GiB "
            f"for PyTorch's allocator ({fraction:.1%} of the card) and {context / GIB:.2f} GiB left for the CUDA "
            f"context ({how}, a training step's kernels loaded).")


@contextlib.contextmanager
def gpu_memory_cap(budget_gib: float):
    """``with gpu_memory_cap(2) as message:`` cap_gpu_memory(2) in the block, the whole card after it, on errors too."""
    message = cap_gpu_memory(budget_gib)
    try:
        yield message
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0, 0)


def hardware_report() -> str:
    """One line: device and its name, memory (the GPU's, else the machine's RAM), compute capability, native bf16,
    profile, Colab."""
    dev, cc = device_type(), compute_capability()
    memory = torch.cuda.get_device_properties(0).total_memory if dev == "cuda" else psutil.virtual_memory().total
    name = {"cuda": gpu_name() or "CUDA GPU", "mps": "Apple GPU (MPS)"}.get(
        dev, f"{platform.processor() or platform.machine() or 'CPU'}, {os.cpu_count()} cores")
    name += f", cc {cc[0]}.{cc[1]}" if cc else ""
    return (f"device={dev} ({name}), memory {memory / GIB:.1f} GiB, "
            f"bf16 native: {'yes' if supports_bf16() else 'no'}, profile={course_profile()}"
            + (", on Colab" if in_colab() else ""))


def banner() -> str:
    """One line every notebook prints: device, memory, profile and library versions."""
    return f"[course] {hardware_report()} | python {platform.python_version()}, torch {torch.__version__}"
