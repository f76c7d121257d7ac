"""MindFormers predict YAMLs read with MindFormerConfig's semantics, on plain pyyaml.

This is what `MINDFORMERS_MODEL_CONFIG` points at. It must work without the mindformers package (and
import fast), so the loader re-implements `MindFormerConfig._file2dict`:

- each file is read with `yaml.safe_load`;
- `base_config` (a file name or a list of them, relative to the folder of the YAML that names it) is
  loaded first, recursively; the key itself is removed from the result;
- several bases are combined in order with a top-level `dict.update`, exactly as MindFormers does:
  a later base replaces a whole top-level section (say `model:`) of an earlier one;
- the child is then deep-merged over its bases: the child wins, mappings merge key by key, any other
  value (scalar, list, null) replaces the base's value.

`model_config_overrides` renames the YAML's model fields to HF config.json names, and `cross_check`
compares them with a model folder's config.json.
"""

import math
import os
from typing import Any

import yaml

BASE_CONFIG_KEY = "base_config"


class MindFormersConfigError(ValueError):
    """A MindFormers YAML that cannot be used; the message names the file and what is wrong."""


class MindFormersYaml(dict):
    """The merged configuration: a plain dict that also remembers where it came from.

    `path` is the YAML that was asked for (absolute); `files` every YAML read, bases first.
    Error messages elsewhere use `path` to name the file.
    """

    def __init__(self, data: dict, path: str, files: list[str]):
        super().__init__(data)
        self.path = path
        self.files = files


def load_mindformers_config(path: str | os.PathLike, origin: str | None = None) -> MindFormersYaml:
    """Load a MindFormers YAML and its `base_config` chain into one dict.

    `origin` says where `path` came from (e.g. "MINDFORMERS_MODEL_CONFIG") for the missing-file error.
    Raises MindFormersConfigError on a missing file, a base_config cycle, malformed YAML, or a
    top level that is not a mapping.
    """
    path = os.path.abspath(os.fspath(path))
    files: list[str] = []
    referenced_by = f"given by {origin}" if origin else None
    data = _load_with_bases(path, referenced_by, chain=[], files=files)
    return MindFormersYaml(data, path, files)


def deep_merge(child: dict, base: dict) -> dict:
    """A new dict: `base` with `child` merged over it (child wins; mappings merge recursively)."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(value, merged[key])
        else:
            merged[key] = value
    return merged


def _load_with_bases(path: str, referenced_by: str | None, chain: list[str], files: list[str]) -> dict:
    # Cycles are detected on real paths, so "a.yaml" and "./x/../a.yaml" are the same file.
    real_path = os.path.realpath(path)
    real_chain = [os.path.realpath(p) for p in chain]
    if real_path in real_chain:
        cycle = chain[real_chain.index(real_path):] + [path]
        raise MindFormersConfigError(
            "Cyclic base_config in MindFormers YAML: " + " -> ".join(cycle))

    data = _read_mapping(path, referenced_by)
    files.append(path)
    if BASE_CONFIG_KEY not in data:
        return data

    base_names = data.pop(BASE_CONFIG_KEY)
    if isinstance(base_names, str):
        base_names = [base_names]
    if not isinstance(base_names, list) or not all(isinstance(n, str) and n for n in base_names):
        raise MindFormersConfigError(
            f"{BASE_CONFIG_KEY} in {path} must be a file name or a list of file names, "
            f"got {base_names!r}.")

    folder = os.path.dirname(path)
    combined_bases: dict = {}
    for name in base_names:
        base_path = os.path.normpath(os.path.join(folder, name))
        base = _load_with_bases(base_path, f"base_config of {path}", chain + [path], files)
        combined_bases.update(base)  # top-level update between bases, as MindFormers does
    return deep_merge(data, combined_bases)


def _read_mapping(path: str, referenced_by: str | None) -> dict:
    """One YAML file's top-level mapping (an empty file reads as {})."""
    where = f" ({referenced_by})" if referenced_by else ""
    if not os.path.exists(path):
        raise MindFormersConfigError(f"MindFormers YAML not found: {path}{where}.")
    if not os.path.isfile(path):
        raise MindFormersConfigError(f"MindFormers YAML {path}{where} is not a file.")
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise MindFormersConfigError(_describe_yaml_error(path, exc)) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise MindFormersConfigError(f"Cannot read MindFormers YAML {path}{where}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MindFormersConfigError(
            f"MindFormers YAML {path} must be a mapping (key: value) at the top level, "
            f"found a {type(data).__name__}.")
    return data


