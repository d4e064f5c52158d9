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


def _parent_and_child(parent_mib_before, parent_mib_during):
    """A parent that touches parent_mib_before MiB, frees it, then holds parent_mib_during MiB while a
    child holds 200 MiB; returns the sampler after both are done."""
    touch = "b = bytearray({} * 2**20); b[::4096] = b'x' * len(b[::4096])"
    parent_code = ("import subprocess, sys, time\n"
                   + touch.format(parent_mib_before) + "\ndel b\n"
                   + touch.format(parent_mib_during) + "\n"
                   "c = subprocess.Popen([sys.executable, '-c', "
                   "\"b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(2)\"])\n"
                   "c.wait()\n")
    return _sampled(parent_code)


def _sampled(code):
    """The sampler after a Python process running ``code`` (as the kernel) has finished."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        sampler = nbval_plugin.KernelMemorySampler(proc.pid, interval=0.05)
        proc.wait()
        sampler.stop()
    finally:
        proc.wait()
    return sampler


def test_a_child_alongside_the_kernel_adds_to_it():
    sampler = _parent_and_child(parent_mib_before=0, parent_mib_during=300)
    assert sampler.together_peak >= 500 * 2**20, (
        f"kernel 300 MiB + child 200 MiB at once read {sampler.together_peak / 2**20:.0f} MiB")


def test_a_child_after_the_kernels_peak_is_not_added_to_that_peak():
    # The parent peaks at 400 MiB, frees it, and only then a 200 MiB child runs: a memory limit never
    # sees 600 MiB at once, so the reported peak must stay well under that sum.
    sampler = _parent_and_child(parent_mib_before=400, parent_mib_during=0)
    peak = max(sampler.kernel_peak, sampler.together_peak)
    assert sampler.kernel_peak >= 400 * 2**20
    assert sampler.children_peak >= 190 * 2**20, "the child was not seen"
    assert peak < sampler.kernel_peak + 150 * 2**20, (
        f"{peak / 2**20:.0f} MiB: the child was added to a kernel peak it did not coincide with")


def test_children_are_counted():
    sampler = _parent_and_child(parent_mib_before=0, parent_mib_during=0)
    assert sampler.children_peak >= 190 * 2**20, "the child process was not seen"
    assert sampler.peak_bytes() >= 200 * 2**20


def test_a_vanished_process_reads_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert nbval_plugin._vm_hwm_bytes(proc.pid) == 0


def test_a_forked_copy_of_the_kernel_adds_only_the_pages_it_writes():
    # After fork, parent and child share the parent's 300 MiB until one writes it; a memory limit charges
    # those pages once. The child then writes 100 MiB of its own: 400 MiB at once, not 300 + 150 + 100.
    code = ("import os, time\n"
            "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    c = bytearray(100 * 2**20); c[::4096] = b'y' * len(c[::4096]); time.sleep(2); os._exit(0)\n"
            "os.waitpid(pid, 0)\n")
    sampler = _sampled(code)
    assert sampler.children_peak >= 95 * 2**20, "the pages the forked child wrote were not counted"
    assert 390 * 2**20 <= sampler.together_peak < 460 * 2**20, (
        f"{sampler.together_peak / 2**20:.0f} MiB for a 300 MiB kernel and a fork that wrote 100 MiB "
        f"({sampler.peak_detail})")


class _Memory:
    def __init__(self, rss, vms, pss=None, uss=None):
        self.rss, self.vms, self.pss, self.uss = rss, vms, rss if pss is None else pss, rss if uss is None else uss


class _ChildThatExecs:
    """A vfork'd child of the kernel that runs g++ after its first read: until then its memory is the kernel's."""

    def __init__(self, kernel_cmdline, kernel_memory, program_memory, exec_after_reads):
        self.reads, self.exec_after = 0, exec_after_reads
        self.kernel_cmdline, self.kernel_memory, self.program_memory = kernel_cmdline, kernel_memory, program_memory

    def _execd(self):
        return self.reads >= self.exec_after

    def cmdline(self):
        self.reads += 1
        return ["g++", "-O3", "kernel.cpp"] if self._execd() else self.kernel_cmdline

    def memory_full_info(self):
        self.reads += 1
        return self.program_memory if self._execd() else self.kernel_memory


class _Kernel:
    def __init__(self, memory):
        self.memory = memory

    def memory_info(self):
        return self.memory


def test_a_child_that_execs_while_it_is_read_counts_as_the_new_program():
    # Seen in a fresh-clone run: a child read while it still shared the kernel's memory, then named after the
    # compiler it had become: "kernel 1,280 + g++ 936 MiB", over Binder's 2 GiB, with no such g++ running.
    mib = 2**20
    kernel_cmdline = ["python", "-m", "ipykernel_launcher"]
    kernel_memory = _Memory(rss=1280 * mib, vms=5000 * mib, pss=936 * mib, uss=900 * mib)
    compiler = _Memory(rss=30 * mib, vms=80 * mib, pss=12 * mib)
    for exec_after in range(1, 5):   # exec before, during and after the reads
        child = _ChildThatExecs(kernel_cmdline, kernel_memory, compiler, exec_after)
        added = nbval_plugin._child_adds(child, _Kernel(_Memory(rss=1282 * mib, vms=5000 * mib)), kernel_cmdline)
        assert added in (0, 12 * mib), f"exec after read {exec_after}: a child read as adding {added / mib:.0f} MiB"


class _Rank:
    """A child that runs the kernel's interpreter with other arguments (a launched rank)."""

    def __init__(self, memory):
        self.memory = memory

    def cmdline(self):
        return ["/venv/bin/python", "worker.py", "RUN_DIR"]

    def memory_full_info(self):
        return self.memory

    def exe(self):
        return "/venv/bin/python"


def test_a_rank_adds_the_pages_it_alone_holds_a_compiler_its_share_of_all():
    # a rank maps the libraries the kernel has mapped (libtorch), already in the kernel's resident set: its USS;
    # another program's libraries are its own: its PSS
    mib = 2**20
    kernel_cmdline = ["/venv/bin/python", "-m", "ipykernel_launcher"]
    rank = _Rank(_Memory(rss=700 * mib, vms=3000 * mib, pss=520 * mib, uss=330 * mib))
    kernel = _Kernel(_Memory(rss=1000 * mib, vms=5000 * mib))
    assert nbval_plugin._child_adds(rank, kernel, kernel_cmdline, "/venv/bin/python") == 330 * mib
    assert nbval_plugin._child_adds(rank, kernel, kernel_cmdline, "/usr/bin/python3") == 520 * mib
