"""Every environment variable the plugin reads, with its default and meaning.

Values are read when accessed (module attribute), so a variable set after import still counts.
"""

import os
from collections.abc import Callable, Mapping
from typing import Any


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _flag(name: str, default: str = "0") -> Callable[..., bool]:
    def read(environ: Mapping[str, str] = os.environ) -> bool:
        value = environ.get(name, default).strip().lower()
        if value not in _TRUE + _FALSE:
            raise ValueError(f"{name}={environ[name]!r} is not a boolean: use 1 or 0 (also "
                             "true/false, yes/no, on/off).")
        return value in _TRUE

    return read


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _first_set(*names: str) -> Callable[[], str | None]:
    return lambda: next((os.environ[n] for n in names if os.environ.get(n)), None)


def _choice(name: str, choices: tuple[str, ...], default: str) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name, default).strip()
        if value.lower() not in (c.lower() for c in choices):
            raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}.")
        return value

    return read


def _positive_number(name: str, default: str | None) -> Callable[[], float | None]:
    def read() -> float | None:
        value = os.environ.get(name, default or "").strip()
        if not value:
            return None
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if number <= 0:
            raise ValueError(f"{name}={value!r} is not a number > 0"
                             + ("; unset it to use the default." if default is None else "."))
        return number

    return read


# name -> (its reader: the current environment, or a flag's from `environ` as well; its doc)
ENVIRONMENT_VARIABLES: dict[str, tuple[Callable[..., Any], str]] = {
    "VLLM_MS_DISABLE_PLATFORM": (
        _flag("VLLM_MS_DISABLE_PLATFORM"),
        "1: the platform entry point stays inactive (vLLM falls back to its own platform detection).",
    ),
    "VLLM_MS_DEVICE": (
        _choice("VLLM_MS_DEVICE", ("auto", "Ascend", "CPU"), "auto"),
        "auto | Ascend | CPU. auto picks Ascend when /dev/davinci* devices exist, else CPU.",
    ),
    "VLLM_MS_CPU_KVCACHE_SPACE": (
        _positive_number("VLLM_MS_CPU_KVCACHE_SPACE", None),
        "KV-cache size in GiB per worker on CPU (like vLLM's VLLM_CPU_KVCACHE_SPACE). "
        "Unset: --kv-cache-memory-bytes if given, else gpu_memory_utilization x free memory, "
        "capped at 4 GiB.",
    ),
    "VLLM_MS_CPU_AMX": (
        _flag("VLLM_MS_CPU_AMX", "1"),
        "CPU, --dtype bfloat16: 1 (default) runs the dense matmuls and the prefill chunks' "
        "attention on AMX tiles where the CPU has them (Intel Sapphire Rapids and later; "
        "attention then rounds the scaled queries and the softmax numerators to bfloat16, on "
        "every row); 0 keeps the AVX512-BF16 kernels.",
    ),
    "VLLM_MS_CPU_LAYER_KERNEL": (
        _flag("VLLM_MS_CPU_LAYER_KERNEL", "1"),
        "CPU: 1 (default) runs the decoder layers of the Llama-family models (Llama, Qwen2, "
        "Qwen3, and Qwen3-MoE with its router and experts) as one operator where it can (float "
        "weights, one tensor-parallel and expert-parallel rank; each run of consecutive such "
        "layers one operator), and DeepSeek-V3's attention after its projections (the latent's "
        "norm, both ropes, the absorbed matmuls and the MLA attention; float32 activations) as "
        "one operator; 0 runs their parts as separate operators (the same kernels for the "
        "Llama family, bit-identical; MindSpore's for DeepSeek's, for comparison).",
    ),
    "VLLM_MS_CPU_TCMALLOC": (
        _flag("VLLM_MS_CPU_TCMALLOC", "1"),
        "CPU: 1 (default) runs the vllm-mindspore command again with tcmalloc preloaded "
        "(LD_PRELOAD) where the system has libtcmalloc_minimal.so.4 and nothing preloads it "
        "already: MindSpore's tensors then start on a cache line (README, \"CPU: preload "
        "tcmalloc\"), and scripts/ray_cluster.py preloads it for a CPU node's Ray processes; "
        "0 keeps glibc's malloc. Offline scripts preload it themselves (a CPU engine without "
        "it logs a warning; 0 silences it).",
    ),
    "VLLM_MS_CPU_BF16_WIDEN": (
        _choice("VLLM_MS_CPU_BF16_WIDEN", ("auto", "1", "0"), "auto"),
        "CPU, --dtype bfloat16, without AMX: 1 widens the bfloat16 weights to float32 and "
        "multiplies them with float32 FMAs (activations not rounded); 0 multiplies them with "
        "AVX512-BF16's vdpbf16ps (activations rounded to bfloat16); auto (default) takes the one "
        "measured faster on this CPU at start-up (widening on Intel's AVX512-BF16 cores, where "
        "vdpbf16ps runs at half the FMAs' rate). Set 1 or 0 for the same numerics on every host.",
    ),
    "VLLM_MODEL_BACKEND": (
        _first_set("vLLM_MODEL_BACKEND", "VLLM_MODEL_BACKEND", "VLLM_MS_MODEL_BACKEND"),
        "Model backend: MindFormers or Native (case-insensitive); read from vLLM_MODEL_BACKEND "
        "(the spelling in the user docs) or VLLM_MS_MODEL_BACKEND. Unset: automatic.",
    ),
    "MINDFORMERS_MODEL_CONFIG": (
        _str("MINDFORMERS_MODEL_CONFIG"),
        "Path of a MindFormers predict YAML (parallel_config, model.model_config).",
    ),
    "VLLM_MS_COMM_TIMEOUT": (
        _positive_number("VLLM_MS_COMM_TIMEOUT", "120"),
        "Seconds a rank waits for its peers when MindSpore's collective communication starts "
        "(tensor/expert parallel) before failing with an error.",
    ),
    "VLLM_MS_LOG_STEPS": (
        _flag("VLLM_MS_LOG_STEPS"),
        "1: log every model step (batch shape, graph compile count, milliseconds).",
    ),
}


# Other spellings of a variable above (read by its getter).
ALIASES = {"vLLM_MODEL_BACKEND": "VLLM_MODEL_BACKEND", "VLLM_MS_MODEL_BACKEND": "VLLM_MODEL_BACKEND"}

# The project's own variables that are not settings of the plugin, known to vLLM's check: set by
# the plugin for its child processes, or read by the test suite.
INTERNAL_VARIABLES = (
    "VLLM_MS_YAML_CLI_DEFAULTS_APPLIED",  # model_backends/mindformers.py
    "VLLM_MS_SCHEDULER_PARENT", "VLLM_MS_SCHEDULER_DEVICE",  # distributed/communication.py
    "VLLM_MS_RUN_SLOW",  # tests: also run the slow tests
    "VLLM_MS_VENV",  # scripts/install.sh and the Makefile: where the environment lives
)


def check_all() -> None:
    """Read every variable above: a malformed value raises ValueError naming the variable
    (the model backend's name included)."""
    for read, _ in ENVIRONMENT_VARIABLES.values():
        read()
    from model_backends import select_backend

    select_backend()


def flag_in(environ: Mapping[str, str], name: str) -> bool:
    """The flag `name` (a boolean above) as a process started with `environ` reads it."""
    return ENVIRONMENT_VARIABLES[name][0](environ)


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(ENVIRONMENT_VARIABLES)
