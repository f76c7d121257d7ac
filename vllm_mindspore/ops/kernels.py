"""The plugin's C++ CPU kernels, built on first use and loaded as MindSpore AOT custom ops.

MindSpore registers no fused LLM kernel on CPU, and a chain of its small ops costs a few
microseconds of dispatch each plus a copy per intermediate; the hot spots (paged attention, the
dense projections, the MoE experts, norms, rotary embeddings) are therefore one C++ operator
each (`csrc/`), called from the graph through `ops.Custom(func_type="aot")`. The library is compiled once per source, compiler and CPU
(`-O3 -march=native`) into `~/.cache/vllm-mindspore/kernels/` and reused; several
processes building at once each write their own file and rename it into place.
"""

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile

from vllm.logger import init_logger

logger = init_logger("vllm.vllm_mindspore.kernels")

_SOURCES = ("paged_attention.cc", "linear.cc", "moe.cc", "norm_rope.cc", "quant.cc",
            "sampling.cc", "decoder_layer.cc")
_HEADERS = ("common.h", "gemm.h", "parallel.h")
# The library's flags and sources' folder (tests build small programs of their own from them).
COMPILE_FLAGS = ("-std=c++17", "-O3", "-march=native", "-ffp-contract=fast", "-pthread",
                 "-shared", "-fPIC")
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _cache_dir() -> str:
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")),
                        "vllm-mindspore", "kernels")


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(CSRC, name), "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(COMPILE_FLAGS).encode())
    digest.update(subprocess.run([compiler, "--version"], capture_output=True, check=True).stdout)
    with open("/proc/cpuinfo", "rb") as f:  # -march=native: a library per CPU model
        digest.update(next((line for line in f if line.startswith(b"flags")), b""))
    return digest.hexdigest()[:16]


@functools.cache
def library_path() -> str:
    """Path of the compiled kernel library, building it if this source/CPU has none yet."""
    compiler = os.environ.get("CXX", "g++")
    try:
        key = _build_key(compiler)
    except (OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(f"vllm-mindspore builds its CPU kernels with a C++17 compiler, and "
                           f"{compiler!r} is not usable ({error}). Install g++ (Debian/Ubuntu: "
                           "apt-get install g++) or point CXX at one.") from error
    path = os.path.join(_cache_dir(), f"libvllm_ms_kernels-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(_cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
    os.close(fd)
    cmd = [compiler, *COMPILE_FLAGS, "-o", tmp, *(os.path.join(CSRC, s) for s in _SOURCES)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"Building vllm-mindspore's CPU kernels failed:\n{' '.join(cmd)}\n"
                           f"{result.stderr[-4000:]}")
    os.replace(tmp, path)
    logger.info("Built CPU kernels: %s", path)
    return path


def set_num_threads(num_threads: int) -> None:
    """Threads each kernel call may use (the worker's share of the host's cores)."""
    ctypes.CDLL(library_path()).SetNumThreads(int(num_threads))


def use_amx(wanted: bool) -> bool:
    """Let the bfloat16 matmul use AMX tiles where the CPU has them (VLLM_MS_CPU_AMX) -> whether
    it will (the CPU has AMX, the kernels were built for it and Linux granted its state)."""
    return bool(ctypes.CDLL(library_path()).UseAmx(int(wanted)))


def widen_bfloat16(setting: bool | None = None) -> bool:
    """Whether the bfloat16 matmul widens its weights to float32 for FMAs (True), multiplies them
    with vdpbf16ps (False), or (None, the default) does whichever it measures faster on this CPU
    -> whether it widens. AMX, where it runs, takes steps of more than 4 rows either way."""
    return bool(ctypes.CDLL(library_path()).WidenBf16(-1 if setting is None else int(setting)))


def custom_op(function: str, out_shape, out_dtype):
    """`ops.Custom` running `function` of the kernel library; out_shape/out_dtype map the input
    shapes/dtypes to the output's."""
    from mindspore import ops

    return ops.Custom(f"{library_path()}:{function}", out_shape=out_shape, out_dtype=out_dtype,
                      func_type="aot")
