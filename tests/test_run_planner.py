"""planner.predict_run prices a whole run (loading, the first step, the worst batch, evaluation, saving) and each
phase's price is held against its CPU measurement within 5% here, on a small GPT-2, with the loop written as notebook
11 writes it; the packing exercise's checker (notebook 11's own cells) rejects collators that let documents attend to
each other or that predict across a document boundary; bad input gets a ValueError that says what to change."""
import tempfile
from pathlib import Path

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel

from course_utils import memory, models, planner
from course_utils.planner import widget
from notebook_lessons import checker_rejects, exec_lesson_cells

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "11_a_whole_run.ipynb"
TOLERANCE = 0.05
SIZE = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=2048, n_positions=128, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
B, T = 2, 128
LENGTHS = [5, 40, 17, 128, 90, 64, 3, 200]   # the longest is cut at T
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------------- the packing exercise's checker
DEFINITIONS = {   # functions only
    "collate_padded": lambda src, tags: src.startswith("def collate_padded"),
    "packed_rows": lambda src, tags: src.startswith("def bucketed_batches"),
    "pack_solution": lambda src, tags: "solution" in tags,
}
CHECKER = {"check_packing": lambda src, tags: src.startswith("checker_model = ")}   # the whole cell


@pytest.fixture(scope="module")
def lesson():
    torch.manual_seed(0)
    docs = [list(torch.randint(0, 256, (n,)).tolist()) for n in (30, 7, 64, 12, 50, 3, 90, 21, 44, 9, 60, 15)]
    config = models.gpt2_config("gpt2", **SIZE)
    namespace = dict(torch=torch, F=F, models=models, config=config, MAX_LEN=T, train_docs=docs,
                     random=__import__("random"))
    exec_lesson_cells(NOTEBOOK, DEFINITIONS, namespace, defs_only=True)
    return exec_lesson_cells(NOTEBOOK, CHECKER, namespace)


def test_the_solution_passes_and_reports_the_tokens_saved(lesson, capsys):
    assert lesson["check_packing"](lesson["pack_solution"]) is True
    assert "saved" in capsys.readouterr().out


def _positions_arange(documents, max_len, pack):
    batch = pack(documents, max_len)   # every row one sequence: each token sees the documents before it in its row
    return dict(batch, position_ids=torch.arange(max_len).expand_as(batch["input_ids"]).clone())


def _labels_across(documents, max_len, pack):
    batch = pack(documents, max_len)   # positions right, but the first token of a document predicted from the last one
    ids, labels = batch["input_ids"], batch["labels"].clone()
    starts = (batch["position_ids"] == 0) & (torch.arange(max_len) > 0)
    labels[starts & (ids != 0)] = ids[starts & (ids != 0)]
    return dict(batch, labels=labels)


def _mask_of_ones(documents, max_len, pack):
    batch = pack(documents, max_len)   # an all-ones 2-D mask beside the restarting positions: one sequence per row
    return dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))


def test_the_checker_rejects_collators_that_let_documents_attend_to_each_other(lesson):
    solution = lesson["pack_solution"]
    wrong = [lambda d, n, f=f: f(d, n, solution) for f in (_positions_arange, _labels_across)]
    wrong.append(lambda d, n: {"input_ids": solution(d, n)["input_ids"]})   # not the form asked for
    assert checker_rejects(lesson["check_packing"], *wrong)


def test_the_checker_rejects_a_mask_that_undoes_the_packing_if_transformers_obeys_it(lesson):
    batch = _mask_of_ones(lesson["train_docs"], T, lesson["pack_solution"])
    model = lesson["checker_model"]
    with torch.no_grad():
        masked = model(**{k: batch[k] for k in ("input_ids", "position_ids", "attention_mask")}).logits
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    if torch.allclose(masked, packed, atol=1e-5):
        pytest.skip("this transformers keeps documents apart by their positions even beside a 2-D mask")
    assert checker_rejects(lesson["check_packing"], lambda d, n: _mask_of_ones(d, n, lesson["pack_solution"]))



