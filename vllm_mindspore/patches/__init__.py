"""The one registry of monkey patches this plugin applies (to vLLM and torch here; to the
mindformers package in `patches.mindformers`).

Each patch names its target, why it is needed and the package and version it was written against.
`apply_patches()` is idempotent and runs in every vLLM process (general plugin entry point and
platform import); `SAMPLER_PATCHES` are applied by the model runner (the processes that sample)
and the mindformers group by the MindFormers model backend. A patch whose target no longer exists
fails loudly instead of silently skipping.
"""

import contextlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger("vllm.vllm_mindspore.patches")


@dataclass(frozen=True)
class Patch:
    target: str  # "module:attribute.path"
    reason: str
    package: str  # the distribution that owns the target
    version: str  # that distribution's version the patch was written against
    replacement: Callable[[object], object]  # original -> new value
    when: Callable[[], bool] = lambda: True


def _noop_when_no_accelerator(original):
    def empty_cache(*args, **kwargs):
        return None

    return empty_cache


def _no_accelerator() -> bool:
    import torch

    return not torch.accelerator.is_available()


_SHUTDOWN_REASON = (
    "vllm.distributed.parallel_state.cleanup_dist_env_and_memory() calls torch.accelerator's "
    "empty_cache() and empty_host_cache() on every non-CPU platform; with a CPU-only torch they "
    "raise at engine shutdown. Our models' memory is MindSpore's, not torch's.")

# The API server process of `vllm-mindspore serve` (set by vllm_mindspore.cli before vLLM runs):
# the patches that only concern the HTTP front end apply there, not in engine or worker processes.
_api_server = False
# Set when the API server stops because its engine died (read by vllm_mindspore.cli).
_engine_failed = False


def _in_api_server() -> bool:
    return _api_server


def engine_failed() -> bool:
    """The API server is stopping (or stopped) because its engine core died."""
    return _engine_failed


_shutting_down = False  # the API server asked its engine to stop (SIGTERM/SIGINT, exit)


def _record_engine_death(original):
    def terminate_if_errored(server, engine):
        global _engine_failed
        # After a requested shutdown the engine reads as errored too: that is no failure.
        if engine.errored and not engine.is_running and not _shutting_down:
            _engine_failed = True
        return original(server, engine)

    return terminate_if_errored


def _shutdown_ends_pending_requests(original):
    def shutdown(self, *args, **kwargs):
        global _shutting_down
        _shutting_down = True
        try:
            return original(self, *args, **kwargs)
        finally:
            # The engine is gone: every request still waiting for output ends with the error
            # vLLM uses for a dead engine, on the event loop that owns the request queues.
            handler = getattr(self, "output_handler", None)
            processor = getattr(self, "output_processor", None)
            if handler is not None and processor is not None:
                from vllm.v1.engine.exceptions import EngineDeadError

                try:
                    handler.get_loop().call_soon_threadsafe(processor.propagate_error,
                                                            EngineDeadError())
                except RuntimeError:  # the loop is already closed: no request is waiting
                    pass

    return shutdown


_ENGINE_DEATH_REASON = (
    "When the engine core dies (a worker crashed, a rank or its communication was lost, a step "
    "raised), vLLM's API server stops through terminate_if_errored() and then returns normally: "
    "`vllm serve` exits with status 0 after a crash. Recording the death lets "
    "`vllm-mindspore serve` exit non-zero, so supervisors and scripts see the failure. "
    "vllm_error imports the function by name, so both references are wrapped.")

PATCHES: list[Patch] = [
    Patch(target=f"torch.accelerator:{name}", reason=_SHUTDOWN_REASON, package="torch",
          version="2.13.0", replacement=_noop_when_no_accelerator, when=_no_accelerator)
    for name in ("empty_cache", "empty_host_cache")
] + [
    Patch(target=f"{module}:terminate_if_errored", reason=_ENGINE_DEATH_REASON,
          package="vllm", version="0.33.0", replacement=_record_engine_death, when=_in_api_server)
    for module in ("vllm.entrypoints.launchers.launcher",
                   "vllm.entrypoints.serve.exception_handling.handlers.vllm_error")
] + [
    Patch(target="vllm.v1.engine.async_llm:AsyncLLM.shutdown", reason=(
        "On SIGTERM/SIGINT the API server stops the engine (abort mode) and cancels the output "
        "handler; when the cancel wins the race against the handler noticing the dead engine, "
        "no in-flight request is told: their streams stay open and uvicorn waits for them "
        "('Waiting for connections to close') until every client gives up. The patched "
        "shutdown ends each pending request with EngineDeadError (an error event or a 500, as "
        "when the engine dies), so the server exits within seconds. It also records that the "
        "shutdown was asked for: the engine then reads as errored, and that must stay a clean "
        "exit (see terminate_if_errored)."),
          package="vllm", version="0.33.0", replacement=_shutdown_ends_pending_requests,
          when=_in_api_server),
]



