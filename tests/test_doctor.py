"""The memory doctor names what holds each live tensor, its bytes add up to the course tracker's live bytes, and the
line it prints frees what it said, to the byte. Cells run in a real IPython shell (Out[n], _, the last traceback)."""
import contextlib
import gc
import os
import sys
import tempfile
import weakref
from pathlib import Path

import background
import pytest
import torch
from counting import counted
from stand_ins import StandIn

from course_utils.doctor import DoctorReport, LiveBytes, cuda_summary, doctor, load_ipython_extension

IPython = pytest.importorskip("IPython")


@pytest.fixture()
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance(colors="nocolor")
    sh.run_cell("%reset -f", store_history=False)
    sh.run_cell("import gc, sys, torch\nfrom torch import nn", store_history=True)
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()  # a reference cycle stays until the doctor's line collects it
    live = LiveBytes("cpu").start()
    yield sh, live
    live.stop()
    sys.last_type = sys.last_value = sys.last_traceback = None
    sh.InteractiveTB.tb = None
    sh.run_cell("%reset -f", store_history=False)
    if collecting:
        gc.enable()
    gc.collect()


def run(sh, code: str):
    return sh.run_cell(code, store_history=True, silent=False)


HOLDERS = {  # cell -> (holder the doctor must name, kind)
    "model = nn.Linear(128, 128)\nopt = torch.optim.Adam(model.parameters())\n"
    "model(torch.randn(8, 128)).sum().backward(); opt.step()": ("`opt`", "optimizer state"),
    "losses = [model(torch.randn(64, 128)).tanh().sum() for _ in range(3)]": ("`losses` (its autograd graph)", "autograd graph"),
    "torch.ones(300, 100)": ("IPython's output history", "tensor"),
    "batch = torch.randn(200, 128)": ("`batch`", "tensor"),
    "def fail():\n    h = torch.ones(2000, 10)\n    raise RuntimeError('boom')\nfail()": ("the last error's traceback", "tensor"),
    "class Box: pass\nb = Box(); b.me = b; b.t = torch.ones(3000); del b": ("a reference cycle", "tensor"),
    "model2 = nn.Linear(64, 64)": ("`model2`", "parameter"),
}


def _baseline(sh):
    return doctor(sh.user_ns, "cpu").total_bytes


def test_each_holder_is_named_counted_and_freed_to_the_byte(shell):
    sh, live = shell
    before = _baseline(sh)  # tensors alive before the cells (a library's): not the tracker's
    for cell in HOLDERS:
        run(sh, cell)
    report = doctor(sh.user_ns, "cpu")
    for holder, kind in HOLDERS.values():
        assert report.row(holder, kind).bytes > 0
    found = report.total_bytes - before
    assert abs(found - live.bytes) <= 0.01 * live.bytes, (found, live.bytes)
    assert found == live.bytes  # in fact to the byte
    # run each printed line, largest group first; the live bytes drop by what the doctor said
    for _ in range(20):
        rows = [r for r in doctor(sh.user_ns, "cpu").rows if r.fix]
        if not rows or live.bytes == 0:
            break
        row = rows[0]
        dropped = live.bytes
        result = run(sh, row.fix)
        assert result.success, row.fix
        dropped -= live.bytes
        assert dropped == row.frees_bytes, (row, dropped)
    assert live.bytes == 0, doctor(sh.user_ns, "cpu")


def test_a_view_and_its_base_count_once(shell):
    sh, live = shell
    run(sh, "big = torch.zeros(10_000)\nview = big[:100]\nother = big.view(100, 100)")
    report = doctor(sh.user_ns, "cpu")
    row = report.row("`big`")
    assert row.holder == "`big` and `other` and `view`" and row.tensors == 1
    assert row.bytes == counted(40_000) == live.bytes  # miscounting the views would say 40,400 or 80,400
    run(sh, "del big, other")
    assert doctor(sh.user_ns, "cpu").row("`view`").bytes == counted(40_000)  # a view keeps its whole storage


