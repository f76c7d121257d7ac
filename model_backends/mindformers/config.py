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

# model_config fields mindformers reads under a name transformers 5 no longer writes to
# config.json (it maps them through `attribute_map`: Qwen3-MoE's `num_experts` is saved as
# `num_local_experts`, so mindformers would build its default 128 experts). Read from vLLM's
# HF config, which resolves the mapping.
RENAMED_FIELDS = {"Qwen3MoeForCausalLM": ("num_experts",)}


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


def rope_settings(hf_text_config) -> dict:
    """model_config's rope fields from vLLM's config. transformers 5 writes `rope_parameters`
    and no top-level `rope_theta`, which mindformers would then take as its default 10000."""
    params = dict(getattr(hf_text_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_text_config, "rope_theta", None))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedByMindFormersError(
            f"rope_type {rope_type!r} (config.json rope_parameters) is not supported by the "
            "MindFormers backend yet: mindformers reads rope scaling with its own field names, "
            "not checked against vLLM's. Use vLLM_MODEL_BACKEND=Native for this model.")
    return {} if theta is None else {"rope_theta": float(theta)}


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
    model_fields = {**rope_settings(hf_text_config), **ARCHITECTURE_FIELDS.get(arch, {}),
                    **{name: getattr(hf_text_config, name)
                       for name in RENAMED_FIELDS.get(arch, ())}}
    settings.update({f"model.model_config.{key}": value for key, value in model_fields.items()})
    for dotted, value in settings.items():
        _set(config, dotted, value)
    return config