def _describe_yaml_error(path: str, exc: yaml.YAMLError) -> str:
    # pyyaml marks are 0-based; editors count lines and columns from 1.
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return f"Malformed MindFormers YAML {path}: {problem}"
    return (f"Malformed MindFormers YAML {path}, line {mark.line + 1}, column {mark.column + 1}: "
            f"{problem}")


# ---------------------------------------------------------------------------------------------
# model.model_config -> HF config.json field names
# ---------------------------------------------------------------------------------------------

# (MindFormers keys, HF config.json key, type). MindFormers' legacy models (research/deepseek3,
# research/qwen2_5) use the short names; its mcore models (configs/qwen3) use HF's own names.
_MODEL_FIELDS: list[tuple[tuple[str, ...], str, type]] = [
    (("hidden_size",), "hidden_size", int),
    (("num_layers", "num_hidden_layers"), "num_hidden_layers", int),
    (("num_heads", "num_attention_heads"), "num_attention_heads", int),
    (("n_kv_heads", "num_key_value_heads"), "num_key_value_heads", int),
    (("head_dim",), "head_dim", int),
    (("kv_lora_rank",), "kv_lora_rank", int),
    (("q_lora_rank",), "q_lora_rank", int),
    (("qk_rope_head_dim",), "qk_rope_head_dim", int),
    (("qk_nope_head_dim",), "qk_nope_head_dim", int),
    (("v_head_dim",), "v_head_dim", int),
    (("vocab_size",), "vocab_size", int),
    (("intermediate_size",), "intermediate_size", int),
    (("rms_norm_eps",), "rms_norm_eps", float),
    (("theta", "rope_theta"), "rope_theta", float),
    (("max_position_embeddings",), "max_position_embeddings", int),
    (("tie_word_embeddings",), "tie_word_embeddings", bool),
    # MoE fields in HF's names, as the mcore models' YAMLs write them in model_config (mindformers
    # merges model_config over config.json: a disagreement would run another routing than HF's).
    (("n_routed_experts",), "n_routed_experts", int),
    (("num_experts",), "num_experts", int),
    (("num_experts_per_tok",), "num_experts_per_tok", int),
    (("moe_intermediate_size",), "moe_intermediate_size", int),
    (("n_shared_experts",), "n_shared_experts", int),
    (("n_group",), "n_group", int),
    (("topk_group",), "topk_group", int),
    (("first_k_dense_replace",), "first_k_dense_replace", int),
    (("routed_scaling_factor",), "routed_scaling_factor", float),
    (("norm_topk_prob",), "norm_topk_prob", bool),
    (("decoder_sparse_step",), "decoder_sparse_step", int),
]

# config.json keys transformers 5 writes for a field under another name (attribute_map).
_HF_SAVED_AS = {"num_experts": "num_local_experts"}

# moe_config keys (MindFormers' DeepSeek YAMLs keep moe_config at the top level).
_MOE_FIELDS: list[tuple[str, str, type]] = [
    ("expert_num", "n_routed_experts", int),
    ("num_experts_chosen", "num_experts_per_tok", int),
    ("routed_scaling_factor", "routed_scaling_factor", float),
    ("n_group", "n_group", int),
    ("topk_group", "topk_group", int),
    ("first_k_dense_replace", "first_k_dense_replace", int),
    ("moe_intermediate_size", "moe_intermediate_size", int),
    ("shared_expert_num", "n_shared_experts", int),
]

# model_config.scaling_factor (a mapping means YaRN) -> HF rope_scaling.
_YARN_FIELDS: list[tuple[str, type]] = [
    ("factor", float),
    ("original_max_position_embeddings", int),
    ("beta_fast", float),
    ("beta_slow", float),
    ("mscale", float),
    ("mscale_all_dim", float),
]