def test_the_sum_check_fails_when_views_are_counted_twice(shell):
    """The 1% comparison above can fail: counting each view's storage again overshoots the tracker."""
    sh, live = shell
    before = _baseline(sh)  # tensors alive before the cell (earlier tests', a library's): not the tracker's
    run(sh, "big = torch.zeros(10_000)\nviews = [big[i:] for i in range(3)]")
    report = doctor(sh.user_ns, "cpu")
    twice = sum(t.untyped_storage().nbytes() for t in [sh.user_ns["big"], *sh.user_ns["views"]])
    assert abs(report.total_bytes - before - live.bytes) <= 0.01 * live.bytes
    assert abs(twice - live.bytes) > 0.01 * live.bytes


def test_the_report_keeps_nothing_alive(shell):
    sh, live = shell
    run(sh, "x = torch.ones(5000)\nlosses = [(torch.ones(100, requires_grad=True) * 2).exp().sum()]")
    probe = weakref.ref(sh.user_ns["x"])
    report = doctor(sh.user_ns, "cpu")
    assert isinstance(report, DoctorReport) and "`x`" in str(report) and "<pre>" in report._repr_html_()
    run(sh, "del x, losses")
    assert probe() is None and live.bytes == 0


def test_after_an_out_of_memory_error_under_a_budget(shell):
    sh, live = shell
    live.stop()
    budget = LiveBytes("cpu", budget=2_000_000).start()
    try:
        result = run(sh, "layers = nn.Sequential(nn.Linear(256, 256), nn.ReLU())\n"
                         "def step(n):\n    x = torch.randn(n, 256)\n    return layers(x).sum()\nstep(2000)")
        assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
        assert "budget" in str(result.error_in_exec)
        del result  # it holds the error, and so its traceback
        run(sh, "report = None")  # the learner's next cell (IPython's last result now lets the error go)
        report = doctor(sh.user_ns, "cpu")
        row = report.row("the last error's traceback")
        params = counted(*(p.untyped_storage().nbytes() for p in sh.user_ns["layers"].parameters()))
        assert row.bytes >= 2000 * 256 * 4  # at least the batch, kept by the frame of step()
        before = budget.bytes
        run(sh, row.fix)
        assert before - budget.bytes == row.frees_bytes and budget.bytes == params
    finally:
        budget.stop()
        live.start()


def test_the_magic_prints_the_report(shell, capsys):
    sh, _ = shell
    load_ipython_extension(sh)
    run(sh, "kept = torch.ones(1000)")
    sh.run_line_magic("memory_doctor", "cpu")
    out = capsys.readouterr().out
    assert "The memory doctor, cpu" in out and "`kept`" in out and "del kept" in out


def test_it_counts_as_the_tracker_does_on_cuda(shell):
    """CUDA's allocator gives out 512-byte blocks and the tracker counts so there (memory.cuda_rounding shows it on any
    device): the doctor counts the same, so its rows add up to the tracker's bytes and a line frees what it said, to
    the byte (a 4-byte loss is 512 bytes there)."""
    from course_utils.memory import cuda_rounding

    sh, live = shell
    with cuda_rounding():
        before = _baseline(sh)
        run(sh, "x = torch.ones(1000)\nlosses = [torch.ones(3, requires_grad=True).exp().sum() for _ in range(4)]")
        report = doctor(sh.user_ns, "cpu")
        assert report.row("`x`").bytes == 4096 and report.row("`losses`", "tensor").bytes == 4 * 512, report
        assert report.total_bytes - before == live.bytes
        for holder, kind in [("`losses`", "autograd graph"), ("`losses`", "tensor"), ("`x`", "tensor")]:
            row, dropped = doctor(sh.user_ns, "cpu").row(holder, kind), live.bytes
            run(sh, row.fix)
            assert dropped - live.bytes == row.frees_bytes, row
        assert live.bytes == 0


def test_cuda_numbers_from_fake_counters():
    segments = [{"total_size": 20 << 20, "allocated_size": 0}, {"total_size": 2 << 20, "allocated_size": 512},
                {"total_size": 40 << 20, "allocated_size": 0, "is_expandable": True}]
    summary = cuda_summary(allocated=512, reserved=62 << 20, free=1 << 30, total=2 << 30, segments=segments)
    assert summary["empty_cache() would return"] == 20 << 20
    assert summary["context and other processes"] == (1 << 30) - (62 << 20)
    report = doctor({}, "cuda", counters=dict(allocated=512, reserved=62 << 20, free=1 << 30, total=2 << 30,
                                              segments=segments))
    assert report.cuda == summary and "allocated minus the tensors found: 512 B" in str(report)


