"""The quickstart and the TP-over-Ray rehearsal of docs/multi-node.md, run from the docs' own blocks,
plus the launch script's checks.

Layout: a scratch folder like the top of a checkout (scripts/, yaml_configs/ linked) with
`demo_model/` a random model of the demo model's shape (scripts/make_tiny_model.py with the demo's
YAML; the real demo model trains for ~90 s). The quickstart's `serve` (one rank, Native backend)
answers the quickstart's curl requests and gives the reference tokens. The rehearsal then runs as
written: env file, `scripts/ray_cluster.py head` on 127.0.0.1 with 2 NPU resources, `status`,
`eval "$(... env)"` + `vllm-mindspore serve --tensor-parallel-size 2 --distributed-executor-backend
ray` with the MindFormers backend (mindformers' own Qwen2 class when the package is installed), curl,
`stop`; its tokens must equal the reference.

Isolation: loopback only (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, else Ray binds the routable address), free ports for every Ray port, a token of this
cluster's own, the script's --state-dir in the test's folder, and Ray's processes (one session,
started by the script) always killed at teardown. The script's checks run against the same cluster:
a layout that does not fit, a changed environment, a second node with this hostname, pyACL missing on
a node forced to Ascend, and `stop` last (no process left, another Ray-named process untouched).
"""

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from conftest import PROMPTS, ROOT, TOKEN_BUDGET, free_port, greedy_tokens, slow
from test_docs_blocks import BlockServer, block_env, doc_block, make_workdir, replace_checked, run_block

from model_backends import mindformers_installed
from vllm_mindspore.cli import installed_tcmalloc

SCRIPT = "scripts/ray_cluster.py"
# Bounds for a shared 2-core machine, added to the docs' commands: a small KV cache instead of
# the default share of host memory, and fewer graph sizes to compile (TOKEN_BUDGET).
SERVE_EXTRA = ("--kv-cache-memory-bytes", str(32 << 20), "--max-num-seqs", "8",
               "--max-num-batched-tokens", str(TOKEN_BUDGET))
MAX_TOKENS = 8


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def raylets() -> set[int]:
    found = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if "raylet" in " ".join(proc.cmdline()):
                found.add(proc.pid)
    return found


def kill_session(sid: int, timeout: float = 30) -> list[int]:
    deadline = time.time() + timeout
    while (procs := session_processes(sid)) and time.time() < deadline:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=2)
    return [p.pid for p in procs]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The scratch checkout, the script's state dir and the environment the blocks run in."""
    work = make_workdir(str(tmp_path_factory.mktemp("docs_ray")))
    run_block(f"{sys.executable} scripts/make_tiny_model.py yaml_configs/small/predict_qwen2_demo.yaml "
              "demo_model --arch Qwen2ForCausalLM", work, timeout=300)
    env = block_env({
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",  # this cluster's own token, not ~/.ray/auth_token
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "AUTOSCALER_METRIC_PORT": str(free_port()),  # fixed ports by default
        "DASHBOARD_METRIC_PORT": str(free_port()),
    })
    return {"work": work, "state": os.path.join(work, "ray-state"), "env": env}


def script_block(block: str, rehearsal) -> str:
    """A docs block with the script's record kept in the test's folder."""
    return replace_checked(block, SCRIPT, f"{SCRIPT} --state-dir {rehearsal['state']}")


def head_block(rehearsal, temp_dir: str, port: int) -> str:
    ray_ports = (f"--ray-client-server-port={free_port()} --dashboard-port={free_port()} "
                 f"--dashboard-agent-listen-port={free_port()}")
    return (script_block(doc_block("ray-head"), rehearsal)
            + f" --port {port} --temp-dir {temp_dir} -- --num-cpus=2 --include-dashboard=false "
            + ray_ports)


def script(rehearsal, *args: str, expect_rc: int | None = None) -> subprocess.CompletedProcess:
    return run_block(" ".join([sys.executable, SCRIPT, "--state-dir", rehearsal["state"], *args]),
                     rehearsal["work"], rehearsal["env"], timeout=120, expect_rc=expect_rc)


