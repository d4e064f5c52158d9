"""Today's open LLMs for the planner: any transformers causal-LM config, priced with fake tensors.

``hf_spec(config)`` takes a shipped name (``'llama-3.1-8b'``, or its Hugging Face repo id), a ``config.json`` path, a
dict or a ``transformers.PretrainedConfig``; it builds the model with ``AutoModelForCausalLM.from_config`` at 2 layers
(the others are their twins) on fake tensors, as :mod:`.measure` does for GPT-2, and returns a ModelSpec with the
model's width, its tied or untied embeddings and its blocks' linear layers (what LoRA and QLoRA act on). The shipped
configs (``llms.json``: the public config.json values, no weights) come measured: nothing is downloaded, ever.
"""
from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from .. import models
from .measure import KINDS, measure_acts, transformer_data
from .specs import ActCoeffs, ModelSpec, _preset_spec, act_coeffs, model_presets, presets, spec_from_data

DEFAULT_SIZE = 1024  # the sequence length a plan uses unless told
# samples per measured forward: with one, a reshape of a sliced fused projection (Phi-3's qkv) stays a view and
# autograd's saved slice keeps the whole fused output alive; with two it is a copy of the slice, as in training
BATCH = 2


@functools.lru_cache(maxsize=1)
def llm_data() -> dict:
    """The parsed ``llms.json``: {'configs': {name: {'repo', 'label', 'params', 'config'}}, 'measured': {...}}."""
    return json.loads(resources.files(__package__).joinpath("llms.json").read_text(encoding="utf-8"))


def llm_presets() -> list[str]:
    """Short names of the shipped LLM configs."""
    return list(llm_data()["configs"])


def llm_name(name: str) -> str | None:
    """The shipped config's short name for a short name or a Hugging Face repo id (any case), else None."""
    key = name.strip().lower()
    return next((k for k, v in llm_data()["configs"].items() if key in (k, v["repo"].lower())), None)


def hf_config(config):
    """A ``transformers.PretrainedConfig`` from a shipped name or repo id, a config.json path, a dict or a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, (str, Path)):
        shipped = llm_name(str(config))
        if shipped:
            config = llm_data()["configs"][shipped]["config"]
        elif Path(config).is_file():
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        else:
            raise ValueError(f"Unknown model {str(config)!r}: not a shipped config ({llm_presets()}) nor a config.json "
                             "file. Pass a path to a config.json, a dict of it, or a transformers config (nothing is "
                             "downloaded).")
    if not isinstance(config, dict):
        raise TypeError(f"config must be a name, a config.json path, a dict or a transformers PretrainedConfig, not "
                        f"{type(config).__name__}.")
    values = dict(config)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ValueError("The config needs its 'model_type' (e.g. 'llama', 'qwen2', 'mistral', 'gemma2', 'phi3'), "
                         "as config.json has it.")
    return AutoConfig.for_model(model_type, **values)


def build_causal_lm(config, *, kind: str = "fp32", attention: str = "math", n_layers: int | None = 2,
                    dtype=None) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``config`` (a PretrainedConfig) with ``n_layers`` layers (None: as
    configured), weights in ``dtype`` (default fp16 for ``kind='half'``, else fp32), ``attention`` 'math' (eager) or
    'fused' (sdpa; eager for a model transformers gives no SDPA path, such as Gemma-2), no KV cache."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    if n_layers is not None:
        config.num_hidden_layers = n_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:n_layers]
    config.use_cache = False
    with models.default_dtype(dtype or (torch.float16 if kind == "half" else torch.float32)):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=models.ATTENTION[attention])
        except ValueError:  # no SDPA path (Gemma-2's soft-capped logits): transformers trains it with eager
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.loss_type = "ForCausalLM"
    return model


def blocks_of(model: nn.Module) -> list:
    """The decoder layers of a transformers causal LM (``model.model.layers`` for Llama-style models)."""
    base = getattr(model, model.base_model_prefix, model)
    for attr in ("layers", "h", "blocks"):
        found = getattr(base, attr, None) or getattr(getattr(base, "decoder", None), attr, None)
        if isinstance(found, nn.ModuleList):
            return list(found)
    raise ValueError(f"{type(model).__name__}: no list of decoder layers found (model.layers / h / blocks).")


def block_linears(block: nn.Module) -> tuple:
    """The linear layers of one block as ``(name, in_features, out_features)``: what LoRA targets (peft's
    ``target_modules='all-linear'``) and what QLoRA stores in 4 bits."""
    return tuple((name, m.in_features, m.out_features) for name, m in block.named_modules() if isinstance(m, nn.Linear))


def replace_linears(model: nn.Module, make, only=None) -> None:
    """Each linear layer of the decoder blocks replaced by ``make(linear)`` (an adapter around it, a 4-bit copy);
    ``only``: a block's layer names (as :func:`block_linears` gives them) to replace, None: all."""
    for block in blocks_of(model):
        for path, module in list(block.named_modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and (only is None or f"{path}.{name}".lstrip(".") in only):
                    setattr(module, name, make(child))


ADAPTER_DTYPES = ("fp32", "bf16", "fp16")


class RankOne(nn.Module):
    """A frozen linear layer plus a rank-1 adapter, computed as peft computes LoRA: the input cast to the adapter's
    dtype (``dtype``; peft's default is fp32 over 16-bit weights), through ``dropout``, then ``lora_A`` and
    ``lora_B``. What the planner measures LoRA's activations with (the rank's own share it adds)."""

    def __init__(self, base, dtype=torch.float32, dropout: float = 0.0):
        super().__init__()
        self.base = base
        with models.default_dtype(dtype):
            self.lora_A = nn.Linear(base.in_features, 1, bias=False)
            self.lora_B = nn.Linear(1, base.out_features, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype)))).to(x.dtype)


