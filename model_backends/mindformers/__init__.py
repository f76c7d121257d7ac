"""The MindFormers backend's configuration step: a MindFormers predict YAML applied to vLLM's config.

Runs in `MindSporePlatform.check_and_update_config`, i.e. in every vLLM process before any worker
starts, so a bad YAML or a YAML that contradicts the model folder fails early with a clear error.
It never imports the mindformers package. `backend` (MindFormersBackend) runs mindformers' own
model classes when the package is installed, configured by `config`, on CPU through
`cpu_substitutes`.
"""

import logging

from vllm_mindspore import envs
from vllm_mindspore.config import (apply_to_vllm_config, cross_check, load_mindformers_config,
                                   model_config_overrides)

# Set by the platform when the YAML's parallel sizes became the CLI parser's defaults; inherited
# by the engine-core and worker processes, which never see the parser.
CLI_DEFAULTS_APPLIED_ENV = "VLLM_MS_YAML_CLI_DEFAULTS_APPLIED"


def package_limits(vllm_config) -> list[str]:
    """What in vLLM's config mindformers' own classes do not run here yet (the native
    implementation, configured from the YAML, runs it instead, and the log says why)."""
    from vllm_mindspore.platform import ASCEND, kernel_device

    limits = []
    if vllm_config.model_config.quantization:
        limits.append(f"--quantization {vllm_config.model_config.quantization} (mindformers' "
                      "quantized layers are Ascend-only)")
    if kernel_device() == ASCEND:
        limits.append("Ascend (the adapter's FlashAttention prefill and PagedAttention increment "
                      "graphs are not written yet)")
    return limits


def load_yaml():
    path = envs.MINDFORMERS_MODEL_CONFIG
    if not path:
        raise ValueError("vLLM_MODEL_BACKEND=MindFormers needs MINDFORMERS_MODEL_CONFIG: the path "
                         "of a MindFormers predict YAML (see yaml_configs/).")
    return load_mindformers_config(path, origin="MINDFORMERS_MODEL_CONFIG")


def configure(vllm_config, log: logging.Logger, cli_defaults_applied: bool) -> None:
    """Apply the YAML: parallel sizes and block size (CLI wins), model fields cross-checked
    against config.json and filled in where config.json lacks them."""
    cfg = load_yaml()
    apply_to_vllm_config(cfg, vllm_config, log, cli_defaults_applied)
    hf_config = vllm_config.model_config.hf_text_config
    missing = cross_check(model_config_overrides(cfg), hf_config.to_dict())
    for key, value in missing.items():
        setattr(hf_config, key, value)
    architectures = list(getattr(vllm_config.model_config.hf_config, "architectures", None) or [])
    from model_backends import MINDFORMERS, resolve_entry

    entry = resolve_entry(architectures, MINDFORMERS, vllm_config)
    log.info("MindFormers backend: %s applied (%d model field(s) filled from it: %s); the model "
             "runs as %s%s.", cfg.path, len(missing), ", ".join(sorted(missing)) or "none",
             entry.model.replace(":", "."), f" ({entry.note})" if entry.note else "")
