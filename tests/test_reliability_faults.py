"""Reliability matrix, faults under tensor parallel (docs/reliability.md): two `mp` worker ranks
joined by MindSpore's collective communication, requests streaming, then a rank's peer is lost
(MindSpore's communication scheduler killed) or a worker is killed mid-step. Either way the
server must stop by itself within 30 s, with a non-zero status and an error naming the cause;
requests in flight get an error; no process or listening port is left. And two bare ranks check
the exit status a rank leaves once its communication is up.

(SIGTERM under load and a request that raises inside a step: tests/test_reliability_serving.py.)
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from conftest import PROMPTS, free_port, slow
from test_reliability_helpers import (LOOPBACK, bound_sockets, leftover_processes,
                                      port_listening, process_tree, wait_until_gone)

# Streams as long as the model allows, so that they are still running when the fault comes even if
# the test's client threads read their first chunk late (2 CPUs shared with four busy processes).
MAX_TOKENS = 960
ARGS = ("--tensor-parallel-size", "2", "--max-model-len", "1024", "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", str(8 << 20), "--max-num-batched-tokens", "16")


@pytest.fixture
def model(tiny_model_factory, tmp_path):
    """A private copy of the tiny Llama: its path marks this test's processes."""
    folder = str(tmp_path / "model")
    shutil.copytree(tiny_model_factory("LlamaForCausalLM"), folder)
    return folder