def test_bad_input_says_what_to_change():
    with pytest.raises(TypeError, match="namespace must be a dict"):
        doctor(["x"], "cpu")
    with pytest.raises(ValueError, match="free <= total"):
        cuda_summary(allocated=0, reserved=0, free=2, total=1, segments=[])
    with pytest.raises(ValueError, match="budget must be positive"):
        LiveBytes("cpu", budget=0)


def test_a_graph_no_backward_runs_through_is_freed_with_its_loss():
    """The tracker left running holds nothing itself: a forward through nested modules whose loss is dropped without
    a backward (an evaluation without no_grad, an error mid-forward) gives back every byte once the loss goes."""
    live = LiveBytes("cpu").start()
    try:
        net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        params = live.bytes
        loss = net(torch.randn(512, 64)).sum()
        assert live.bytes > params + 4 * 512 * 64 * 4  # the activations the graph saved
        del loss
        gc.collect()
        assert live.bytes == params
        del net
    finally:
        live.stop()


# ---------------------------------------------------------------------------------------------------------------------
# Each Python the course supports. From 3.12 the interpreter and IPython also keep the last error in sys.last_exc, so
# 3.11's line (sys.last_type, sys.last_value, sys.last_traceback) leaves it alive there. This interpreter is one
# version; the others are stood in for: the doctor and IPython read a `sys` whose version_info is the other one's,
# and what IPython keeps it sets on the real sys, as that Python's IPython would.
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01c_memory_doctor.ipynb"
NEWEST = (3, 14)  # the newest Python released; the oldest is pyproject's requires-python
LINE_311 = ("sys.last_type = sys.last_value = sys.last_traceback = None; get_ipython().InteractiveTB.tb = None; "
            "import gc; gc.collect();")  # the line 01c typed, right on 3.10 and 3.11 only


def supported_pythons() -> list[tuple[int, int]]:
    """Every minor version from pyproject's requires-python (and the README's "Python 3.N+") to the newest."""
    import re

    oldest = re.search(r'requires-python\s*=\s*">=\s*3\.(\d+)', (ROOT / "pyproject.toml").read_text())
    readme = re.search(r"Needs Python 3\.(\d+)\+", (ROOT / "README.md").read_text())
    assert oldest and readme and oldest[1] == readme[1], "pyproject's requires-python and the README's minimum differ"
    return [(3, minor) for minor in range(int(oldest[1]), max(NEWEST, sys.version_info[:2])[1] + 1)]


class _PythonOf(StandIn):
    """``sys`` as another Python shows it to a module: its version_info; what the module sets lands on the real sys."""

    def __init__(self, version):
        super().__init__(sys, version_info=(*version, 0, "final", 0))

    def __setattr__(self, name, value):
        setattr(self.__dict__["_real"], name, value)


@contextlib.contextmanager
def python(version, monkeypatch):
    """The doctor and IPython as on Python ``version``; afterwards no sys.last_exc this interpreter would not have."""
    import importlib

    from IPython.core import interactiveshell

    doctor_module = importlib.import_module("course_utils.doctor")  # the module: the package exports the function
    had = hasattr(sys, "last_exc")
    stand_in = _PythonOf(version)
    monkeypatch.setattr(interactiveshell, "sys", stand_in)
    monkeypatch.setattr(doctor_module, "sys", stand_in)
    try:
        yield
    finally:
        monkeypatch.setattr(interactiveshell, "sys", sys)
        monkeypatch.setattr(doctor_module, "sys", sys)
        if not had and hasattr(sys, "last_exc"):
            del sys.last_exc


def _last_error_kept() -> list[str]:
    return [name for name in ("last_type", "last_value", "last_traceback", "last_exc") if getattr(sys, name, None)]


