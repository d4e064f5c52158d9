"""The planner's RL mode (course_utils.planner.rl): a GRPO step priced by phase, checked against the tracker's
measurement of notebook 12's own step at several knob settings; the generation engine's pool; bad input; and the
exercise's checker, which must reject a version that makes the whole fp32 log-softmax."""
import functools
import warnings
from pathlib import Path

import pytest
import torch

from course_utils import planner, timeline
from notebook_lessons import checker_rejects, exec_lesson_cells

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "12_rl_fine_tuning.ipynb"
VOCAB, LAYERS, WIDTH, PROMPT = 512, 2, 32, 6


def _nb(**settings):
    """Notebook 12's log-prob functions, its GRPO step and its checker, run here at the test's sizes."""
    ns = {"torch": torch, "COMPLETION_LEN": 4, "DEVICE": torch.device("cpu"), "MODEL": {"vocab_size": VOCAB},
          "EXERCISE_ROWS": 32, "EXERCISE_CHUNK": 4, "BETA": 0.04, "LEARNING_RATE": 1e-3, "G": 4, **settings}
    exec("from course_utils import memory\nfrom course_utils.memory import MIB\nfrom course_utils.checks import claim", ns)
    lesson = {"logprobs": lambda s, t: s.startswith("def full_logprobs"),
              "step": lambda s, t: s.startswith("class GRPOStep"),
              "peak": lambda s, t: s.startswith("def peak_above_logits"),
              "checker": lambda s, t: s.startswith("def check_chunked_logprobs"),
              "solution": lambda s, t: "solution" in t}
    return exec_lesson_cells(NOTEBOOK, lesson, ns, defs_only=True)


@functools.lru_cache(maxsize=1)
def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    policy, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)
    reference.load_state_dict(policy.state_dict())
    return policy, reference.requires_grad_(False)


class _Tokenizer:   # the step decodes completions for its reward: words are token ids here
    def batch_decode(self, ids):
        return [" ".join(map(str, row.tolist())) for row in ids]


def _measure(ns, prompts, *, length=4, beta=0.04, micro=None, selective=False):
    policy, reference = _tiny()
    fn = ns["selective_logprobs"] if selective else ns["full_logprobs"]
    step = ns["GRPOStep"](policy, reference, fn, beta, micro)
    step(prompts, length)
    tl = timeline.record_phases(lambda: step(prompts, length), model=policy,
                               state=(step.optimizer, reference) if beta else (step.optimizer,),
                               phases={"generation": (step, "generate"), "log-probs": (step, "logprobs")})
    return tl.peak_bytes


def _act_per_token(prompts):
    from course_utils import memory

    policy, _ = _tiny()
    kept = {}
    report = memory.measure_memory(lambda: kept.setdefault("h", policy.model(prompts).last_hidden_state), model=policy)
    return report.by_category["activations"] / prompts.numel()


@pytest.fixture
def one_thread():   # tiny tensors: one thread is several times faster than two on a busy 2-core machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_rl_mode_prices_the_measured_step_within_5_percent_at_five_settings(one_thread):
    warnings.filterwarnings("ignore")
    ns = _nb(tokenizer=_Tokenizer(), plain_words=lambda p, c: [len(set(a.split()) & set(b.split())) / 4 for a, b in
                                                            zip(p, c)])
    torch.manual_seed(1)
    prompts = torch.randint(3, VOCAB, (2, PROMPT))
    act = _act_per_token(prompts.repeat_interleave(4, 0))
    n_params = sum(p.numel() for p in _tiny()[0].parameters())

    def price(length=4, beta=0.04, micro=None, selective=False):
        return planner.price_grpo_step(n_params=n_params, vocab=VOCAB, n_layers=LAYERS, kv_width=WIDTH, prompts=2,
                                       num_generations=4, prompt_len=PROMPT, completion_len=length, micro_batch=micro,
                                       reference="separate" if beta else "none",
                                       logprobs="selective" if selective else "full", act_bytes_per_token=act)
    settings = [{}, {"length": 8}, {"micro": 4}, {"beta": 0.0}, {"selective": True}]
    peaks = {}
    for kw in settings:
        measured, priced = _measure(ns, prompts, **kw), price(**kw).peak_bytes
        assert priced == pytest.approx(measured, rel=0.05), (kw, priced, measured)
        peaks[str(kw)] = measured
    assert peaks["{'length': 8}"] > peaks["{}"] > peaks["{'beta': 0.0}"], "the knobs move the peak the priced way"