class ModelConfigOverrides(dict):
    """HF config.json fields taken from the YAML; `sources[hf_key]` is the YAML key they came from."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source
        self.sources: dict[str, str] = {}

    def put(self, hf_key: str, value: Any, yaml_key: str) -> None:
        self[hf_key] = value
        self.sources[hf_key] = yaml_key


def model_config_overrides(yaml_cfg: dict) -> ModelConfigOverrides:
    """The YAML's model fields (`model.model_config`, `moe_config`) under HF config.json names.

    Only keys the YAML sets appear. Not mapped, on purpose: compute_dtype (a compute choice, not
    the checkpoint's dtype), num_blocks (vLLM sizes its own KV cache), block_size (see
    parallel.parser_defaults) and quantization_config (MindFormers' own format, read by the model
    backend from the YAML; vLLM would misread it in config.json).
    """
    source = getattr(yaml_cfg, "path", "<yaml>")
    model = yaml_cfg.get("model") or {}
    model_config = (model.get("model_config") if isinstance(model, dict) else None) or {}
    if not isinstance(model_config, dict):
        raise MindFormersConfigError(f"model.model_config in {source} must be a mapping.")
    overrides = ModelConfigOverrides(source)

    for yaml_keys, hf_key, kind in _MODEL_FIELDS:
        present = [k for k in yaml_keys if model_config.get(k) is not None]
        values = {k: _typed(model_config[k], kind, f"model.model_config.{k}", source)
                  for k in present}
        if len(set(values.values())) > 1:
            raise MindFormersConfigError(
                f"{source} sets both " + " and ".join(f"model.model_config.{k} = {v!r}"
                                                      for k, v in values.items())
                + f"; they mean the same ({hf_key}), keep one.")
        if present:
            overrides.put(hf_key, values[present[0]], f"model.model_config.{present[0]}")

    # seq_length is MindFormers' maximum sequence length; it stands in for max_position_embeddings
    # only when the YAML has no max_position_embeddings (MindFormers' own DeepSeek-R1 YAMLs pair
    # seq_length 4096 with max_position_embeddings 163840).
    if "max_position_embeddings" not in overrides and model_config.get("seq_length") is not None:
        overrides.put("max_position_embeddings",
                      _typed(model_config["seq_length"], int, "model.model_config.seq_length", source),
                      "model.model_config.seq_length")

    for prefix, moe in _moe_sections(yaml_cfg, model_config, source):
        for yaml_key, hf_key, kind in _MOE_FIELDS:
            if moe.get(yaml_key) is not None:
                overrides.put(hf_key, _typed(moe[yaml_key], kind, f"{prefix}.{yaml_key}", source),
                              f"{prefix}.{yaml_key}")

    # Rope scaling: the legacy models' scaling_factor (a mapping means YaRN), or the mcore models'
    # rope_scaling in HF's form (its `type` or `rope_type` names the method).
    present = [key for key in ("scaling_factor", "rope_scaling")
               if isinstance(model_config.get(key), dict)]
    if len(present) > 1:
        hf_key = "rope_scaling"
        raise MindFormersConfigError(
            f"{source} sets both " + " and ".join(f"model.model_config.{key}" for key in present)
            + f"; they mean the same ({hf_key}), keep one.")
    for yaml_key in present:
        scaling = model_config[yaml_key]
        method = ("yarn" if yaml_key == "scaling_factor"
                  else scaling.get("rope_type") or scaling.get("type"))
        rope_scaling: dict[str, Any] = {"rope_type": method}
        for key, kind in _YARN_FIELDS:
            if scaling.get(key) is not None:
                rope_scaling[key] = _typed(scaling[key], kind,
                                           f"model.model_config.{yaml_key}.{key}", source)
        overrides.put("rope_scaling", rope_scaling, f"model.model_config.{yaml_key}")
    return overrides


def cross_check(overrides: ModelConfigOverrides | dict, hf_config: dict,
                hf_source: str = "config.json") -> dict[str, Any]:
    """Compare the YAML's model fields with the model folder's config.json.

    Raises MindFormersConfigError naming both values for every field they disagree on. Returns the
    fields config.json lacks, which the caller applies.
    """
    sources = getattr(overrides, "sources", {})
    yaml_source = getattr(overrides, "source", "the MindFormers YAML")
    mismatches, missing = [], {}
    for hf_key, yaml_value in overrides.items():
        yaml_key = sources.get(hf_key, hf_key)
        hf_value = _hf_value(hf_config, hf_key)
        if hf_value is None:
            missing[hf_key] = yaml_value
        elif hf_key == "rope_scaling":
            mismatches += _rope_scaling_mismatches(yaml_value, hf_value, yaml_key, hf_source)
        elif not _same(yaml_value, hf_value):
            mismatches.append(f"  {yaml_key} = {yaml_value!r} but {hf_source} has "
                              f"{hf_key} = {hf_value!r}")
    if mismatches:
        raise MindFormersConfigError(
            f"MindFormers YAML {yaml_source} disagrees with the model's {hf_source}:\n"
            + "\n".join(mismatches)
            + "\nFix the YAML (or point MINDFORMERS_MODEL_CONFIG at the YAML for this model).")
    return missing


def _rope_scaling_mismatches(yaml_scaling: dict, hf_scaling: Any, yaml_key: str,
                             hf_source: str) -> list[str]:
    """Field by field; a field config.json leaves out takes the method's default, so is no conflict."""
    if not isinstance(hf_scaling, dict):
        return [f"  {yaml_key} = {yaml_scaling!r} but {hf_source} has rope_scaling = {hf_scaling!r}"]
    hf_type = hf_scaling.get("rope_type") or hf_scaling.get("type")
    if hf_type != yaml_scaling["rope_type"]:
        return [f"  {yaml_key} (a mapping) means {yaml_scaling['rope_type']} rope scaling but "
                f"{hf_source} has rope type {hf_type!r}"]
    return [f"  {yaml_key}.{key} = {value!r} but {hf_source} has rope_scaling.{key} = "
            f"{hf_scaling[key]!r}"
            for key, value in yaml_scaling.items()
            if key != "rope_type" and hf_scaling.get(key) is not None
            and not _same(value, hf_scaling[key])]


