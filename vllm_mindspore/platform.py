"""MindSporePlatform: tells vLLM how to run on MindSpore (Ascend NPUs or plain CPUs).

vLLM's own torch code only ever sees the CPU: models, KV cache and collectives live in MindSpore,
so `device_type`/`device_name` stay "cpu" (vLLM builds `torch.device(...)` from them) on both
devices. What differs per device is the Ray resource key and the default block size.
"""

import glob
import os

import psutil
import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from model_backends.contract import Precision
from vllm_mindspore import envs
from vllm_mindspore.device import ASCEND, CPU, detect_device
from vllm_mindspore.patches import apply_patches
from vllm_mindspore.scoped import ScopedSetting

logger = init_logger("vllm.vllm_mindspore.platform")

apply_patches()

DEVICE = detect_device()
_kernel_device: ScopedSetting[str | None] = ScopedSetting(None)


def kernel_device() -> str:
    """The device whose kernels the ops/ cells choose when they are built: DEVICE, except inside
    `building_for` (the Ascend graph check compiles Ascend graphs on CPU)."""
    return _kernel_device.value or DEVICE


def building_for(device: str):
    """Cells built in this block choose `device`'s kernels (and cache layouts)."""
    return _kernel_device.using(device)


def visible_npus() -> int:
    """NPUs this node may use: ASCEND_RT_VISIBLE_DEVICES when set, else the device nodes."""
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return len(glob.glob("/dev/davinci[0-9]*"))


def cpu_flags() -> list[str]:
    """The CPU's feature flags, as /proc/cpuinfo lists them."""
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line for line in cpuinfo if line.startswith("flags")), "").split()


def cpu_has_bfloat16_dot() -> bool:
    """AVX512-BF16 (vdpbf16ps), which the CPU kernels' bfloat16 matmul is written for."""
    return "avx512_bf16" in cpu_flags()


def cpu_has_amx() -> bool:
    """AMX-BF16 tiles, which the bfloat16 matmul uses where it can (VLLM_MS_CPU_AMX)."""
    return "amx_bf16" in cpu_flags()


def precision_for(model_dtype: torch.dtype, device: str) -> Precision:
    """The model's dtype everywhere, except --dtype bfloat16 on CPU: MindSpore's CPU kernels have
    no bfloat16 Reshape, Gather or Sub, so the graph computes in float32 (activations, norms,
    attention) and the dense projections take bfloat16 weights and round their inputs to bfloat16
    (the plugin's matmul on AMX tiles or AVX512-BF16, float32 sums); the KV cache is bfloat16: a
    bfloat16 model's speed, with fewer roundings than torch's."""
    bfloat16_on_cpu = device == CPU and model_dtype == torch.bfloat16
    return Precision(compute=torch.float32 if bfloat16_on_cpu else model_dtype,
                     bfloat16_weights=bfloat16_on_cpu, kv_cache=model_dtype)


def check_dtype_for_device(device: str, dtype: str) -> None:
    """CPU computes in float32 or float16, and bfloat16 as `precision_for` says (on
    CPUs with AVX512-BF16); Ascend's fused cache, attention and rope kernels take bfloat16 or
    float16 only."""
    if device == CPU and dtype == "bfloat16" and not cpu_has_bfloat16_dot():
        raise ValueError(
            "--dtype bfloat16 on CPU needs AVX512-BF16 (the avx512_bf16 flag in /proc/cpuinfo), "
            "which this CPU lacks. Use --dtype float32 (or float16); bfloat16 checkpoints are "
            "cast on load.")
    if device == ASCEND and dtype == "float32":
        raise ValueError(
            "--dtype float32 is not supported on Ascend: the fused KV-cache, attention and rope "
            "kernels take bfloat16 or float16. Use --dtype bfloat16 (or float16, or auto: "
            "float32 checkpoints then run in bfloat16).")


def check_world_fits_devices(local_world_size: int, device: str, npus: int) -> None:
    """Each local rank drives one NPU: more ranks than NPUs on a node cannot start."""
    if device == ASCEND and local_world_size > npus:
        raise ValueError(
            f"This node runs {local_world_size} ranks (tensor_parallel_size x "
            f"data_parallel_size_local) but sees {npus} NPU(s) (ASCEND_RT_VISIBLE_DEVICES / "
            "/dev/davinci*). Lower the parallel sizes, or spread the ranks over more nodes "
            "(Ray, or --data-parallel-size-local with --headless secondaries).")


