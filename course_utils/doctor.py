"""The memory doctor: what still holds memory in this kernel, and the line that frees it.

``doctor()`` lists the live tensors of a device grouped by what keeps them alive: a global name, IPython's output
history (``Out[n]``, ``_``), the last error's traceback, an autograd graph reachable from a kept tensor, a reference
cycle, or something else. Bytes are storage bytes, each storage once (views share theirs), counted as the course's
tracker counts them (:func:`memory.block_bytes`: in 512-byte blocks on CUDA, as its allocator gives them out), so
that a line's drop in the tracker is what the doctor said. It keeps only numbers and strings: its report holds no
tensor alive. ``LiveBytes`` is the course's tracker left running across cells, with an
optional budget past which an allocation raises ``torch.OutOfMemoryError`` (a small GPU, emulated on any device).
"""
from __future__ import annotations

import functools
import gc
import sys
import types
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .memory import _MultiStepMemTracker, block_bytes, format_bytes
from .validation import byte_counts, positive_int

# kinds of tensor, most telling first: a storage reached in several ways takes the first kind in this order
KINDS = ("parameter", "buffer", "gradient", "optimizer state", "tensor", "autograd graph")
_INFRA = ("IPython", "ipykernel", "traitlets", "zmq", "tornado", "asyncio", "jupyter_client", "_pytest", "pytest",
          "pluggy", "logging", "threading", "concurrent", "nbval", "comm", "matplotlib")  # objects never walked into
_IPYTHON_NAMES = {"In", "Out", "_", "__", "___", "_ih", "_oh", "_dh", "exit", "quit", "get_ipython"}
_CYCLE_LIMIT, _CYCLE_LEVELS = 5000, 40  # how far the referrers of unreached tensors are searched


@dataclass
class DoctorRow:
    """Storages with the same holders; ``fix``: the line that frees them ('' if unknown), ``frees_bytes``: all it frees."""

    holder: str
    kind: str
    bytes: int
    tensors: int
    fix: str
    frees_bytes: int