# ---------------------------------------------------------------------------- the run, priced and measured
@pytest.fixture(scope="module")
def spec():
    return planner.gpt2_spec("gpt2", kinds=("fp32",), **SIZE)


@pytest.fixture(scope="module")
def run(spec):
    return planner.predict_run(spec, lengths=LENGTHS, micro_batch=B, max_length=T, eval_batches=2, device="cpu")


def step(model, opt, ids):
    out = model(input_ids=ids, labels=ids)   # the loop keeps its outputs until backward ends
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def measured():
    """Each phase of a small run on the CPU, measured as notebook 11 measures it."""
    torch.manual_seed(0)
    config = models.gpt2_config("gpt2", **SIZE)
    folder = Path(tempfile.mkdtemp())
    models.build_gpt2(config, attention="math").save_pretrained(folder)
    box, peaks = {}, {}
    peaks["load"] = planner.measure_phase(lambda: box.update(model=GPT2LMHeadModel.from_pretrained(
        folder, attn_implementation="eager")))["device"]
    model = box["model"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (B, T))
    peaks["first step"] = planner.measure_phase(lambda: step(model, opt, ids), model=model, optimizer=opt)["device"]
    peaks["training step"] = planner.measure_phase(lambda: step(model, opt, ids), model=model, optimizer=opt)["device"]

    @torch.no_grad()
    def evaluate():
        for _ in range(2):
            out = model(input_ids=ids, labels=ids)
            out.loss.item()
            del out
    peaks["evaluation"] = planner.measure_phase(evaluate, model=model, optimizer=opt)["device"]

    def save_host_copy():
        copy = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        state = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        torch.save({"model": copy, "optimizer": state}, folder / "checkpoint.pt")
    peaks["save"] = planner.measure_phase(save_host_copy, model=model, optimizer=opt)["device"]
    return peaks


@pytest.mark.parametrize("phase", planner.run.PHASES)
def test_each_phase_is_priced_within_5_percent_of_its_measurement(run, measured, phase):
    predicted = run.phases[phase]["device"]
    assert predicted == pytest.approx(measured[phase], rel=TOLERANCE), (phase, predicted, measured[phase])
    assert run.phases[phase]["host"] == predicted  # on a CPU the host is the device


def test_the_run_names_its_peak_phase_and_worst_batch(run, measured):
    assert run.worst_batch == (B, T)
    assert run.peak_phase == max(measured, key=measured.get) == "training step"
    assert run.average_step_bytes < run.phases["training step"]["device"]
    assert "training step" in str(run) and set(run.frame().index) == set(planner.run.PHASES)


def test_the_settings_move_the_phases_they_should(spec):
    base = dict(lengths=LENGTHS, micro_batch=B, max_length=T, device="cpu")
    plain = planner.predict_run(spec, **base)
    n = spec.n_params
    assert planner.predict_run(spec, load="init", **base).phases["load"]["host"] == 8 * n
    assert planner.predict_run(spec, load_dtype="bf16", **base).phases["load"]["host"] == \
        plain.phases["load"]["host"] // 2
    kept = planner.predict_run(spec, keep_logits="device", eval_batches=5, **base)
    logits = B * T * spec.output_per_unit * 4
    assert kept.phases["evaluation"]["device"] - plain.phases["evaluation"]["device"] == 4 * logits
    gpu = planner.predict_run(spec, "T4", save="sharded", save_ranks=4, **{**base, "device": "cuda"})
    whole = planner.predict_run(spec, "T4", save="host_copy", **{**base, "device": "cuda"})
    assert gpu.phases["save"]["host"] < whole.phases["save"]["host"] / 3
    assert whole.phases["load"]["device"] < whole.phases["load"]["host"]   # the tied head is read once on the host


