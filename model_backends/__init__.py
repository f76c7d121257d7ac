"""What `vLLM_MODEL_BACKEND` chooses between, and the one registry of supported models.

`MODEL_REGISTRY` maps (backend, HF architecture) to the class that implements it. Classes are
named by import path so listing what is supported does not import MindSpore.
"""

import importlib

NATIVE = "Native"

MODEL_REGISTRY: dict[tuple[str, str], str] = {
    (NATIVE, "LlamaForCausalLM"): "model_backends.native.llama:LlamaForCausalLM",
    (NATIVE, "Qwen2ForCausalLM"): "model_backends.native.qwen2:Qwen2ForCausalLM",
    (NATIVE, "Qwen3ForCausalLM"): "model_backends.native.qwen3:Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    pass


def supported_architectures(backend: str = NATIVE) -> list[str]:
    return sorted(arch for b, arch in MODEL_REGISTRY if b == backend)


def resolve_model_class(architectures: list[str], backend: str = NATIVE):
    """First architecture of config.json's `architectures` that `backend` implements."""
    for arch in architectures:
        target = MODEL_REGISTRY.get((backend, arch))
        if target is not None:
            module_name, class_name = target.split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise UnsupportedModelError(
        f"Model architecture(s) {architectures} are not supported by the {backend} backend of "
        f"vllm-mindspore. Supported: {', '.join(supported_architectures(backend))}.")
