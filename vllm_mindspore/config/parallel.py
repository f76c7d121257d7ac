"""A MindFormers YAML's `parallel_config` (and `block_size`) mapped onto vLLM's settings.

Two ways in, one rule: what the command line says explicitly wins, the YAML fills in the rest
(seed 000: "--tensor-parallel-size 覆盖 model_parallel").

- `vllm serve`: the platform's `pre_register_and_update(parser)` calls
  `parser.set_defaults(**parser_defaults(cfg))`, so the YAML becomes argparse defaults and an explicit
  flag overrides it. `apply_to_vllm_config(..., cli_defaults_applied=True)` then logs the overrides.
- `LLM(...)` (no parser): `apply_to_vllm_config(...)` from `check_and_update_config` checks the final
  config against the YAML. Parallel sizes cannot change after vLLM built its config, so a size left at
  vLLM's default (1) while the YAML asks for more is an error telling the user what to pass.

Expert parallel. vLLM has only an on/off switch (`--enable-expert-parallel`); the degree lives in the
YAML (`expert_parallel`). Users of these YAMLs expect `expert_parallel: 4` to take effect by itself, so
expert_parallel > 1 turns the switch on (as a parser default, or on the offline config); an explicit
`--no-enable-expert-parallel` still wins and is reported: the routed experts are then split by tensor
parallelism and `expert_parallel` is ignored. `expert_parallel_size()` gives the effective degree.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_mindspore.config.mindformers_yaml import MindFormersConfigError

# Seed 000, in English: "data_parallel and model_parallel set the parallel strategy of attention and
# the dense FFN, expert_parallel that of the routed experts in the MoE part, and data_parallel *
# model_parallel must be divisible by expert_parallel."
EXPERT_PARALLEL_RULE = (
    "data_parallel and model_parallel set the parallelism of attention and the dense FFN, "
    "expert_parallel that of the routed MoE experts, and data_parallel * model_parallel must be "
    "divisible by expert_parallel")

# vLLM's default for every parallel size; in the offline path it means "not given".
VLLM_DEFAULT_SIZE = 1


@dataclass(frozen=True)
class YamlParallelConfig:
    """The YAML's `parallel_config`; missing keys take MindFormers' defaults (1)."""

    data_parallel: int = 1
    model_parallel: int = 1
    expert_parallel: int = 1
    pipeline_stage: int = 1
    source: str = field(default="<yaml>", compare=False)

    @classmethod
    def from_yaml(cls, yaml_cfg: dict) -> "YamlParallelConfig":
        source = _source(yaml_cfg)
        section = yaml_cfg.get("parallel_config")
        if section is None:
            return cls(source=source)
        if not isinstance(section, dict):
            raise MindFormersConfigError(
                f"parallel_config in {source} must be a mapping, got {section!r}.")
        sizes = {}
        for key in ("data_parallel", "model_parallel", "expert_parallel", "pipeline_stage"):
            value = section.get(key)
            if value is not None:  # MindFormers reads a missing or null key as its default
                sizes[key] = _positive_int(value, f"parallel_config.{key}", source)
        return cls(**sizes, source=source)

    @property
    def world_size(self) -> int:
        """Devices (processes) the YAML asks for: data_parallel * model_parallel * pipeline_stage."""
        return self.data_parallel * self.model_parallel * self.pipeline_stage


def validate(parallel: YamlParallelConfig) -> None:
    """Reject parallel settings this plugin cannot run, with a message naming the YAML."""
    if parallel.pipeline_stage > 1:
        raise MindFormersConfigError(
            f"parallel_config.pipeline_stage = {parallel.pipeline_stage} in {parallel.source}: "
            "pipeline parallelism is not supported by vllm-mindspore. Set pipeline_stage: 1 and "
            "spread the model with model_parallel (and data_parallel / expert_parallel).")
    _check_expert_rule(parallel.data_parallel, parallel.model_parallel, parallel.expert_parallel,
                       f"parallel_config in {parallel.source}: data_parallel * model_parallel")


def parser_defaults(yaml_cfg: dict) -> dict[str, Any]:
    """argparse defaults for vLLM's CLI (dest names of `EngineArgs.add_cli_args`), from the YAML.

    Validates first, so a bad YAML fails before any engine or worker starts.
    """
    parallel = YamlParallelConfig.from_yaml(yaml_cfg)
    validate(parallel)
    defaults: dict[str, Any] = {
        "tensor_parallel_size": parallel.model_parallel,
        "data_parallel_size": parallel.data_parallel,
        "pipeline_parallel_size": parallel.pipeline_stage,
        "enable_expert_parallel": parallel.expert_parallel > 1,
    }
    block_size = yaml_block_size(yaml_cfg)
    if block_size is not None:
        defaults["block_size"] = block_size
    quantization = yaml_quantization(yaml_cfg)
    if quantization is not None:
        defaults["quantization"] = quantization
    return defaults


def apply_to_vllm_config(yaml_cfg: dict, vllm_config: Any, log: logging.Logger,
                         cli_defaults_applied: bool = False) -> None:
    """Check vLLM's final config against the YAML; fill what is still open; log every override.

    `cli_defaults_applied`: True when `parser_defaults` already went into the CLI parser (serve),
    so every value that differs from the YAML was given explicitly. False for `LLM(...)`.
    Sets `enable_expert_parallel` (offline, YAML expert_parallel > 1) and `cache_config.block_size`
    (when nothing chose one yet); everything else is checked, not changed.
    """
    parallel = YamlParallelConfig.from_yaml(yaml_cfg)
    validate(parallel)
    vllm_parallel = vllm_config.parallel_config
    source = parallel.source

    for yaml_key, yaml_value, vllm_name in (
        ("model_parallel", parallel.model_parallel, "tensor_parallel_size"),
        ("data_parallel", parallel.data_parallel, "data_parallel_size"),
        ("pipeline_stage", parallel.pipeline_stage, "pipeline_parallel_size"),
    ):
        effective = getattr(vllm_parallel, vllm_name)
        if effective == yaml_value:
            continue
        if not cli_defaults_applied and effective == VLLM_DEFAULT_SIZE:
            raise MindFormersConfigError(
                f"{source} sets parallel_config.{yaml_key}: {yaml_value}, but vLLM was started with "
                f"{vllm_name}={effective} (its default), and parallel sizes cannot change once vLLM "
                f"has built its config. Pass {vllm_name}={yaml_value} (LLM(...) argument or "
                f"--{vllm_name.replace('_', '-')}), or set {yaml_key}: {effective} in the YAML.")
        log.warning("%s=%d (given explicitly) overrides parallel_config.%s=%d from %s.",
                    vllm_name, effective, yaml_key, yaml_value, source)

    if vllm_parallel.pipeline_parallel_size > 1:
        raise MindFormersConfigError(
            f"pipeline_parallel_size={vllm_parallel.pipeline_parallel_size}: pipeline parallelism "
            "is not supported by vllm-mindspore.")

    _reconcile_expert_parallel(parallel, vllm_parallel, log, cli_defaults_applied)

    dp, tp = vllm_parallel.data_parallel_size, vllm_parallel.tensor_parallel_size
    log.info("MindFormers YAML %s: world size %d (data_parallel %d x model_parallel %d x "
             "pipeline_stage %d); effective world size %d (dp %d x tp %d x pp %d), "
             "expert parallel %d.", source, parallel.world_size, parallel.data_parallel,
             parallel.model_parallel, parallel.pipeline_stage,
             dp * tp * vllm_parallel.pipeline_parallel_size, dp, tp,
             vllm_parallel.pipeline_parallel_size, expert_parallel_size(yaml_cfg, vllm_parallel))

    _apply_block_size(yaml_cfg, vllm_config.cache_config, log, source)
    _check_quantization(yaml_cfg, vllm_config.model_config, log, source)


def _check_quantization(yaml_cfg: dict, model_config: Any, log: logging.Logger,
                        source: str) -> None:
    """The YAML's quantization_config against vLLM's --quantization: `LLM(...)` cannot take it
    from the YAML (vLLM built its quantization config already), so it must be passed."""
    expected = yaml_quantization(yaml_cfg)
    effective = getattr(model_config, "quantization", None)
    if expected is None or effective == expected:
        return
    if effective is None:
        raise MindFormersConfigError(
            f"{source} sets model.model_config.quantization_config (W8A8), but vLLM was started "
            f"without quantization: pass quantization={expected!r} (LLM(...) argument or "
            f"--quantization {expected}), or set quantization_config: null in the YAML for a "
            "float checkpoint.")
    log.warning("quantization=%s (given explicitly) overrides the YAML's quantization_config "
                "(%s) from %s.", effective, expected, source)


def expert_parallel_size(yaml_cfg: dict, vllm_parallel_config: Any) -> int:
    """How many groups the routed experts are split into: the YAML's expert_parallel when vLLM's
    expert parallel is on, else 1 (experts then follow tensor parallelism)."""
    if not vllm_parallel_config.enable_expert_parallel:
        return 1
    return YamlParallelConfig.from_yaml(yaml_cfg).expert_parallel


def yaml_block_size(yaml_cfg: dict) -> int | None:
    """`model.model_config.block_size`, or None when the YAML does not set it."""
    value = _model_config(yaml_cfg).get("block_size")
    if value is None:
        return None
    return _positive_int(value, "model.model_config.block_size", _source(yaml_cfg))


# MindFormers' post-training quantization with int8 weights and activations: the MindSpore-Lab
# A8W8 checkpoints, whose description file is golden-stick's (docs/quantization.md).
_YAML_W8A8 = {"quant_method": "ptq", "weight_dtype": "int8", "activation_dtype": "int8"}


def yaml_quantization(yaml_cfg: dict) -> str | None:
    """vLLM's --quantization for `model.model_config.quantization_config`: `golden-stick` for
    MindFormers' W8A8 (ptq, int8 weights and activations), None when the YAML has none."""
    section = _model_config(yaml_cfg).get("quantization_config")
    if section is None:
        return None
    found = ({key: section.get(key) for key in _YAML_W8A8} if isinstance(section, dict)
             else section)
    if found != _YAML_W8A8:
        raise MindFormersConfigError(
            f"{_source(yaml_cfg)} sets model.model_config.quantization_config: {found!r}; "
            f"vllm-mindspore serves MindFormers' W8A8 ({_YAML_W8A8}, served as --quantization "
            "golden-stick) only. Set quantization_config: null for a float checkpoint.")
    return "golden-stick"