@pytest.fixture(scope="module")
def tp1_tokens(rehearsal, tmp_path_factory):
    """The quickstart: serve the demo model, ask it with both curl blocks; greedy tokens."""
    log = str(tmp_path_factory.mktemp("tp1") / "server.log")
    server = BlockServer(doc_block("serve"), "demo_model", rehearsal["work"], log,
                         rehearsal["env"], SERVE_EXTRA)
    try:
        server.wait_ready()
        completion = json.loads(server.curl(doc_block("curl-completions"), rehearsal["work"]))
        assert completion["model"] == "demo_model" and completion["usage"]["completion_tokens"] > 0
        chat = json.loads(server.curl(doc_block("curl-chat"), rehearsal["work"]))
        assert chat["choices"][0]["message"]["role"] == "assistant"
        return greedy_tokens(server, "demo_model", PROMPTS, MAX_TOKENS)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(rehearsal):
    """ray-env-file + ray-head as written (plus isolation); always torn down."""
    temp_dir = tempfile.mkdtemp(prefix="vmsdoc", dir="/tmp")  # Ray's sockets: 108-byte limit
    run_block(doc_block("ray-env-file"), rehearsal["work"], rehearsal["env"])
    port = free_port()
    sid = None
    try:
        result = run_block(head_block(rehearsal, temp_dir, port), rehearsal["work"],
                           rehearsal["env"], timeout=240)
        with open(os.path.join(rehearsal["state"], "cluster.json")) as f:
            state = json.load(f)
        sid = state["sid"]
        assert state["address"] == f"127.0.0.1:{port}"
        assert "join --env-file" in result.stdout  # tells the other nodes what to run
        yield {"sid": sid, "port": port, "state": state, "head_block": head_block}
    finally:
        script(rehearsal, "stop")
        leftover = kill_session(sid) if sid else []
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftover, f"Ray processes left behind: {leftover}"


def test_tp2_over_ray_matches_tp1(rehearsal, tp1_tokens, cluster, tmp_path):
    status = run_block(script_block(doc_block("ray-status"), rehearsal), rehearsal["work"],
                       rehearsal["env"], timeout=120)
    assert "NPU total: 2" in status.stdout and "needs 2 NPU: fits" in status.stdout, status.stdout
    assert "environment: unchanged since ray start" in status.stdout
    if installed_tcmalloc():
        assert f"its workers preload {installed_tcmalloc()}" in status.stdout, status.stdout

    # `env` must carry what the driver needs: RAY_ADDRESS and the loopback switch.
    exported = script(rehearsal, "env", expect_rc=0).stdout
    assert f"export RAY_ADDRESS=127.0.0.1:{cluster['port']}" in exported
    assert "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in exported
    assert "export vLLM_MODEL_BACKEND=MindFormers" in exported

    server = BlockServer(script_block(doc_block("ray-serve"), rehearsal), "demo_model",
                         rehearsal["work"], str(tmp_path / "ray_server.log"), rehearsal["env"],
                         SERVE_EXTRA)
    try:
        server.wait_ready(timeout=400)  # two ranks compiling on 2 cores
        completion = json.loads(server.curl(doc_block("ray-curl"), rehearsal["work"]))
        assert completion["usage"]["completion_tokens"] > 0
        assert greedy_tokens(server, "demo_model", PROMPTS, MAX_TOKENS) == tp1_tokens
        actors = []
        for proc in session_processes(cluster["sid"]):
            with contextlib.suppress(psutil.Error):
                if " ".join(proc.cmdline()).startswith("ray::RayWorkerProc"):
                    actors.append(proc)
        assert len(actors) == 2, "both ranks must be actors of the script's Ray cluster"
        server_tree = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
        assert not server_tree & {p.pid for p in actors}, "actors must be the cluster's processes"
        if installed_tcmalloc():  # the script preloads it for Ray's processes on a CPU node
            for actor in actors:
                assert "tcmalloc" in Path(f"/proc/{actor.pid}/maps").read_text(), actor
    finally:
        server.stop()
    # Stopping the server frees the cluster: Ray ends the actors of the departed driver.
    _, alive = psutil.wait_procs(actors, timeout=30)
    assert not alive, f"Ray worker actors still running after the server stopped: {alive}"
    log = server.log_tail(100000)
    assert "Model backend: MindFormers" in log
    if installed_tcmalloc():
        assert "tcmalloc is not preloaded" not in log
    assert "tensor_parallel_size=2 (given explicitly) overrides parallel_config.model_parallel=1" in log
    for rank in (0, 1):
        assert f"MindSpore communication up: rank {rank} of 2" in log
    if mindformers_installed():
        # Not counted per rank: Ray may fold lines that differ only in words with digits (rank,
        # pid, time) into one "[repeated 2x across cluster]".
        assert ("Built mindformers.models.qwen2.modeling_qwen2_infer.InferenceQwen2ForCausalLM "
                "with MindFormersBackend") in log


