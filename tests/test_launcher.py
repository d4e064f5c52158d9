"""Tests of course_tools.launcher, with the worker scripts in tests/workers/.

Real processes (2 ranks, gloo on CPU): a collective across ranks through the command line, a rank that
hangs (stopped at the timeout, no process left behind), a rank that raises (its traceback reaches the
caller) and a launcher killed by SIGKILL (its ranks exit by themselves).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from course_tools import launcher
from course_tools.launcher import LaunchError, launch

WORKERS = Path(__file__).resolve().parent / "workers"


def _still_running(script: Path) -> list[int]:
    """Live processes, anywhere on the machine, running ``script``: a rank the launcher left behind.

    Searched by command line rather than as this process's children: an orphaned rank is reparented (so it is
    no child of ours), and the notebooks this test run executes in the background start children of their own.
    """
    left = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(script) in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def test_the_search_for_ranks_left_behind_finds_one():
    """Otherwise the 'nothing left running' checks below could never fail."""
    script = WORKERS / "hang.py"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(script)])
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in _still_running(script):
            assert time.monotonic() < deadline, "a running process with the script's path was not found"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.pid not in _still_running(script)


def test_launch_rejects_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="%%writefile"):
        launch(tmp_path / "missing.py")
    script = WORKERS / "rank_info.py"
    for bad in (dict(nproc=0), dict(nproc=1.5), dict(timeout_s=0), dict(grace_s=-1), dict(threads_per_rank=0)):
        with pytest.raises(ValueError):
            launch(script, **bad)


def test_command_line_runs_two_ranks_joined_in_one_group(tmp_path, capsys):
    assert launcher.main(["--nproc-per-node", "2", "--timeout", "120", "--threads-per-rank", "1",
                          str(WORKERS / "rank_info.py"), "2.0", str(tmp_path)]) == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" and r["threads"] == 1 for r in ranks)
    assert [r["sum"] for r in ranks] == [6.0, 6.0]            # 2*1 + 2*2 on both ranks
    assert ranks[0]["pid"] != ranks[1]["pid"]
    out = capsys.readouterr().out
    assert "[rank 1] rank 1 of 2: sum 6.0" in out and "2 ranks finished" in out
    assert not _still_running(WORKERS / "rank_info.py")         # nothing left running


def test_command_line_reports_a_failure(tmp_path, capsys):
    assert launcher.main([str(tmp_path / "missing.py")]) == 1
    assert "No script" in capsys.readouterr().err


def test_launch_stops_hanging_ranks_at_the_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish within timeout_s=3"):
        launch(WORKERS / "hang.py", tmp_path, timeout_s=3, grace_s=1)
    assert time.monotonic() - t0 < 3 + 1 + 6 + 3               # timeout + grace + SIGKILL wait (+ slack), not forever
    assert not _still_running(WORKERS / "hang.py")             # no orphaned ranks
    for pid_file in tmp_path.glob("rank*.pid"):                # ranks that got as far as the hang are gone
        pid = int(pid_file.read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_launch_reports_the_failing_rank_and_stops_the_others():
    with pytest.raises(LaunchError) as info:
        launch(WORKERS / "fail.py", 1, timeout_s=120, grace_s=1)
    msg = str(info.value)
    assert "failed on rank(s) [1]" in msg or "failed on rank(s) [0, 1]" in msg
    assert "rank 1 failed on purpose" in msg                   # the rank's own traceback reaches the caller
    assert "runpy" not in msg                                   # the traceback starts at the script
    assert not _still_running(WORKERS / "fail.py")


@pytest.mark.slow
def test_ranks_exit_when_the_launcher_is_killed(tmp_path):
    """Even a SIGKILLed notebook kernel leaves no rank behind: each rank watches its parent."""
    code = (f"from course_tools.launcher import launch; "
            f"launch({str(WORKERS / 'hang.py')!r}, {str(tmp_path)!r}, timeout_s=120)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert time.monotonic() < deadline, "the ranks never started"
            assert proc.poll() is None, "the launcher exited early"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in tmp_path.glob("rank*.pid"):  # never leave a stray process, even if the test fails
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
