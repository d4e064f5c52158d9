"""course_utils.estimate: the arithmetic, and predictions within 2% of measure_memory (vision models, GPT-2,
encoder-decoders, and tiny twins of today's open LLM families) for each optimizer."""
import pytest
import timm
import torch
from torch import nn

from course_utils import estimate, models
from course_utils.memory import measure_memory


def test_sixteen_bytes_per_param_mixed_precision_adam():
    n = 1_000_000_000
    tb = estimate.training_state_bytes(n, optimizer="adam", param_dtype="fp16", master_weights=True)
    assert (tb.params, tb.grads, tb.optimizer, tb.master_weights) == (2 * n, 2 * n, 8 * n, 4 * n)
    assert tb.total == 16 * n


def test_fp32_adam_is_16_gb_for_1e9_params():
    tb = estimate.training_state_bytes(10**9, optimizer="adam")
    assert tb.total == 16 * 10**9


def test_gpt2_xl_fp32_adam():
    tb = estimate.training_state_bytes(models.GPT2_XL_PARAMS, optimizer="adamw")
    assert round(tb.params / 1024**3, 1) == 5.8
    assert round(tb.total / 1024**3, 1) == 23.2


@pytest.mark.parametrize("opt, per_param", [("sgd", 0), ("sgd_momentum", 4), ("adam", 8), ("AdamW", 8), ("SGD+momentum", 4)])
def test_state_bytes_per_optimizer(opt, per_param):
    assert estimate.optimizer_state_bytes(1000, opt) == per_param * 1000


def test_8bit_adam_state():
    big = 256 * 100
    # two uint8 states + one fp32 absmax per 256-block each
    assert estimate.optimizer_state_bytes(big, "adam8bit") == 2 * big + 2 * 4 * 100
    # tensors under 4096 elements keep 32-bit state in bitsandbytes
    assert estimate.optimizer_state_bytes(100, "adam8bit", tensor_sizes=[100]) == 800


def test_dtype_names():
    assert estimate.dtype_of("fp32") == torch.float32
    assert estimate.dtype_of("BF16") == torch.bfloat16
    assert estimate.dtype_of(torch.float16) == torch.float16
    assert estimate.dtype_of("int8").itemsize == 1
    assert estimate.dtype_of("half") == torch.float16  # torch's own names work too


def test_activation_bytes_counts_saved_tensors_not_parameters():
    lin = nn.Linear(100, 50)
    x = torch.randn(8, 100)
    # Linear saves its input (8x100 fp32) for the weight gradient; the output is 8x50
    assert estimate.activation_bytes(lin, x) == 8 * 100 * 4 + 8 * 50 * 4


def test_saved_bytes_by_module_attributes_each_storage_to_its_first_saver():
    import torch.nn.functional as F

    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(5, 16)
    # Linear "1" saves its input; each ReLU its output, which the next Linear saves again (counted once);
    # the weights (saved by the Linears) are parameters, not activations
    by_module = estimate.saved_bytes_by_module(model, x)
    assert by_module == {"1": 5 * 16 * 4, "2": 5 * 32 * 4, "4": 5 * 32 * 4}
    assert sum(by_module.values()) + 5 * 4 * 4 == estimate.activation_bytes(model, x)  # + the output

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return (x * 2) + F.relu(self.fc(x))  # ops outside modules: F.relu joins fc, x * 2 saves nothing

    assert estimate.saved_bytes_by_module(Res(), torch.randn(4, 8)) == {"fc": 4 * 8 * 4 * 2}  # fc's input, relu's output


def _hf(config_class, **extra):
    """A tiny twin (two layers, width 64) of a transformers family, with random weights."""
    import transformers

    def build():
        common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**common, **extra))
    return build


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0))


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64))


VOCAB, SEQ = 512, 32


