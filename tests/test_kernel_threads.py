"""The kernels' thread pool (csrc/parallel.h): a kernel called in a process forked after the pool
started (vLLM forks its engine and worker processes), and kernels called from several threads at
once (MindSpore calls them from the Python thread and from its actor threads), both on two
threads. The kernel is called straight through ctypes, with numpy buffers, as MindSpore's AOT
custom op calls it."""

import ctypes
import os
import signal
import threading
import time

import numpy as np
import pytest
from ms_cells import call_aot

from vllm_mindspore.ops import kernels

ROWS, SIZE, EPS = 512, 512, 1e-6  # rows * size is past the norm's threshold for using threads
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207  # <linux/ptrace.h>
WAIT_ALL_THREADS = 0x40000000  # __WALL: waitpid for a thread as for a process


pytestmark = pytest.mark.usefixtures("two_kernel_threads")


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The library's RmsNorm on float32 x [rows, size] and weight [size]."""
    y = np.empty_like(x)
    assert call_aot(kernels.library_path(), "RmsNorm",
                    [x, weight, np.array([EPS], np.float32), y]) == 0
    return y


def inputs(seed: int):
    g = np.random.default_rng(seed)
    return (g.standard_normal((ROWS, SIZE)).astype(np.float32),
            g.standard_normal(SIZE).astype(np.float32))


def expected(x, weight):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS) * weight


def test_kernels_run_in_a_child_forked_after_the_pool_started():
    x, weight = inputs(0)
    np.testing.assert_allclose(rms_norm(x, weight), expected(x, weight), rtol=1e-5, atol=1e-5)
    pid = os.fork()
    if pid == 0:  # the child: the parent's workers are not here
        ok = np.allclose(rms_norm(x, weight), expected(x, weight), rtol=1e-5, atol=1e-5)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the child's kernel gave wrong values"
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("a kernel called in a forked child hung (its pool waited for the parent's threads)")


def test_kernels_called_from_several_threads_at_once():
    cases = [inputs(seed) for seed in range(4)]
    failures = []

    def call(x, weight):
        want = expected(x, weight)
        for _ in range(50):
            if not np.allclose(rms_norm(x, weight), want, rtol=1e-5, atol=1e-5):
                failures.append("wrong values")
                return

    threads = [threading.Thread(target=call, args=case) for case in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a kernel call hung"
    assert not failures


def test_a_kernel_does_not_wait_for_a_worker_that_cannot_run():
    """The pool's worker is stopped (ptrace stops that one thread, as a worker the OS has put aside
    for another process): each kernel call still returns, with the right values, the caller doing
    the whole job. A pool that waited for every worker in every job would hang here."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    x, weight = inputs(1)
    workers_read, workers_write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a pool of its own, its worker the one thread its first kernel starts
        ok = False
        try:
            before = set(os.listdir("/proc/self/task"))
            rms_norm(x, weight)
            started = set(os.listdir("/proc/self/task")) - before
            os.write(workers_write, (" ".join(started) + "\n").encode())
            os.read(go_read, 1)
            want = expected(x, weight)
            ok = all(np.allclose(rms_norm(x, weight), want, rtol=1e-5, atol=1e-5)
                     for _ in range(20))
        finally:
            os._exit(0 if ok else 1)
    os.close(workers_write)  # a child that fails early ends the read below
    try:
        workers = [int(tid) for tid in os.read(workers_read, 200).split()]
        assert workers, "the first kernel call started no worker thread"
        for tid in workers:
            if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
                pytest.skip(f"ptrace is not allowed here ({os.strerror(ctypes.get_errno())})")
            assert libc.ptrace(PTRACE_INTERRUPT, tid, None, None) == 0
            assert os.waitpid(tid, WAIT_ALL_THREADS)[0] == tid  # the worker has stopped
        os.write(go_write, b"x")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(-1, os.WNOHANG | WAIT_ALL_THREADS)
            if done == pid:
                assert os.waitstatus_to_exitcode(status) == 0, "wrong values with the worker stopped"
                return
            time.sleep(0.05)
        pytest.fail("a kernel call waited for the stopped worker")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            while os.waitpid(-1, WAIT_ALL_THREADS)[0] != pid:
                pass  # the stopped worker is reaped first: this process traces it
        except (ProcessLookupError, ChildProcessError):
            pass