def test_packing_makes_every_batch_the_worst_one():
    assert planner.worst_batch([3, 9, 4], 8, max_length=64, padding="packed") == (8, 64)
    assert planner.worst_batch([3, 9, 4], 8, max_length=64) == (8, 9)
    assert planner.worst_batch([3, 99, 4], 8, max_length=64, padding="longest") == (8, 64)


@pytest.mark.parametrize("kwargs, text", [
    (dict(lengths=[]), "non-empty"), (dict(lengths=[3, 0]), ">= 1"), (dict(lengths="long"), "whole numbers"),
    (dict(micro_batch=0), "micro_batch"), (dict(padding="sorted"), "padding must be one of"),
    (dict(load="download"), "load must be one of"), (dict(save="pickle"), "save must be one of"),
    (dict(keep_logits="yes"), "keep_logits"), (dict(eval_batches=-1), "eval_batches"),
    (dict(precision="bf16"), "fp32"), (dict(host_gib=-2), "host_gib"), (dict(load_dtype="int8"), "load_dtype"),
    (dict(padding="packed", max_length=None), "max_length"),
])
def test_bad_input_says_what_to_change(spec, kwargs, text):
    settings = {**dict(lengths=LENGTHS, micro_batch=B, max_length=T, device="cpu"), **kwargs}
    with pytest.raises(ValueError, match=text):
        planner.predict_run(spec, **settings)


def test_the_widget_shows_the_runs_phases_and_keeps_its_plan():
    shown = widget.render(model="gpt2", gpu="T4", micro_batch=4, size=512, accumulation=1, search=False, largest=False,
                          lengths=[100, 300, 700], eval_batches=4)
    assert shown.ok and shown.run is not None and "The whole run" in shown.message
    assert shown.run.worst_batch == (4, 512)
    plain = widget.render(model="gpt2", gpu="T4", micro_batch=4, size=512, accumulation=1, search=False, largest=False)
    assert plain.ok and plain.run is None and "The whole run" not in plain.message
    assert shown.message.startswith(plain.message)
    odd = widget.render(model="gpt2", gpu="T4", micro_batch=4, size=512, search=False, largest=False, lengths=[])
    assert odd.ok and "The whole run: lengths" in odd.message   # the step still plans; the run says what to fix
    with pytest.raises(ValueError, match="RunPlan"):
        widget.plot_run("a plan")


def test_measure_phase_counts_what_from_pretrained_reads_as_host_memory():
    folder = Path(tempfile.mkdtemp())
    config = models.gpt2_config("gpt2", **SIZE)
    models.build_gpt2(config).save_pretrained(folder)
    peaks = planner.measure_phase(lambda: GPT2LMHeadModel.from_pretrained(folder))
    n = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
    assert peaks["host"] == 4 * (n + SIZE["vocab_size"] * SIZE["n_embd"]) == peaks["device"]
    with pytest.raises(TypeError, match="callable"):
        planner.measure_phase("not a function")
    assert memory.tensor_bytes(torch.zeros(3)) == 12


# ---------------------------------------------------------------------------- saving on ranks (notebook 11's worker)
def _notebook_worker(name: str) -> str:
    """The source of the notebook cell that writes ``name`` (its %%writefile line removed)."""
    import json

    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith("%%writefile") and name in source.splitlines()[0]:
            return source.split("\n", 1)[1]
    raise AssertionError(f"no cell of {NOTEBOOK.name} writes {name}")


