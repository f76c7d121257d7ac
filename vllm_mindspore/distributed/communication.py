"""MindSpore collective communication brought up from vLLM's own ranks, without msrun.

vLLM gives every worker its rank, the world size and a gloo process group. From those, rank 0
picks a free port and shares it over gloo, starts MindSpore's cluster scheduler (a fresh
interpreter, killed by the kernel if rank 0 dies), and every rank joins as an `MS_WORKER`
before calling `mindspore.communication.init()` (HCCL on Ascend, mccl on CPU). A peer that never
arrives makes `init()` fail after `VLLM_MS_COMM_TIMEOUT` seconds instead of hanging.
"""

import atexit
import os
import socket
import subprocess
import sys
import threading
import time

from vllm.logger import init_logger

from vllm_mindspore import envs

logger = init_logger("vllm.vllm_mindspore.communication")

_scheduler: subprocess.Popen | None = None
_tp_group: str | None = None  # MindSpore group of this rank's tensor-parallel ranks

# Runs in a fresh interpreter: never a fork of a process that has run MindSpore.
_SCHEDULER_PROGRAM = r"""
import ctypes, os, signal, sys
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with rank 0
if os.getppid() != int(os.environ["VLLM_MS_SCHEDULER_PARENT"]):
    sys.exit(0)
import mindspore as ms
ms.set_device(os.environ["VLLM_MS_SCHEDULER_DEVICE"])
from mindspore.communication import init
init()
"""


def expert_parallel_across_dp(vllm_config) -> bool:
    """MoE experts sharded over the ranks of several data-parallel engines: MindSpore's world
    is then vLLM's whole world, and every engine steps with the same token count."""
    parallel = vllm_config.parallel_config
    return (parallel.enable_expert_parallel and vllm_config.model_config.is_moe
            and parallel.data_parallel_size > 1)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _share_from_rank0(value: int, rank: int, cpu_group) -> int:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(tensor, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
    return int(tensor.item())


def _start_scheduler(host: str, port: int, world_size: int, device: str) -> None:
    global _scheduler
    env = {k: v for k, v in os.environ.items() if k != "MS_NODE_ID"}
    env.update(MS_ROLE="MS_SCHED", MS_SCHED_HOST=host, MS_SCHED_PORT=str(port),
               MS_WORKER_NUM=str(world_size), VLLM_MS_SCHEDULER_PARENT=str(os.getpid()),
               VLLM_MS_SCHEDULER_DEVICE=device, GLOG_v=env.get("GLOG_v", "3"))
    _scheduler = subprocess.Popen([sys.executable, "-c", _SCHEDULER_PROGRAM], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, close_fds=True)
    threading.Thread(target=_watch_scheduler, args=(_scheduler, host, port), daemon=True,
                     name="vllm-ms-scheduler-watch").start()


def _watch_scheduler(scheduler: subprocess.Popen, host: str, port: int) -> None:
    """The scheduler holds MindSpore's cluster together; without it every rank's collectives
    are lost and MindSpore ends the ranks silently some 30 s later. Its death before our own
    shutdown stops this rank at once with the cause, which makes vLLM stop the engine."""
    code = scheduler.wait()
    if _scheduler is not scheduler:  # shutdown_communication() stopped it
        return
    logger.error("MindSpore's communication scheduler (pid %d, %s:%d) exited with status %s: "
                 "collective communication between the ranks is lost. Stopping rank 0 so that "
                 "vLLM shuts the engine down.", scheduler.pid, host, port, code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def init_communication(rank: int, world_size: int, cpu_group, host: str, device: str,
                       tp_ranks: list[int]) -> None:
    """Join MindSpore's collective world as `rank` of `world_size` (call after MindSpore's
    device is set). `cpu_group` is vLLM's gloo group over the same ranks; `tp_ranks` are this
    rank's tensor-parallel peers in that world (a subgroup when the world spans several
    data-parallel engines)."""
    global _tp_group
    if world_size == 1:
        return
    start = time.perf_counter()
    port = _share_from_rank0(_free_port(host) if rank == 0 else 0, rank, cpu_group)
    if rank == 0:
        _start_scheduler(host, port, world_size, device)
    timeout = str(int(envs.VLLM_MS_COMM_TIMEOUT))
    os.environ.update(MS_ROLE="MS_WORKER", MS_SCHED_HOST=host, MS_SCHED_PORT=str(port),
                      MS_WORKER_NUM=str(world_size), MS_NODE_ID=str(rank),
                      MS_TOPO_TIMEOUT=timeout, MS_NODE_TIMEOUT=timeout)
    from mindspore.communication import get_group_size, get_rank, init

    try:
        init()
    except RuntimeError as error:
        raise RuntimeError(
            f"MindSpore collective communication did not come up for rank {rank} of "
            f"{world_size} (scheduler {host}:{port}) within {timeout}s: a peer did not arrive or "
            f"died. Raise VLLM_MS_COMM_TIMEOUT if ranks start slowly. Cause: {error}") from error
    if (get_rank(), get_group_size()) != (rank, world_size):
        raise RuntimeError(f"MindSpore assigned rank {get_rank()} of {get_group_size()}, "
                           f"vLLM expected rank {rank} of {world_size}.")
    if 1 < len(tp_ranks) < world_size:
        from mindspore.communication import create_group

        _tp_group = "tp_" + "_".join(map(str, tp_ranks))
        create_group(_tp_group, list(tp_ranks))
    # MindSpore's exit-time finalize waits for the scheduler and every peer; after vLLM's own
    # shutdown that wait can only hang, so the process leaves directly (registered last: runs
    # first), with a failure status if an exception went uncaught.
    sys.excepthook = _failing(sys.excepthook)
    atexit.register(_exit_now)
    logger.info("MindSpore communication up: rank %d of %d via %s:%d in %.1f s", rank,
                world_size, host, port, time.perf_counter() - start)


def tp_group() -> str:
    """MindSpore group name for tensor-parallel collectives."""
    if _tp_group is not None:
        return _tp_group
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


def sized_collective(primitive_cls, size: int, group: str | None = None):
    """A MindSpore AllGather/ReduceScatter over `group` (default: the world) of `size` ranks.
    In a running world `size` is what the group reports; it is set explicitly so that graphs
    built for a parallel layout without a communication world (the Ascend graph check) infer
    the gathered/scattered shapes of that layout."""
    from mindspore.communication import GlobalComm

    primitive = primitive_cls(group=group or GlobalComm.WORLD_COMM_GROUP)
    primitive.rank_size = size
    primitive.add_prim_attr("rank_size", size)
    return primitive


_exit_status = 0


def _failing(excepthook):
    def hook(*args):
        global _exit_status
        _exit_status = 1
        excepthook(*args)

    return hook


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


def shutdown_communication() -> None:
    """Stop the scheduler started by rank 0 (not waited for: it waits for the workers)."""
    global _scheduler
    scheduler, _scheduler = _scheduler, None  # first: its watcher then knows the exit is ours
    if scheduler is not None:
        scheduler.kill()
