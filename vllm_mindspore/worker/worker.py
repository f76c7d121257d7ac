"""MindSporeWorker: the WorkerBase surface vLLM's engine core calls, one per rank."""

import os

import psutil
import torch
from vllm.logger import init_logger
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_mindspore import envs
from vllm_mindspore.cli import missing_tcmalloc_warning
from vllm_mindspore.distributed.communication import (expert_parallel_across_dp,
                                                       init_communication, shutdown_communication)
from vllm_mindspore.platform import ASCEND, DEVICE, precision_for

logger = init_logger("vllm.vllm_mindspore.worker")

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_CAP = 4 * GiB


def _host_of(init_method: str) -> str:
    """The host of vLLM's `tcp://host:port` init method (rank 0's node), else loopback."""
    if init_method and init_method.startswith("tcp://"):
        return init_method[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1"


def init_mindspore(device_index: int, cpu_threads: int, bfloat16_weights: bool) -> None:
    """MindSpore for this rank: graph mode; on Ascend the kernel-by-kernel runtime with
    infer_boost (which selects the fused inference kernels and feeds them the per-request
    lengths by graph-input name); on CPU this rank's share of the cores for MindSpore's op
    threads and the plugin's kernels (MindSpore's default, 25 op threads, oversubscribes small
    hosts), and how the matmuls of bfloat16 weights run: AMX tiles where the CPU has them,
    else widened to float32 FMAs or on vdpbf16ps, whichever is faster here."""
    os.environ.setdefault("GLOG_v", "3")  # read once, at `import mindspore`
    import mindspore as ms

    if DEVICE == ASCEND:
        ms.set_device("Ascend", device_index)
        ms.set_context(mode=ms.GRAPH_MODE, jit_config={"jit_level": "O0", "infer_boost": "on"})
        return
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.device_context.cpu.op_tuning.threads_num(cpu_threads)
    from vllm_mindspore.ops import kernels

    kernels.set_num_threads(cpu_threads)
    # torch only samples here (argmax / top-k over [reqs, vocab]). Its OpenMP workers spin for
    # milliseconds after each op (libgomp's default wait policy) and take a core from the next
    # step's kernels: 13% of a 64-token decode step's CPU time on 2 cores, whole runs -17% with one
    # torch thread. Unconditional, unlike vLLM's `set_torch_threads_for_runtime()` (which keeps
    # a user's OMP_NUM_THREADS): OMP_NUM_THREADS is set for the host's OpenMP programs, and the
    # model's kernels here use their own pool (`kernels.set_num_threads`), not OpenMP.
    torch.set_num_threads(1)
    with open("/proc/self/maps") as maps:
        warning = missing_tcmalloc_warning(maps.read())
    if warning:
        logger.warning(warning)
    amx = kernels.use_amx(envs.VLLM_MS_CPU_AMX)
    if not bfloat16_weights:
        return
    widen = envs.VLLM_MS_CPU_BF16_WIDEN
    widened = kernels.widen_bfloat16(None if widen == "auto" else widen == "1")
    if amx:
        logger.info("CPU kernels: bfloat16 matmuls on AMX tiles (VLLM_MS_CPU_AMX=0: AVX512-BF16)")
    elif widened:
        logger.info("CPU kernels: bfloat16 weights widened to float32 for FMAs (%s; "
                    "VLLM_MS_CPU_BF16_WIDEN=0: vdpbf16ps)",
                    "measured faster here" if widen == "auto" else "VLLM_MS_CPU_BF16_WIDEN=1")


class MindSporeWorker(WorkerBase):
    def init_device(self) -> None:
        from vllm.distributed import (ensure_model_parallel_initialized,
                                      init_distributed_environment)

        self.device = torch.device("cpu")
        parallel = self.parallel_config
        # vLLM's own process groups (gloo) carry control-plane traffic between ranks.
        init_distributed_environment(parallel.world_size, self.rank, self.distributed_init_method,
                                     self.local_rank, "gloo")
        ensure_model_parallel_initialized(parallel.tensor_parallel_size,
                                          parallel.pipeline_parallel_size)
        init_mindspore(parallel.get_local_gpu_index(self.local_rank),
                       max(1, len(os.sched_getaffinity(0)) // parallel.local_world_size),
                       precision_for(self.model_config.dtype, DEVICE).bfloat16_weights)
        from vllm.distributed.parallel_state import get_tp_group, get_world_group

        tp = get_tp_group()
        if expert_parallel_across_dp(self.vllm_config):
            # Experts are dispatched across every DP x TP rank: MindSpore's world is vLLM's,
            # with each engine's TP ranks as a subgroup.
            group, host = get_world_group(), parallel.data_parallel_master_ip
        else:
            group, host = tp, _host_of(self.distributed_init_method)
        init_communication(group.rank_in_group, group.world_size, group.cpu_group, host, DEVICE,
                           [group.ranks.index(r) for r in tp.ranks])
        from vllm_mindspore.worker.model_runner import MindSporeModelRunner

        self.model_runner = MindSporeModelRunner(self.vllm_config)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm-mindspore does not support dummy weights (elastic EP scale-up).")
        self.model_runner.load_model()

    def get_model(self):
        return self.model_runner.backend

    def get_supported_tasks(self):
        return ("generate",)

    # ---- KV cache ----------------------------------------------------------------------------
    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # vLLM would otherwise ask its torch attention backends; our caches are MindSpore's.
        return ["LBNHC"]

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache of this worker.

        Explicit sizes win: --kv-cache-memory-bytes, then VLLM_MS_CPU_KVCACHE_SPACE (GiB, CPU).
        Otherwise the worker takes its share of `gpu_memory_utilization` of the device memory,
        minus what is already used; on CPU that share is capped at 4 GiB so a laptop-sized
        default does not claim the whole host.
        """
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit:
            return int(explicit)
        utilization = self.cache_config.gpu_memory_utilization
        if DEVICE == ASCEND:
            import mindspore as ms

            total = ms.hal.get_device_properties(self.local_rank).total_memory
            return int(total * utilization - ms.runtime.max_memory_allocated())
        if envs.VLLM_MS_CPU_KVCACHE_SPACE:
            return int(float(envs.VLLM_MS_CPU_KVCACHE_SPACE) * GiB)
        memory = psutil.virtual_memory()
        budget = ((memory.total * utilization - (memory.total - memory.available))
                  / self.parallel_config.local_world_size)
        if budget <= 0:
            raise ValueError(
                f"No host memory left for the KV cache: {memory.available / GiB:.1f} GiB available "
                f"of {memory.total / GiB:.1f} GiB at gpu_memory_utilization={utilization}. Set "
                "--kv-cache-memory-bytes or VLLM_MS_CPU_KVCACHE_SPACE (GiB).")
        return int(min(budget, DEFAULT_CPU_KV_CACHE_CAP))

    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=self.model_runner.warm_up(), encoder=0.0)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    # ---- execution ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return None

    def execute_dummy_batch(self) -> None:
        """An idle data-parallel engine's step while others run: MoE collectives need it."""
        self.model_runner.execute_dummy_batch()

    def profile(self, is_start: bool = True, profile_prefix=None):
        return None

    def add_lora(self, lora_request) -> bool:
        raise ValueError("LoRA is not supported by vllm-mindspore.")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self):
        return set()

    def check_health(self) -> None:
        return None

    def weight_bytes(self) -> int:
        """Bytes of model weights resident on this rank (KV cache excluded)."""
        return self.model_runner.backend.weight_bytes()

    def shutdown(self) -> None:
        shutdown_communication()