@pytest.mark.slow
def test_a_sharded_save_on_two_gloo_ranks_is_priced_rank_by_rank(tmp_path):
    # 11's worker on 2 real processes: 07's MLP sharded by FSDP2, one Adam step, then DCP (each rank its share) and
    # the state gathered whole on rank 0 (the other rank holds one gathered tensor at a time); each rank's host peak
    # against price_save, within 5%
    from course_utils import distributed

    worker = tmp_path / "dcp_worker.py"
    worker.write_text(_notebook_worker("DCP_WORKER"))
    mlp = dict(n_layers=3, width=768, in_features=32, n_classes=10)
    ranks = distributed.run_ranks(worker, {"model": models.mlp(**mlp), "x": torch.randn(4, 32),
                                           "y": torch.randint(0, 10, (4,))}, world_size=2)
    with torch.device("meta"):
        model = models.mlp(**mlp)
    price = {save: planner.price_save(model, save=save, save_ranks=2, device="cpu")["host"]
             for save in ("sharded", "gathered")}
    n = sum(p.numel() for p in model.parameters())
    largest = 4 * max(p.numel() for p in model.parameters())
    for rank, result in enumerate(ranks):
        assert result["held"] == pytest.approx(12 * n / 2, rel=0.01)
        assert result["peaks"]["sharded"] == pytest.approx(price["sharded"], rel=TOLERANCE), rank
        assert result["peaks"]["gathered"] >= result["held"] + largest   # one whole tensor, at least
    assert ranks[0]["peaks"]["gathered"] == pytest.approx(price["gathered"], rel=TOLERANCE)
    # only rank 0 keeps the whole state; the other rank holds gathered weights as they pass (two at once when busy)
    assert ranks[1]["peaks"]["gathered"] < ranks[1]["held"] + 12 * n


def test_price_save_counts_a_modules_tensors():
    with torch.device("meta"):
        tied = GPT2LMHeadModel(models.gpt2_config("gpt2", **SIZE))
    n = sum(p.numel() for p in tied.parameters())
    head = 4 * tied.lm_head.weight.numel()
    copied = planner.price_save(tied, device="cuda")
    assert copied["host"] == 12 * n + head   # the tied head's second key copied twice
    assert planner.price_save(tied, save="sharded", save_ranks=4, device="cpu")["host"] == -(-12 * n // 4)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        planner.price_save("gpt2")
    with pytest.raises(ValueError, match="save='sharded'"):
        planner.price_save(tied, save_ranks=2)


def test_saves_over_ranks_are_priced_per_rank(spec):
    base = dict(lengths=LENGTHS, micro_batch=B, max_length=T)
    checkpoint = 12 * spec.n_params
    for device in ("cpu", "cuda"):
        one = planner.predict_run(spec, save="streamed", device=device, **base).phases["save"]
        four = planner.predict_run(spec, save="sharded", save_ranks=4, device=device, **base).phases["save"]
        rank0 = planner.predict_run(spec, save="gathered", save_ranks=4, device=device, **base).phases["save"]
        assert four["device"] == pytest.approx(one["device"] / 4, rel=0.01)
        assert rank0["host"] >= checkpoint and rank0["host"] > 3 * four["host"]
    gpu = planner.predict_run(spec, save="gathered", save_ranks=4, device="cuda", **base).phases["save"]
    assert gpu["device"] == -(-checkpoint // 4) + 4 * spec.largest_tensor   # one whole tensor on the card at a time
    cpu = planner.predict_run(spec, save="gathered", save_ranks=4, device="cpu", **base).phases["save"]
    assert cpu["device"] == -(-checkpoint // 4) + gpu["host"]   # on a CPU the gathered tensors are the host's copy
    with pytest.raises(ValueError, match="save='sharded'"):
        planner.predict_run(spec, save="host_copy", save_ranks=2, device="cpu", **base)


def test_run_ranks_says_what_to_fix(tmp_path):
    from course_utils import distributed

    with pytest.raises(ValueError, match="write the worker script first"):
        distributed.run_ranks(tmp_path / "missing.py", {})
    worker = tmp_path / "fails.py"
    worker.write_text("raise SystemExit('this rank refuses')\n")
    with pytest.raises(RuntimeError, match="the ranks failed"):
        distributed.run_ranks(worker, {}, world_size=2, timeout_s=60)