@dataclass
class DoctorReport:
    """What :func:`doctor` found on one device; ``cuda``: the allocator's and the driver's numbers (CUDA only)."""

    device: str
    rows: list[DoctorRow]
    cuda: dict | None = None
    notes: list[str] = field(default_factory=list)

    total_bytes = property(lambda self: sum(r.bytes for r in self.rows))

    def row(self, holder_part: str, kind: str | None = None) -> DoctorRow:
        """The largest row whose holder contains ``holder_part`` (and of that kind)."""
        found = [r for r in self.rows if holder_part in r.holder and kind in (None, r.kind)]
        if not found:
            raise KeyError(f"no row held by {holder_part!r}{f' of kind {kind!r}' if kind else ''}; holders: "
                           f"{sorted({r.holder for r in self.rows})}")
        return found[0]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([vars(r) for r in self.rows], columns=list(DoctorRow.__dataclass_fields__))

    def __str__(self) -> str:
        lines = [f"The memory doctor, {self.device}: {format_bytes(self.total_bytes)} in live tensors"]
        for r in self.rows:
            lines.append(f"  {format_bytes(r.bytes):>11}  {r.kind:<15} held by {r.holder} ({r.tensors} storage"
                         f"{'s' if r.tensors != 1 else ''})")
            fix = r.fix.replace("\n", "  then  ") if r.fix else "(no line frees it: find what holds it, or restart)"
            lines.append(f"{'':15}free it: {fix}" + (f"   [frees {format_bytes(r.frees_bytes)}]" if r.fix else ""))
        if self.cuda:
            lines.append("  on the card: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.cuda.items()))
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "<pre>" + str(self).replace("&", "&amp;").replace("<", "&lt;") + "</pre>"


def cuda_summary(*, allocated: int, reserved: int, free: int, total: int, segments: list[dict]) -> dict:
    """The four numbers of a card and what ``torch.cuda.empty_cache()`` would return: every cached segment with no
    block in use (``segments`` in the format of ``torch.cuda.memory_snapshot()``); pure, so a CPU test covers it."""
    byte_counts(allocated=allocated, reserved=reserved, free=free, total=total)
    if free > total or allocated > reserved:
        raise ValueError("need free <= total and allocated <= reserved: pass mem_get_info() and the allocator's counters.")
    idle = sum(s["total_size"] for s in segments if s.get("allocated_size", 0) == 0 and not s.get("is_expandable"))
    return {"allocated": allocated, "reserved": reserved, "driver's view (used)": total - free,
            "context and other processes": max(0, total - free - reserved), "empty_cache() would return": idle}


class _Walk:
    """Finds the storages reachable from one root, with their kind and whether only through an autograd graph."""

    def __init__(self, device: torch.device, skip: set[int]):
        self.device, self.skip = device, skip
        self.found: dict[int, tuple[int, set[str], bool]] = {}  # storage -> (bytes, kinds, direct?)
        self.graph_only: bool = False

    def tensor(self, t: torch.Tensor, kind: str, via_graph: bool) -> None:
        if isinstance(t, FakeTensor):  # shapes without memory
            return
        if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
            inner = getattr(t, "__tensor_flatten__")()[0]
            for name in inner:
                self.tensor(getattr(t, name), kind, via_graph)
            return
        if t.device.type == self.device.type and self.device.index in (None, t.device.index):
            storage = t.untyped_storage()
            nbytes, kinds, direct = self.found.get(storage._cdata, (block_bytes(t), set(), False))
            self.found[storage._cdata] = (nbytes, kinds | {kind}, direct or not via_graph)

    def run(self, root, via_graph: bool = False) -> None:
        seen, stack, held = set(self.skip), [(root, "tensor", via_graph)], []
        while stack:
            obj, kind, graph = stack.pop()
            if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType)):
                continue
            seen.add(id(obj))
            held.append(obj)  # saved tensors are unpacked afresh: held, no id is reused while the walk runs
            push = lambda children, k=kind, g=graph: stack.extend((c, k, g) for c in children)  # noqa: E731
            if isinstance(obj, torch.Tensor):
                if isinstance(obj, FakeTensor):  # shapes without memory (a prediction's leftovers)
                    continue
                self.tensor(obj, "autograd graph" if graph and kind == "tensor" else kind, graph)
                try:
                    grad, grad_fn = obj.grad if obj.is_leaf else None, obj.grad_fn
                except RuntimeError:  # a view autograd refuses to describe: its bytes are counted, its graph not
                    grad = grad_fn = None
                if grad is not None:
                    stack.append((grad, "gradient", graph))
                if grad_fn is not None:
                    stack.append((grad_fn, "tensor", True))
            elif isinstance(obj, torch.nn.Module):
                push(obj._parameters.values(), "parameter")
                push(obj._buffers.values(), "buffer")
                push(v for k, v in vars(obj).items() if k not in ("_parameters", "_buffers"))
            elif isinstance(obj, torch.optim.Optimizer):
                push((v for s in obj.state.values() for v in s.values()), "optimizer state")
                push((p for g in obj.param_groups for p in g["params"]), "parameter")
            elif hasattr(obj, "next_functions"):
                self._node(obj, push)
            elif isinstance(obj, dict):
                push(obj.keys()), push(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset, deque)):
                push(obj)
            elif isinstance(obj, types.TracebackType):
                push((obj.tb_frame, obj.tb_next))
            elif isinstance(obj, types.FrameType):
                if obj.f_locals is not obj.f_globals:  # a module's frame: its names are roots of their own
                    push(obj.f_locals.values())
            elif isinstance(obj, BaseException):
                push((obj.__traceback__, obj.__context__, obj.__cause__, obj.args, getattr(obj, "__dict__", {})))
            elif isinstance(obj, types.FunctionType):
                push([c.cell_contents for c in obj.__closure__ or () if "cell_contents" in dir(c)] + [obj.__defaults__, obj.__kwdefaults__])
            elif isinstance(obj, (types.MethodType, functools.partial)):
                push((getattr(obj, "__self__", None), getattr(obj, "__func__", None), getattr(obj, "args", None),
                      getattr(obj, "keywords", None), getattr(obj, "func", None)))
            elif hasattr(obj, "__dict__") and not type(obj).__module__.split(".")[0] in _INFRA:
                push(vars(obj).values())

    @staticmethod
    def _node(node, push) -> None:
        """An autograd node: its saved tensors, the leaf it accumulates into, the next nodes. Saved tensors are read
        as stored, never unpacked: unpacking runs a hook's unpack (checkpoint's recomputes the forward, an offload's
        copies back), which would allocate what the doctor is counting."""
        saved = [getattr(node, "variable", None)]
        for name in dir(node):
            if name.startswith("_raw_saved_"):
                try:
                    raw = getattr(node, name)
                except RuntimeError:  # freed by a backward already
                    continue
                for item in raw if isinstance(raw, (list, tuple)) else (raw,):
                    try:
                        saved.append(getattr(item, "data", item))  # the tensor, or what a pack hook returned
                    except RuntimeError:
                        pass
        push(saved)
        push(fn for fn, _ in getattr(node, "next_functions", ()) if fn is not None)


