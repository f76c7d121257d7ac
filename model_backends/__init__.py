"""What `vLLM_MODEL_BACKEND` chooses between, and the one registry of supported models.

Backends:
  Native      this project's MindSpore graph-mode models, configured by the model's config.json.
  MindFormers models described by a MindFormers predict YAML (MINDFORMERS_MODEL_CONFIG): its
              parallel_config drives vLLM's parallel sizes and its model_config is checked against
              (and fills gaps in) config.json. Without the mindformers package installed, the
              architecture is built from this project's native implementation.

`MODEL_REGISTRY` maps (backend, HF architecture) to the `ModelBackend` class that builds the model
(`contract.py`) and the model class it runs, both named by import path so listing what is
supported imports no MindSpore. `build_backend` is what a worker calls.
"""

import importlib
import importlib.util
import os
import time
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

_NATIVE_BACKEND = "model_backends.native.backend:NativeBackend"

# MindSpore Transformers' own inference classes (the optional `mindformers` package, `make
# install-mindformers`): registered there as `mcore_<architecture>`.
_MINDFORMERS_MODELS = {
    "Qwen2ForCausalLM": "mindformers.models.qwen2.modeling_qwen2_infer:InferenceQwen2ForCausalLM",
    "Qwen3ForCausalLM": "mindformers.models.qwen3.modeling_qwen3_infer:InferenceQwen3ForCausalLM",
    "Qwen3MoeForCausalLM":
        "mindformers.models.qwen3_moe.modeling_qwen3_moe_infer:InferenceQwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM":
        "mindformers.models.deepseek3.modeling_deepseek_v3_infer:InferenceDeepseekV3ForCausalLM",
}

_MINDFORMERS_MISSING = {"LlamaForCausalLM": "mindformers 2.0.0 has no inference (mcore) Llama class"}

_MINDFORMERS_BACKEND = "model_backends.mindformers.backend:MindFormersBackend"


def mindformers_installed() -> bool:
    """The mindformers package is importable (found without importing it)."""
    return importlib.util.find_spec("mindformers") is not None


class ModelEntry(NamedTuple):
    backend: str  # "module:Class" of the ModelBackend that builds and runs the model
    model: str  # "module:Class" of the model class it runs
    note: str = ""  # why this implementation runs for the selected backend, when it is not obvious


def _mindformers_entry(arch: str, native: str) -> ModelEntry:
    """MindFormers backend: the package's class when it is installed and has one for `arch`,
    else the native implementation configured from the YAML (and the reason, logged)."""
    if not mindformers_installed():
        return ModelEntry(_NATIVE_BACKEND, native, "the mindformers package is not installed "
                          "(make install-mindformers): native implementation, configured from "
                          "the YAML")
    if arch not in _MINDFORMERS_MODELS:
        reason = _MINDFORMERS_MISSING.get(arch, f"vllm-mindspore does not run mindformers' {arch} "
                                                "class yet")
        return ModelEntry(_NATIVE_BACKEND, native, f"{reason}: native implementation, configured "
                          "from the YAML")
    return ModelEntry(_MINDFORMERS_BACKEND, _MINDFORMERS_MODELS[arch])


MODEL_REGISTRY: dict[tuple[str, str], ModelEntry] = {
    **{(NATIVE, arch): ModelEntry(_NATIVE_BACKEND, model)
       for arch, model in _NATIVE_MODELS.items()},
    **{(MINDFORMERS, arch): _mindformers_entry(arch, model)
       for arch, model in _NATIVE_MODELS.items()},
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


def import_target(target: str):
    """The object a registry path "module:name" names."""
    module_name, name = target.split(":")
    return getattr(importlib.import_module(module_name), name)


def resolve_entry(architectures: list[str], backend: str, vllm_config=None) -> ModelEntry:
    """The registry entry of the first architecture of config.json's `architectures` that
    `backend` implements; with `vllm_config`, a mindformers class that cannot run that
    configuration yet gives way to the native implementation (the entry's note says why)."""
    for arch in architectures:
        entry = MODEL_REGISTRY.get((backend, arch))
        if entry is None:
            continue
        if vllm_config is not None and entry.backend == _MINDFORMERS_BACKEND:
            from model_backends.mindformers import package_limits

            limits = package_limits(vllm_config)
            if limits:
                return ModelEntry(_NATIVE_BACKEND, _NATIVE_MODELS[arch],
                                  f"mindformers' {arch} class does not run {'; '.join(limits)}: "
                                  "native implementation, configured from the YAML")
        return entry
    raise UnsupportedModelError(
        f"Model architecture(s) {architectures} are not supported by the {backend} backend of "
        f"vllm-mindspore. Supported: {', '.join(supported_architectures(backend))}.")


def check_model_servable(model_config, backend: str) -> None:
    """Refuse, in vLLM's front-end process before any worker starts (seconds instead of a
    worker's start-up), a model no worker could build: an architecture `backend` does not
    implement, or a local folder with no (or an incomplete set of) safetensors weights."""
    from model_backends.native.checkpoint import safetensors_files

    resolve_entry(list(getattr(model_config.hf_config, "architectures", None) or []), backend)
    if os.path.isdir(model_config.model):  # a hub id is vLLM's to resolve
        safetensors_files(model_config.model)


def resolve_model_class(architectures: list[str], backend: str):
    """The model class `backend` runs for config.json's `architectures`."""
    return import_target(resolve_entry(architectures, backend).model)


def build_backend(vllm_config, block_size: int, precision, static_shapes: bool):
    """The model of `vllm_config` behind the backend vLLM_MODEL_BACKEND selects, built with its
    weights loaded: a `contract.ModelBackend` (arguments: its `build`'s)."""
    from vllm.logger import init_logger

    choice = select_backend()
    model_config = vllm_config.model_config
    entry = resolve_entry(list(getattr(model_config.hf_config, "architectures", None) or []),
                          choice.name, vllm_config)
    start = time.perf_counter()
    backend = import_target(entry.backend).build(entry.model, vllm_config, block_size, precision,
                                                 static_shapes)
    backend.load_weights(model_config.model, model_config.quantization)
    init_logger("vllm.vllm_mindspore.model_backends").info(
        "Built %s with %s (%s backend selected%s, %s) and loaded its weights in %.2f s",
        backend.implementation, type(backend).__name__, choice.name,
        f": {entry.note}" if entry.note else "", precision, time.perf_counter() - start)
    return backend


def describe_registry() -> str:
    """The supported (backend, architecture) pairs as a table, for `vllm-mindspore models`."""
    lines = [f"{'backend':<13}architecture -> implementation (built by)"]
    for (backend, arch), entry in sorted(MODEL_REGISTRY.items()):
        lines.append(f"{backend:<13}{arch} -> {entry.model.replace(':', '.')} "
                     f"({entry.backend.rsplit(':', 1)[1]}{'; ' + entry.note if entry.note else ''})")
    return "\n".join(lines)