def test_the_traceback_line_frees_the_last_error_on_every_supported_python(shell, monkeypatch):
    sh, live = shell
    versions = supported_pythons()
    assert versions[0] <= (3, 11) and (3, 12) in versions, versions  # both sides of the change are covered
    for version in versions:
        with python(version, monkeypatch):
            run(sh, "def fail():\n    h = torch.ones(2000, 10)\n    raise RuntimeError('boom')\nfail()")
            run(sh, "pass")  # the learner's next cell
            kept = _last_error_kept()
            assert ("last_exc" in kept) == (version >= (3, 12)), (version, kept)  # what that Python's IPython keeps
            row = doctor(sh.user_ns, "cpu").row("the last error's traceback")
            assert ("sys.last_exc = None" in row.fix) == (version >= (3, 12)), (version, row.fix)
            assert row.bytes == row.frees_bytes == counted(80_000), (version, row)
            if version >= (3, 12):  # 3.11's line there: sys.last_exc still holds the error, and its frame the tensor
                before = live.bytes
                run(sh, LINE_311)
                assert live.bytes == before and _last_error_kept() == ["last_exc"], version
                assert doctor(sh.user_ns, "cpu").row("the last error's traceback").bytes == counted(80_000)
            before = live.bytes
            run(sh, row.fix)
            assert before - live.bytes == row.frees_bytes and _last_error_kept() == [], (version, row.fix)
            assert live.bytes == 0


def test_the_traceback_line_names_sys_last_exc_when_something_set_it(monkeypatch):
    """On 3.10 or 3.11 nothing sets sys.last_exc; if something does (a backport, a tool), the doctor walks it as a
    root, so its line clears it too. Outside IPython the line has no IPython copy to clear."""
    import importlib

    doctor_module = importlib.import_module("course_utils.doctor")
    for version, last_exc, named in [((3, 11), None, False), ((3, 11), RuntimeError("kept"), True),
                                     ((3, 12), None, True)]:
        monkeypatch.setattr(doctor_module, "sys", StandIn(sys, version_info=(*version, 0, "final", 0),
                                                          last_exc=last_exc))
        assert ("sys.last_exc = None" in doctor_module.traceback_fix()) == named, (version, last_exc)
    assert "InteractiveTB" not in doctor_module.traceback_fix(in_ipython=False)


def _lesson(namespace, **picks):
    """exec 01c's cells that ``picks`` name (only their imports and functions) into ``namespace``."""
    from notebook_lessons import exec_lesson_cells

    return exec_lesson_cells(NOTEBOOK, picks, namespace, defs_only=True)


def test_01c_frees_the_last_error_with_the_doctors_lines_on_python_3_12(shell, monkeypatch):
    """01c's cells on 3.12's behaviour: section 2 finds the batch in a frame of the last traceback; the doctor's
    lines, run as 01c runs them (run_doctors_lines), free it to the byte where the line 01c used to type would not."""
    sh, live = shell
    run(sh, "import types\nfrom course_utils.memory import format_bytes")
    sh.user_ns["live"] = live
    _lesson(sh.user_ns, frames=lambda s, t: "def last_error_frames(" in s,
            lines=lambda s, t: "def run_doctors_lines(" in s)
    with python((3, 12), monkeypatch):
        run(sh, "x_big = torch.randn(2000, 256)\ndef train_step(x):\n    h = x * 2\n"
                "    raise torch.OutOfMemoryError('over the budget')\ntrain_step(x_big)")
        run(sh, "import weakref\nkept_batch = weakref.ref(x_big)\ndel x_big")
        run(sh, "_, batch_kept_by = find_holders(kept_batch(), 'the batch')")
        assert sh.user_ns["batch_kept_by"] == ["train_step"] and "last_exc" in _last_error_kept()
        row = doctor(sh.user_ns, "cpu").row("the last error's traceback")
        assert row.frees_bytes == 2 * 2000 * 256 * 4  # the batch and h, held by train_step's frame
        before = live.bytes
        run(sh, LINE_311)
        assert live.bytes == before  # 3.11's line typed on 3.12 frees nothing
        sh.user_ns["row"] = row
        run(sh, "drops = run_doctors_lines(row)")
        assert sum(sh.user_ns["drops"].values()) == before - live.bytes == row.frees_bytes
        assert sh.user_ns["kept_batch"]() is None and live.bytes == 0 and _last_error_kept() == []


def test_01c_types_no_line_of_one_python():
    """Every line 01c runs to let the last error go comes from the doctor: none of its cells names the sys.last_*
    that only some Pythons set (the exercise's checker sets sys.last_traceback, which every Python has)."""
    import json
    import re

    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    typed = [line for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
             if re.search(r"sys\.last_(type|value|exc)\b|InteractiveTB", line)]
    assert not typed, typed