# --quantization methods the worker implements: W8A8 checkpoints in msModelSlim's layout
# (`ascend`) and MindSpore golden-stick's (`golden-stick`); docs/quantization.md.
SUPPORTED_QUANTIZATION: tuple[str, ...] = ("ascend", "golden-stick")


def unsupported_features(vllm_config) -> list[str]:
    """What the configuration asks for that the plugin's worker cannot do, each with the flag
    that asked for it. Refused at start-up: served anyway, each would crash a step mid-serve or
    answer silently wrong (an adapter, draft model, quantization or cache dtype ignored)."""
    found = []
    model_config = vllm_config.model_config
    if vllm_config.lora_config is not None:
        found.append("LoRA adapters (--enable-lora): merge the adapter into the checkpoint")
    if vllm_config.speculative_config is not None:
        found.append("speculative decoding (--speculative-config)")
    if model_config is not None:
        if model_config.runner_type != "generate":
            found.append(f"the {model_config.runner_type!r} runner (--runner/--convert: "
                         "embedding, classification, scoring, reward): only text generation "
                         "is implemented")
        if model_config.quantization not in (None, *SUPPORTED_QUANTIZATION):
            found.append(f"quantization {model_config.quantization!r} (--quantization or a "
                         "quantized checkpoint): W8A8 checkpoints are served with --quantization "
                         "ascend or golden-stick (docs/quantization.md); otherwise use a "
                         "float32/float16/bfloat16 checkpoint")
        if getattr(model_config, "enable_prompt_embeds", False):
            found.append("prompt embeddings (--enable-prompt-embeds)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(model_config.dtype).removeprefix("torch.") if model_config else None
    if cache_dtype not in ("auto", model_dtype):
        found.append(f"--kv-cache-dtype {cache_dtype}: the KV cache is kept in the model's dtype")
    return found


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "tekken.json")


def check_tokenizer_present(model_config) -> None:
    """A local model folder with no tokenizer file at all fails later in transformers with a
    misleading message (about sentencepiece/tiktoken); say what is missing, and where."""
    if model_config is None or model_config.skip_tokenizer_init:
        return
    folder = model_config.tokenizer
    if not folder or not os.path.isdir(folder):
        return  # a hub id, or a path vLLM reports itself
    names = os.listdir(folder)
    if any(name in TOKENIZER_FILES or name.endswith((".tiktoken", ".model")) for name in names):
        return
    raise ValueError(
        f"No tokenizer in {folder!r}: none of {', '.join(TOKENIZER_FILES)} is there. Copy the "
        "model's tokenizer files into the folder, pass --tokenizer with a folder that has them, "
        "or --skip-tokenizer-init to send and receive token ids only.")


def check_supported_features(vllm_config) -> None:
    found = unsupported_features(vllm_config)
    if found:
        raise NotImplementedError("vllm-mindspore does not support " + "; ".join(found) + ".")


def check_quantization_flag(model_config) -> None:
    """A W8A8 checkpoint (a description file beside its weights) served without --quantization
    is refused here, naming the flag, instead of failing later on its int8 tensors."""
    from model_backends.native.quant_config import unflagged_checkpoint_error

    if model_config is None or model_config.quantization is not None:
        return
    error = unflagged_checkpoint_error(model_config.model)
    if error:
        raise ValueError(error)


class MindSporePlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    # Ray places one worker per bundle of this resource. "NPU" is Ray's built-in Ascend
    # accelerator (it then sets ASCEND_RT_VISIBLE_DEVICES itself).
    ray_device_key: str = "NPU"
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    dist_backend: str = "gloo"  # vLLM's own (control-plane) torch.distributed groups
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        if DEVICE == ASCEND:  # the first is what --dtype auto picks for float32 checkpoints
            return [torch.bfloat16, torch.float16]
        # auto keeps float32 on CPU (bfloat16 checkpoints are cast on load): bfloat16 here would
        # make it the default for bfloat16 checkpoints; --dtype bfloat16 asks for it.
        return [torch.float32, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "Ascend NPU (MindSpore)" if DEVICE == ASCEND else "CPU (MindSpore)"

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return f"mindspore-{DEVICE.lower()}-{device_id}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return psutil.virtual_memory().total

    @classmethod
    def set_device(cls, device) -> None:
        pass

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # Only consulted by vLLM's torch model code, which this plugin never runs.
        return "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def verify_model_arch(cls, model_arch: str) -> None:
        # Resolved by model_backends when the worker builds the model, with a clear error there.
        pass

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM's check of VLLM_* variables, knowing the plugin's own (vllm_mindspore/envs.py),
        whose values are also checked (set or not, whatever their prefix): a bad one is an
        error naming the variable."""
        from vllm import envs as vllm_envs

        envs.check_all()
        for name in os.environ:
            if not name.startswith("VLLM_") or name in vllm_envs.environment_variables:
                continue
            known = envs.ALIASES.get(name, name)
            if known in envs.ENVIRONMENT_VARIABLES or known in envs.INTERNAL_VARIABLES:
                continue
            if hard_fail:
                raise ValueError(f"Unknown vLLM environment variable detected: {name}")
            logger.warning("Unknown vLLM environment variable detected: %s", name)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """The W8A8 methods join vLLM's quantization registry (`--quantization ascend` /
        `golden-stick`; vLLM calls this before it builds any model config, with or without a
        parser). With a MindFormers YAML, its parallel_config (and block_size) become the CLI's
        defaults, so an explicit flag such as --tensor-parallel-size overrides model_parallel."""
        from model_backends.native.quant_config import register_with_vllm

        register_with_vllm()
        if parser is None or not envs.MINDFORMERS_MODEL_CONFIG:
            return
        from model_backends import MINDFORMERS, select_backend
        from model_backends.mindformers import CLI_DEFAULTS_APPLIED_ENV, load_yaml
        from vllm_mindspore.config import parser_defaults

        if select_backend().name != MINDFORMERS:
            return
        # vLLM calls this at the end of EngineArgs.add_cli_args with the parser it filled.
        parser.set_defaults(**parser_defaults(load_yaml()))
        os.environ[CLI_DEFAULTS_APPLIED_ENV] = "1"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        from model_backends import MINDFORMERS, check_model_servable, select_backend

        backend = select_backend()
        logger.info("Model backend: %s (%s)", backend.name, backend.reason)
        if backend.name == MINDFORMERS:
            from model_backends.mindformers import CLI_DEFAULTS_APPLIED_ENV, configure

            configure(vllm_config, logger, os.environ.get(CLI_DEFAULTS_APPLIED_ENV) == "1")
        elif envs.MINDFORMERS_MODEL_CONFIG:
            logger.warning("MINDFORMERS_MODEL_CONFIG is ignored: the %s backend was chosen (%s).",
                           backend.name, backend.reason)

        # MindSpore hangs in children forked after it ran an op: every vLLM child is spawned.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError(
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}: vllm-mindspore does "
                "not implement pipeline parallelism. Use --tensor-parallel-size (and "
                "--data-parallel-size) to spread the model.")
        if parallel.distributed_executor_backend != "ray":  # Ray places ranks across nodes
            check_world_fits_devices(
                parallel.tensor_parallel_size * parallel.pipeline_parallel_size
                * (parallel.data_parallel_size_local or 1), DEVICE,
                visible_npus() if DEVICE == ASCEND else 0)
        if parallel.worker_cls == "auto":
            parallel.worker_cls = "vllm_mindspore.worker.worker.MindSporeWorker"

        # The model is a MindSpore graph: no torch.compile, no CUDA graphs.
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        # Synchronous steps: async scheduling, with the runner's steps on a thread of their own
        # so the engine's scheduling and output work overlap the graphs, was measured on 2 vCPUs
        # at 0.985x the batch-1 time and 0.975x the offline throughput (docs/benchmarks.md): the
        # engine's thread takes a core from the kernels' threads.
        vllm_config.scheduler_config.async_scheduling = False

        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = 128 if DEVICE == ASCEND else 16

        model_config = vllm_config.model_config
        if model_config is not None:
            check_dtype_for_device(DEVICE, str(model_config.dtype).removeprefix("torch."))
            check_model_servable(model_config, backend.name)
        check_supported_features(vllm_config)
        check_quantization_flag(model_config)
        check_tokenizer_present(model_config)
        logger.info(
            "MindSpore platform on %s: worker=%s executor=%s tp=%d dp=%d block_size=%d",
            DEVICE, parallel.worker_cls, parallel.distributed_executor_backend,
            parallel.tensor_parallel_size, parallel.data_parallel_size, cache.block_size,
        )