def _split_cycles(tensors: list, stop: set[int], skip: set[int]) -> tuple[list, list]:
    """Among ``tensors`` (no root reaches them): (the objects only reference cycles keep, which gc.collect() frees;
    the tensors something else keeps). Their referrers are searched for all of them at once, one heap scan a level
    (a search per tensor scanned the heap per tensor: minutes in a large kernel); a member that something outside
    the group refers to (a module's names, a type, an object no Python referrer shows) is reachable, and so is what
    it refers to; the rest is what the garbage collector would free."""
    members, reachable, args = {id(t): t for t in tensors}, set(), tuple(tensors)
    for _ in range(_CYCLE_LEVELS):
        if not args or len(members) > len(tensors) + _CYCLE_LIMIT:
            break
        refs = gc.get_referrers(*args)  # no list of the search's own refers to them here: it would join the group
        found = []
        for ref in refs:
            if (ref is members or ref is args or ref is tensors or id(ref) in skip or id(ref) in members
                    or isinstance(ref, types.FrameType)
                    or (type(ref) is tuple and len(ref) == len(args) and all(a is b for a, b in zip(ref, args)))):
                continue
            if id(ref) in stop or isinstance(ref, (type, types.ModuleType)):
                reachable.update(id(c) for c in gc.get_referents(ref) if id(c) in members)
                continue
            members[id(ref)] = ref
            found.append(ref)
        args, refs, ref, found = tuple(found), None, None, None
    reachable.update(map(id, args))  # the search stopped there: count them as kept from outside
    args = None
    inside = Counter(id(r) for m in members.values() for r in gc.get_referents(m))
    listed = set(map(id, tensors))
    # sys.getrefcount: its argument, the members dict and the loop's name hold each object, the list the tensors
    reachable.update(id(m) for m in members.values() if sys.getrefcount(m) - 3 - (id(m) in listed) > inside[id(m)])
    todo = [members[i] for i in reachable if i in members]
    while todo:
        for child in gc.get_referents(todo.pop()):
            if id(child) in members and id(child) not in reachable:
                reachable.add(id(child))
                todo.append(child)
    cycle = [m for i, m in members.items() if i not in reachable]
    return cycle, [t for t in tensors if id(t) in reachable]


def _shell():
    ipython = sys.modules.get("IPython")  # imported already wherever a shell runs
    return ipython.get_ipython() if ipython else None


