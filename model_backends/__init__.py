"""What `vLLM_MODEL_BACKEND` chooses between, and the one registry of supported models.

Backends:
  Native      this project's MindSpore graph-mode models, configured by the model's config.json.
  MindFormers models described by a MindFormers predict YAML (MINDFORMERS_MODEL_CONFIG): its
              parallel_config drives vLLM's parallel sizes and its model_config is checked against
              (and fills gaps in) config.json. Without the mindformers package installed, the
              architecture is built from this project's native implementation.

`MODEL_REGISTRY` maps (backend, HF architecture) to the implementing class, named by import path
so listing what is supported imports no MindSpore.
"""

import importlib
from typing import NamedTuple

from vllm_mindspore import envs

NATIVE = "Native"
MINDFORMERS = "MindFormers"
BACKENDS = (NATIVE, MINDFORMERS)

_NATIVE_MODELS = {
    "LlamaForCausalLM": "model_backends.native.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "model_backends.native.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "model_backends.native.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "model_backends.native.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "model_backends.native.deepseek_v3:DeepseekV3ForCausalLM",
}

MODEL_REGISTRY: dict[tuple[str, str], str] = {
    **{(NATIVE, arch): target for arch, target in _NATIVE_MODELS.items()},
    # No mindformers package on the supported stack (see PLATFORM_FACTS): the YAML-described model
    # is built from the native implementation of the same architecture.
    **{(MINDFORMERS, arch): target for arch, target in _NATIVE_MODELS.items()},
}


class UnsupportedModelError(ValueError):
    pass


class BackendChoice(NamedTuple):
    name: str
    reason: str


def select_backend() -> BackendChoice:
    """The backend from vLLM_MODEL_BACKEND (or VLLM_MS_MODEL_BACKEND); unset: MindFormers when
    MINDFORMERS_MODEL_CONFIG is set, else Native."""
    requested = envs.VLLM_MODEL_BACKEND
    if requested:
        for name in BACKENDS:
            if requested.strip().lower() == name.lower():
                return BackendChoice(name, f"vLLM_MODEL_BACKEND={requested}")
        raise ValueError(f"vLLM_MODEL_BACKEND={requested!r} is not a model backend of "
                         f"vllm-mindspore; valid values: {', '.join(BACKENDS)} (case-insensitive).")
    if envs.MINDFORMERS_MODEL_CONFIG:
        return BackendChoice(MINDFORMERS, "MINDFORMERS_MODEL_CONFIG is set and vLLM_MODEL_BACKEND "
                                          "is not")
    return BackendChoice(NATIVE, "default (neither vLLM_MODEL_BACKEND nor MINDFORMERS_MODEL_CONFIG "
                                 "is set)")


def supported_architectures(backend: str) -> list[str]:
    return sorted(arch for b, arch in MODEL_REGISTRY if b == backend)


def resolve_model_class(architectures: list[str], backend: str):
    """First architecture of config.json's `architectures` that `backend` implements."""
    for arch in architectures:
        target = MODEL_REGISTRY.get((backend, arch))
        if target is not None:
            module_name, class_name = target.split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise UnsupportedModelError(
        f"Model architecture(s) {architectures} are not supported by the {backend} backend of "
        f"vllm-mindspore. Supported: {', '.join(supported_architectures(backend))}.")


def describe_registry() -> str:
    """The supported (backend, architecture) pairs as a table, for `vllm-mindspore models`."""
    lines = [f"{'backend':<13}architecture -> implementation"]
    for (backend, arch), target in sorted(MODEL_REGISTRY.items()):
        lines.append(f"{backend:<13}{arch} -> {target.replace(':', '.')}")
    return "\n".join(lines)
