"""A plan: the planner's answer for one training setup on one card. Its peak by category and the phase that sets it,
a range from the planner's measured error, the verdict (fits, tight, does not fit), what each memory counter would
show (``max_memory_allocated``, ``max_memory_reserved``, nvidia-smi), the host RAM it needs and its step time."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..units import GIB
from .specs import GPUSpec, ModelSpec, published_data


def plan_spread() -> tuple[float, float]:
    """(low, high): how far published measurements of real GPUs fell from the planner's prediction of the same figure,
    as fractions (``published.json``'s ``spread``, which ``tests/test_published.py`` recomputes from its rows). A
    plan's range is its expected peak times (1 + low) to (1 + high)."""
    spread = published_data()["spread"]
    return float(spread["low"]), float(spread["high"])


FIGURES = ("max_memory_allocated", "max_memory_reserved", "nvidia-smi")


@dataclass
class Plan:
    """Predicted peak GPU memory of one whole optimizer step (every micro-batch, then the step), by category, with a
    range, what each counter would show, the host RAM it needs, and the time model's verdict."""

    model: ModelSpec
    gpu: GPUSpec
    settings: object  # the model.Settings it was planned for
    by_category: dict
    phase: str
    step_seconds: float
    notes: list = field(default_factory=list)
    host_bytes: int = 0  # what the plan keeps in host RAM (master weights, CPU optimizer, streamed and offloaded)
    paged_bytes: int = 0  # optimizer state in CUDA unified memory (paged optimizers): outside PyTorch's allocator
    overhead_parts: dict = field(default_factory=dict)  # the overhead: allocator reserve, cuBLAS workspaces, context
    named_parts: dict = field(default_factory=dict)  # the peak by what it is (see breakdown)

    @property
    def peak_bytes(self) -> int:
        """What the card must hold, expected: tensors + overhead (allocator reserve, cuBLAS workspaces, CUDA context);
        a paged optimizer's state is apart (it can wait in host RAM)."""
        return int(sum(self.by_category.values()))

    @property
    def tensor_peak_bytes(self) -> int:
        """The peak of PyTorch's tensors (what measure_memory reports)."""
        return int(sum(v for k, v in self.by_category.items() if k != "overhead"))

    @property
    def range_bytes(self) -> tuple[int, int, int]:
        """(low, expected, high) of :attr:`peak_bytes`: the expected peak widened by how far published measurements
        fell from the planner's predictions (:func:`plan_spread`)."""
        low, high = plan_spread()
        return round(self.peak_bytes * (1 + low)), self.peak_bytes, round(self.peak_bytes * (1 + high))

    @property
    def verdict(self) -> str:
        """'fits' (the high end of the range fits the card), 'tight' (the expected peak fits, the high end does not:
        the planner's own error is larger than the margin) or 'does not fit'."""
        _, expected, high = self.range_bytes
        return "fits" if high <= self.gpu.memory_bytes else "tight" if expected <= self.gpu.memory_bytes else \
            "does not fit"

    @property
    def fits(self) -> bool:
        """The high end of the range fits the card (what PyTorch can allocate on it)."""
        return self.verdict == "fits"

    @property
    def figures(self) -> dict:
        """What each counter would show at the peak: ``max_memory_allocated`` (tensors + cuBLAS's workspaces),
        ``max_memory_reserved`` (+ the allocator's reserve), ``nvidia-smi`` (+ the CUDA context + a paged optimizer's
        state, as much of it as the card holds beside the rest)."""
        if self.settings.device != "cuda":
            return {"max_memory_allocated": self.tensor_peak_bytes}
        allocated = self.tensor_peak_bytes + self.overhead_parts["workspaces"]
        reserved = allocated + self.overhead_parts["reserve"]
        card = reserved + self.overhead_parts["context"]
        return {"max_memory_allocated": allocated, "max_memory_reserved": reserved,
                "nvidia-smi": card + max(0, min(self.paged_bytes, self.gpu.memory_bytes - card))}

    def breakdown(self):
        """The peak by what it is, in GiB (a pandas Series that sums to :attr:`peak_bytes`): the weights (4-bit ones
        and the 16-bit rest under QLoRA), adapters with their gradients and state, or gradients, optimizer state and
        master weights, the checkpoints or saved tensors, the block recomputed, logits and loss, temporaries, and the
        card's overhead (cuBLAS workspaces, allocator reserve, CUDA context)."""
        import pandas as pd

        return pd.Series({k: v / GIB for k, v in self.named_parts.items()}, name="GiB")

    def __str__(self) -> str:
        """The total the card needs against its memory, its range and verdict, the categories, the counters, the host
        RAM and the step time."""
        s = self.settings
        low, expected, high = self.range_bytes
        margin = (high - self.gpu.memory_bytes) / GIB
        verdict = {"fits": "fits", "tight": f"TIGHT (the high end is {margin:.2f} GiB over)",
                   "does not fit": "does NOT fit"}[self.verdict]
        lines = [f"{self.model.name} on {self.gpu.name}: {expected / GIB:.2f} GiB (range {low / GIB:.2f}-"
                 f"{high / GIB:.2f}) of {self.gpu.memory_gib:.2f} GiB -> {verdict}, the peak of one optimizer step "
                 f"({s.accumulation} micro-batches of {s.micro_batch} x {s.size}, then the step; {s.precision}, "
                 f"{s.optimizer}, checkpointing {s.checkpointing}; peak {self.phase})"]
        lines += [f"  {k:<12}{v / GIB:8.2f} GiB" for k, v in self.by_category.items()]
        if self.paged_bytes:
            lines.append(f"  paged       {self.paged_bytes / GIB:8.2f} GiB (optimizer state in CUDA unified memory)")
        if s.device == "cuda":
            lines.append("  counters: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in self.figures.items()))
        lines.append(f"  host RAM it needs: {self.host_bytes / GIB:.1f} GiB")
        lines.append(f"  predicted time per optimizer step: {self.step_seconds:.2f} s")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])
