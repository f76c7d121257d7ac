"""`vllm-mindspore`: vLLM's own command line (serve, chat, complete, bench, ...) with this
plugin's environment defaults applied first, plus `vllm-mindspore models` (what is supported).

Before vLLM starts, the plugin's environment variables are checked (a bad value stops the command
with one line naming it); `serve` exits with status 1 when it stopped because its engine died."""

import os
import sys
from collections.abc import Mapping


def set_env_defaults() -> None:
    # MindSpore hangs in a child forked after it ran an op; MindSpore's glog is noisy at WARNING.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("GLOG_v", "3")


def check_environment() -> None:
    from vllm_mindspore import envs

    try:
        envs.check_all()
    except ValueError as error:
        sys.exit(f"vllm-mindspore: error: {error}")


# Where the system packages put tcmalloc (libtcmalloc-minimal4 on Debian and Ubuntu,
# gperftools-libs on RHEL-likes), the minimal library first.
TCMALLOC_PATHS = tuple(os.path.join(folder, name)
                       for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
                       for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                                      "/usr/lib64", "/usr/lib", "/usr/local/lib"))


def installed_tcmalloc() -> str | None:
    """The first of TCMALLOC_PATHS on this machine (also what benchmarks/throughput.py preloads)."""
    return next((path for path in TCMALLOC_PATHS if os.path.exists(path)), None)


def missing_tcmalloc_warning(maps: str) -> str | None:
    """What a CPU engine logs when tcmalloc is not among its process's mappings (`maps`, the text
    of /proc/self/maps) and VLLM_MS_CPU_TCMALLOC does not switch it off: a script that runs vLLM's
    offline `LLM` without the preload, a Ray worker of a node started by plain `ray start`, or a
    host without tcmalloc."""
    from vllm_mindspore import envs

    if not envs.VLLM_MS_CPU_TCMALLOC or "tcmalloc" in maps:
        return None
    library = installed_tcmalloc()
    fix = (f"run the script as LD_PRELOAD={library} python script.py" if library else
           "install it (Debian/Ubuntu: apt-get install -y libtcmalloc-minimal4) and run the "
           "script as LD_PRELOAD=/path/to/libtcmalloc_minimal.so.4 python script.py")
    return ("tcmalloc is not preloaded: MindSpore's CPU tensors (weights, KV cache, activations) "
            "then start 16 bytes into a cache line, and the kernels' steps ran 11-20% slower "
            "(README, \"CPU: preload tcmalloc\"). The vllm-mindspore command preloads it itself, "
            "and scripts/ray_cluster.py for the workers of a Ray node it starts; "
            f"for an offline script, {fix}. VLLM_MS_CPU_TCMALLOC=0 silences this warning.")


def tcmalloc_preload(environ: Mapping[str, str]) -> str | None:
    """The LD_PRELOAD, tcmalloc first, for a CPU process started with `environ`; None when it needs
    none: tcmalloc is preloaded already, VLLM_MS_CPU_TCMALLOC=0, or it is not installed."""
    from vllm_mindspore import envs

    preloaded = environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preloaded or not envs.flag_in(environ, "VLLM_MS_CPU_TCMALLOC"):
        return None
    library = installed_tcmalloc()
    return ":".join(filter(None, [library, preloaded])) if library else None


def preload_tcmalloc() -> None:
    """On CPU, runs this command again with tcmalloc preloaded (`tcmalloc_preload`). MindSpore
    allocates its CPU tensors with malloc, and glibc's start 16 bytes into a cache line;
    tcmalloc's on one, which the kernels' 64-byte loads and AMX tile rows read as one line instead
    of two (README, "CPU: preload tcmalloc"). The same process id runs on (execve), with the
    workers it starts inheriting it."""
    from vllm_mindspore.device import CPU, detect_device

    preload = tcmalloc_preload(os.environ)
    if preload is None or detect_device() != CPU:
        return
    env = dict(os.environ, LD_PRELOAD=preload)
    os.execve(sys.executable, [sys.executable, "-m", "vllm_mindspore.cli", *sys.argv[1:]], env)


def main() -> None:
    set_env_defaults()
    check_environment()
    preload_tcmalloc()
    if sys.argv[1:2] == ["models"]:
        from model_backends import describe_registry, select_backend

        print(describe_registry())
        backend = select_backend()
        print(f"\nselected backend: {backend.name} ({backend.reason})")
        return
    from vllm.entrypoints.cli.main import main as vllm_main

    from vllm_mindspore import patches

    if sys.argv[1:2] == ["serve"]:
        patches.enable_api_server_patches()
    sys.argv[0] = "vllm-mindspore"
    try:
        vllm_main()
    finally:
        if patches.engine_failed():
            # Raised from `finally`, this also replaces a SystemExit(0) from vLLM.
            sys.exit("vllm-mindspore: the engine stopped after an error (see the log above); "
                     "exiting with status 1.")


if __name__ == "__main__":
    main()
