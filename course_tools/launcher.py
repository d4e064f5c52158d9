"""Run a script in N processes joined in one ``torch.distributed`` group, like ``torchrun``, safe to call from a notebook.

    python -m course_tools.launcher --nproc-per-node 2 [--timeout 120] worker.py ARGS...

Each process runs ``worker.py ARGS`` as ``__main__`` with the variables ``torchrun`` sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so the script calls
``dist.init_process_group("gloo")`` exactly as it would under ``torchrun``. What this adds for notebooks and tests:

- the rendezvous store listens on a port the operating system picks (port 0; rank 0 hosts it and tells the others),
  and the ranks join it as ``torchrun``'s workers join its agent's store (``TORCHELASTIC_USE_AGENT_STORE``): two
  launches never collide, and the launcher itself never imports torch;
- a timeout: a run that hangs (a rank waiting in a collective that another rank never reached) is stopped;
- no orphans: every rank is terminated, then killed, on error, timeout or Ctrl-C, and a rank exits by itself when
  the launcher dies (even by SIGKILL, e.g. a notebook kernel restarted mid-run);
- a failing rank's traceback reaches the caller (:class:`LaunchError`, or exit code 1 on the command line).

Why not torchrun itself (``torch.distributed.run``): its ``--standalone`` also takes a free port, but it has no
limit on a run's wall time (only restarts, monitoring and a shutdown grace), and it starts each worker in a session
of its own with nothing that ends it when the agent is killed by SIGKILL; and it imports torch before any rank starts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


class LaunchError(RuntimeError):
    """A multi-process launch failed: a rank raised, crashed, or the run passed its timeout."""


def _positive(value, name: str, example: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a number {'>= 0' if allow_zero else '> 0'}, e.g. {example}, not {value!r}.")
    return value


def launch(script, *script_args, nproc: int = 2, timeout_s: float = 120.0, threads_per_rank: int | None = None,
           grace_s: float = 3.0) -> list[str]:
    """Run ``python script *script_args`` in ``nproc`` processes (ranks 0 .. nproc-1) and wait for all of them.

    Returns each rank's output (stdout and stderr together), indexed by rank. Raises :class:`LaunchError` when a rank
    exits with an error (its output, with the traceback, is in the message) or the run takes longer than
    ``timeout_s``; in every case all ranks are stopped. The script passes results back the way it would under
    ``torchrun``: by writing files (e.g. ``torch.save``) to a folder given in ``script_args``.
    """
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"No script at {script}; write the worker file first (e.g. with %%writefile).")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a whole number of processes >= 1, e.g. 2, not {nproc!r}.")
    _positive(timeout_s, "timeout_s", "60")
    _positive(grace_s, "grace_s", "3", allow_zero=True)
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be a whole number >= 1, not {threads_per_rank!r}.")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS=str(threads_per_rank))
    here = str(Path(__file__).resolve().parent.parent)  # the ranks import this module (and the course's packages)
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    logdir = tempfile.mkdtemp(prefix="course_launch_")
    env["COURSE_LAUNCH_PORT_FILE"] = os.path.join(logdir, "port")
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            with open(os.path.join(logdir, f"rank{rank}.log"), "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", "from course_tools.launcher import _run_rank; _run_rank()",
                     str(script.resolve()), *map(str, script_args)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline, timed_out = time.monotonic() + timeout_s, False
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                # a rank failed; the others may wait forever in a collective: give them a moment, then stop them
                _wait(procs, min(grace_s, max(0.0, deadline - time.monotonic())))
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        _stop(procs, grace_s)
        outputs = [_read(os.path.join(logdir, f"rank{r}.log")) for r in range(nproc)]
        if timed_out:
            raise LaunchError(f"{script.name} did not finish within timeout_s={timeout_s:g} s on {nproc} ranks; "
                              f"every process was stopped ({_states(procs)}). A rank may wait in a collective that "
                              "another rank never reached, or the machine is slower than expected: then raise "
                              "timeout_s." + _tails(outputs, range(nproc)))
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raised = [r for r in failed if procs[r].returncode > 0] or failed
            raise LaunchError(f"{script.name} failed on rank(s) {raised} ({_states(procs)}); every process was "
                              "stopped." + _tails(outputs, failed))
        return outputs
    finally:
        _stop(procs, grace_s)  # also on KeyboardInterrupt / any error here
        shutil.rmtree(logdir, ignore_errors=True)


def _run_rank() -> None:
    """One rank (``python -c``): watch the launcher, run the script as ``__main__``, report, exit without hanging."""
    import runpy

    _exit_with_parent()
    import torch.distributed as dist

    port_file = os.environ.pop("COURSE_LAUNCH_PORT_FILE")
    if os.environ["RANK"] == "0":
        # Rank 0 hosts the rendezvous store on a port the OS picks (port 0: no race for a "free" port) and tells
        # the others which one it got; every rank, rank 0 included, then joins it as a client, as under torchrun.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # noqa: F841 - keep it alive
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
    while not os.path.exists(port_file):
        time.sleep(0.02)
    with open(port_file) as f:
        os.environ["MASTER_PORT"] = f.read()
    sys.argv = sys.argv[1:]                      # the script sees itself as argv[0], as under `python script.py`
    sys.path[0] = os.path.dirname(sys.argv[0])   # and can import the files beside it
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as err:  # noqa: BLE001 - the traceback goes to this rank's output, which the launcher reports
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != sys.argv[0]:
            tb = tb.tb_next  # start the traceback at the script: the launcher's own frames are noise
        traceback.print_exception(type(err), err, tb or err.__traceback__)
        code = 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
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


def _kill_group(proc: subprocess.Popen, sig) -> None:
    if not hasattr(os, "killpg"):  # Windows: no process groups; stop the child itself
        (proc.kill if sig == getattr(signal, "SIGKILL", None) else proc.terminate)()
        return
    try:
        os.killpg(proc.pid, sig)  # the rank leads its own session: this reaches anything it started
    except (ProcessLookupError, PermissionError):
        pass


def _wait(procs, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _stop(procs, grace_s: float) -> None:
    """SIGTERM every live rank (and its process group), wait up to ``grace_s``, then SIGKILL."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _kill_group(p, signal.SIGTERM)
    _wait(live, grace_s)
    for p in live:
        if p.poll() is None:
            _kill_group(p, getattr(signal, "SIGKILL", signal.SIGTERM))
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - the kernel refused SIGKILL?
            pass


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _states(procs) -> str:
    def state(code):
        return "running" if code is None else f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    return ", ".join(f"rank {r}: {state(p.poll())}" for r, p in enumerate(procs))


def _tails(outputs: list[str], ranks, n_chars: int = 3000) -> str:
    parts = [f"\n--- rank {r} output (last lines) ---\n{outputs[r].strip()[-n_chars:]}" for r in ranks
             if outputs[r].strip()]
    return "".join(parts) or " No rank printed anything (killed, out of memory, or a crash before Python started?)."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", "--nproc", type=int, default=2, help="number of processes (ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before every rank is stopped")
    parser.add_argument("--threads-per-rank", type=int, default=None, help="CPU threads per rank (OMP_NUM_THREADS)")
    parser.add_argument("script", help="the worker script each rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        outputs = launch(args.script, *args.script_args, nproc=args.nproc_per_node, timeout_s=args.timeout,
                         threads_per_rank=args.threads_per_rank)
    except (LaunchError, ValueError, FileNotFoundError) as err:
        print(f"launcher: {err}", file=sys.stderr)
        return 1
    for rank, text in enumerate(outputs):
        for line in text.strip().splitlines():
            print(f"[rank {rank}] {line}")
    print(f"launcher: {len(outputs)} ranks finished in {time.monotonic() - t0:.1f} s (process start included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