def _stream(server, prompt: str, started: threading.Event, result: dict) -> dict:
    """Reads one greedy stream into `result` (`_new_result`) as it goes, for the test to watch."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"error"' in line[:20]:
                    result["error"] = line
                    continue
                result["chunks"] += 1
                started.set()
                if '"finish_reason":"length"' in line.replace(" ", ""):
                    result["finish_reason"] = "length"
    except httpx.HTTPError as error:
        result["transport_error"] = repr(error)
    finally:
        result["ended_at"] = time.time()
        started.set()
    return result


def _new_result() -> dict:
    return {"chunks": 0, "finish_reason": None, "error": None, "transport_error": None,
            "ended_at": None}


def _far_from_its_end(result: dict) -> bool:
    return result["ended_at"] is None and result["chunks"] < MAX_TOKENS // 2


def _fault_under_load(server, fault) -> tuple[list[dict], float]:
    """Two greedy streams running, each far from its end, then `fault()`: -> (how the streams
    ended, fault time). A stream that got ahead before the other's first chunk came (a client
    thread can start late on 2 busy CPUs) is replaced, so neither can finish before the fault."""
    streams: list[tuple] = [None, None]
    with ThreadPoolExecutor(6) as pool:
        for _ in range(3):
            for i, stream in enumerate(streams):
                if stream is None or not _far_from_its_end(stream[2]):
                    started, result = threading.Event(), _new_result()
                    streams[i] = (pool.submit(_stream, server, PROMPTS[i], started, result),
                                  started, result)
            for _, started, _ in streams:
                assert started.wait(120)
            if all(_far_from_its_end(result) for _, _, result in streams):
                break
        else:
            pytest.fail(f"no two streams running together: {[s[2] for s in streams]}")
        fault_at = time.time()
        fault()
        return [future.result() for future, _, _ in streams], fault_at


def _assert_stopped_with_error(server, model, results, fault_at, cause: str):
    for result in results:
        ended = f"stream ended {result['ended_at'] - fault_at:+.2f} s from the fault"
        assert result["chunks"] and result["finish_reason"] is None, (
            result, ended, server.log_tail(6000))
        assert result["error"] or result["transport_error"], (result, ended)
    wait_until_gone(server, model, 30)
    stopped = time.time() - fault_at
    assert stopped < 30
    assert server.proc.returncode != 0
    log = server.log_tail(100000)
    assert cause in log, log[-4000:]
    assert "vllm-mindspore: the engine stopped after an error" in log
    assert not leftover_processes(server, model)
    assert not port_listening(server.port)
    return stopped


def test_lost_communication_peer_stops_the_server(serve, model):
    """MindSpore's scheduler (rank 0's helper process that holds the communication world) is
    killed while the ranks serve: rank 0 notices at once and stops, naming it (without that,
    MindSpore ended a rank silently some 30 s later and the server exited 0)."""
    server = serve(model, *ARGS)
    sockets = bound_sockets(server.proc.pid)  # API, ZMQ, gloo, MindSpore's cluster and ranks
    assert sockets and all(ip in LOOPBACK for _, ip, _ in sockets), sockets
    scheduler = [p for p in process_tree(server.proc.pid)
                 if "VLLM_MS_SCHEDULER_PARENT" in " ".join(p.cmdline())]
    assert len(scheduler) == 1, "MindSpore's scheduler process not found"
    results, fault_at = _fault_under_load(server, lambda: scheduler[0].send_signal(signal.SIGKILL))
    stopped = _assert_stopped_with_error(
        server, model, results, fault_at,
        f"MindSpore's communication scheduler (pid {scheduler[0].pid}")
    assert "collective communication between the ranks is lost" in server.log_tail(100000)
    print(f"stopped {stopped:.1f} s after the scheduler was killed")


@slow("another TP=2 start-up (~70 s on 2 cores); tests/test_tensor_parallel.py covers a killed "
      "worker in every run")
def test_worker_killed_mid_step_stops_the_server(serve, model):
    server = serve(model, *ARGS)
    workers = [p for p in process_tree(server.proc.pid) if "Worker_TP1" in p.name()
               or "Worker_TP1" in " ".join(p.cmdline())]
    assert len(workers) == 1, [(p.pid, p.name()) for p in process_tree(server.proc.pid)]
    results, fault_at = _fault_under_load(server, lambda: workers[0].send_signal(signal.SIGKILL))
    stopped = _assert_stopped_with_error(server, model, results, fault_at,
                                         "died unexpectedly")
    assert not psutil.pid_exists(workers[0].pid) or workers[0].status() == psutil.STATUS_ZOMBIE
    print(f"stopped {stopped:.1f} s after the worker was killed")


def test_a_rank_that_raises_exits_non_zero_and_its_peer_zero(tmp_path):
    """Two ranks join MindSpore's collective world as the workers do (init_communication over a
    gloo group, no msrun), then rank 0 raises at top level and rank 1 ends normally: the exit
    handler that skips MindSpore's finalize (it can only hang after vLLM's shutdown) must keep
    rank 0's failure a non-zero status, and rank 1's 0; the scheduler dies with rank 0."""
    script = textwrap.dedent(f"""
        import sys
        import torch.distributed as dist
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=rank,
                                world_size=2)
        import mindspore as ms
        ms.set_device("CPU")
        from vllm_mindspore.distributed.communication import init_communication
        init_communication(rank, 2, dist.group.WORLD, "127.0.0.1", "CPU", [0, 1])
        dist.barrier()
        if rank == 0:
            raise RuntimeError("rank 0 failed after communication came up")
    """)
    env = {**os.environ, "VLLM_MS_COMM_TIMEOUT": "60", "GLOG_v": "3"}
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(rank)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True, cwd=tmp_path)
             for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
                rank.wait()
    logs = [stdout + stderr for stdout, stderr in outputs]
    assert "rank 0 failed after communication came up" in logs[0], logs[0][-2000:]
    assert [rank.returncode for rank in ranks] == [1, 0], [log[-1500:] for log in logs]
    deadline = time.time() + 10
    while time.time() < deadline and any(
            "VLLM_MS_SCHEDULER_PARENT" in " ".join(p.info["cmdline"] or [])
            and p.info["ppid"] in (1, ranks[0].pid)
            for p in psutil.process_iter(["cmdline", "ppid"])):
        time.sleep(0.25)
    leftover = [p.pid for p in psutil.process_iter(["cmdline"])
                if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not leftover