def _graph_fix(name: str, value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{name} = {name}.detach()"
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
        return f"{name} = [t.detach() for t in {name}]"
    return f"del {name}"


def traceback_fix(in_ipython: bool = True) -> str:
    """The line that lets the last error go on this Python: every ``sys.last_*`` that can hold it (from Python 3.12
    the interpreter and IPython also keep it in ``sys.last_exc``; on an older one too if something set it), IPython's
    copy for ``%debug`` (``in_ipython``), then a collection: the frame that caught the error refers to it, a cycle
    once the names let go."""
    names = ["last_type", "last_value", "last_traceback"]
    if sys.version_info >= (3, 12) or getattr(sys, "last_exc", None) is not None:
        names.append("last_exc")
    return ("import gc, sys; " + " = ".join(f"sys.{n}" for n in names) + " = None; "
            + ("get_ipython().InteractiveTB.tb = None; " if in_ipython else "") + "gc.collect()")


def doctor(namespace: dict | None = None, device=None, *, counters=None) -> DoctorReport:
    """What holds the live tensors of ``device`` (default: this machine's) in ``namespace`` (default: the notebook's
    names, IPython's or ``__main__``'s). ``counters``: the CUDA numbers (a dict of :func:`cuda_summary`'s keyword
    arguments; default, on a GPU, read from torch.cuda)."""
    from .hardware import get_device

    shell = _shell()
    namespace = (shell.user_ns if shell else sys.modules["__main__"].__dict__) if namespace is None else namespace
    if not isinstance(namespace, dict):
        raise TypeError(f"namespace must be a dict of names (globals(), IPython's user_ns), not {type(namespace).__name__}.")
    device = torch.device(device) if device is not None else get_device()
    out = namespace.get("Out") if isinstance(namespace.get("Out"), dict) else {}
    skip = {id(namespace), id(out), id(namespace.get("_oh"))}
    roots, fixes = [], {}  # (holder key, label, object, via_graph)
    for name, value in list(namespace.items()):
        if name in _IPYTHON_NAMES or (name.startswith("_") and name[1:].isdigit()) or name.startswith("_i"):
            continue
        roots.append((("name", name), f"`{name}`", value))
        fixes[("name", name)] = (f"del {name}", _graph_fix(name, value))
    history = list(out.values()) + [namespace[n] for n in ("_", "__", "___") if n in namespace]
    # IPython also keeps the last three results in its hidden namespace, which `%reset -f out` leaves as they are
    in_ipython = shell is not None and namespace is shell.user_ns
    hidden = {n: v for n, v in shell.user_ns_hidden.items() if n in ("_", "__", "___")} if in_ipython else {}
    roots += [(("out",), "IPython's output history (Out[n], _)", v) for v in history + list(hidden.values())]
    fixes[("out",)] = ("%reset -f out" + ("\nget_ipython().user_ns_hidden.update(_='', __='', ___='')"
                                          if in_ipython else ""),) * 2
    # IPython keeps the last traceback twice: in sys (for pdb) and in its formatter (for %debug)
    last = [getattr(sys, n, None) for n in ("last_traceback", "last_value", "last_exc")]
    last += [getattr(shell.InteractiveTB, "tb", None)] if in_ipython else []
    roots += [(("traceback",), "the last error's traceback (sys.last_traceback)", v) for v in last if v is not None]
    fixes[("traceback",)] = (traceback_fix(in_ipython),) * 2
    value = history = hidden = last = None

    storages: dict[int, list] = {}  # storage -> [bytes, kinds, holder keys {(key, direct?)}]
    labels = {}
    for key, label, obj in roots:
        walk = _Walk(device, skip)
        walk.run(obj)
        labels[key] = label
        for sid, (nbytes, kinds, direct) in walk.found.items():
            entry = storages.setdefault(sid, [nbytes, set(), set()])
            entry[1] |= kinds
            entry[2].add((key, direct))
    roots = obj = None

    # tensors no root reaches: a reference cycle, or held by something the doctor does not walk into
    module_dicts = {id(m.__dict__) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    unreached = []
    for t in gc.get_objects():
        if issubclass(type(t), torch.Tensor):
            walk = _Walk(device, skip)
            walk.tensor(t, "tensor", False)
            if not all(sid in storages for sid in walk.found):
                unreached.append(t)
    t = None
    cycle, elsewhere = _split_cycles(unreached, module_dicts | skip, skip | {id(unreached)})
    unreached.clear()
    labels[("cycle",)] = "a reference cycle (unreachable, not yet collected)"
    labels[("elsewhere",)] = "something the doctor does not look into"
    fixes[("cycle",)], fixes[("elsewhere",)] = ("gc.collect()",) * 2, ("", "")
    for key, found in ((("cycle",), cycle), (("elsewhere",), elsewhere)):
        walk = _Walk(device, skip)
        for m in found:
            walk.run(m)
        for sid, (nbytes, kinds, direct) in walk.found.items():
            if sid not in storages:
                storages[sid] = [nbytes, kinds, {(key, direct)}]
    cycle = elsewhere = found = m = None

    groups = defaultdict(lambda: [0, 0, Counter()])
    for nbytes, kinds, holders in storages.values():
        group = groups[frozenset(holders)]
        group[0] += nbytes
        group[1] += 1
        group[2][next(k for k in KINDS if k in kinds)] += nbytes
    rows = []
    for holders, (nbytes, count, kinds) in groups.items():
        lines = sorted({fixes[key][0 if direct else 1] for key, direct in holders})
        fix = "" if "" in lines else "\n".join(lines)
        covered = set()  # what running the lines releases: a name's del, its graph too; a detach, the graph only
        for key, _ in holders:
            covered |= {(key, True), (key, False)} if fixes[key][0] in lines else {(key, False)} if fix else set()
        if any(line.startswith("%reset") or "gc.collect()" in line for line in lines):  # %reset collects too
            covered |= {(("cycle",), True), (("cycle",), False)}
        frees = sum(g[0] for other, g in groups.items() if fix and other <= covered)
        names = " and ".join(sorted({labels[key] + (" (its autograd graph)" if not direct else "") for key, direct in holders}))
        rows.append(DoctorRow(names, kinds.most_common(1)[0][0], nbytes, count, fix, frees))
    rows.sort(key=lambda r: -r.bytes)
    report = DoctorReport(str(device), rows)
    if device.type == "cuda":
        if counters is None:
            free, total = torch.cuda.mem_get_info(device)
            counters = dict(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                            free=free, total=total, segments=torch.cuda.memory_snapshot())
        report.cuda = cuda_summary(**counters)
        report.notes.append(f"allocated minus the tensors found: {format_bytes(counters['allocated'] - report.total_bytes)}"
                            " (cuBLAS workspaces, tensors only C++ holds)")
    return report


class LiveBytes(_MultiStepMemTracker):
    """The course's tensor tracker (as ``measure_memory``'s) left running across cells: ``bytes`` is what the
    tensors created since ``start()`` (and the ``track_external`` models and optimizers) hold now on ``device``.
    With ``budget`` (bytes), a module whose forward took the live tensors past it raises ``torch.OutOfMemoryError``
    as it returns (raised from Python, so only Python frames hold what it made, as after a real out-of-memory error)."""

    def __init__(self, device="cpu", budget: int | None = None):
        super().__init__()
        self.device = torch.device(device)
        self.budget = None if budget is None else positive_int(budget, "budget", "a number of bytes, or None")
        self._high = 0  # the most bytes seen since the last check

    @property
    def bytes(self) -> int:
        return sum(snap.get("Total", 0) for dev, snap in self.get_tracker_snapshot("current").items()
                   if torch.device(dev).type == self.device.type)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        self._high = max(self._high, self.bytes) if self.budget else 0

    def _check(self, module) -> None:
        high, self._high = self._high, self.bytes
        if self.budget and high > self.budget:
            raise torch.OutOfMemoryError(
                f"Out of memory under the course's budget on {self.device} in {type(module).__name__}: live tensors "
                f"reached {format_bytes(high)}, the budget is {format_bytes(self.budget)}.")

    def start(self) -> LiveBytes:  # a tracker that outlives a cell: no `with` block
        self.__enter__()
        # no module tracking (only the totals are read): its gradient hooks tie a graph that no backward runs
        # through (an evaluation without no_grad, an error mid-forward) into a cycle gc cannot collect
        self._mod_tracker.__exit__()
        if self.budget:  # a hook of its own, after the tracker's: raising in those would run them twice
            self._hook = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: self._check(m))
        return self

    def stop(self) -> None:
        if getattr(self, "_hook", None):
            self._hook.remove()
        self.__exit__(None, None, None)


def _magic(line: str = "") -> None:  # %memory_doctor [device]
    print(doctor(device=line.strip() or None))


def load_ipython_extension(ipython) -> None:
    """``%load_ext course_utils.doctor`` registers the ``%memory_doctor`` line magic."""
    ipython.register_magic_function(_magic, "line", "memory_doctor")
