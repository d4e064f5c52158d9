"""The optimizer's state as the planner prices it: notebook 10's optimizers by a transformer's shapes, the others by
:func:`course_utils.estimate.optimizer_state_bytes` over the model's tensors (8-bit Adam keeps small tensors' state in
fp32), and the part of a paged optimizer's state that lives in CUDA unified memory."""
from __future__ import annotations

from ..estimate import optimizer_state_bytes
from .specs import ModelSpec

# notebook 10's optimizers, priced for a transformer's shapes (optimizer_state); the bf16 one keeps no fp32 master
BEYOND_ADAM = {"adafactor": "Adafactor (factored second moment)", "lion": "Lion (one moment)",
               "adam_mini": "Adam-mini (one v per block)", "galore": "GaLore (low-rank projection)",
               "apollo": "APOLLO (random low-rank scaling)", "adamw_bf16_sr": "bf16 AdamW with stochastic rounding"}


def optimizer_state(model: ModelSpec, optimizer: str) -> int:
    """State bytes of notebook 10's optimizers for a transformer of width d (GPT-2's shapes: per block the matrices
    d x 3d, d x d, d x 4d, 4d x d and 13 d vector values; the head: embedding rows of d values), as each library keeps
    it: Adafactor a row and a column mean per matrix; Lion m; Adam-mini m and one v per row (embeddings, MLP), per
    bias value or per other tensor; GaLore and APOLLO (rank d/4) m, v of the projected matrices and the projection
    (GaLore's a view of the SVD's factor: d^2 values), AdamW elsewhere; bf16 AdamW + SR m, v in bf16."""
    if model.unit != "token" or model.linears:
        raise ValueError(f"optimizer={optimizer!r} is priced for transformers of GPT-2's and BERT's "
                         f"shapes; {model.name} is not one: choose 'adam', 'adamw', 'adam8bit' or 'sgd'.")
    d, n, nb = model.hidden_size, model.n_params, model.n_blocks
    mats, vec, r, rows = ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)), 13 * d, d // 4, model.head_params // d
    per_block = {"adafactor": 4 * sum(a + b for a, b in mats) + 4 * vec + 48,
                 "adam_mini": 4 * (12 * d * d + vec) + 4 * (9 * d + 5 * d + 4),
                 "galore": sum(8 * r * max(m) + 4 * min(m) ** 2 for m in mats) + 8 * vec,
                 "apollo": sum(4 * r * (2 * max(m) + min(m)) for m in mats) + 8 * vec}
    head = {"adafactor": 4 * (rows + 4 * d), "adam_mini": 4 * (model.head_params + rows + 2),
            "galore": 8 * model.head_params, "apollo": 8 * model.head_params}
    if optimizer in per_block:
        return nb * per_block[optimizer] + head[optimizer]
    return 4 * n  # lion: m in fp32; adamw_bf16_sr: m and v in bf16


def state_bytes(model: ModelSpec, optimizer: str, n: int, sizes=None, dtype: str = "fp32") -> int:
    """The optimizer's state for ``n`` trainable values whose state is kept in ``dtype`` (fp32; 16 bits for pure
    16-bit training without a master, or 16-bit adapters): notebook 10's by the model's shapes, the others by
    :func:`course_utils.estimate.optimizer_state_bytes`."""
    if optimizer in BEYOND_ADAM:
        return optimizer_state(model, optimizer)
    return optimizer_state_bytes(n, optimizer, param_dtype=dtype, tensor_sizes=sizes)


def tensor_sizes(model: ModelSpec) -> list[int]:
    """Numel of each trainable tensor, as the optimizer sees them: a transformers LLM's linear weights by name, the
    rest of each block (norms, biases) and of the head (embeddings, norm) as one tensor each; for the other presets,
    the largest tensor and one per block."""
    if not model.linears:
        return [model.largest_tensor] + [max(1, (model.n_params - model.largest_tensor) // model.n_blocks)] * \
            model.n_blocks
    block = [d_in * d_out for _, d_in, d_out in model.linears]
    rest = [bp - sum(block) for bp in model.block_params]
    embeddings = round(model.output_per_unit) * model.hidden_size
    head = [embeddings] * (1 if model.tied_head else 2)
    return [x for i in range(model.n_blocks) for x in block + [rest[i]] if x > 0] + head + \
        [x for x in [model.head_params - sum(head)] if x > 0]


PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages the state of tensors this large (get_state_buffer); smaller stay put


def paged_state_bytes(optimizer: str, sizes) -> int:
    """The part of a paged bitsandbytes optimizer's state in CUDA unified memory: m and v of each tensor of
    ``PAGED_MIN_NUMEL`` values or more (uint8 for 8-bit AdamW, fp32 for its 32-bit AdamW); their absmax stay
    ordinary tensors."""
    per_value = 2 if optimizer == "adam8bit" else 8
    return sum(per_value * n for n in sizes if n >= PAGED_MIN_NUMEL)
