"""Helpers shared by the reliability matrix (tests/test_reliability_*.py; docs/reliability.md):
process trees, listening sockets, Prometheus metrics, token-id prompts and a server's end.
No tests here."""

import contextlib
import os
import re
import socket
import sysconfig
import time
import urllib.request

import psutil

LOOPBACK = ("127.0.0.1", "::1")


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> int:
    total = 0
    for process in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total


def bound_sockets(pid: int) -> list[tuple[str, str, int]]:
    """(process name, ip, port) of every listening TCP socket and bound UDP socket of the
    process tree."""
    found = []
    for process in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            for conn in process.net_connections("inet"):
                listening = conn.status == psutil.CONN_LISTEN
                udp = conn.type == socket.SOCK_DGRAM and conn.laddr
                if listening or udp:
                    found.append((process.name(), conn.laddr.ip, conn.laddr.port))
    return found


def port_listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp"))


def leftover_processes(server, marker: str) -> list[str]:
    """Live processes of the server's process group (it runs in its own session), or whose
    command line names `marker` (the model folder): nothing may outlive the server."""
    left = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE or process.pid == os.getpid():
                continue
            in_group = os.getpgid(process.pid) == server.proc.pid
            named = marker in " ".join(process.info["cmdline"] or [])
        except (psutil.Error, ProcessLookupError):
            continue
        if in_group or named:
            left.append(f"{process.pid} {' '.join(process.info['cmdline'] or [])[:120]}")
    return left


def wait_until_gone(server, marker: str, timeout: float) -> float:
    """Seconds until the server's main process has exited and no process of it is left;
    fails after `timeout` seconds."""
    start = time.time()
    while time.time() - start < timeout:
        if server.proc.poll() is not None and not leftover_processes(server, marker):
            return time.time() - start
        time.sleep(0.25)
    raise AssertionError(f"server (exit {server.proc.poll()}) or its processes still there after "
                         f"{timeout}s: {leftover_processes(server, marker)}\n"
                         f"{server.log_tail(40)}")


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Metrics:
    """The server's Prometheus metrics."""

    def __init__(self, text: str):
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match and not line.startswith("#"):
                labels = dict(_LABEL.findall(match.group(2) or ""))
                self.samples.append((match.group(1), labels, float(match.group(3))))

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return sum(value for sample, sample_labels, value in self.samples
                   if sample == name and labels.items() <= sample_labels.items())


def metrics(server, api_key: str | None = None) -> Metrics:
    request = urllib.request.Request(server.url + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return Metrics(response.read().decode())


def wait_idle(server, api_key: str | None = None, timeout: float = 30) -> Metrics:
    """Metrics once no request runs or waits and no KV block is in use."""
    deadline = time.time() + timeout
    while True:
        values = metrics(server, api_key)
        state = [values.get(name) for name in ("vllm:num_requests_running",
                                               "vllm:num_requests_waiting",
                                               "vllm:kv_cache_usage_perc")]
        if state == [0, 0, 0]:
            return values
        if time.time() > deadline:
            raise AssertionError(f"not idle after {timeout}s: running, waiting, KV usage {state}")
        time.sleep(0.25)


def token_prompts(tokenizer_dir: str, lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly these many token ids, from different places of a standard-library
    source (the tiny tokenizer was trained on such text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py")) as f:
        ids = tokenizer(f.read())["input_ids"]
    prompts, start = [], 0
    for length in lengths:
        prompts.append(ids[start:start + length])
        start += length
    assert all(len(p) == n for p, n in zip(prompts, lengths))
    return prompts


def log_lines(server) -> list[str]:
    with open(server.log_path, "rb") as f:
        return f.read().decode(errors="replace").splitlines()


def step_shapes(log: str) -> list[tuple[int, int]]:
    """(requests, tokens) of every step logged with VLLM_MS_LOG_STEPS=1."""
    return [(int(r), int(t)) for r, t in re.findall(r"step: (\d+) reqs, (\d+) tokens", log)]
