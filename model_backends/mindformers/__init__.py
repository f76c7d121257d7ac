"""The MindFormers backend's configuration step: a MindFormers predict YAML applied to vLLM's config.

Runs in `MindSporePlatform.check_and_update_config`, i.e. in every vLLM process before any worker
starts, so a bad YAML or a YAML that contradicts the model folder fails early with a clear error.
It never imports the mindformers package. `backend` (MindFormersBackend) runs mindformers' own
model classes when the package is installed, configured by `config`, on CPU through
`cpu_substitutes`, on Ascend with mindformers' own ops.
"""

import logging

from vllm_mindspore import envs
from vllm_mindspore.config import (apply_to_vllm_config, cross_check, load_mindformers_config,
                                   model_config_overrides)

# Set by the platform when the YAML's parallel sizes became the CLI parser's defaults; inherited
# by the engine-core and worker processes, which never see the parser.
CLI_DEFAULTS_APPLIED_ENV = "VLLM_MS_YAML_CLI_DEFAULTS_APPLIED"


HF_LATENT_NORM_EPS = 1e-6
# mindformers 2.0.0 builds MLA's PagedAttention with mla_v_dim=512 (DeepSeek-V3's kv_lora_rank),
# whatever the model's rank.
ASCEND_MLA_KV_LORA_RANK = 512


def unexpressible_fields(arch: str | None, hf_text_config) -> list[str]:
    """config.json settings mindformers 2.0.0's class cannot express (it would run another
    model than HF's): its Qwen3-MoE drops decoder_sparse_step and mlp_only_layers and makes
    every layer sparse; its DeepSeek-V3 loads no `self_attn.q_proj` (no weight_mapping entry,
    and no rope permutation for it), permutes every checkpoint's rope rows from the
    interleaved layout and normalises the latents with rms_norm_eps."""
    problems = []
    if arch == "Qwen3MoeForCausalLM":
        if hf_text_config.decoder_sparse_step != 1:
            problems.append(f"decoder_sparse_step={hf_text_config.decoder_sparse_step} "
                            "(config.json): mindformers' Qwen3-MoE makes every layer sparse (it "
                            "ignores the field)")
        if hf_text_config.mlp_only_layers:
            problems.append(f"mlp_only_layers={list(hf_text_config.mlp_only_layers)} "
                            "(config.json): mindformers' Qwen3-MoE has no dense layers (it "
                            "ignores the field)")
    if arch == "DeepseekV3ForCausalLM":
        if hf_text_config.q_lora_rank is None:
            problems.append("q_lora_rank=null (config.json): mindformers 2.0.0's DeepSeek-V3 "
                            "has no checkpoint name for self_attn.q_proj (weight_mapping) nor "
                            "the rope permutation its rows need")
        if hf_text_config.rms_norm_eps != HF_LATENT_NORM_EPS:
            problems.append(f"rms_norm_eps={hf_text_config.rms_norm_eps} (config.json): "
                            "mindformers' DeepSeek-V3 also gives it to the q/kv latent norms, "
                            f"which HF builds with eps {HF_LATENT_NORM_EPS}")
        if not getattr(hf_text_config, "rope_interleave", True):
            problems.append("rope_interleave=false (config.json): mindformers' DeepSeek-V3 "
                            "takes every checkpoint's q/k rope rows as interleaved")
    return problems


def package_limits(vllm_config) -> list[str]:
    """What in vLLM's config mindformers' own classes do not run here yet (the native
    implementation, configured from the YAML, runs it instead, and the log says why)."""
    model_config = vllm_config.model_config
    architectures = list(getattr(model_config.hf_config, "architectures", None) or [None])
    limits = unexpressible_fields(architectures[0], model_config.hf_text_config)
    if vllm_config.model_config.quantization:
        limits.append(f"--quantization {vllm_config.model_config.quantization} (mindformers' "
                      "quantized layers: not driven by the adapter, and Ascend-only)")
    if (vllm_config.parallel_config.tensor_parallel_size != 1
            and architectures[0] in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")):
        limits.append("tensor parallelism for MoE and MLA models (not verified yet)")
    if vllm_config.parallel_config.enable_expert_parallel:
        limits.append("expert parallelism (mindformers' expert-parallel groups are not set up by "
                      "the adapter, and its expert dispatch is not substituted on CPU)")
    from vllm_mindspore.platform import ASCEND, kernel_device

    kv_lora_rank = getattr(model_config.hf_text_config, "kv_lora_rank", None)
    if (kernel_device() == ASCEND and architectures[0] == "DeepseekV3ForCausalLM"
            and kv_lora_rank != ASCEND_MLA_KV_LORA_RANK):
        limits.append(f"kv_lora_rank={kv_lora_rank} on Ascend (mindformers 2.0.0 builds MLA's "
                      f"PagedAttention with mla_v_dim={ASCEND_MLA_KV_LORA_RANK}: its output "
                      "would not fit the model's latent)")
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
