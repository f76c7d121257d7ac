#!/usr/bin/env python3
"""Start, join, check and stop the Ray cluster that `vllm-mindspore serve
--distributed-executor-backend ray` runs on, the way the multi-node guide does it.

    python scripts/ray_cluster.py head   [--env-file FILE] [--port 6379] [--devices N] [-- RAY_ARGS]
    python scripts/ray_cluster.py join   --address HEAD_IP:PORT [--env-file FILE] [--devices N]
    python scripts/ray_cluster.py status [--tensor-parallel-size N] [--data-parallel-size M]
    python scripts/ray_cluster.py env    # `export` lines for the shell that runs `vllm-mindspore serve`
    python scripts/ray_cluster.py stop

Run it with the interpreter of the environment that has Ray (~/.cache/vllm-mindspore/venv/bin/python,
or `python` inside the container image). What it adds to plain `ray start`:

- The environment file (shell syntax: `export X=...`, `source .../set_env.sh`) is applied *before*
  Ray starts, because Ray's workers keep the environment their node started with. The values are
  recorded; `status`, `env` and a second `head`/`join` say which variables changed since then
  instead of letting the change be silently ignored (restart with `stop` + `head`/`join`).
- The node declares its devices as Ray's `NPU` resource, one per rank (the resource the plugin's
  workers ask Ray for): on Ascend the visible NPUs (ASCEND_RT_VISIBLE_DEVICES, else /dev/davinci*),
  on CPU `--devices N` ranks (default 1).
- On Ascend, Ray needs pyACL (`import acl`) to see the NPUs: checked before Ray starts.
- `join` refuses a node whose hostname is already in the cluster (Ray needs distinct hostnames).
- `status` lists the nodes and compares the NPU total with what a layout needs.
- `stop` stops exactly the processes of the Ray node this script started (everything `ray start`
  spawned stays in one session), not other Ray clusters on the machine as `ray stop` would, and
  checks that none is left.

State (what was started, with which environment) lives in --state-dir, default
~/.cache/vllm-mindspore/ray-cluster. Exit codes: 0 ok, 1 no cluster / failure, 2 refused
(layout does not fit, duplicate hostname, pyACL missing, environment changed), 3 environment changed
since `ray start` (status/env).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

try:
    from vllm_mindspore.cli import tcmalloc_preload
    from vllm_mindspore.device import ASCEND, CPU, device_for
except ImportError as error:  # run with another Python than the plugin's environment
    sys.exit(f"ray_cluster.py: {error}. Run it with the Python of the environment vllm-mindspore "
             "is installed in (`make install`, then activate that venv).")

DEFAULT_STATE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "vllm-mindspore", "ray-cluster")
STATE_FILE = "cluster.json"
RESOURCE = "NPU"  # vllm_mindspore.platform.MindSporePlatform.ray_device_key
LOOPBACK = ("127.0.0.1", "localhost")

# Variables whose value at `ray start` matters to the plugin, MindSpore, CANN/HCCL or vLLM: compared
# between the recorded start and now, together with every variable the env file sets.
WATCHED_NAMES = {"PYTHONPATH", "LD_LIBRARY_PATH", "TP_SOCKET_IFNAME", "GLOG_v"}
WATCHED_PREFIXES = ("VLLM_", "vLLM_", "MS_", "MINDFORMERS_", "HCCL_", "ASCEND_", "GLOO_", "NCCL_")
# Set by bash itself while sourcing the env file, or by the venv's activate script.
SHELL_NOISE = {"_", "SHLVL", "PWD", "OLDPWD", "PS1", "COLUMNS", "LINES"}

OK, FAILED, REFUSED, ENV_CHANGED = 0, 1, 2, 3


class Refused(Exception):
    """A check failed before anything was started: message for the user, exit code 2."""


def say(message: str) -> None:
    print(f"[ray_cluster] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# environment


def load_env_file(path: str | None, base: dict[str, str],
                  cwd: str | None = None) -> tuple[dict[str, str], dict[str, str | None]]:
    """Source `path` with bash on top of `base` (in `cwd`, where the node was started, so `$PWD`
    in the file means the same) -> (resulting environment, {name: value or None (unset)} for each
    variable the file changed). Plain `X=1` lines count as exported."""
    if not path:
        return dict(base), {}
    if not os.path.isfile(path):
        raise Refused(f"env file {path} does not exist.")
    script = 'set -a; . "$1" >/dev/null || exit 97; exec env -0'
    cwd = cwd if cwd and os.path.isdir(cwd) else None
    result = subprocess.run(["bash", "-c", script, "ray_cluster-env", path], env=base, cwd=cwd,
                            capture_output=True, timeout=120)
    if result.returncode != 0:
        raise Refused(f"sourcing the env file {path} failed (exit {result.returncode}):\n"
                      + result.stderr.decode(errors="replace")[-2000:])
    env = {}
    for item in result.stdout.split(b"\0"):
        if b"=" in item:
            name, value = item.split(b"=", 1)
            env[name.decode()] = value.decode(errors="replace")
    for name in SHELL_NOISE:
        env.pop(name, None)
        if name in base:
            env[name] = base[name]
    changed: dict[str, str | None] = {n: v for n, v in env.items() if base.get(n) != v}
    changed.update({n: None for n in base if n not in env})
    return env, changed


def watched(env: dict[str, str], file_vars: dict[str, str | None]) -> dict[str, str | None]:
    names = set(file_vars) | {n for n in env if n in WATCHED_NAMES or n.startswith(WATCHED_PREFIXES)}
    return {n: env.get(n) for n in sorted(names)}


def _shown(value: str | None) -> str:
    return "(unset)" if value is None else repr(value)


def env_changes(recorded: dict[str, str | None], now: dict[str, str | None]) -> list[str]:
    lines = []
    for name in sorted(set(recorded) | set(now)):
        before, after = recorded.get(name), now.get(name)
        if before != after:
            lines.append(f"{name}: {_shown(before)} at ray start, now {_shown(after)}")
    return lines


def current_env(state: dict, env_file: str | None) -> tuple[dict[str, str], dict[str, str | None]]:
    path = env_file if env_file is not None else state.get("env_file")
    return load_env_file(path, dict(os.environ), state.get("cwd"))


def report_env(state: dict, env_file: str | None) -> list[str]:
    """Print (and return) what changed in the watched environment since `ray start`."""
    env, file_vars = current_env(state, env_file)
    now = watched(env, {**state.get("env_file_vars", {}), **file_vars})
    changes = env_changes(state.get("env", {}), now)
    if changes:
        say("WARNING: the environment changed since `ray start`; Ray's processes still run with "
            "the old values, so the change is ignored until Ray restarts:")
        for line in changes:
            say(f"  {line}")
        say("Restart this node (and every other node whose environment changed): "
            f"`{restart_command(state)}`.")
    return changes


# ---------------------------------------------------------------------------------------------
# devices and checks


def count_devices(device: str, env: dict[str, str], requested: int | None) -> int:
    if device == CPU:
        return requested if requested is not None else 1
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES")
    npus = (len([d for d in visible.split(",") if d.strip()]) if visible is not None
            else len(glob.glob("/dev/davinci[0-9]*")))
    if requested is not None and requested > npus:
        raise Refused(f"--devices {requested} but this node sees {npus} NPU(s) "
                      "(ASCEND_RT_VISIBLE_DEVICES / /dev/davinci*).")
    if (requested or npus) < 1:
        raise Refused("no NPU visible on this Ascend node (ASCEND_RT_VISIBLE_DEVICES is empty "
                      "and no /dev/davinci* device); check `npu-smi info` and the env file.")
    return requested or npus


def check_pyacl(env: dict[str, str]) -> None:
    """Ray finds and assigns Ascend NPUs through pyACL (`import acl`) in the node's environment."""
    probe = subprocess.run([sys.executable, "-c", "import acl"], env=env, capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        error = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Refused(
            "this is an Ascend node, but pyACL is not importable in the environment Ray would start "
            f"with (`import acl`: {error}). Ray needs it to see the NPUs. Extract it from the "
            "Ascend-cann-nnrt package of the node's CANN version (same on every node):\n"
            "  ./Ascend-cann-nnrt_<VERSION>_linux-<arch>.run --noexec --extract=./ && cd run_package\n"
            "  ./Ascend-pyACL_<VERSION>_linux-<arch>.run --full --install-path=<install_path>\n"
            "and add it to the env file:\n"
            "  export PYTHONPATH=<install_path>/CANN-<VERSION>/python/site-packages/:$PYTHONPATH\n"
            "(docs/multi-node.md, 'pyACL').")


def tcmalloc_for_ray(device: str, env: dict[str, str]) -> str | None:
    """LD_PRELOAD with tcmalloc for the Ray processes of a CPU node. The plugin's workers are
    started by the node's raylet with the node's environment, not by the `vllm-mindspore` command,
    which preloads it for itself (README, "CPU: preload tcmalloc"). None on Ascend, with
    VLLM_MS_CPU_TCMALLOC=0, when the environment preloads it already, or where it is not
    installed (the workers then log a warning that says how to install it)."""
    if device != CPU:
        return None
    try:
        return tcmalloc_preload(env)
    except ValueError as error:
        raise Refused(f"{error} (in the environment Ray would start with)") from error


def tcmalloc_status(state: dict) -> str:
    """What `status` says of tcmalloc in this node's Ray processes (CPU only): the LD_PRELOAD
    `start` gave them, this script's or the env file's own."""
    if state["device"] != CPU or "ld_preload" not in state:  # a node started by an older script
        return ""
    preload = state["ld_preload"] or ""
    if "tcmalloc" in preload:
        return f"; its workers preload {preload}"
    return ("; its workers run without tcmalloc (VLLM_MS_CPU_TCMALLOC=0 or not installed: README, "
            "\"CPU: preload tcmalloc\")")


def gcs_nodes(address: str, timeout: float = 20) -> list[dict]:
    """Alive nodes of the cluster whose GCS is at `address` (what `ray status` reads)."""
    import ray._raylet

    client = ray._raylet.GcsClient(address=address)
    infos = client.get_all_node_info(timeout=timeout)
    nodes = []
    for info in infos.values():
        if info.state != 0:  # GcsNodeInfo.ALIVE
            continue
        nodes.append({"hostname": info.node_manager_hostname,
                      "ip": info.node_manager_address,
                      "resources": dict(info.resources_total)})
    return nodes


def check_hostname_unique(address: str) -> None:
    try:
        nodes = gcs_nodes(address)
    except Exception as error:
        raise Refused(f"cannot reach the head's Ray GCS at {address}: {error}. Check the address "
                      "(the head prints it), the port and the firewall.") from error
    me = socket.gethostname()
    for node in nodes:
        if node["hostname"] == me:
            raise Refused(
                f"a node with this hostname ({me!r}, at {node['ip']}) is already in the cluster at "
                f"{address}. Ray's nodes need distinct hostnames: give this machine its own "
                "(`hostname <new-host-name>`) and join again. (Joining a head on the same machine "
                "is not a second node.)")


# ---------------------------------------------------------------------------------------------
# processes of one `ray start` session


def _proc_session(pid: int) -> tuple[int, str] | None:
    """-> (session id, state letter) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[3]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _proc_session(int(entry))
            if info and info[0] == sid and info[1] != "Z":
                found.append(int(entry))
    return found


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def live_processes(state: dict) -> list[int]:
    """The recorded session's processes, if they are still Ray's (not a reused session id)."""
    if state.get("boot_id") != boot_id():
        return []
    pids = session_processes(state["sid"])
    if not any(("raylet" in c or "gcs_server" in c or "ray::" in c or "/ray/" in c)
               for c in map(_cmdline, pids)):
        return []
    return pids


def kill_session(sid: int, grace: float = 5, timeout: float = 30) -> list[int]:
    """SIGTERM the session's processes (Ray shuts down in order), SIGKILL what is left after
    `grace` s -> pids still alive `timeout` s later."""
    for pid in session_processes(sid):
        _signal(pid, signal.SIGTERM)
    end = time.time() + grace
    while session_processes(sid) and time.time() < end:
        time.sleep(0.2)
    end = time.time() + timeout
    while (pids := session_processes(sid)) and time.time() < end:
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.2)
    return session_processes(sid)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------
# state


def state_path(args) -> str:
    return os.path.join(args.state_dir, STATE_FILE)


def read_state(args) -> dict | None:
    try:
        with open(state_path(args)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_state(args, state: dict) -> None:
    os.makedirs(args.state_dir, exist_ok=True)
    tmp = state_path(args) + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, state_path(args))


def restart_command(state: dict) -> str:
    """The head/join command this node was started with, plus --restart."""
    argv = state.get("argv") or ["scripts/ray_cluster.py", state["role"]]
    if "--" in argv:
        i = argv.index("--")
        argv = argv[:i] + ["--restart"] + argv[i:]
    else:
        argv = argv + ["--restart"]
    command = "python " + " ".join(shlex.quote(a) for a in argv)
    cwd = state.get("cwd")
    return f"cd {shlex.quote(cwd)} && {command}" if cwd and cwd != os.getcwd() else command


def self_command(state: dict, sub: str) -> str:
    """The command line that runs sub-command `sub` of this script for the recorded node."""
    script = sys.argv[0] if sys.argv[0].endswith("ray_cluster.py") else "scripts/ray_cluster.py"
    parts = ["python", shlex.quote(script)]
    if state.get("state_dir") and state["state_dir"] != DEFAULT_STATE_DIR:
        parts.append(f"--state-dir {shlex.quote(state['state_dir'])}")
    parts.append(sub)
    if sub in ("head", "join") and state.get("env_file"):
        parts.append(f"--env-file {shlex.quote(state['env_file'])}")
    if sub == "join":
        parts.append(f"--address {state['address']}")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# sub-commands


def ray_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    found = here if os.path.exists(here) else shutil.which("ray")
    if not found:
        raise Refused(f"no `ray` command next to {sys.executable} or on PATH: run this script with "
                      "the interpreter of the environment that has Ray "
                      "(~/.cache/vllm-mindspore/venv/bin/python).")
    return found


def start(args, role: str) -> int:
    existing = read_state(args)
    if existing and live_processes(existing):
        changes = report_env(existing, args.env_file)
        if changes and not args.restart:
            say(f"Ray is already running here ({existing['role']} of {existing['address']}, "
                "started by this script) with the old environment; not starting a second node. "
                "Add --restart to stop it and start again.")
            return REFUSED
        if not args.restart:
            say(f"Ray is already running here ({existing['role']} of {existing['address']}), "
                "environment unchanged; nothing to do.")
            return OK
        cmd_stop(args)
    elif existing:
        say("dropping the record of a Ray node that no longer runs.")
        os.remove(state_path(args))

    env, file_vars = load_env_file(args.env_file, dict(os.environ))
    device = device_for(env.get("VLLM_MS_DEVICE", "auto"))  # the node's, from its env file
    devices = count_devices(device, env, args.devices)
    if device == ASCEND:
        check_pyacl(env)
    preload = tcmalloc_for_ray(device, env)
    if role == "join":
        check_hostname_unique(args.address)

    ray = ray_binary()
    node_ip = args.node_ip_address
    cmd = [ray, "start"]
    if role == "head":
        cmd += ["--head", f"--port={args.port}"]
    else:
        cmd += [f"--address={args.address}"]
    if node_ip:
        cmd.append(f"--node-ip-address={node_ip}")
    cmd += ["--resources", json.dumps({RESOURCE: devices})]
    if getattr(args, "temp_dir", None):  # head only (a joining node uses the cluster's)
        cmd.append(f"--temp-dir={args.temp_dir}")
    cmd += args.ray_args
    added = {}
    if node_ip in LOOPBACK or (role == "join" and args.address.split(":")[0] in LOOPBACK):
        # Otherwise Ray replaces 127.0.0.1 by the host's routable address: the nodes listen there
        # and a driver (vllm-mindspore serve) looks for the GCS there. `env` exports it too.
        added["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray_env = {**env, **added}  # the serving shell gets `added`; it preloads tcmalloc for itself
    if preload:
        ray_env["LD_PRELOAD"] = preload

    os.makedirs(args.state_dir, exist_ok=True)
    log_path = os.path.join(args.state_dir, "ray_start.log")
    say(f"{device} node: declaring {devices} {RESOURCE} (one per rank)"
        + (f", environment from {args.env_file}" if args.env_file else "")
        + (f", tcmalloc preloaded for its workers ({preload})" if preload else "")
        + f"; ray start log: {log_path}")
    say("$ " + " ".join(shlex.quote(c) for c in cmd))
    with open(log_path, "wb") as log:
        starter = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ray_env,
                                   start_new_session=True)
    sid = starter.pid
    try:
        returncode = starter.wait(args.timeout)
    except subprocess.TimeoutExpired:
        returncode = None
    with open(log_path, errors="replace") as f:
        output = f.read()
    if returncode != 0:
        kill_session(sid, grace=2)
        say(f"`ray start` failed ({'timed out' if returncode is None else f'exit {returncode}'}); "
            f"its output:\n{output[-4000:]}")
        return FAILED

    address = args.address if role == "join" else f"{node_ip or _advertised_ip(output)}:{args.port}"
    state = {
        "role": role, "address": address, "sid": sid, "boot_id": boot_id(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "device": device, "devices": devices,
        "env_file": os.path.abspath(args.env_file) if args.env_file else None,
        "env_file_vars": file_vars, "env": watched(env, file_vars), "ray_env": added,
        "ld_preload": ray_env.get("LD_PRELOAD"),  # what its Ray processes (and workers) preload
        "state_dir": args.state_dir, "command": cmd, "argv": list(sys.argv), "cwd": os.getcwd(),
    }
    write_state(args, state)
    say(f"Ray {role} started: cluster {address}, session {sid}.")
    if role == "head":
        say(f"On every other node (same env file, distinct hostname): "
            f"`{self_command(state, 'join')}`")
    say(f"Check: `{self_command(state, 'status')} --tensor-parallel-size N`")
    say(f"Before `vllm-mindspore serve`: `eval \"$({self_command(state, 'env')})\"`")
    return OK


def _advertised_ip(output: str) -> str:
    for line in output.splitlines():
        if "Local node IP:" in line:
            return line.split("Local node IP:")[1].strip()
    return socket.gethostbyname(socket.gethostname())


def cmd_status(args) -> int:
    state = read_state(args)
    address = args.address or (state or {}).get("address")
    if state and not live_processes(state) and not args.address:
        say(f"the Ray {state['role']} this script started ({state['address']}) no longer runs; "
            f"start it again: `{self_command(state, state['role'])}`.")
        return FAILED
    if not address:
        say("no Ray cluster started by this script on this node (give --address HEAD:PORT to "
            "check another).")
        return FAILED
    try:
        nodes = gcs_nodes(address)
    except Exception as error:
        say(f"cannot reach the Ray cluster at {address}: {error}")
        return FAILED
    total = sum(n["resources"].get(RESOURCE, 0) for n in nodes)
    if state:
        say(f"this node: {state['role']} of {address}, {state['device']}, {state['devices']} "
            f"{RESOURCE}, started {state['started']}"
            + (f" with {state['env_file']}" if state.get("env_file") else "")
            + tcmalloc_status(state))
    say(f"cluster {address}: {len(nodes)} node(s) alive")
    for node in sorted(nodes, key=lambda n: n["ip"]):
        res = node["resources"]
        say(f"  {node['hostname']:<24} {node['ip']:<15} {RESOURCE} {res.get(RESOURCE, 0):g}  "
            f"CPU {res.get('CPU', 0):g}")
    say(f"{RESOURCE} total: {total:g}")
    code = OK
    if args.tensor_parallel_size or args.data_parallel_size:
        tp, dp = args.tensor_parallel_size or 1, args.data_parallel_size or 1
        need = tp * dp
        layout = f"tensor_parallel_size={tp} x data_parallel_size={dp}"
        if total >= need:
            say(f"layout {layout} needs {need} {RESOURCE}: fits ({total:g} in the cluster).")
        else:
            say(f"layout {layout} needs {need} {RESOURCE}, the cluster has {total:g}: join more "
                "nodes (or declare more devices per node) or lower the parallel sizes.")
            code = REFUSED
    if state:
        if report_env(state, args.env_file):
            code = code or ENV_CHANGED
        else:
            say("environment: unchanged since ray start.")
    return code


def cmd_env(args) -> int:
    state = read_state(args)
    if not state or not live_processes(state):
        say("no running Ray node started by this script on this node.")
        return FAILED
    changed = report_env(state, None)
    print(f"export RAY_ADDRESS={shlex.quote(state['address'])}")
    for name, value in sorted(state.get("ray_env", {}).items()):
        print(f"export {name}={shlex.quote(value)}")
    for name, value in sorted(state.get("env_file_vars", {}).items()):
        print(f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}")
    return ENV_CHANGED if changed else OK


def cmd_stop(args) -> int:
    state = read_state(args)
    if not state:
        say("no Ray node started by this script on this node; nothing to stop.")
        return OK
    pids = live_processes(state)
    if pids:
        left = kill_session(state["sid"])
        if left:
            say(f"could not stop Ray processes {left} (session {state['sid']}).")
            return FAILED
        say(f"stopped the Ray {state['role']} ({len(pids)} processes of session {state['sid']}); "
            "none left. Other Ray clusters on this machine were not touched.")
    else:
        say(f"the Ray {state['role']} recorded here no longer runs.")
    os.remove(state_path(args))
    return OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ray_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, ray_args = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(
        prog="ray_cluster.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after `--` go to `ray start` unchanged (head/join).")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                        help="where this node's record is kept (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    def node_options(p):
        p.add_argument("--env-file", help="shell file exported before Ray starts (the guide's "
                       "variables); see scripts/ray_env.example.sh")
        p.add_argument("--devices", type=int, help="NPU resources (ranks) this node declares: "
                       "default all visible NPUs on Ascend, 1 on CPU")
        p.add_argument("--node-ip-address", help="this node's address (127.0.0.1: loopback-only "
                       "cluster, one machine)")
        p.add_argument("--restart", action="store_true",
                       help="stop this node's Ray first if it runs (e.g. after an env change)")
        p.add_argument("--timeout", type=float, default=180, help="seconds to wait for ray start")

    head = sub.add_parser("head", help="start the head node")
    node_options(head)
    head.add_argument("--port", type=int, default=6379, help="GCS port (default: %(default)s)")
    head.add_argument("--temp-dir", help="Ray's session/log folder (default: Ray's, /tmp/ray)")
    join = sub.add_parser("join", help="join this node to a head")
    node_options(join)
    join.add_argument("--address", required=True, help="HEAD_IP:PORT the head printed")
    status = sub.add_parser("status", help="nodes, NPU total vs a layout, environment drift")
    status.add_argument("--address", help="cluster to query (default: the one started here)")
    status.add_argument("--env-file", help="compare this file instead of the recorded one")
    status.add_argument("--tensor-parallel-size", type=int)
    status.add_argument("--data-parallel-size", type=int)
    sub.add_parser("env", help="print `export` lines (RAY_ADDRESS and the env file's variables) "
                   "for the shell that runs vllm-mindspore serve")
    sub.add_parser("stop", help="stop the Ray node this script started here (only that one)")

    args = parser.parse_args(argv)
    args.state_dir = os.path.abspath(os.path.expanduser(args.state_dir))
    args.ray_args = ray_args
    try:
        if args.command in ("head", "join"):
            return start(args, args.command)
        return {"status": cmd_status, "env": cmd_env, "stop": cmd_stop}[args.command](args)
    except Refused as refused:
        say(f"refused: {refused}")
        return REFUSED


if __name__ == "__main__":
    sys.exit(main())