def _moe_sections(yaml_cfg: dict, model_config: dict, source: str):
    """(key prefix, mapping) of each moe_config present: top level first, model_config's wins."""
    for prefix, section in (("moe_config", yaml_cfg.get("moe_config")),
                            ("model.model_config.moe_config", model_config.get("moe_config"))):
        if section is None:
            continue
        if not isinstance(section, dict):
            raise MindFormersConfigError(f"{prefix} in {source} must be a mapping.")
        yield prefix, section


def _hf_value(hf_config: dict, hf_key: str) -> Any:
    # transformers 5 moves rope_theta and the scaling fields into rope_parameters.
    value = hf_config.get(hf_key)
    if value is None and hf_key in _HF_SAVED_AS:
        value = hf_config.get(_HF_SAVED_AS[hf_key])
    rope_parameters = hf_config.get("rope_parameters") or {}
    if value is None and hf_key == "rope_theta":
        value = rope_parameters.get("rope_theta")
    if value is None and hf_key == "rope_scaling" and rope_parameters:
        value = rope_parameters
    return value


def _same(yaml_value: Any, hf_value: Any) -> bool:
    if isinstance(yaml_value, bool) or isinstance(hf_value, bool):
        return yaml_value is hf_value
    if isinstance(yaml_value, (int, float)) and isinstance(hf_value, (int, float)):
        return math.isclose(yaml_value, hf_value, rel_tol=1e-9, abs_tol=0.0)  # 40 == 40.0
    return yaml_value == hf_value


def _typed(value: Any, kind: type, key: str, source: str) -> Any:
    """`value` as `kind`, or an error naming the key and file."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 (pyyaml) reads 1e-6 as a string; only 1.0e-6 is a float. Accept both.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    raise MindFormersConfigError(f"{key} in {source} must be {kind.__name__}, got {value!r}.")