def _wrong_who_holds(solution):
    """Plausible wrong answers to 01c's exercise, most built on its solution."""
    import types

    def names_only(tensor, namespace):  # no climb: a list in a name, the history, the traceback missed
        return {k for k, v in namespace.items() if v is tensor}

    def underscore_is_a_name(tensor, namespace):  # IPython's `_` and `__` named, not counted as the history
        return solution(tensor, namespace) | {k for k, v in namespace.items() if k.startswith("_") and v is tensor}

    def every_frame_is_the_error(tensor, namespace):  # the checker's own frame counted as the last error's
        frames = [r for r in gc.get_referrers(tensor) if isinstance(r, types.FrameType)]
        return solution(tensor, namespace) | ({"sys.last_traceback"} if frames else set())

    def a_root_met_once(tensor, namespace, depth=6):  # the namespace marked seen: a second name of it missed
        history, in_error = namespace.get("Out"), {id(f) for f in solution.__globals__["last_error_frames"]()}
        holders, seen, level = set(), {id(tensor)}, [tensor]
        for _ in range(depth):
            ids, up = {id(o) for o in level}, []
            for ref in gc.get_referrers(*level):
                if id(ref) in seen or ref is level or isinstance(ref, (type, types.ModuleType)):
                    continue
                seen.add(id(ref))
                if ref is namespace:
                    holders |= {"Out" if k.startswith("_") else k for k, v in ref.items() if id(v) in ids}
                elif ref is history or id(ref) in in_error:
                    holders.add("Out" if ref is history else "sys.last_traceback")
                elif not isinstance(ref, types.FrameType):
                    up.append(ref)
            level = up
        return holders

    return [names_only, underscore_is_a_name, every_frame_is_the_error, a_root_met_once,
            lambda tensor, namespace: solution(tensor, namespace, depth=1),  # one level: a list in a list missed
            lambda tensor, namespace: set(sorted(solution(tensor, namespace))[:1])]  # stops at the first holder


def test_01c_who_holds_checker_accepts_its_solution_and_rejects_mistakes():
    from notebook_lessons import checker_rejects

    ns = _lesson({}, imports=lambda s, t: s.startswith("import gc\nimport pickle"),
                 frames=lambda s, t: "def last_error_frames(" in s,
                 checker=lambda s, t: "def check_who_holds(" in s, solution=lambda s, t: "solution" in t)
    check, solution = ns["check_who_holds"], ns["solution_who_holds"]
    assert check(solution)
    for wrong in _wrong_who_holds(solution):
        assert checker_rejects(check, wrong), wrong
    with pytest.raises(NotImplementedError):
        check(ns["my_who_holds"])  # the cell as shipped: the learner's function to write


def test_tensors_a_library_keeps_cost_one_search_not_one_each():
    """Tensors no root reaches (a library's cache, here a module's list) are searched for cycles all at once: 400 of
    them take about as long as 10 (one search per tensor scanned the whole heap each time: 36 times longer)."""
    import time
    import types

    library = types.ModuleType("a_library_cache")
    sys.modules["a_library_cache"] = library
    try:
        def seconds(n):
            library.cache = [torch.randn(100) for _ in range(n)]
            start = time.perf_counter()
            report = doctor(namespace={})
            elapsed = time.perf_counter() - start
            assert report.row("something the doctor does not look into").bytes >= n * 400
            return elapsed

        few, many = min(seconds(10) for _ in range(2)), seconds(400)
        assert many < 8 * few + 0.5, f"400 unreached tensors took {many:.2f} s, 10 took {few:.2f} s"
    finally:
        del sys.modules["a_library_cache"]


