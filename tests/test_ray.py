"""Tensor parallel over Ray, launched as the README and the user guide do: `ray start --head` with
the ranks' `NPU` resources declared, then `vllm-mindspore serve --tensor-parallel-size 2
--distributed-executor-backend ray` joining that cluster through RAY_ADDRESS. Both ranks run as
Ray actors of the cluster, and the served greedy tokens equal HF transformers'."""

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import psutil
import pytest
from conftest import PROMPTS, HFReference, assert_matches_hf, free_port

MAX_TOKENS = 8
ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes",
        str(16 << 20))


def _session_processes(sid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of session `sid`."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _kill_session(sid: int, timeout: float = 30) -> list[int]:
    """SIGKILL every process of session `sid` (what `ray stop --force` does, limited to this
    cluster); -> pids still alive after `timeout`."""
    deadline = time.time() + timeout
    while (procs := _session_processes(sid)) and time.time() < deadline:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=2)
    return [p.pid for p in procs]


@pytest.fixture
def ray_cluster(tmp_path):
    """A one-node Ray cluster on 127.0.0.1 with 2 `NPU`s, started in its own session and always
    torn down.

    `ray stop` cannot be used: it kills every Ray process on the machine, whichever cluster it
    belongs to. Every process of this cluster (GCS, raylet, agents, worker actors) stays in the
    session `ray start` was given, so the teardown kills exactly that session.
    """
    # Short: Ray's unix sockets live under it (108-byte path limit).
    temp_dir = tempfile.mkdtemp(prefix="vmsray", dir="/tmp")
    env = {
        # Otherwise Ray replaces 127.0.0.1 by the host's routable address and serves there.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # A token for this cluster only (not ~/.ray/auth_token).
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        # Fixed ports by default (44217, 44227).
        "AUTOSCALER_METRIC_PORT": str(free_port()),
        "DASHBOARD_METRIC_PORT": str(free_port()),
    }
    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
           "--node-ip-address=127.0.0.1", f"--port={port}",
           f"--ray-client-server-port={free_port()}",
           f"--dashboard-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           "--resources", '{"NPU": 2}', "--num-cpus=2", "--include-dashboard=false",
           "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    log_path = tmp_path / "ray_start.log"
    with open(log_path, "wb") as log:
        starter = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **env}, start_new_session=True)
    sid = starter.pid
    try:
        returncode = starter.wait(120)
        assert returncode == 0, f"ray start failed ({returncode}):\n{log_path.read_text()}"
        yield SimpleNamespace(sid=sid, env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    finally:
        with contextlib.suppress(ProcessLookupError):
            starter.kill()
        starter.wait()
        leftover = _kill_session(sid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftover, f"Ray processes left behind: {leftover}"


def test_tp2_over_ray_matches_hf(ray_cluster, serve, tiny_model_factory):
    # GQA split: 2 KV heads over 2 ranks; vocabulary not divisible by 2 (padded shard).
    model = tiny_model_factory("LlamaForCausalLM", vocab_size=515)
    server = serve(model, *ARGS, "--tensor-parallel-size", "2",
                   "--distributed-executor-backend", "ray",
                   env={**ray_cluster.env, "RAY_DEDUP_LOGS": "0"})
    client = server.client()

    def complete(prompt):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # submitted together: batched by vLLM
        choices = list(pool.map(complete, PROMPTS))

    # The two ranks are actors of this Ray cluster (its processes, not the server's children).
    actor_procs = []
    for proc in _session_processes(ray_cluster.sid):
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.cmdline()).startswith("ray::RayWorkerProc"):
                actor_procs.append(proc)
    actors = sorted(p.pid for p in actor_procs)
    assert len(actors) == 2, f"expected 2 RayWorkerProc actors in the cluster, found {actors}"
    server_tree = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
    assert not server_tree & set(actors)

    reference = HFReference(model)
    for prompt, choice in zip(PROMPTS, choices):
        ref_tokens, ref_steps = reference.greedy(choice.prompt_token_ids, MAX_TOKENS)
        assert_matches_hf(choice.token_ids, choice.logprobs.token_logprobs, ref_tokens,
                          ref_steps, f"tp2 ray {prompt[:20]!r}")

    log = server.log_tail(100000)
    assert "executor=ray tp=2" in log
    # Each rank's MindSpore world came up inside its Ray actor; Ray forwarded the line to the
    # server's log prefixed with the actor's class and pid.
    ranks = {int(rank): int(pid) for pid, rank in re.findall(
        r"\(RayWorkerProc pid=(\d+)[^)]*\).*MindSpore communication up: rank (\d) of 2", log)}
    assert sorted(ranks) == [0, 1], f"both ranks' start-up lines expected:\n{server.log_tail()}"
    assert sorted(ranks.values()) == actors

    # Stopping the server frees the cluster: Ray ends the actors of the departed driver.
    server.stop()
    _, alive = psutil.wait_procs(actor_procs, timeout=30)
    assert not alive, f"Ray worker actors still running after the server stopped: {alive}"