def _reconcile_expert_parallel(parallel: YamlParallelConfig, vllm_parallel: Any,
                               log: logging.Logger, cli_defaults_applied: bool) -> None:
    source, ep = parallel.source, parallel.expert_parallel
    if ep > 1 and not vllm_parallel.enable_expert_parallel:
        if cli_defaults_applied:  # the YAML made it the default, so the user switched it off
            log.warning("%s sets parallel_config.expert_parallel=%d, but expert parallel was "
                        "switched off explicitly (--no-enable-expert-parallel): the routed experts "
                        "are split by tensor parallelism and expert_parallel is ignored.", source, ep)
            return
        vllm_parallel.enable_expert_parallel = True
        log.info("Expert parallel enabled because %s sets parallel_config.expert_parallel=%d "
                 "(set expert_parallel: 1 in the YAML to keep it off).", source, ep)
    elif ep == 1 and vllm_parallel.enable_expert_parallel:
        log.warning("Expert parallel is enabled but %s sets parallel_config.expert_parallel=1: the "
                    "routed experts are not split into groups; set expert_parallel in the YAML to "
                    "choose the degree.", source)
    if vllm_parallel.enable_expert_parallel and ep > 1:
        # The CLI may have changed dp or tp, so the rule is checked again on the effective sizes.
        _check_expert_rule(
            vllm_parallel.data_parallel_size, vllm_parallel.tensor_parallel_size, ep,
            f"data_parallel_size * tensor_parallel_size (effective) with expert_parallel from {source}:"
            " data_parallel * model_parallel")