def test_leftovers_of_a_prediction_do_not_stop_the_doctor():
    """Fake tensors (a planner's or capstone's prediction) hold no memory, and a view autograd refuses to describe
    (made under no_grad, its base changed in place since) still has bytes: the doctor reports, it does not raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(1000, 1000, requires_grad=True) * 2
    base = torch.ones(500, requires_grad=True).clone()
    with torch.no_grad():
        view = base[:100]
    base.mul_(2)
    with pytest.raises(RuntimeError, match="view was created in no_grad mode"):
        view.grad_fn  # what the doctor meets
    report = doctor(namespace={"fake": fake, "view": view, "base": base})
    assert 2000 <= report.total_bytes < 4_000_000, report  # base's 500 floats (the view shares them), never 4 MB of fakes
    assert not any("`fake`" in row.holder for row in report.rows), report


def test_a_checkpointed_graph_is_counted_without_recomputing_it():
    """Reading a saved tensor through its unpack hook runs the hook: checkpoint recomputes the forward, an offload
    copies back. The doctor reads what is stored, so a loss kept from a checkpointed model costs no new tensor."""
    from torch.utils.checkpoint import checkpoint
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.append(str(func))
            return func(*args, **(kwargs or {}))

    layer = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    loss = checkpoint(lambda t: layer(t).relu().sum(), x, use_reentrant=False)
    with Ops() as ops:
        report = doctor(namespace={"loss": loss, "x": x, "layer": layer})
    assert ops.ran == [], f"the doctor ran {ops.ran[:5]}"
    assert report.row("`x`").bytes >= 32 * 64 * 4


# ---------------------------------------------------------------------------------------------------------------------
# The doctor looks at every object of its process: in a learner's kernel a few hundred thousand, in this test run's
# process millions left by a thousand tests (a test took 173 s there, 4 s alone). So these tests run once, together,
# in a fresh process, as in a kernel; each test here reports its own outcome from that run.
FRESH = "COURSE_DOCTOR_TESTS_FRESH"


def start_in_background(items=()) -> None:
    """The fresh process starts in a thread of this test run: the course's pytest plugin calls this when these tests
    are selected, so it runs beside the other tests (about a minute on two busy cores); else the first test does."""
    background.start("doctor-tests", _run_fresh)


def _fresh_run() -> dict:
    return background.start("doctor-tests", _run_fresh).result()


def _run_fresh() -> dict:
    import json
    import os
    import subprocess

    out = Path(tempfile.mkdtemp(prefix="doctor-tests-")) / "outcomes.json"
    code = ("import json, sys, pytest\nfrom course_tools.installed import CellOutcomes\n"
            "outcomes = CellOutcomes()\n"
            # pyproject's addopts name nbval's options: a machine without nbval (the GPU check's) must not need them
            f"pytest.main([{__file__!r}, '-q', '-o', 'addopts=', '-p', 'no:cacheprovider'], plugins=[outcomes])\n"
            f"open({str(out)!r}, 'w').write(json.dumps(outcomes.outcomes))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{FRESH: "1"}), capture_output=True,
                          text=True, timeout=900, cwd=Path(__file__).parent)
    return json.loads(out.read_text()) if out.is_file() else {"error": proc.stdout[-3000:] + proc.stderr[-3000:]}


def _in_a_fresh_process(name: str):
    def test():
        outcomes = _fresh_run()
        outcome = outcomes.get(name)
        assert outcome is not None, f"{name} did not report from the fresh process: {outcomes.get('error', outcomes)}"
        if outcome["outcome"] == "skipped":
            pytest.skip(outcome["text"])
        assert outcome["outcome"] == "passed", f"{name} failed in a fresh process:\n{outcome['text']}"

    test.__name__ = test.__qualname__ = name
    test.pytestmark = getattr(globals()[name], "pytestmark", [])  # `-m gpu` selects what the original is marked
    return test


if not os.environ.get(FRESH):
    for _name in [n for n in list(globals()) if n.startswith("test_")]:
        globals()[_name] = _in_a_fresh_process(_name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_doctor_reads_the_allocator_and_empty_cache_returns_what_it_said():
    """The CUDA branch with the real counters: a named tensor's row is its storage, and the bytes the doctor says
    ``empty_cache()`` would return are what reserved drops by (torch.cuda.memory_snapshot()'s real format)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kept, dropped = torch.empty(3 << 20, device="cuda"), torch.empty(5 << 20, device="cuda")  # 12 and 20 MiB
    del dropped                                      # its segment stays cached, with no block in use
    report = doctor({"kept": kept}, "cuda")
    assert report.row("`kept`").bytes == kept.untyped_storage().nbytes()
    assert report.cuda["allocated"] == torch.cuda.memory_allocated() >= report.total_bytes
    idle, reserved = report.cuda["empty_cache() would return"], torch.cuda.memory_reserved()
    assert idle >= 20 << 20, report
    torch.cuda.empty_cache()
    assert reserved - torch.cuda.memory_reserved() == idle, report