def test_the_phases_and_lines_add_up():
    kw = dict(n_params=1000, vocab=100, n_layers=2, kv_width=8, prompts=2, num_generations=4, prompt_len=5,
              completion_len=3)
    base = planner.price_grpo_step(**kw)
    assert set(base.phases) == {"generation", "reference log-probs", "policy forward", "backward", "optimizer"}
    assert base.peak_phase == "backward" and base.peak_bytes == base.phases["backward"]
    assert base.lines["reference"] == base.lines["weights"] == 4000 and base.lines["optimizer state"] == 8000
    assert base.lines["logits and log-probs"] == 8 * 3 * 100 * 4   # full: the log-softmax, N x V fp32
    assert base.lines["backward temporaries"] == 2 * 8 * 3 * 100 * 4
    assert base.lines["kv cache"] == 2 * 2 * 8 * 8 * 8 * 4
    none = planner.price_grpo_step(**kw, reference="none")
    assert base.peak_bytes - none.peak_bytes == 4000 and none.phases["reference log-probs"] == none.phases["optimizer"] - 4000
    lora = planner.price_grpo_step(**kw, reference="adapter", trainable_params=10)
    assert lora.lines["reference"] == 0 and lora.lines["optimizer state"] == 80 and lora.lines["gradients"] == 40
    half = planner.price_grpo_step(**kw, micro_batch=4)
    assert half.lines["logits and log-probs"] * 2 == base.lines["logits and log-probs"]
    assert half.phases["backward"] - half.lines["gradients"] < base.phases["backward"], "a micro-batch holds less"
    pool = planner.price_grpo_step(**kw, pool_bytes=10**6)
    assert all(pool.phases[k] - base.phases[k] == 10**6 for k in base.phases)
    assert "peak" in str(base)


def test_the_engine_pool_and_what_each_counter_shows():
    counters = planner.engine_pool_bytes(80 * 2**30, 0.3, trainer_bytes=10 * 2**30)
    assert counters["engine"] == int(0.3 * 80 * 2**30) and counters["trainer"] == 10 * 2**30
    assert counters["card"] == counters["engine"] + counters["trainer"]
    assert counters["left"] == 80 * 2**30 - counters["card"]
    assert planner.engine_pool_bytes(80 * 2**30, 0.9, trainer_bytes=10 * 2**30)["left"] < 0


@pytest.mark.parametrize("kwargs, message", [
    ({"num_generations": 1}, "at least 2"),
    ({"num_generations": 0}, "num_generations"),
    ({"micro_batch": 3}, "must divide"),
    ({"reference": "copy"}, "reference must be one of"),
    ({"logprobs": "fast"}, "logprobs must be one of"),
    ({"reference": "adapter"}, "trainable_params"),
    ({"trainable_params": 10**9}, "cannot exceed"),
    ({"vocab": -1}, "vocab"),
    ({"act_bytes_per_token": -2.0}, "act_bytes_per_token"),
])
def test_bad_input_says_what_to_change(kwargs, message):
    kw = dict(n_params=1000, vocab=100, n_layers=2, kv_width=8, prompts=2, num_generations=4, prompt_len=5,
              completion_len=3)
    with pytest.raises(ValueError, match=message):
        planner.price_grpo_step(**{**kw, **kwargs})


def test_bad_pool_and_phase_input():
    with pytest.raises(ValueError, match="fraction of the card below 1"):
        planner.engine_pool_bytes(80 * 2**30, 1.5)
    with pytest.raises(ValueError, match="card_bytes"):
        planner.engine_pool_bytes(-1)
    with pytest.raises(ValueError, match="phases maps a label"):
        timeline.record_phases(lambda: None, model=torch.nn.Linear(2, 2), phases={"x": (object(), "missing")})


def test_record_phases_labels_and_restores_the_methods():
    model = torch.nn.Linear(8, 8)

    class Loop:
        def forward_pass(self):
            return model(torch.randn(4, 8)).sum()

    loop = Loop()
    tl = timeline.record_phases(lambda: loop.forward_pass().backward(), model=model,
                               phases={"mine": (loop, "forward_pass")})
    assert "mine" in set(tl.events["step_phase"]) and "backward" in set(tl.events["step_phase"])
    assert "forward_pass" not in vars(loop), "the instance is left as it was"


def test_the_checker_accepts_the_solution_and_rejects_the_full_log_softmax():
    ns = _nb()
    check = ns["check_chunked_logprobs"]
    assert check(ns["chunked_logprobs_solution"], verbose=False)

    def full_then_chunks(logits, index, chunk):   # right values, but the whole fp32 log-softmax made first
        whole = logits.log_softmax(-1)
        return torch.cat([w.gather(-1, i.unsqueeze(-1)).squeeze(-1) for w, i in zip(whole.split(chunk),
                                                                                    index.split(chunk))])

    def wrong_values(logits, index, chunk):   # forgets the logsumexp: raw logits
        return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    def detached(logits, index, chunk):   # right values, no gradient
        return ns["chunked_logprobs_solution"](logits, index, chunk).detach()

    assert checker_rejects(lambda fn: check(fn, verbose=False), full_then_chunks, lambda a, b, _: ns["full_logprobs"](a, b), wrong_values,
                           detached)
