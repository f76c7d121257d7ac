"""The MindFormerConfig a mindformers model is built from: the user's predict YAML
(MINDFORMERS_MODEL_CONFIG, read by MindFormerConfig itself, `base_config` included) or an empty
one, then vLLM's settings, which win over the YAML as the CLI does for the configuration step.

mindformers merges the model folder's config.json under the YAML's model_config when it builds
the model; what config.json says in a way mindformers does not read is set here.
"""

import mindspore as ms

from vllm_mindspore import envs

_DTYPE_NAMES = {ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16"}

# model_config fields an architecture implies and its config.json does not state: HF's Qwen2
# always has q/k/v biases, mindformers' Qwen2 builds them only with add_qkv_bias (default False).
ARCHITECTURE_FIELDS = {"Qwen2ForCausalLM": {"add_qkv_bias": True}}


class UnsupportedByMindFormersError(ValueError):
    pass


def _set(config, dotted: str, value) -> None:
    from mindformers.tools.register.config import MindFormerConfig

    *parents, leaf = dotted.split(".")
    node = config
    for name in parents:
        if node.get(name) is None:
            node[name] = MindFormerConfig()
        node = node[name]
    node[leaf] = value


# Multi-latent attention models, whose YaRN mindformers builds from `rope_scaling`.
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


def _unsupported_rope(field: str, why: str):
    return UnsupportedByMindFormersError(
        f"config.json rope_parameters {field}: {why}. Use vLLM_MODEL_BACKEND=Native for this "
        "model.")


def mla_yarn_scaling(params: dict) -> dict:
    """rope_parameters (YaRN) -> mindformers' `rope_scaling`. mindformers scales the cos/sin
    tables as HF does (mscale(factor, mscale) / mscale(factor, mscale_all_dim), or
    mscale(factor) without both), but its softmax scale is mscale(factor, `mscale`)^2 /
    sqrt(qk_head_dim) (MultiLatentAttention.softmax_scale) where HF's and vLLM's is
    mscale(factor, `mscale_all_dim`)^2 / sqrt(qk_head_dim), and it has no `attention_factor`:
    both must agree for the model to be the one HF runs."""
    if params.get("attention_factor") is not None:
        raise _unsupported_rope("attention_factor", "mindformers' YaRN has no such field")
    mscale = params.get("mscale", 0.0) or 0.0
    mscale_all_dim = params.get("mscale_all_dim", 0.0) or 0.0
    if mscale != mscale_all_dim:
        raise _unsupported_rope(
            f"mscale={mscale} != mscale_all_dim={mscale_all_dim}",
            "mindformers' MLA softmax scale is mscale(factor, mscale)^2 / sqrt(qk_head_dim) "
            "where HF's is mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim)")
    return {"rope_type": "yarn", "mscale": mscale, "mscale_all_dim": mscale_all_dim,
            **{key: params[key] for key in _YARN_KEYS if key in params}}


def rope_settings(arch: str, hf_text_config) -> dict:
    """model_config's rope fields from vLLM's config. transformers 5 writes `rope_parameters`
    and no top-level `rope_theta`, which mindformers would then take as its default 10000."""
    params = dict(getattr(hf_text_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_text_config, "rope_theta", None))
    settings = {} if theta is None else {"rope_theta": float(theta)}
    rope_type = params.get("rope_type", "default")
    if rope_type == "yarn" and arch in MLA_ARCHITECTURES:
        settings["rope_scaling"] = mla_yarn_scaling(params)
    elif rope_type == "default" and arch in MLA_ARCHITECTURES:
        # mindformers' MLA config defaults to YaRN (factor 40) and takes another rope only from
        # `rope_scaling`: `type` picks the position embedding, the leftover `rope_type` the
        # MLA layers' rope, `factor` 1 keeps the softmax scale unscaled.
        settings["rope_scaling"] = {
            "type": "rope", "rope_type": "rope", "factor": 1.0,
            "original_max_position_embeddings": hf_text_config.max_position_embeddings}
    elif rope_type != "default":
        raise _unsupported_rope(f"rope_type {rope_type!r}",
                                "mindformers reads rope scaling with its own field names, not "
                                "checked against vLLM's for this architecture")
    return settings


def renamed_fields(arch: str, hf_text_config) -> dict:
    """model_config fields transformers 5 writes to config.json under names mindformers reads
    otherwise, from vLLM's HF config."""
    if arch == "Qwen3MoeForCausalLM":
        # Saved as `num_local_experts` (attribute_map): mindformers would build its default 128.
        return {"num_experts": hf_text_config.num_experts}
    if arch in MLA_ARCHITECTURES:
        # Saved `qk_head_dim` is nope + rope; mindformers reads that key as qk_nope_head_dim.
        return {"qk_head_dim": hf_text_config.qk_nope_head_dim}
    return {}


def mindformers_config(vllm_config, arch: str, block_size: int, dtype, device: str):
    """-> a MindFormerConfig building `arch`, for `AutoModel.from_config` and
    `build_mf_context`."""
    from mindformers.tools.register.config import MindFormerConfig

    path = envs.MINDFORMERS_MODEL_CONFIG
    config = MindFormerConfig(path) if path else MindFormerConfig()
    model_dir = vllm_config.model_config.model
    dtype_name = _DTYPE_NAMES[dtype]
    parallel = vllm_config.parallel_config
    settings = {
        "run_mode": "predict",
        "use_legacy": False,
        "load_ckpt_format": "safetensors",
        "pretrained_model_dir": model_dir,
        "load_checkpoint": model_dir,
        "context.mode": 0,  # graph mode
        "context.device_target": device,
        "parallel.parallel_mode": "STAND_ALONE",
        "parallel_config.model_parallel": parallel.tensor_parallel_size,
        "parallel_config.data_parallel": 1,
        "parallel_config.pipeline_stage": 1,
        "parallel_config.expert_parallel": 1,
        "parallel_config.vocab_emb_dp": False,
        "model.model_config.compute_dtype": dtype_name,
        "model.model_config.params_dtype": dtype_name,
        "model.model_config.rotary_dtype": dtype_name,
        "model.model_config.router_dense_type": dtype_name,
        # HF and vLLM normalise in float32 whatever the compute dtype.
        "model.model_config.layernorm_compute_dtype": "float32",
        "model.model_config.max_position_embeddings": vllm_config.model_config.max_model_len,
        "model.model_config.block_size": block_size,
        "model.model_config.pre_process": True,
        "model.model_config.post_process": True,
        "model.model_config.offset": 0,
        "model.model_config.use_fused_mla": False,
    }
    hf_text_config = vllm_config.model_config.hf_text_config
    model_fields = {**rope_settings(arch, hf_text_config), **ARCHITECTURE_FIELDS.get(arch, {}),
                    **renamed_fields(arch, hf_text_config)}
    settings.update({f"model.model_config.{key}": value for key, value in model_fields.items()})
    for dotted, value in settings.items():
        _set(config, dotted, value)
    return config