def _check_expert_rule(dp: int, mp: int, ep: int, what: str) -> None:
    if (dp * mp) % ep:
        raise MindFormersConfigError(
            f"{what} = {dp} * {mp} = {dp * mp} is not divisible by expert_parallel = {ep}. "
            f"Rule: {EXPERT_PARALLEL_RULE}.")


def _apply_block_size(yaml_cfg: dict, cache_config: Any, log: logging.Logger, source: str) -> None:
    block_size = yaml_block_size(yaml_cfg)
    if block_size is None:
        return
    if not cache_config.user_specified_block_size:
        cache_config.block_size = block_size
        cache_config.user_specified_block_size = True  # chosen: the platform default keeps off
        log.info("block_size=%d from model.model_config.block_size in %s.", block_size, source)
    elif cache_config.block_size != block_size:
        log.warning("block_size=%d (given explicitly) overrides model.model_config.block_size=%d "
                    "from %s.", cache_config.block_size, block_size, source)


def _model_config(yaml_cfg: dict) -> dict:
    model = yaml_cfg.get("model") or {}
    model_config = model.get("model_config") if isinstance(model, dict) else None
    return model_config if isinstance(model_config, dict) else {}


def _source(yaml_cfg: dict) -> str:
    return getattr(yaml_cfg, "path", "<yaml>")


def _positive_int(value: Any, key: str, source: str) -> int:
    # bool is an int subclass in Python, but `model_parallel: true` is a mistake, not a size.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MindFormersConfigError(
            f"{key} in {source} must be a positive integer, got {value!r}.")
    return value
