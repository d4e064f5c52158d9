"""Regenerate the models in ``course_utils/planner/presets.json`` and the shipped LLMs' measurements in ``llms.json``:
each preset's parameter counts and activation coefficients, measured with the planner's own functions (saved-tensor
hooks on fake tensors, see ``course_utils.planner.measure`` and ``.llm``). ``tests/test_planner.py`` and
``tests/test_planner_llms.py`` re-measure a sample and compare it with the files.

    python -m course_tools.measure_presets              # every model preset and LLM (a few minutes on a CPU)
    python -m course_tools.measure_presets gpt2 mlp     # only these
    python -m course_tools.measure_presets llama-3.1-8b
    python -m course_tools.measure_presets --spread     # published.json's spread, from its stated rows priced now
"""
from __future__ import annotations

import functools
import json
import sys
from importlib import resources

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_utils import models
from course_utils.planner import llm, measure

PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base", "bert-large", "mlp", "small-cnn", "resnet18",
           "resnet50", "efficientnet_b0")


class WithLoss(nn.Module):
    """A classifier whose forward returns its cross-entropy loss, as the training step computes it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.inner(x).float(), y)


def _build_bert(name: str, kind: str, attention: str):
    from transformers import BertConfig, BertForSequenceClassification

    size = {} if name == "bert-base" else dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096)
    cfg = BertConfig(num_hidden_layers=2, **size)
    cfg._attn_implementation = models.ATTENTION[attention]
    with models.default_dtype(torch.float16 if kind == "half" else torch.float32):
        model = BertForSequenceClassification(cfg)

    def make(u):
        return (), {"input_ids": torch.randint(0, cfg.vocab_size, (1, u)), "labels": torch.zeros(1, dtype=torch.long)}
    return model, list(model.bert.encoder.layer), make


def _build_classifier(name: str, kind: str, attention: str = "math"):
    """The MLP, the small CNN (28 x 28 digits) or a timm vision model (224 x 224), with its loss."""
    dtype = torch.float16 if kind == "half" else torch.float32
    with models.default_dtype(dtype):
        if name in ("mlp", "small-cnn"):
            model = models.mlp() if name == "mlp" else measure.small_cnn()
            blocks, shape = list(model.children()), (1, 1, 28, 28)
        else:
            import timm

            model = timm.create_model(name, pretrained=False)
            resnet = name.startswith("resnet")
            stages = (model.layer1, model.layer2, model.layer3, model.layer4) if resnet else model.blocks
            blocks, shape = [b for stage in stages for b in stage], (1, 3, 224, 224)

    def make(u):
        return (torch.randn(*shape, dtype=dtype), torch.zeros(1, dtype=torch.long)), {}
    return WithLoss(model), blocks, make


def measure_spec_data(name: str, *, fake: bool = True, kinds=measure.KINDS, pricings=None) -> dict:
    """A preset's entry of ``presets.json``, measured now (``kinds``, ``pricings``: see the planner's measure)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; choose one of {PRESETS}.")
    if name.startswith("gpt2"):
        return measure.gpt2_data(name, kinds=kinds, fake=fake, pricings=pricings)
    if name.startswith("bert"):
        build = functools.partial(_build_bert, name)
        acts = measure.measure_acts(build, transformer=True, fake=fake, kinds=kinds, pricings=pricings)
        with models.fake_mode():
            model, blocks, _ = build("fp32", "math")
        return measure.transformer_data(model, blocks, 12 if name == "bert-base" else 24, acts, output_per_unit=0.0,
                                        default_size=512, max_size=model.config.max_position_embeddings)
    build = functools.partial(_build_classifier, name)
    acts = measure.measure_acts(build, transformer=False, fake=fake, kinds=kinds, pricings=pricings)
    model, blocks, make = build("fp32")  # real, on the CPU: parameters and forward FLOPs
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    with FlopCounterMode(display=False) as counter:
        model(*make(1)[0])
    ref = 28 if name in ("mlp", "small-cnn") else 224
    return {"family": "mlp" if ref == 28 else "vision", "unit": "sample" if ref == 28 else "image area", "acts": acts,
            "largest_tensor": max(p.numel() for p in model.parameters()), "n_blocks": len(blocks),
            "block_params": block_params,
            "block_largest": [max((p.numel() for p in b.parameters()), default=0) for b in blocks],
            "n_params": sum(p.numel() for p in model.parameters()),
            "fwd_flops_per_unit": float(counter.get_total_flops()),
            "output_per_unit": 0.0, "ref_size": ref, "default_size": ref, "uniform": False}


def tidy(obj):
    """Measured numbers as presets.json keeps them: 3 decimals at most, whole numbers as integers."""
    if isinstance(obj, dict):
        return {k: tidy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [tidy(x) for x in obj]
    if isinstance(obj, float):
        return int(obj) if round(obj, 3).is_integer() else round(obj, 3)
    return obj


def dumps(obj, indent: int = 0) -> str:
    """JSON as presets.json is written: one key per line, a list of numbers or names on one line."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, list) and any(isinstance(x, (list, dict)) for x in obj):
        return "[\n" + ",\n".join(pad + dumps(x, indent + 1) for x in obj) + "\n" + " " * indent + "]"
    return json.dumps(obj, ensure_ascii=False)


def write_spread() -> dict:
    """Price ``published.json``'s rows with the planner as it is now and write the spread its stated rows give (what
    every plan's range is made of; ``tests/test_published.py`` fails until the stored one is the fresh one)."""
    from course_utils.planner import published

    path = resources.files("course_utils.planner").joinpath("published.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    published.published_data.cache_clear()
    data["spread"] = published.spread(published.table(spread=(0.0, 0.0)))
    with resources.as_file(path) as file:
        file.write_text(dumps(data) + "\n", encoding="utf-8")
    published.published_data.cache_clear()
    print(f"wrote {path}: spread {data['spread']['low']:+.2%} to {data['spread']['high']:+.2%} over "
          f"{len(data['spread']['rows'])} stated rows")
    return data["spread"]


def main(names=None) -> None:
    if names == ["--spread"]:
        write_spread()
        return
    names = names or PRESETS + tuple(llm.llm_presets())
    unknown = [n for n in names if n not in PRESETS and n not in llm.llm_presets()]
    if unknown:
        raise SystemExit(f"Unknown presets {unknown}; choose from {PRESETS + tuple(llm.llm_presets())}.")
    for file_name, key, chosen, measure_one in (
            ("presets.json", "models", [n for n in names if n in PRESETS], measure_spec_data),
            ("llms.json", "measured", [n for n in names if n not in PRESETS], llm.hf_data)):
        if not chosen:
            continue
        path = resources.files("course_utils.planner").joinpath(file_name)
        data = json.loads(path.read_text(encoding="utf-8"))
        for name in chosen:
            print(f"measuring {name} ...", flush=True)
            data[key][name] = tidy(measure_one(name))
        with resources.as_file(path) as file:
            file.write_text(dumps(data) + "\n", encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
