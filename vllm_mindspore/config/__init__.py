"""Configuration read from a MindFormers predict YAML (`MINDFORMERS_MODEL_CONFIG`).

Pure Python on pyyaml: importing this package loads neither MindSpore nor vLLM.

Typical use by the platform:
    cfg = load_mindformers_config(path, origin="MINDFORMERS_MODEL_CONFIG")
    parser.set_defaults(**parser_defaults(cfg))            # pre_register_and_update(parser)
    apply_to_vllm_config(cfg, vllm_config, logger, ...)    # check_and_update_config
    missing = cross_check(model_config_overrides(cfg), hf_config_dict)
"""

from vllm_mindspore.config.mindformers_yaml import (
    MindFormersConfigError,
    MindFormersYaml,
    ModelConfigOverrides,
    cross_check,
    deep_merge,
    load_mindformers_config,
    model_config_overrides,
)
from vllm_mindspore.config.parallel import (
    EXPERT_PARALLEL_RULE,
    YamlParallelConfig,
    apply_to_vllm_config,
    expert_parallel_size,
    parser_defaults,
    validate,
    yaml_block_size,
    yaml_quantization,
)

__all__ = [
    "EXPERT_PARALLEL_RULE",
    "MindFormersConfigError",
    "MindFormersYaml",
    "ModelConfigOverrides",
    "YamlParallelConfig",
    "apply_to_vllm_config",
    "cross_check",
    "deep_merge",
    "expert_parallel_size",
    "load_mindformers_config",
    "model_config_overrides",
    "parser_defaults",
    "validate",
    "yaml_block_size",
    "yaml_quantization",
]
