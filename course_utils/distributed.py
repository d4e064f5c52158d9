"""Beyond one GPU: the arithmetic of sharding, offload and pipelines, and a launcher for real
multi-process runs from a notebook.

Formulas (predict)
------------------
- :func:`zero_bytes_per_rank`: ZeRO (Rajbhandari et al. 2019) per-rank memory for mixed-precision
  Adam, 2 + 2 + 12 bytes per parameter (fp16 weights, fp16 gradients, fp32 master weights + m + v).
  Stage 1 shards the 12 bytes of optimizer state over the ranks, stage 2 also the gradients,
  stage 3 (= FSDP's full sharding) also the parameters.
- :func:`bubble_fraction`: a GPipe pipeline of ``p`` stages and ``m`` micro-batches idles
  ``(p - 1) / (m + p - 1)`` of the time; :func:`gpipe_schedule` lays the schedule out.
- :func:`offload_pcie_cost`: the bytes an offloading step moves over PCIe, and how long that takes.

Launcher (measure)
------------------
:func:`launch` runs a worker function in ``world_size`` fresh Python processes (like ``torchrun``
does), joined in one process group (gloo on CPU, NCCL when there is one GPU per rank). The
rendezvous store listens on a port the operating system picks (port 0 on 127.0.0.1), so two
launches never collide. Every child is terminated, then killed, on error, timeout or Ctrl-C:
no orphaned processes. Each rank's return value comes back through a temporary folder
(``torch.save``), as a list indexed by rank.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

from .units import GIB
from .validation import positive_int, positive_number

# --------------------------------------------------------------------------------------------
# ZeRO / FSDP memory formulas
# --------------------------------------------------------------------------------------------
#: Mixed-precision Adam, bytes per parameter (Rajbhandari et al. 2019, section 3.1):
#: fp16 parameters, fp16 gradients, and K = 12 bytes of fp32 master weights, momentum and variance.
MIXED_ADAM_BYTES = {"params": 2, "grads": 2, "optimizer": 12}
ZERO_STAGES = (0, 1, 2, 3)
STAGE_LABELS = {
    0: "DDP (nothing sharded)",
    1: "ZeRO-1 (optimizer sharded)",
    2: "ZeRO-2 (+ gradients)",
    3: "ZeRO-3 / FSDP (+ parameters)",
}


def _check_stage(stage) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {ZERO_STAGES} (0 = plain data parallelism), not {stage!r}.")
    return stage


@dataclass(frozen=True)
class ZeroBytes:
    """Bytes one rank holds for the model state under a ZeRO stage."""

    stage: int
    world_size: int
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def zero_bytes_per_rank(n_params: int, world_size: int, stage: int, *, param_bytes: float = 2,
                        grad_bytes: float = 2, optimizer_bytes: float = 12) -> ZeroBytes:
    """Per-rank model-state bytes under ZeRO ``stage`` with ``world_size`` data-parallel ranks.

    Stage 0 (plain DDP) keeps everything on every rank: ``(2 + 2 + 12) * n_params``. Stage 1
    divides the optimizer bytes by ``world_size``, stage 2 also the gradient bytes, stage 3
    also the parameter bytes. A sharded buffer is padded to a multiple of ``world_size``, so a
    shard is ``ceil(bytes / world_size)``. Activations and temporary buffers are not included.

    >>> zero_bytes_per_rank(1_000, 4, 3).total   # 16 bytes/param / 4 ranks
    4000
    """
    n_params = positive_int(n_params, "n_params", "number of parameters, e.g. 1_557_611_200")
    world_size = positive_int(world_size, "world_size", "number of ranks, e.g. 8")
    stage = _check_stage(stage)
    per_param = {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}
    for name, value in per_param.items():
        positive_number(value, f"{name[:-1] if name != 'optimizer' else name}_bytes (bytes per parameter)", allow_zero=True)
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    out = {}
    for name, b in per_param.items():
        full = n_params * b
        out[name] = int(math.ceil(full / world_size)) if sharded[name] else int(math.ceil(full))
    return ZeroBytes(stage=stage, world_size=world_size, **out)


def zero_table(n_params: int, world_sizes=(1, 2, 4, 8, 16, 32, 64), stages=ZERO_STAGES, **bytes_per_param):
    """A pandas DataFrame of :func:`zero_bytes_per_rank` for every stage and world size (long format)."""
    import pandas as pd

    world_sizes = list(world_sizes)
    stages = list(stages)
    if not world_sizes or not stages:
        raise ValueError("world_sizes and stages must each list at least one value, e.g. world_sizes=(1, 2, 4).")
    rows = []
    for stage in stages:
        for n in world_sizes:
            z = zero_bytes_per_rank(n_params, n, stage, **bytes_per_param)
            rows.append({"stage": stage, "strategy": STAGE_LABELS[stage], "world_size": n, **z.as_dict(),
                         "total_GiB": z.total / GIB})
    return pd.DataFrame(rows)


def min_world_size(n_params: int, budget_bytes: int, stage: int, *, max_world_size: int = 4096,
                   **bytes_per_param) -> int | None:
    """The fewest ranks whose per-rank model state fits ``budget_bytes`` under ``stage``; None if none does."""
    budget_bytes = positive_int(budget_bytes, "budget_bytes", "e.g. 80 * 1024**3")
    max_world_size = positive_int(max_world_size, "max_world_size")
    for n in range(1, max_world_size + 1):
        if zero_bytes_per_rank(n_params, n, stage, **bytes_per_param).total <= budget_bytes:
            return n
        if stage == 0:
            return None  # nothing is sharded: more ranks never help
    return None


def plot_zero_per_rank(n_params: int, world_sizes=(1, 2, 4, 8, 16, 32, 64), *, budget_bytes: int | None = None,
                       budget_label: str = "GPU memory", ax=None, title: str | None = None, **bytes_per_param):
    """Per-rank model state (GiB) vs number of ranks, one line per ZeRO stage (log-2 x axis)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = zero_table(n_params, world_sizes, **bytes_per_param)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=df, x="world_size", y="total_GiB", hue="strategy", marker="o", ax=ax)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(df["world_size"])))
    ax.set_xticklabels([str(n) for n in sorted(set(df["world_size"]))])
    if budget_bytes is not None:
        positive_int(budget_bytes, "budget_bytes")
        ax.axhline(budget_bytes / GIB, color="black", linestyle="--", linewidth=1)
        ax.text(ax.get_xlim()[0], budget_bytes / GIB, f" {budget_label}", va="bottom", ha="left", fontsize=9)
    ax.legend(title="strategy", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.set_xlabel("number of data-parallel ranks")
    ax.set_ylabel("model state per rank (GiB)")
    ax.set_title(title or f"ZeRO per-rank memory, {n_params / 1e9:.2f}B parameters, mixed-precision Adam")
    return ax


# --------------------------------------------------------------------------------------------
# Pipeline parallelism
# --------------------------------------------------------------------------------------------
def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of a GPipe schedule: ``(p - 1) / (m + p - 1)`` for ``p`` stages, ``m`` micro-batches."""
    p = positive_int(p, "p", "pipeline stages")
    m = positive_int(m, "m", "micro-batches per step")
    return (p - 1) / (m + p - 1)


def gpipe_schedule(p: int, m: int) -> list[dict]:
    """The GPipe schedule as a list of ``{stage, slot, micro_batch, phase}`` (phase 'F' or 'B').

    Every forward and backward takes one time slot (the assumption behind :func:`bubble_fraction`).
    Stage ``s`` runs the forward of micro-batch ``j`` at slot ``s + j``; all backwards start after
    the last forward, from the last stage back, so one step takes ``2 * (m + p - 1)`` slots.
    """
    p = positive_int(p, "p", "pipeline stages")
    m = positive_int(m, "m", "micro-batches per step")
    cells = []
    t_fwd = m + p - 1
    for s in range(p):
        for j in range(m):
            cells.append({"stage": s, "slot": s + j, "micro_batch": j, "phase": "F"})
            cells.append({"stage": s, "slot": t_fwd + (p - 1 - s) + j, "micro_batch": j, "phase": "B"})
    return sorted(cells, key=lambda c: (c["stage"], c["slot"]))


def schedule_bubble_fraction(schedule: list[dict]) -> float:
    """Idle slots / all slots of a schedule from :func:`gpipe_schedule` (the measured bubble)."""
    if not schedule:
        raise ValueError("schedule is empty; build one with gpipe_schedule(p, m).")
    n_stages = 1 + max(c["stage"] for c in schedule)
    n_slots = 1 + max(c["slot"] for c in schedule)
    busy = {(c["stage"], c["slot"]) for c in schedule}
    if len(busy) != len(schedule):
        raise ValueError("schedule puts two tasks on one stage in the same slot.")
    return 1 - len(busy) / (n_stages * n_slots)


def plot_pipeline_schedule(p: int, m: int, *, ax=None, title: str | None = None):
    """Draw the GPipe schedule: one row per stage, forward (blue) and backward (orange) per micro-batch."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule = gpipe_schedule(p, m)
    n_slots = 2 * (m + p - 1)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(14, 1.5 + 0.45 * n_slots), 0.6 * p + 1.2))
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for s in range(p):
        ax.broken_barh([(0, n_slots)], (s - 0.4, 0.8), facecolors="#eeeeee", edgecolor="none")
    for c in schedule:
        ax.broken_barh([(c["slot"], 1)], (c["stage"] - 0.4, 0.8), facecolors=colors[c["phase"]], edgecolor="white")
        ax.text(c["slot"] + 0.5, c["stage"], f"{c['phase']}{c['micro_batch']}", ha="center", va="center",
                color="white", fontsize=8)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, n_slots)
    ax.set_xticks(range(0, n_slots + 1, 1 if n_slots <= 30 else 2 if n_slots <= 60 else 5))
    ax.set_xlabel("time slot (one forward or backward of one micro-batch)")
    ax.grid(False)
    ax.legend(handles=[Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward"),
                       Patch(color="#eeeeee", label="idle (bubble)")], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or f"GPipe, p={p} stages, m={m} micro-batches: bubble = {bubble_fraction(p, m):.0%}")
    return ax