def _flash_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention on (fake) CUDA tensors as a GPU runs a batch without padding: in fp16/bf16 the
    flash kernel, given the grouped key and value heads as they are (for fake tensors transformers builds a mask, and
    with it repeats them); in fp32 the memory-efficient kernel, with them repeated for every query head. Under
    autocast the kernel's inputs are cast to its dtype, as autocast casts SDPA's."""
    if torch.is_autocast_enabled("cuda"):
        query, key, value = (x.to(torch.get_autocast_dtype("cuda")) for x in (query, key, value))
    if query.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, True, False,
                                                                 scale=scaling)[0]
    else:
        key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for x in (key, value))
        out = nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True,
                                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _adapter_torch_dtype(adapter_dtype: str, kind: str):
    """The adapters' torch dtype: fp32, or 16 bits as the weights of ``kind`` 'half' are (fp16 and bf16 have the
    same bytes; fp16 keeps a CPU's fake tensors on one dtype)."""
    if adapter_dtype == "fp32":
        return torch.float32
    return torch.float16 if kind == "half" else torch.bfloat16 if adapter_dtype == "bf16" else torch.float16


def _build(config, kind: str, attention: str, lora=None):
    """``lora``: None (every weight trains), True (rank-1 fp32 adapters on every linear layer), or ``(names, dtype,
    dropout)``: adapters on those layers of each block, in that dtype ('fp32', 'bf16', 'fp16'), with that dropout."""
    from transformers import AttentionInterface

    model = build_causal_lm(config, kind=kind, attention=attention)
    if model.config._attn_implementation == "sdpa":  # only 'cuda-fused' asks for it: the kernel a GPU runs
        AttentionInterface.register("course_flash_gqa", _flash_gqa)
        model.config._attn_implementation = "course_flash_gqa"
    if lora:
        names, dtype, dropout = (None, "fp32", 0.0) if lora is True else lora
        model.requires_grad_(False)
        replace_linears(model, functools.partial(RankOne, dtype=_adapter_torch_dtype(dtype, kind), dropout=dropout),
                        only=names)

    def make(u):
        x = torch.randint(0, config.vocab_size, (BATCH, u))
        return (), {"input_ids": x, "labels": x}
    return model, blocks_of(model), make


def hf_data(config, *, kinds=KINDS, pricings=None, fake: bool = True) -> dict:
    """The planner's data (as ``presets.json`` keeps a model) of a transformers causal LM, measured now."""
    config = hf_config(config)
    acts, lora_acts = (_per_sample(measure_acts(functools.partial(_build, config, lora=lora), transformer=True,
                                                fake=fake, kinds=kinds, pricings=pricings)) for lora in (False, True))
    with models.fake_mode():
        model = build_causal_lm(config)
    blocks = blocks_of(model)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    max_size = getattr(config, "max_position_embeddings", None)
    return {**transformer_data(model, blocks, config.num_hidden_layers, acts, output_per_unit=config.vocab_size,
                               default_size=min(DEFAULT_SIZE, max_size or DEFAULT_SIZE), max_size=max_size),
            "hidden": config.hidden_size, "tied": tied, "linears": [list(x) for x in block_linears(blocks[0])],
            "lora_acts": lora_acts}


def _per_sample(measured):
    """Coefficients measured on BATCH samples, per sample."""
    if isinstance(measured, dict):
        return {k: _per_sample(v) for k, v in measured.items()}
    if isinstance(measured, (list, tuple)):
        return [_per_sample(x) for x in measured]
    return measured / BATCH