def test_status_refuses_a_layout_that_does_not_fit(rehearsal, cluster):
    result = script(rehearsal, "status", "--tensor-parallel-size", "16", expect_rc=2)
    assert "needs 16 NPU, the cluster has 2" in result.stdout
    result = script(rehearsal, "status", "--tensor-parallel-size", "1", "--data-parallel-size", "2",
                    expect_rc=0)
    assert "needs 2 NPU: fits" in result.stdout


def test_changed_environment_is_reported_not_ignored(rehearsal, cluster, tmp_path):
    env_file = os.path.join(rehearsal["work"], "ray_env_cpu.sh")
    with open(env_file) as f:
        original = f.read()
    try:
        with open(env_file, "a") as f:
            f.write("export MS_ALLOC_CONF=enable_vmm:true\n")
        result = script(rehearsal, "status", expect_rc=3)
        assert "WARNING: the environment changed since `ray start`" in result.stdout
        assert "MS_ALLOC_CONF: (unset) at ray start, now 'enable_vmm:true'" in result.stdout
        assert "--restart" in result.stdout
        # Starting again with the changed file is refused, not silently a no-op.
        again = run_block(cluster["head_block"](rehearsal, "/tmp/unused", free_port()),
                          rehearsal["work"], rehearsal["env"], timeout=120, expect_rc=2)
        assert "already running here" in again.stdout and "Add --restart" in again.stdout
        assert script(rehearsal, "env").returncode == 3
    finally:
        with open(env_file, "w") as f:
            f.write(original)
    # A watched variable exported in the shell counts too.
    shell = run_block(f"export HCCL_OP_EXPANSION_MODE=AIV; {sys.executable} {SCRIPT} --state-dir "
                      f"{rehearsal['state']} status", rehearsal["work"], rehearsal["env"],
                      expect_rc=3)
    assert "HCCL_OP_EXPANSION_MODE: (unset) at ray start, now 'AIV'" in shell.stdout
    assert script(rehearsal, "status", expect_rc=0)
    # From another folder the env file still means what it meant ($PWD in it): no false alarm.
    elsewhere = run_block(f"{sys.executable} {os.path.join(ROOT, SCRIPT)} --state-dir "
                          f"{rehearsal['state']} status", tmp_path, rehearsal["env"], expect_rc=0)
    assert "environment: unchanged" in elsewhere.stdout


def test_a_second_node_with_this_hostname_is_refused(rehearsal, cluster, tmp_path):
    other_state = str(tmp_path / "second-node")
    before = raylets()
    result = run_block(f"{sys.executable} {SCRIPT} --state-dir {other_state} join --env-file "
                       f"ray_env_cpu.sh --address 127.0.0.1:{cluster['port']}", rehearsal["work"],
                       rehearsal["env"], timeout=120, expect_rc=2)
    assert "already in the cluster" in result.stdout and "hostname" in result.stdout
    assert not os.path.exists(os.path.join(other_state, "cluster.json"))
    assert not os.path.exists(os.path.join(other_state, "ray_start.log"))  # ray start never ran
    assert raylets() <= before


def test_missing_pyacl_is_refused_on_an_ascend_node(rehearsal, tmp_path):
    env_file = tmp_path / "ascend_env.sh"
    env_file.write_text("export VLLM_MS_DEVICE=Ascend\nexport ASCEND_RT_VISIBLE_DEVICES=0,1\n")
    state = str(tmp_path / "ascend-node")
    result = run_block(f"{sys.executable} {SCRIPT} --state-dir {state} head --env-file {env_file} "
                       f"--node-ip-address 127.0.0.1 --port {free_port()}", rehearsal["work"],
                       rehearsal["env"], timeout=120, expect_rc=2)
    assert "pyACL is not importable" in result.stdout and "PYTHONPATH" in result.stdout
    assert not os.path.exists(os.path.join(state, "ray_start.log"))


