"""The one registry of monkey patches this plugin applies to vLLM and torch.

Each patch names its target, why it is needed and the vLLM version it was written against.
`apply_patches()` is idempotent and runs in every vLLM process (general plugin entry point and
platform import). A patch whose target no longer exists fails loudly instead of silently skipping.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger("vllm.vllm_mindspore.patches")


@dataclass(frozen=True)
class Patch:
    target: str  # "module:attribute.path"
    reason: str
    vllm_version: str
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

PATCHES: list[Patch] = [
    Patch(target=f"torch.accelerator:{name}", reason=_SHUTDOWN_REASON, vllm_version="0.33.0",
          replacement=_noop_when_no_accelerator, when=_no_accelerator)
    for name in ("empty_cache", "empty_host_cache")
]

_applied: set[str] = set()


def _resolve(target: str):
    module_name, attr_path = target.split(":")
    owner = importlib.import_module(module_name)
    *parents, attr = attr_path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def apply_patches() -> None:
    for patch in PATCHES:
        if patch.target in _applied or not patch.when():
            continue
        owner, attr = _resolve(patch.target)
        setattr(owner, attr, patch.replacement(getattr(owner, attr)))
        _applied.add(patch.target)
        logger.debug("patched %s (%s)", patch.target, patch.reason)