# --------------------------------------------------------------------------------------------
# Offload
# --------------------------------------------------------------------------------------------
#: Theoretical one-direction bandwidth of an x16 link, GB/s (1e9 bytes/s). Measured copies reach ~80% of it.
PCIE_GB_PER_S = {"pcie3_x16": 15.75, "pcie4_x16": 31.5, "pcie5_x16": 63.0}


@dataclass(frozen=True)
class OffloadCost:
    """What one optimizer step of CPU offload moves over PCIe and how long that takes."""

    n_params: int
    bytes_to_cpu: int
    bytes_to_gpu: int
    bandwidth_bytes_per_s: float

    @property
    def bytes_per_step(self) -> int:
        return self.bytes_to_cpu + self.bytes_to_gpu

    @property
    def seconds_per_step(self) -> float:
        """Both copies one after the other (the capstone's simple loop; overlap would hide some)."""
        return self.bytes_per_step / self.bandwidth_bytes_per_s


def offload_pcie_cost(n_params: int, *, link: str | float = "pcie4_x16", grad_bytes: float = 2,
                      param_bytes: float = 2, efficiency: float = 1.0) -> OffloadCost:
    """Bytes and seconds per optimizer step when the optimizer (and fp32 master weights) live on the CPU.

    Each step copies the gradients GPU -> CPU (``grad_bytes`` per parameter, fp16 = 2) and the
    updated weights CPU -> GPU (``param_bytes``, fp16 = 2). ``link`` is a key of
    :data:`PCIE_GB_PER_S` or a bandwidth in GB/s; ``efficiency`` (0-1] scales it to what copies
    really reach.
    """
    n_params = positive_int(n_params, "n_params")
    positive_number(grad_bytes, "grad_bytes", allow_zero=True)
    positive_number(param_bytes, "param_bytes", allow_zero=True)
    if isinstance(link, str):
        if link not in PCIE_GB_PER_S:
            raise ValueError(f"Unknown link {link!r}; use one of {sorted(PCIE_GB_PER_S)} or a bandwidth in GB/s.")
        gb_s = PCIE_GB_PER_S[link]
    else:
        gb_s = positive_number(link, "link bandwidth (GB/s)", allow_zero=True)
        if gb_s == 0:
            raise ValueError("link bandwidth must be > 0 GB/s, e.g. 16 for PCIe 3.0 x16.")
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], e.g. 0.8, not {efficiency!r}.")
    return OffloadCost(n_params=n_params, bytes_to_cpu=int(math.ceil(n_params * grad_bytes)),
                       bytes_to_gpu=int(math.ceil(n_params * param_bytes)),
                       bandwidth_bytes_per_s=gb_s * 1e9 * efficiency)