def config_json(config) -> str:
    """A transformers config as the planner keeps it: its values as JSON (sorted keys, no version or path)."""
    values = hf_config(config).to_dict()
    for key in ("transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype"):
        values.pop(key, None)
    return json.dumps(values, sort_keys=True, default=str)


@functools.lru_cache(maxsize=32)
def _cached_spec(config_json: str, name: str, kinds: tuple, pricings: tuple | None, fake: bool) -> ModelSpec:
    data = hf_data(json.loads(config_json), kinds=kinds, pricings=pricings, fake=fake)
    return spec_from_data(name, {**data, "config": config_json})


@functools.lru_cache(maxsize=256)
def _adapter_data(config_json: str, names: tuple | None, dtype: str, dropout: float, pricing: str, kind: str) -> dict:
    measured = measure_acts(functools.partial(_build, hf_config(json.loads(config_json)), lora=(names, dtype, dropout)),
                            transformer=True, kinds=(kind,), pricings=(pricing,), first_block=True)
    return _per_sample(measured)


def adapter_coeffs(spec: ModelSpec, names, dtype: str, dropout: float, pricing: str, kind: str) -> ActCoeffs:
    """What one sample saves with rank-1 adapters on the block's linear layers ``names`` (None: all) over frozen
    weights, in ``dtype`` ('fp32', 'bf16', 'fp16'), with ``dropout``, as ``pricing`` ('cpu', 'cuda-math',
    'cuda-fused') and ``kind`` ('fp32', 'amp', 'half') run it: measured now on fake tensors (about a second, cached)
    from the model's config. Only an adapted layer saves its input for the adapter (cast to the adapter's dtype: with
    fp32 adapters over 16-bit weights, a copy per adapted layer); a frozen layer without one saves nothing."""
    if not spec.config:
        raise ValueError(f"{spec.name} carries no transformers config, so adapters on some layers (lora_targets), "
                         "16-bit adapters or lora_dropout cannot be measured for it: price it with "
                         "planner.hf_spec(config), or use the defaults (every linear layer, fp32, no dropout).")
    if dtype not in ADAPTER_DTYPES:
        raise ValueError(f"Unknown adapter dtype {dtype!r}; choose one of {ADAPTER_DTYPES}.")
    names = None if names is None else tuple(sorted(names))
    data = _adapter_data(spec.config, names, dtype, float(dropout), pricing, kind)
    return act_coeffs(data, spec.n_blocks)[pricing][kind]


def hf_spec(config, name: str | None = None, *, kinds=KINDS, pricings=None, fake: bool = True) -> ModelSpec:
    """A ModelSpec of a transformers causal LM: ``config`` a shipped name (:func:`llm_presets`) or its repo id (its
    stored measurement, instant), a config.json path, a dict or a ``PretrainedConfig`` (measured now on fake tensors at
    2 layers, a few seconds, cached). ``kinds``, ``pricings``: what to measure (fewer = faster); ``fake=False``: real
    tensors, the CPU's pricing only (faster for tiny models)."""
    shipped = llm_name(config) if isinstance(config, str) else None
    if shipped and shipped in llm_data()["measured"]:
        return _shipped_spec(shipped, name or shipped)
    cfg = hf_config(config)
    label = name or shipped or getattr(cfg, "name_or_path", "") or f"{cfg.model_type} (custom)"
    return _cached_spec(config_json(cfg), label, tuple(kinds), tuple(pricings) if pricings else None, fake)


@functools.lru_cache(maxsize=None)
def _shipped_spec(shipped: str, name: str) -> ModelSpec:
    return spec_from_data(name, {**llm_data()["measured"][shipped],
                                 "config": config_json(llm_data()["configs"][shipped]["config"])})


def get_model(model) -> ModelSpec:
    """A ModelSpec from a preset name ('gpt2-xl', 'bert-base', 'efficientnet_b0', ...), a shipped LLM ('llama-3.1-8b'
    or its repo id, see ``llm.llm_presets()``) or a ModelSpec. Here, not in :mod:`.specs`: an LLM's spec comes from
    :func:`hf_spec`, which measures, and the measuring builds on :mod:`.specs`."""
    if isinstance(model, ModelSpec):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a preset name or a ModelSpec (custom_model(...), hf_spec(config)), not "
                        f"{type(model).__name__}.")
    if model not in presets()["models"]:
        if llm_name(model):
            return hf_spec(model)
        raise ValueError(f"Unknown model {model!r}; choose one of {model_presets() + llm_presets()}, describe "
                         "yours with custom_model(n_params, activation_bytes_per_sample), or price a transformers "
                         "config with hf_spec(config).")
    return _preset_spec(model)