def test_a_cpu_node_preloads_tcmalloc_for_its_ray_processes(monkeypatch, tmp_path):
    """What `head`/`join` add to Ray's environment; the TP-over-Ray test checks that its actors
    run with it."""
    from vllm_mindspore import cli

    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import ray_cluster

    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    monkeypatch.setattr(cli, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"), str(library)))
    preload = ray_cluster.tcmalloc_for_ray
    assert preload("CPU", {"LD_PRELOAD": "/opt/other.so"}) == f"{library}:/opt/other.so"
    assert preload("CPU", {}) == str(library)
    # On Ascend, switched off, or preloaded already by the env file: nothing added.
    assert preload("Ascend", {}) is None
    assert preload("CPU", {"VLLM_MS_CPU_TCMALLOC": "0"}) is None
    assert preload("CPU", {"LD_PRELOAD": str(library)}) is None
    with pytest.raises(ray_cluster.Refused, match="VLLM_MS_CPU_TCMALLOC='sometimes' is not a boolean"):
        preload("CPU", {"VLLM_MS_CPU_TCMALLOC": "sometimes"})
    monkeypatch.setattr(cli, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"),))
    assert preload("CPU", {}) is None
    # `status` reports what the node's Ray processes preload: the script's or the env file's.
    report = ray_cluster.tcmalloc_status
    assert report({"device": "CPU", "ld_preload": f"{library}:/opt/other.so"}) == (
        f"; its workers preload {library}:/opt/other.so")
    assert "without tcmalloc" in report({"device": "CPU", "ld_preload": "/opt/other.so"})
    assert "without tcmalloc" in report({"device": "CPU", "ld_preload": None})
    assert report({"device": "Ascend", "ld_preload": None}) == ""
    assert report({"device": "CPU"}) == ""  # recorded by a script that did not say


def test_stop_leaves_no_ray_process_and_spares_other_ray_processes(rehearsal, cluster):
    """Last: stops the module's cluster as the docs do."""
    decoy = subprocess.Popen(["bash", "-c", "exec -a raylet sleep 300"], start_new_session=True)
    try:
        assert session_processes(cluster["sid"])
        result = run_block(script_block(doc_block("ray-stop"), rehearsal), rehearsal["work"],
                           rehearsal["env"], timeout=120)
        assert "none left" in result.stdout
        assert not session_processes(cluster["sid"])
        assert decoy.poll() is None, "stop killed a process that is not its own"
        assert not os.path.exists(os.path.join(rehearsal["state"], "cluster.json"))
        assert "no Ray cluster" in script(rehearsal, "status", expect_rc=1).stdout
    finally:
        os.killpg(decoy.pid, signal.SIGKILL)
        decoy.wait()


# ------------------------------------------------------------------------------------------
# A real second node: two network + UTS namespaces on this machine (own address, own hostname)
# joined by a veth pair, so `join` passes its hostname check and Ray places one rank per node.

NODE_A, NODE_B, IFNAME = "10.77.0.1", "10.77.0.2", "vmsnet0"


def _namespace(*flags: str) -> tuple[subprocess.Popen, int]:
    """A process holding new namespaces -> (the unshare process, the pid inside them)."""
    holder = subprocess.Popen(["unshare", *flags, "--fork", "sleep", "3600"],
                              start_new_session=True)
    deadline = time.time() + 10
    while time.time() < deadline:
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(holder.pid).children()
            if children:
                return holder, children[0].pid
        time.sleep(0.05)
    raise RuntimeError("unshare started no child")


def _in(pid: int, *command: str, mount: bool = False) -> list[str]:
    return ["nsenter", "-t", str(pid), "-n", "-u", *(["-m"] if mount else []), *command]


def _sh(pid: int, script: str, mount: bool = False, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(_in(pid, "bash", "-e", "-c", script, mount=mount), capture_output=True,
                            text=True, timeout=kwargs.pop("timeout", 60), **kwargs)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture
def two_nodes(rehearsal, tmp_path):
    if not (shutil.which("unshare") and shutil.which("nsenter") and shutil.which("ip")):
        pytest.skip("needs unshare, nsenter and ip (util-linux, iproute2)")
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.decode().strip()}")
    ray_tmp = tempfile.mkdtemp(prefix="vmsnodes", dir="/tmp")
    holders, sessions = [], []
    try:
        holder_a, pid_a = _namespace("--net", "--uts")
        holder_b, pid_b = _namespace("--net", "--uts", "--mount")
        holders += [holder_a, holder_b]
        _sh(pid_a, f"hostname node-a; ip link set lo up; ip link add {IFNAME} type veth peer name "
                   f"vmspeer; ip link set vmspeer netns {pid_b}; ip addr add {NODE_A}/24 dev {IFNAME}; "
                   f"ip link set {IFNAME} up; ip route add default dev {IFNAME}")
        # Node b: its own Ray session folder and shared memory, as a separate machine has.
        _sh(pid_b, f"hostname node-b; ip link set lo up; ip link set vmspeer name {IFNAME}; "
                   f"ip addr add {NODE_B}/24 dev {IFNAME}; ip link set {IFNAME} up; "
                   f"ip route add default dev {IFNAME}; mount -t tmpfs tmpfs {ray_tmp}; "
                   "mount -t tmpfs tmpfs /dev/shm", mount=True)
        env_file = tmp_path / "ray_env_nodes.sh"
        env_file.write_text("export VLLM_MS_DEVICE=CPU\n" + "".join(
            f"export {name}={IFNAME}\n" for name in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
                                                     "HCCL_SOCKET_IFNAME")))
        states = {node: str(tmp_path / f"state-{node}") for node in "ab"}
        yield SimpleNamespace(pid_a=pid_a, pid_b=pid_b, ray_tmp=ray_tmp, env_file=str(env_file),
                              states=states, sessions=sessions)
    finally:
        for node, pid in (("b", locals().get("pid_b")), ("a", locals().get("pid_a"))):
            state = os.path.join(str(tmp_path), f"state-{node}", "cluster.json")
            if pid and os.path.exists(state):
                with open(state) as f:
                    sessions.append(json.load(f)["sid"])
                subprocess.run(_in(pid, sys.executable, os.path.join(ROOT, SCRIPT), "--state-dir",
                                   os.path.dirname(state), "stop", mount=node == "b"),
                               capture_output=True, timeout=120, env=rehearsal["env"])
        leftover = [pid for sid in sessions for pid in kill_session(sid)]
        for holder in holders:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert not leftover, f"Ray processes left behind: {leftover}"


CLIENT = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", timeout=120, max_retries=0)
prompts = json.loads(sys.argv[3])
def one(prompt):
    return client.completions.create(model=sys.argv[2], prompt=prompt, max_tokens=int(sys.argv[4]),
        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
with ThreadPoolExecutor(len(prompts)) as pool:
    print(json.dumps(list(pool.map(one, prompts))))
"""


@slow("about 2 min: a second Ray node in network namespaces")
def test_tp2_over_two_ray_nodes_matches_tp1(rehearsal, tp1_tokens, two_nodes, tmp_path):
    nodes, env = two_nodes, rehearsal["env"]
    script_path = os.path.join(ROOT, SCRIPT)
    port = free_port()
    head = _sh(nodes.pid_a, f"{sys.executable} {script_path} --state-dir {nodes.states['a']} head "
                            f"--env-file {nodes.env_file} --node-ip-address {NODE_A} --devices 1 "
                            f"--port {port} --temp-dir {nodes.ray_tmp} -- --num-cpus=1 "
                            "--include-dashboard=false", env=env, timeout=240)
    assert f"cluster {NODE_A}:{port}" in head.stdout
    joined = _sh(nodes.pid_b, f"{sys.executable} {script_path} --state-dir {nodes.states['b']} join "
                              f"--env-file {nodes.env_file} --address {NODE_A}:{port} "
                              f"--node-ip-address {NODE_B} --devices 1 -- --num-cpus=1",
                 mount=True, env=env, timeout=240)
    assert "Ray join started" in joined.stdout
    status = _sh(nodes.pid_a, f"{sys.executable} {script_path} --state-dir {nodes.states['a']} "
                              "status --tensor-parallel-size 2", env=env)
    assert "2 node(s) alive" in status.stdout and "node-b" in status.stdout
    assert "needs 2 NPU: fits" in status.stdout

    # Every node reads the model from the same absolute path (relative paths resolve per node).
    model = os.path.join(rehearsal["work"], "demo_model")
    serve = (f'eval "$({sys.executable} {script_path} --state-dir {nodes.states["a"]} env)"\n'
             f"exec vllm-mindspore serve {model} --tensor-parallel-size 2 "
             "--distributed-executor-backend ray --max-model-len 2048 --host 127.0.0.1 --port 8000 "
             + " ".join(SERVE_EXTRA))
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(_in(nodes.pid_a, "bash", "-e", "-c", serve), env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 400
        while subprocess.run(_in(nodes.pid_a, "curl", "-sf", "http://127.0.0.1:8000/health"),
                             capture_output=True).returncode != 0:
            assert server.poll() is None, log_path.read_text()[-4000:]
            assert time.time() < deadline, log_path.read_text()[-4000:]
            time.sleep(1)
        result = subprocess.run(_in(nodes.pid_a, sys.executable, "-c", CLIENT,
                                    "http://127.0.0.1:8000/v1", model, json.dumps(PROMPTS),
                                    str(MAX_TOKENS)), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout) == tp1_tokens
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    log = log_path.read_text()
    # One rank on each node: Ray tags the remote actor's lines with its node's address.
    assert f"ip={NODE_B})" in log and "MindSpore communication up: rank 1 of 2" in log
    assert "MindSpore communication up: rank 0 of 2" in log