def _lm_batch(b):  # a causal LM computes its own loss from labels
    ids = torch.randint(0, VOCAB, (b, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq_batch(b):  # the decoder trains on its own inputs (teacher forcing), shorter than the source
    target = torch.randint(0, VOCAB, (b, SEQ // 2))
    return {"input_ids": torch.randint(0, VOCAB, (b, SEQ)), "decoder_input_ids": target.clone(), "labels": target}


CASES = [  # name, build, batch of b, batch sizes
    ("mlp", lambda: models.mlp(n_layers=2, width=256), lambda b: {"x": torch.randn(b, 1, 28, 28)}, (16, 128)),
    ("resnet18", lambda: timm.create_model("resnet18", in_chans=1, num_classes=10),
     lambda b: {"x": torch.randn(b, 1, 48, 48)}, (4, 16)),
    ("gpt2", lambda: models.build_gpt2("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64),
     _lm_batch, (2, 8)),
    ("t5", _t5, _seq2seq_batch, (4, 8)),
    ("bart", _bart, _seq2seq_batch, (4, 8)),
    ("llama", _hf("LlamaConfig"), _lm_batch, (2, 8)),
    ("qwen2", _hf("Qwen2Config"), _lm_batch, (2, 8)),
    ("mistral", _hf("MistralConfig"), _lm_batch, (2, 8)),
    ("gemma2", _hf("Gemma2Config", head_dim=16), _lm_batch, (2, 8)),  # logit soft-capping, tied embeddings
    ("phi3", _hf("Phi3Config", pad_token_id=0, bos_token_id=0, eos_token_id=0), _lm_batch, (2, 8)),
]


def _optimizer(name, params):
    if name == "adam8bit":
        bnb = pytest.importorskip("bitsandbytes", reason="8-bit Adam needs bitsandbytes, which is not installed here")
        return bnb.optim.Adam8bit(params, lr=1e-4)
    return torch.optim.SGD(params, lr=0.01) if name == "sgd" else torch.optim.Adam(params, lr=1e-4)


def _measure_step(model, opt, batch):
    def step():
        inputs = {k: v.clone() for k, v in batch.items()}  # the batch is made inside the step, as a loader does
        if "x" in inputs:  # a classifier: the loss is taken outside the model
            out = model(inputs["x"])
            loss = nn.functional.cross_entropy(out, torch.zeros(len(out), dtype=torch.long))
        else:  # a transformers model computes its loss from the labels; the step holds its outputs
            out = model(**inputs)
            loss = out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: the optimizer state exists from then on
    return measure_memory(step, model=model, optimizer=opt)


# MemTracker's module tracker warns when a model it hooked for an earlier batch has been freed: harmless
@pytest.mark.filterwarnings("ignore:Module is None:UserWarning")
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adam8bit"])
@pytest.mark.parametrize("name, build, make_batch, batches", CASES, ids=[c[0] for c in CASES])
def test_estimate_within_2_percent_of_measurement(name, build, make_batch, batches, optimizer):
    for batch_size in batches:
        torch.manual_seed(0)
        model = build()
        batch = make_batch(batch_size)
        measured = _measure_step(model, _optimizer(optimizer, model.parameters()), batch)
        predicted = (estimate.estimate_training_memory(model, batch["x"], optimizer=optimizer) if "x" in batch
                     else estimate.estimate_training_memory(model, optimizer=optimizer, **batch))
        error = (predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes
        table = "\n".join(f"  {c:<12} {predicted.by_category[c]:>12,} {measured.by_category[c]:>12,}"
                          for c in measured.by_category)
        assert abs(error) <= 0.02, (f"{name}, {optimizer}, batch {batch_size}: predicted {predicted.peak_bytes:,} B, "
                                    f"measured {measured.peak_bytes:,} B ({error:+.1%}); predicted vs measured:"
                                    f"\n{table}")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: estimate.optimizer_state_bytes(-5, "adam"), ValueError, "positive"),
        (lambda: estimate.optimizer_state_bytes(0, "adam"), ValueError, "positive"),
        (lambda: estimate.optimizer_state_bytes(10, "lion"), ValueError, "choose one of"),
        (lambda: estimate.optimizer_state_bytes(10, 3), TypeError, "name"),
        (lambda: estimate.dtype_of("fp12"), ValueError, "Unknown dtype"),
        (lambda: estimate.dtype_of("nn"), ValueError, "Unknown dtype"),  # a torch attribute, not a dtype
        (lambda: estimate.training_state_bytes(2.5), TypeError, "whole number"),
        (lambda: estimate.activation_bytes("model", torch.ones(1)), TypeError, "nn.Module"),
        (lambda: estimate.activation_bytes(nn.Linear(2, 2)), ValueError, "example input"),
        (lambda: estimate.count_params([1, 2]), TypeError, "nn.Module"),
        (lambda: estimate.estimate_training_memory(nn.ReLU(), torch.ones(1)), ValueError, "no parameters"),
        (lambda: estimate.estimate_training_memory("model", torch.ones(1)), TypeError, "nn.Module"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_activation_bytes_count_what_the_output_holds():
    # a returned key/value cache is an object holding tensors: they stay alive as long as the step holds the output
    class Cache:
        def __init__(self, keys):
            self.layers = [{"keys": keys}]

    class WithCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 8)

        def forward(self, x):
            return {"out": self.lin(x), "cache": Cache(x * 2)}

    x = torch.randn(4, 16)
    # Linear saves its input; the output and the cache's keys are held by the step
    assert estimate.activation_bytes(WithCache(), x) == 4 * 16 * 4 + 4 * 8 * 4 + 4 * 16 * 4


def test_a_tied_weight_adds_its_gradient_twice_where_it_is_used_again():
    class Tied(nn.Module):  # an embedding and an output layer sharing one weight, as T5, BART and GPT-2 do
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(1000, 32), nn.Linear(32, 1000, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    ids, tied, untied = torch.randint(0, 1000, (2, 3)), Tied(), Tied()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    weight = 1000 * 32 * 4
    for model in (tied, untied):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            logits = model(ids.clone())
            nn.functional.cross_entropy(logits.reshape(-1, 1000), torch.zeros(6, dtype=torch.long)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        measured = measure_memory(step, model=model, optimizer=opt)
        predicted = estimate.estimate_training_memory(model, ids, optimizer="sgd")
        assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes
    # the tied weight counts once, and backward's buffer holds the head's gradient when the embedding adds its own:
    # two more of the weight's size there
    assert predicted.by_category["params"] == 2 * weight  # the untied model, measured last
    by_category = estimate.estimate_training_memory(tied, ids, optimizer="sgd").by_category
    assert by_category["params"] == weight and by_category["other"] >= 2 * weight > predicted.by_category["other"]


def test_activation_bytes_work_on_fake_tensors():
    # fake tensors all have data_ptr() == 0: storages must be told apart another way
    with models.fake_mode():
        lin = nn.Linear(100, 50)
        x = torch.randn(8, 100)
        assert estimate.activation_bytes(lin, x) == 8 * 100 * 4 + 8 * 50 * 4


# ---------------------------------------------------------------- either loop, on models the test above does not use
WIDE = dict(vocab_size=4096, hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # a vocabulary 64 widths wide, as today's LLMs


def _wide(config_class, **extra):
    def build():
        import transformers

        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**{**WIDE, **extra}))
    return build


def _wide_batch(b):
    ids = torch.randint(0, WIDE["vocab_size"], (b, 64))
    return {"input_ids": ids, "labels": ids.clone()}


OTHER_CASES = [
    ("llama", _wide("LlamaConfig"), _wide_batch, 4),
    ("gemma2, logit soft-capping", _wide("Gemma2Config", head_dim=16), _wide_batch, 4),
    ("qwen2", _wide("Qwen2Config"), _wide_batch, 4),
    ("t5, 3 layers", lambda: __import__("transformers").T5ForConditionalGeneration(__import__("transformers").T5Config(
        vocab_size=4096, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4, decoder_start_token_id=0)),
     lambda b: {"input_ids": torch.randint(0, 4096, (b, 64)), "decoder_input_ids": (t := torch.randint(0, 4096, (b, 32))),
                "labels": t.clone()}, 4),
    ("vit", lambda: timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=10),
     lambda b: {"x": torch.randn(b, 3, 64, 64)}, 8),
    ("convnext", lambda: timm.create_model("convnext_atto", num_classes=10), lambda b: {"x": torch.randn(b, 3, 64, 64)}, 8),
    ("mobilenetv3", lambda: timm.create_model("mobilenetv3_small_050", num_classes=10),
     lambda b: {"x": torch.randn(b, 3, 96, 96)}, 8),
]


def _measure_loop(model, opt, batch, keep_outputs):
    """The whole step as either loop writes it: holding the outputs (``out = model(...)``) or not."""
    def step():
        inputs = {k: v.clone() for k, v in batch.items()}
        if "x" in inputs:
            target = torch.zeros(len(inputs["x"]), dtype=torch.long)
            if keep_outputs:
                out = model(inputs["x"])
                loss = nn.functional.cross_entropy(out, target)
            else:
                loss = nn.functional.cross_entropy(model(inputs["x"]), target)
        elif keep_outputs:
            out = model(**inputs)
            loss = out.loss
        else:
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return measure_memory(step, model=model, optimizer=opt)


@pytest.mark.filterwarnings("ignore:Module is None:UserWarning")
@pytest.mark.parametrize("keep_outputs", [True, False], ids=["outputs kept", "outputs freed"])
@pytest.mark.parametrize("name, build, make_batch, batch_size", OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_estimate_within_2_percent_for_either_loop(name, build, make_batch, batch_size, keep_outputs):
    torch.manual_seed(0)
    model, batch = build(), make_batch(batch_size)
    measured = _measure_loop(model, torch.optim.Adam(model.parameters(), lr=1e-4), batch, keep_outputs)

    def estimate_with(keep):
        if "x" in batch:
            return estimate.estimate_training_memory(model, batch["x"], keep_outputs=keep).peak_bytes
        return estimate.estimate_training_memory(model, keep_outputs=keep, **batch).peak_bytes
    error = estimate_with(keep_outputs) / measured.peak_bytes - 1
    assert abs(error) <= 0.02, f"{name}: {error:+.1%}"
    if name.startswith(("llama", "gemma2")) and not keep_outputs:  # the loop matters where the logits are large
        assert estimate_with(True) / measured.peak_bytes - 1 > 0.05


def test_keep_outputs_must_be_a_bool():
    with pytest.raises(TypeError, match="keep_outputs must be True or False"):
        estimate.estimate_training_memory(nn.Linear(2, 2), torch.ones(1, 2), keep_outputs="no")