def deepspeed_zero_offload_config(*, micro_batch_size: int = 4, grad_accum_steps: int = 16, stage: int = 2,
                                  offload_params: bool = False, lr: float = 1e-5) -> dict:
    """A DeepSpeed config for ZeRO-Offload (Ren et al. 2021): optimizer state and step on the CPU.

    Shown in the course, not run (DeepSpeed is not a course dependency). ``offload_params``
    (stage 3 only) also keeps the fp16 parameters on the CPU (ZeRO-Infinity style).
    """
    positive_int(micro_batch_size, "micro_batch_size")
    positive_int(grad_accum_steps, "grad_accum_steps")
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"ZeRO-Offload needs stage 1, 2 or 3, not {stage!r}.")
    if offload_params and stage != 3:
        raise ValueError("offload_params needs stage=3: only ZeRO-3 shards (and so can offload) the parameters.")
    positive_number(lr, "lr", allow_zero=True)
    zero = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.0}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
class LaunchError(RuntimeError):
    """A multi-process launch failed: a rank raised, crashed, or the run passed its timeout."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (bind to port 0 and let the OS choose).

    Another program may take it before you use it; :func:`launch` avoids that race by keeping
    its rendezvous store listening on the port it was given.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend(world_size: int) -> str:
    """'nccl' when there is one CUDA GPU per rank (and at least 2), else 'gloo' (CPU)."""
    import torch.distributed as dist

    world_size = positive_int(world_size, "world_size")
    if world_size >= 2 and torch.cuda.is_available() and torch.cuda.device_count() >= world_size \
            and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_device() -> torch.device:
    """Inside a launched worker: this rank's GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _child_main(rank: int, world_size: int, port: int, backend: str, workdir: str, timeout_s: float,
                threads: int) -> None:
    """Entry point of one rank (run as ``python -c``): join the group, run the task, save its result or traceback."""
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    torch.set_num_threads(threads)
    _exit_with_parent()
    code = 0
    try:
        task = torch.load(os.path.join(workdir, "task.pt"), weights_only=False)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
        result = task["fn"](*task["args"], **task["kwargs"])
        torch.save(result, os.path.join(workdir, f"rank{rank}.tmp"))
        os.replace(os.path.join(workdir, f"rank{rank}.tmp"), os.path.join(workdir, f"rank{rank}.pt"))
    except BaseException:  # noqa: BLE001 - report everything to the parent, then exit non-zero
        with open(os.path.join(workdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: no hang on background threads


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """Exit this rank if the launching process dies (even by SIGKILL): no orphan outlives its notebook."""
    import threading

    parent = os.getppid()

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_CHILD_CODE = ("import sys; from course_utils.distributed import _child_main; "
               "_child_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], "
               "float(sys.argv[6]), int(sys.argv[7]))")


def _kill_group(proc, sig) -> None:
    if not hasattr(os, "killpg"):  # Windows: no process groups; stop the child itself
        (proc.kill if sig == getattr(signal, "SIGKILL", None) else proc.terminate)()
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own session: this reaches anything it started
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs, grace_s: float) -> None:
    """SIGTERM every live child (and its process group), wait up to ``grace_s``, then SIGKILL: no orphans."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            _kill_group(p, getattr(signal, "SIGKILL", signal.SIGTERM))
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - the kernel refused SIGKILL?
                pass


def launch(fn, world_size: int = 2, *, args: tuple = (), kwargs: dict | None = None, backend: str | None = None,
           timeout_s: float = 120.0, threads_per_rank: int | None = None, grace_s: float = 3.0) -> list:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` processes joined in one process group.

    ``fn`` must be importable (defined in a ``.py`` module, e.g. :mod:`course_utils.dist_workers`):
    each rank is a fresh Python process that imports it by name, so a function typed into a
    notebook cell cannot be sent. Inside ``fn``, ``torch.distributed`` is initialised
    (``dist.get_rank()``, collectives work). Arguments travel by ``torch.save`` (tensors are fine).
    Returns the ranks' return values, ``[result_rank0, result_rank1, ...]``.

    With ``backend='gloo'`` the ranks see no GPU (``CUDA_VISIBLE_DEVICES=''``) and compute on the CPU;
    with ``'nccl'`` rank ``r`` uses ``cuda:r``.

    Raises :class:`LaunchError` when a rank raises (with its traceback) or when the run takes
    longer than ``timeout_s``; in every case all children are terminated, then killed. A rank
    also exits by itself if the launching process dies.
    """
    import torch.distributed as dist

    if not callable(fn):
        raise TypeError(f"fn must be a function, not {type(fn).__name__}.")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__") or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"fn {qualname or fn!r} is defined in a notebook, a script's __main__, a lambda or inside a function; "
            "the worker processes cannot import it. Put it at the top level of a .py module "
            "(see course_utils/dist_workers.py)."
        )
    world_size = positive_int(world_size, "world_size", "number of processes, e.g. 2")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments, not {type(args).__name__}.")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments, not {type(kwargs).__name__}.")
    backend = default_backend(world_size) if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), not {backend!r}.")
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world_size):
        raise ValueError(f"backend 'nccl' needs {world_size} CUDA GPUs, this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; use backend='gloo'.")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, e.g. 60, not {timeout_s!r}.")
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s >= 0:
        raise ValueError(f"grace_s must be a number of seconds >= 0, e.g. 3, not {grace_s!r}.")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    threads_per_rank = positive_int(threads_per_rank, "threads_per_rank")

    workdir = tempfile.mkdtemp(prefix="course_dist_")
    procs: list[subprocess.Popen] = []
    logs = []
    # The parent hosts the rendezvous store on a port the OS picks (port 0): no race for a "free" port.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root, os.getcwd()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = str(threads_per_rank)
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks compute on the CPU; FSDP would otherwise pick cuda:0
    try:
        torch.save({"fn": fn, "args": tuple(args), "kwargs": kwargs}, os.path.join(workdir, "task.pt"))
        for rank in range(world_size):
            log = open(os.path.join(workdir, f"rank{rank}.log"), "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, str(rank), str(world_size), str(store.port), backend, workdir,
                 str(float(timeout_s)), str(threads_per_rank)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                break
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # the others may wait forever in a collective: give them a moment, then stop them
                _wait_all(procs, min(grace_s, max(0.0, deadline - time.monotonic())))
                _stop(procs, grace_s)
                # name every rank that raised, not only the first to exit (a peer may lose the race)
                raised = [r for r in range(world_size) if os.path.exists(os.path.join(workdir, f"rank{r}.err"))]
                raise LaunchError(_failure_message(workdir, procs, raised or failed, qualname))
            if time.monotonic() > deadline:
                _stop(procs, grace_s)
                raise LaunchError(
                    f"{qualname} did not finish within timeout_s={timeout_s:g} s on {world_size} ranks; every "
                    f"process was stopped ({_states(procs)}). A rank may wait in a collective that another rank "
                    "never reached, or the machine is slower than expected: then raise timeout_s."
                    + _errors_text(workdir, range(world_size))
                )
            time.sleep(0.05)
        results = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise LaunchError(f"rank {rank} exited cleanly but saved no result; was it killed from outside?")
            results.append(torch.load(path, weights_only=False))
        return results
    finally:
        _stop(procs, grace_s)  # also on KeyboardInterrupt / any error in the parent
        for log in logs:
            log.close()
        del store
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_all(procs, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _states(procs) -> str:
    out = []
    for r, p in enumerate(procs):
        code = p.poll()
        state = "running" if code is None else (f"killed by signal {-code}" if code < 0 else f"exit code {code}")
        out.append(f"rank {r}: {state}")
    return ", ".join(out)


def _errors_text(workdir: str, ranks) -> str:
    parts = []
    for r in ranks:
        path = os.path.join(workdir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f"\n--- rank {r} traceback ---\n{f.read().rstrip()}")
    return "".join(parts)


def _log_tail(workdir: str, rank: int, n_chars: int = 2000) -> str:
    path = os.path.join(workdir, f"rank{rank}.log")
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace").strip()
    return f"\n--- rank {rank} output (last lines) ---\n{text[-n_chars:]}" if text else ""


def _failure_message(workdir: str, procs, failed, name: str) -> str:
    details = _errors_text(workdir, range(len(procs)))
    if not details:
        details = (" No traceback was saved: the process crashed (killed, out of memory, or a segfault)."
                   + "".join(_log_tail(workdir, r) for r in failed))
    return f"{name} failed on rank(s) {failed} ({_states(procs)}); every process was stopped." + details


# --------------------------------------------------------------------------------------------
# Local shard accounting
# --------------------------------------------------------------------------------------------
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank: a DTensor's local shard, or ``t`` itself."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(t).__name__}.")
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def local_state_bytes(model: torch.nn.Module, optimizer=None) -> dict:
    """Bytes this rank stores for parameters, gradients and optimizer state (DTensor shards count locally)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, not {type(model).__name__}.")

    def nbytes(t):
        t = local_tensor(t)
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = 0
    if optimizer is not None:
        if not hasattr(optimizer, "state"):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}.")
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    optim += nbytes(value)
    return {"params": params, "grads": grads, "optimizer": optim}
