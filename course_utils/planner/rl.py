"""The planner's RL mode: the peak memory of one GRPO step, by phase, and the measurement it is checked against.

A GRPO step (Shao et al. 2024, "DeepSeekMath"; TRL's ``GRPOTrainer``) for ``prompts`` prompts:

* **generation**: ``num_generations`` (G) completions per prompt, all ``prompts x G`` rows at once, with a KV cache
  (2 x layers x rows x (prompt + completion) x kv width) and each new position's logits;
* **reference log-probs** (no gradient): the frozen reference model scores every completion token; ``reference``:
  'separate' (a second copy of the weights), 'adapter' (LoRA: the policy with its adapter disabled, no extra weights)
  or 'none' (beta = 0: no KL term, no reference);
* **policy log-probs, loss and backward**, micro-batch by micro-batch (``micro_batch`` rows; gradients accumulate):
  the logits of the completion positions and their log-probabilities, where the whole vocabulary counts. With
  ``logprobs='full'`` (log-softmax, then gather) forward keeps the fp32 log-softmax (N x V, N = rows x completion
  length; the logits themselves are freed: log-softmax's backward needs only its output) and backward makes two
  more N x V tensors (the gather's zero-filled gradient, log-softmax's gradient); with ``'selective'`` (gather the
  chosen logit, subtract the logsumexp) forward keeps the logits (logsumexp's backward reads its input) and
  backward makes three N x V tensors (the gather's gradient, exp(logits - logsumexp), their product); the counts
  are read off the tracker's timeline of the notebook's step, tensor by tensor;
* **the optimizer step**: AdamW's state, 8 bytes per trainable parameter, and the gradients.

Every phase also holds the state (weights, reference, AdamW's moments) and, with a generation engine such as vLLM
beside the trainer, the engine's own pool (``pool_bytes``: ``gpu_memory_utilization`` x the card, see
:func:`engine_pool_bytes`). The backbone's saved activations are ``act_bytes_per_token`` (measured, per token).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..validation import positive_int, positive_number

REFERENCES = ("separate", "adapter", "none")
# logits-sized tensors kept from forward to backward (logits over completion + 1 positions) and N x V fp32 tensors
# that backward makes, per log-prob path
LOGPROBS = {"full": (0, 1, 2), "selective": (1, 0, 3)}  # (kept logits, kept log-softmax, backward N x V)
ADAM_BYTES = 8  # AdamW's m and v in fp32, per trainable parameter


@dataclass(frozen=True)
class RLStepPrice:
    """What :func:`price_grpo_step` found: bytes per phase (each the phase's peak, the state included), the lines
    that make them, and the highest phase."""

    phases: dict
    lines: dict

    peak_bytes = property(lambda self: max(self.phases.values()))
    peak_phase = property(lambda self: max(self.phases, key=self.phases.get))

    def __str__(self) -> str:
        rows = [f"  {name:<22} {b / 2**20:9.2f} MiB" for name, b in self.phases.items()]
        return f"GRPO step, peak {self.peak_bytes / 2**20:.2f} MiB ({self.peak_phase})\n" + "\n".join(rows)


def engine_pool_bytes(card_bytes: int, gpu_memory_utilization: float = 0.9, *, trainer_bytes: int = 0) -> dict:
    """A generation engine that keeps its own pool (vLLM): it takes ``gpu_memory_utilization`` of the card for its
    weights and KV cache, whatever it needs. Returns what each counter shows: ``engine`` (the pool), ``trainer``
    (PyTorch's tensors: ``max_memory_allocated`` counts only these), ``card`` (nvidia-smi: both), and ``left``."""
    card = positive_int(card_bytes, "card_bytes", "the card's memory in bytes, e.g. 80 * 2**30")
    share = positive_number(gpu_memory_utilization, "gpu_memory_utilization", "a fraction of the card, e.g. 0.3")
    if share >= 1:
        raise ValueError(f"gpu_memory_utilization is a fraction of the card below 1 (vLLM's default 0.9), "
                         f"not {gpu_memory_utilization}.")
    trainer = positive_int(trainer_bytes, "trainer_bytes", "the trainer's peak in bytes", allow_zero=True)
    engine = int(share * card)
    return {"engine": engine, "trainer": trainer, "card": engine + trainer, "left": card - engine - trainer}


def price_grpo_step(*, n_params: int, vocab: int, n_layers: int, kv_width: int, prompts: int, num_generations: int,
                    prompt_len: int, completion_len: int, micro_batch: int | None = None, reference: str = "separate",
                    logprobs: str = "full", trainable_params: int | None = None, act_bytes_per_token: float = 0.0,
                    weight_bytes: int = 4, pool_bytes: int = 0) -> RLStepPrice:
    """Peak bytes of one GRPO step (AdamW, fp32 logits), by phase, at the steady state (AdamW's moments exist).
    ``micro_batch``: completions per forward/backward (default: all ``prompts x num_generations``);
    ``trainable_params``: LoRA's adapter parameters (default: every weight trains)."""
    n = positive_int(n_params, "n_params", "the policy's parameter count")
    v, layers, kv = (positive_int(x, what) for x, what in ((vocab, "vocab"), (n_layers, "n_layers"),
                                                           (kv_width, "kv_width")))
    g = positive_int(num_generations, "num_generations", "completions per prompt, G (TRL's default: 8)")
    if g < 2:
        raise ValueError("num_generations must be at least 2: GRPO's advantage compares completions of one prompt.")
    rows = positive_int(prompts, "prompts", "prompts per step") * g
    p, c = positive_int(prompt_len, "prompt_len"), positive_int(completion_len, "completion_len")
    micro = rows if micro_batch is None else positive_int(micro_batch, "micro_batch", "completions per micro-batch")
    if micro > rows or rows % micro:
        raise ValueError(f"micro_batch ({micro}) must divide the step's {rows} completions (prompts x num_generations).")
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES} ('none' when beta = 0), not {reference!r}.")
    if logprobs not in LOGPROBS:
        raise ValueError(f"logprobs must be one of {sorted(LOGPROBS)}, not {logprobs!r}.")
    trainable = n if trainable_params is None else positive_int(trainable_params, "trainable_params")
    if trainable > n:
        raise ValueError(f"trainable_params ({trainable:,}) cannot exceed n_params ({n:,}).")
    if reference == "adapter" and trainable_params is None:
        raise ValueError("reference='adapter' is LoRA's: pass trainable_params (the adapters' parameter count).")
    act = positive_number(act_bytes_per_token, "act_bytes_per_token", allow_zero=True)
    pool = positive_int(pool_bytes, "pool_bytes", allow_zero=True)

    weights = n * weight_bytes + (trainable * 4 if trainable_params is not None else 0)  # adapters in fp32
    lines = {"weights": weights, "reference": n * weight_bytes if reference == "separate" else 0,
             "optimizer state": ADAM_BYTES * trainable, "engine pool": pool}
    state = sum(lines.values())
    nv = micro * c * v * 4  # one fp32 N x V tensor of a micro-batch
    logits = micro * (c + 1) * v * 4  # the logits the model returns (the completion positions and one more)
    kept_logits, kept_lsm, backward_nv = LOGPROBS[logprobs]
    lines["kv cache"] = 2 * layers * rows * (p + c) * kv * weight_bytes
    lines["logits and log-probs"] = kept_logits * logits + kept_lsm * nv
    lines["activations"] = int(act * micro * (p + c))
    lines["backward temporaries"] = backward_nv * nv
    lines["gradients"] = 4 * trainable
    grads_before = lines["gradients"] if micro < rows else 0  # from the second micro-batch on they accumulate
    phases = {"generation": state + lines["kv cache"] + 2 * rows * v * 4,
              "reference log-probs": state + (logits + nv * (logprobs == "full") if reference != "none" else 0),
              "policy forward": state + grads_before + lines["activations"] + lines["logits and log-probs"],
              "backward": state + grads_before + lines["activations"] + lines["logits and log-probs"]
              + lines["backward temporaries"],
              "optimizer": state + lines["gradients"]}
    return RLStepPrice(phases={k: int(b) for k, b in phases.items()}, lines={k: int(b) for k, b in lines.items()})
