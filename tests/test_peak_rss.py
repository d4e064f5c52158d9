"""The notebook harness measures each notebook's kernel memory (course_tools.nbval_plugin):
a process's peak is read exactly, spawned processes are included, and the check item runs last."""
import subprocess
import sys
import time

from course_tools import nbval_plugin


def test_peak_of_a_process_that_grew_and_shrank():
    code = "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; time.sleep(3)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        sampler = nbval_plugin.KernelMemorySampler(proc.pid, interval=0.05)
        time.sleep(2)  # the 300 MiB is gone by now; VmHWM still holds the peak
        peak = sampler.stop()
    finally:
        proc.wait()
    assert peak >= 300 * 2**20, f"peak {peak / 2**20:.0f} MiB misses the 300 MiB the process touched"


def test_children_are_counted():
    parent_code = ("import subprocess, sys, time; "
                   "c = subprocess.Popen([sys.executable, '-c', "
                   "\"b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(3)\"]); "
                   "c.wait()")
    proc = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        sampler = nbval_plugin.KernelMemorySampler(proc.pid, interval=0.05)
        time.sleep(2.5)
        peak = sampler.stop()
    finally:
        proc.wait()
    assert sampler.children_peak, "the child process was not seen"
    assert peak >= 200 * 2**20


def test_a_vanished_process_reads_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert nbval_plugin._vm_hwm_bytes(proc.pid) == 0