def _sampling_noise_from_kernel(original):
    from vllm_mindspore.worker.sampling import with_kernel_noise

    return with_kernel_noise(original)


def _greedy_argmax_from_kernel(original):
    from vllm_mindspore.worker.sampling import greedy_argmax

    return staticmethod(greedy_argmax)


SAMPLER_PATCHES: list[Patch] = [
    Patch(target="vllm.v1.sample.sampler:Sampler.greedy_sample", reason=(
        "vLLM's sampler takes the greedy argmax with its C++ greedy_argmax only on its own CPU "
        "platform (absent from this vLLM build) and with torch's argmax elsewhere: 0.5 ms for "
        "64 rows x 8000 tokens on the worker's one torch thread, ~3% of a decode step. The "
        "replacement picks the same tokens (first maximum, first NaN) in the plugin's C++ "
        "kernel."), package="vllm", version="0.33.0", replacement=_greedy_argmax_from_kernel),
    Patch(target="vllm.v1.sample.ops.topk_topp_sampler:random_sample", reason=(
        "vLLM's sampler draws the exponential noise of random sampling with torch's "
        "exponential_(), ~1.2 ms for 8 rows x 8000 tokens on CPU (a tenth of a decode step; "
        "vLLM's CPU backend uses its C++ fused_gumbel_argmax instead, absent from this vLLM "
        "build). The replacement makes the same draw in the plugin's C++ kernel from one seed "
        "per row (the request's generator or torch's default one); float64 noise stays "
        "vLLM's."), package="vllm", version="0.33.0", replacement=_sampling_noise_from_kernel),
]

_applied: set[str] = set()
_originals: dict[str, object] = {}  # target -> the value the applied patch replaced


def _resolve(target: str):
    module_name, attr_path = target.split(":")
    owner = importlib.import_module(module_name)
    *parents, attr = attr_path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def enable_api_server_patches() -> None:
    """This process is `vllm-mindspore serve`'s API server: apply its patches too."""
    global _api_server
    _api_server = True
    apply_patches()


def apply(patches: list[Patch]) -> None:
    """Apply each patch whose condition holds, once per process."""
    for patch in patches:
        if patch.target in _applied or not patch.when():
            continue
        owner, attr = _resolve(patch.target)
        # as stored: a class's staticmethod stays one when `suspended` puts it back
        _originals[patch.target] = inspect.getattr_static(owner, attr)
        setattr(owner, attr, patch.replacement(_originals[patch.target]))
        _applied.add(patch.target)
        logger.debug("patched %s (%s %s: %s)", patch.target, patch.package, patch.version,
                     patch.reason)


@contextlib.contextmanager
def suspended(patches: list[Patch]):
    """The originals of those of `patches` this process applied, for the block (then the
    replacements again). For a process that builds for another device than the one the patches
    were applied for: the Ascend graph check on CPU, where CPU substitutes applied by an earlier
    CPU build must not reach cells built for Ascend."""
    restored = []
    try:
        for patch in patches:
            if patch.target in _applied:
                owner, attr = _resolve(patch.target)
                restored.append((owner, attr, inspect.getattr_static(owner, attr)))
                setattr(owner, attr, _originals[patch.target])
        yield
    finally:
        for owner, attr, replacement in restored:
            setattr(owner, attr, replacement)


_applying = False


def apply_patches() -> None:
    global _applying
    if _applying:  # re-entered from a target's import (which imports the platform): the outer
        return     # call goes on with the rest
    _applying = True
    try:
        apply(PATCHES)
    finally:
        _applying = False
