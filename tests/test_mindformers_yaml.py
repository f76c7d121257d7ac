"""MindFormers YAML semantics, parallel_config -> vLLM mapping, model fields, and the shipped
yaml_configs/. Fast and server-free; only the CLI test builds vLLM's real argument parser."""

import glob
import json
import logging
import os
import textwrap
from types import SimpleNamespace

import pytest
from conftest import MF_DEEPSEEK_V3, MF_DEEPSEEK_YARN, MF_QWEN3_MOE

from vllm_mindspore.config import (
    MindFormersConfigError,
    YamlParallelConfig,
    apply_to_vllm_config,
    cross_check,
    expert_parallel_size,
    load_mindformers_config,
    model_config_overrides,
    parser_defaults,
    validate,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAML_DIR = os.path.join(ROOT, "yaml_configs")
TP16 = os.path.join(YAML_DIR, "predict_deepseek_r1_671b_w8a8.yaml")
EP4TP4 = os.path.join(YAML_DIR, "predict_deepseek_r1_671b_w8a8_ep4tp4.yaml")
LOG = logging.getLogger("vllm.test_mindformers_yaml")

# DeepSeek-R1's published config.json (the fields the YAML maps).
DEEPSEEK_R1_CONFIG = {
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "vocab_size": 129280, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "max_position_embeddings": 163840,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}


def write(folder, name, text):
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))
    return path


def yaml_with(tmp_path, parallel: str = "", model_config: str = "") -> dict:
    """Load a one-file YAML with the given parallel_config / model_config bodies."""
    text = "parallel_config:\n" + textwrap.indent(textwrap.dedent(parallel), "  ") if parallel else ""
    if model_config:
        text += "model:\n  model_config:\n" + textwrap.indent(textwrap.dedent(model_config), "    ")
    return load_mindformers_config(write(tmp_path, "cfg.yaml", text or "{}\n"))


def fake_vllm_config(tp=1, dp=1, pp=1, ep=False, block_size=None, quantization=None):
    parallel = SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp,
                               pipeline_parallel_size=pp, enable_expert_parallel=ep)
    # As vLLM's CacheConfig: an unset block size becomes 16 and counts as not user-specified.
    cache = SimpleNamespace(block_size=block_size or 16,
                            user_specified_block_size=block_size is not None)
    return SimpleNamespace(parallel_config=parallel, cache_config=cache,
                           model_config=SimpleNamespace(quantization=quantization))


# ---------------------------------------------------------------- YAML semantics


def test_multi_level_base_config_chain_deep_merges_child_over_bases(tmp_path):
    write(tmp_path, "base/grand.yaml", """\
        seed: 0
        model:
          model_config: {hidden_size: 8, num_layers: 2, scaling_factor: {factor: 4.0, beta_fast: 32.0}}
          arch: {type: A}
        """)
    write(tmp_path, "base/parent.yaml", """\
        base_config: grand.yaml        # relative to base/, not to the child's folder
        model:
          model_config: {num_layers: 4, scaling_factor: {factor: 8.0}}
        """)
    child = write(tmp_path, "child.yaml", """\
        base_config: base/parent.yaml
        model:
          model_config: {hidden_size: 16}
        """)
    cfg = load_mindformers_config(child)
    assert "base_config" not in cfg
    assert cfg["seed"] == 0
    assert cfg["model"]["arch"] == {"type": "A"}
    assert cfg["model"]["model_config"] == {
        "hidden_size": 16, "num_layers": 4, "scaling_factor": {"factor": 8.0, "beta_fast": 32.0}}
    assert cfg.path == child
    assert [os.path.basename(f) for f in cfg.files] == ["child.yaml", "parent.yaml", "grand.yaml"]


def test_list_bases_merge_in_order_at_top_level_like_mindformers(tmp_path):
    write(tmp_path, "a.yaml", "model: {x: 1, y: 1}\nonly_a: a\nshared: a\n")
    write(tmp_path, "b.yaml", "model: {y: 2}\nshared: b\n")
    cfg = load_mindformers_config(write(tmp_path, "c.yaml", "base_config: [a.yaml, b.yaml]\n"))
    # MindFormerConfig combines bases with dict.update: b's `model` section replaces a's whole.
    assert cfg == {"model": {"y": 2}, "only_a": "a", "shared": "b"}


def test_child_scalars_lists_and_null_replace_base_values(tmp_path):
    write(tmp_path, "base.yaml", "a: {b: {c: 1}}\nl: [1, 2]\nq: {quant_method: ptq}\n")
    cfg = load_mindformers_config(write(tmp_path, "child.yaml", """\
        base_config: base.yaml
        a: {b: 5}
        l: [3]
        q: null
        """))
    assert cfg == {"a": {"b": 5}, "l": [3], "q": None}


def test_same_base_twice_through_two_paths_is_not_a_cycle(tmp_path):
    write(tmp_path, "common.yaml", "k: 1\n")
    write(tmp_path, "left.yaml", "base_config: common.yaml\nleft: 1\n")
    write(tmp_path, "right.yaml", "base_config: common.yaml\nright: 1\n")
    cfg = load_mindformers_config(write(tmp_path, "top.yaml", "base_config: [left.yaml, right.yaml]\n"))
    assert cfg == {"k": 1, "left": 1, "right": 1}


def test_missing_base_names_the_path_and_the_including_yaml(tmp_path):
    child = write(tmp_path, "child.yaml", "base_config: nowhere/missing.yaml\n")
    with pytest.raises(MindFormersConfigError) as err:
        load_mindformers_config(child)
    assert os.path.join(str(tmp_path), "nowhere", "missing.yaml") in str(err.value)
    assert f"base_config of {child}" in str(err.value)


def test_missing_top_level_file_names_its_origin(tmp_path):
    with pytest.raises(MindFormersConfigError, match=r"not found: .*absent\.yaml \(given by "
                                                     r"MINDFORMERS_MODEL_CONFIG\)"):
        load_mindformers_config(tmp_path / "absent.yaml", origin="MINDFORMERS_MODEL_CONFIG")


def test_cyclic_base_config_shows_the_cycle(tmp_path):
    write(tmp_path, "a.yaml", "base_config: b.yaml\n")
    write(tmp_path, "b.yaml", "base_config: sub/../c.yaml\n")
    write(tmp_path, "c.yaml", "base_config: b.yaml\n")
    with pytest.raises(MindFormersConfigError, match="Cyclic base_config") as err:
        load_mindformers_config(tmp_path / "a.yaml")
    b, c = (os.path.join(str(tmp_path), n) for n in ("b.yaml", "c.yaml"))
    assert f"{b} -> {c} -> {b}" in str(err.value)


def test_self_reference_is_a_cycle(tmp_path):
    with pytest.raises(MindFormersConfigError, match="Cyclic"):
        load_mindformers_config(write(tmp_path, "self.yaml", "base_config: ./self.yaml\n"))


def test_malformed_yaml_names_file_and_line(tmp_path):
    write(tmp_path, "base.yaml", "model:\n  model_config:\n    hidden_size: 8\n   bad_indent: 1\n")
    child = write(tmp_path, "child.yaml", "base_config: base.yaml\n")
    with pytest.raises(MindFormersConfigError) as err:
        load_mindformers_config(child)
    message = str(err.value)
    assert os.path.join(str(tmp_path), "base.yaml") in message
    assert "line 4" in message


def test_malformed_yaml_unclosed_bracket(tmp_path):
    path = write(tmp_path, "bad.yaml", "a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(MindFormersConfigError, match=r"bad\.yaml, line \d+"):
        load_mindformers_config(path)


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just text\n", "str")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    with pytest.raises(MindFormersConfigError, match=f"mapping .* at the top level, found a {kind}"):
        load_mindformers_config(write(tmp_path, "top.yaml", text))


def test_bad_base_config_value(tmp_path):
    with pytest.raises(MindFormersConfigError, match="base_config in .* must be a file name"):
        load_mindformers_config(write(tmp_path, "x.yaml", "base_config: 3\n"))


def test_empty_file_reads_as_empty_mapping(tmp_path):
    assert load_mindformers_config(write(tmp_path, "empty.yaml", "")) == {}


# ---------------------------------------------------------------- parallel_config


def test_parallel_defaults_when_section_or_keys_missing(tmp_path):
    assert YamlParallelConfig.from_yaml(yaml_with(tmp_path)) == YamlParallelConfig()
    cfg = yaml_with(tmp_path, parallel="model_parallel: 2\nvocab_emb_dp: False\n")
    assert YamlParallelConfig.from_yaml(cfg) == YamlParallelConfig(model_parallel=2)


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "true", "'4'", "[2]"])
def test_parallel_sizes_must_be_positive_ints(tmp_path, value):
    cfg = yaml_with(tmp_path, parallel=f"model_parallel: {value}\n")
    with pytest.raises(MindFormersConfigError,
                       match=r"parallel_config\.model_parallel in .*cfg\.yaml must be a positive"):
        YamlParallelConfig.from_yaml(cfg)


def test_parallel_config_must_be_a_mapping(tmp_path):
    cfg = load_mindformers_config(write(tmp_path, "p.yaml", "parallel_config: 16\n"))
    with pytest.raises(MindFormersConfigError, match="parallel_config in .* must be a mapping"):
        YamlParallelConfig.from_yaml(cfg)


def test_yaml_only_mapping_to_vllm_defaults(tmp_path):
    cfg = yaml_with(tmp_path, parallel="data_parallel: 1\nmodel_parallel: 16\n",
                    model_config="block_size: 128\n")
    assert parser_defaults(cfg) == {
        "tensor_parallel_size": 16, "data_parallel_size": 1, "pipeline_parallel_size": 1,
        "enable_expert_parallel": False, "block_size": 128}


def test_dp_ep_mapping_enables_expert_parallel(tmp_path):
    cfg = yaml_with(tmp_path, parallel="data_parallel: 4\nmodel_parallel: 4\nexpert_parallel: 4\n")
    defaults = parser_defaults(cfg)
    assert defaults["data_parallel_size"] == 4 and defaults["tensor_parallel_size"] == 4
    assert defaults["enable_expert_parallel"] is True
    assert "block_size" not in defaults


@pytest.mark.parametrize("parallel, message", [
    ("data_parallel: 2\nmodel_parallel: 3\nexpert_parallel: 4\n",
     r"data_parallel \* model_parallel = 2 \* 3 = 6 is not divisible by expert_parallel = 4\. "
     r"Rule: data_parallel and model_parallel set the parallelism of attention"),
    ("model_parallel: 4\nexpert_parallel: 8\n", r"= 1 \* 4 = 4 is not divisible by expert_parallel = 8"),
    ("model_parallel: 8\npipeline_stage: 2\n", r"pipeline_stage = 2 .* not supported"),
])
def test_invalid_parallel_combinations_rejected(tmp_path, parallel, message):
    cfg = yaml_with(tmp_path, parallel=parallel)
    with pytest.raises(MindFormersConfigError, match=message):
        validate(YamlParallelConfig.from_yaml(cfg))
    with pytest.raises(MindFormersConfigError, match=message):  # before any engine starts
        parser_defaults(cfg)


def test_yaml_w8a8_quantization_config_selects_golden_stick(tmp_path, caplog):
    """MindFormers' W8A8 (ptq, int8 weights and activations) is served as --quantization
    golden-stick: a parser default for serve; offline, LLM(...) must pass it (vLLM built its
    quantization config before the platform sees the YAML); an explicit method wins."""
    w8a8 = ("quantization_config:\n  quant_method: ptq\n  weight_dtype: int8\n"
            "  activation_dtype: int8\n")
    cfg = yaml_with(tmp_path, model_config=w8a8)
    assert parser_defaults(cfg)["quantization"] == "golden-stick"
    with pytest.raises(MindFormersConfigError, match="pass quantization='golden-stick'"):
        apply_to_vllm_config(cfg, fake_vllm_config(), LOG)
    apply_to_vllm_config(cfg, fake_vllm_config(quantization="golden-stick"), LOG)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        apply_to_vllm_config(cfg, fake_vllm_config(quantization="ascend"), LOG,
                             cli_defaults_applied=True)
    assert "quantization=ascend (given explicitly) overrides" in caplog.text
    assert "quantization" not in parser_defaults(yaml_with(tmp_path, model_config=""))


def test_yaml_other_quantization_config_rejected(tmp_path):
    cfg = yaml_with(tmp_path, model_config="quantization_config:\n  quant_method: ptq\n"
                                           "  weight_dtype: int4\n  activation_dtype: int8\n")
    with pytest.raises(MindFormersConfigError,
                       match=r"quantization_config: .*'weight_dtype': 'int4'.*golden-stick"):
        parser_defaults(cfg)


def test_invalid_block_size_rejected(tmp_path):
    cfg = yaml_with(tmp_path, model_config="block_size: 0\n")
    with pytest.raises(MindFormersConfigError, match=r"model\.model_config\.block_size .* positive"):
        parser_defaults(cfg)


@pytest.fixture(scope="module")
def vllm_parser_factory():
    """vLLM's real serve/LLM argument parser (the one `pre_register_and_update` receives)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    saved = os.environ.pop("MINDFORMERS_MODEL_CONFIG", None)  # keep the platform hook neutral
    try:
        yield lambda: AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    finally:
        if saved is not None:
            os.environ["MINDFORMERS_MODEL_CONFIG"] = saved


def test_cli_overrides_yaml_through_vllm_parser(vllm_parser_factory):
    parser = vllm_parser_factory()
    parser.set_defaults(**parser_defaults(load_mindformers_config(TP16)))

    args = parser.parse_args([])  # YAML only
    assert (args.tensor_parallel_size, args.data_parallel_size, args.pipeline_parallel_size,
            args.enable_expert_parallel, args.block_size) == (16, 1, 1, False, 128)
    assert args.quantization == "golden-stick"  # quantization_config: ptq, int8 / int8

    args = parser.parse_args(["--tensor-parallel-size", "8", "--block-size", "64"])
    assert (args.tensor_parallel_size, args.block_size) == (8, 64)
    assert parser.parse_args(["-tp", "4"]).tensor_parallel_size == 4


def test_dp_ep_yaml_through_vllm_parser(vllm_parser_factory):
    parser = vllm_parser_factory()
    parser.set_defaults(**parser_defaults(load_mindformers_config(EP4TP4)))
    args = parser.parse_args([])
    assert (args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel) == (4, 4, True)
    args = parser.parse_args(["--data-parallel-size", "2", "--no-enable-expert-parallel"])
    assert (args.data_parallel_size, args.enable_expert_parallel) == (2, False)


def test_apply_logs_cli_override_with_both_values(caplog):
    cfg = load_mindformers_config(TP16)
    vllm_config = fake_vllm_config(tp=8, block_size=128, quantization="golden-stick")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        apply_to_vllm_config(cfg, vllm_config, LOG, cli_defaults_applied=True)
    assert "tensor_parallel_size=8 (given explicitly) overrides parallel_config.model_parallel=16" \
        in caplog.text
    assert "world size 16" in caplog.text and "effective world size 8" in caplog.text


def test_apply_offline_fills_expert_parallel_and_block_size(caplog):
    cfg = load_mindformers_config(EP4TP4)
    vllm_config = fake_vllm_config(tp=4, dp=4, quantization="golden-stick")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        apply_to_vllm_config(cfg, vllm_config, LOG)
    assert vllm_config.parallel_config.enable_expert_parallel is True
    assert vllm_config.cache_config.block_size == 128
    assert expert_parallel_size(cfg, vllm_config.parallel_config) == 4
    assert "Expert parallel enabled because" in caplog.text


def test_apply_offline_rejects_yaml_size_left_at_vllm_default():
    with pytest.raises(MindFormersConfigError,
                       match=r"model_parallel: 16, but vLLM was started with tensor_parallel_size=1 "
                             r"\(its default\).*Pass tensor_parallel_size=16"):
        apply_to_vllm_config(load_mindformers_config(TP16), fake_vllm_config(tp=1), LOG)


def test_apply_reports_expert_parallel_switched_off(caplog):
    cfg = load_mindformers_config(EP4TP4)
    vllm_config = fake_vllm_config(tp=4, dp=4, ep=False, block_size=128,
                                   quantization="golden-stick")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        apply_to_vllm_config(cfg, vllm_config, LOG, cli_defaults_applied=True)
    assert vllm_config.parallel_config.enable_expert_parallel is False
    assert "expert_parallel is ignored" in caplog.text
    assert expert_parallel_size(cfg, vllm_config.parallel_config) == 1


def test_apply_rejects_cli_sizes_that_break_the_expert_rule():
    cfg = load_mindformers_config(EP4TP4)
    with pytest.raises(MindFormersConfigError, match=r"= 1 \* 2 = 2 is not divisible by expert_parallel = 4"):
        apply_to_vllm_config(cfg, fake_vllm_config(tp=2, dp=1, ep=True), LOG, cli_defaults_applied=True)


def test_apply_rejects_cli_pipeline_parallel(tmp_path):
    with pytest.raises(MindFormersConfigError, match="pipeline parallelism is not supported"):
        apply_to_vllm_config(yaml_with(tmp_path), fake_vllm_config(pp=2), LOG, cli_defaults_applied=True)


def test_apply_keeps_explicit_block_size(caplog, tmp_path):
    cfg = yaml_with(tmp_path, model_config="block_size: 16\n")
    vllm_config = fake_vllm_config(block_size=32)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        apply_to_vllm_config(cfg, vllm_config, LOG)
    assert vllm_config.cache_config.block_size == 32
    assert "block_size=32 (given explicitly) overrides model.model_config.block_size=16" in caplog.text


# ---------------------------------------------------------------- model fields


def test_deepseek_model_overrides_match_published_config():
    overrides = model_config_overrides(load_mindformers_config(TP16))
    assert overrides["num_hidden_layers"] == 61 and overrides["n_routed_experts"] == 256
    assert overrides["rope_scaling"] == {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert overrides.sources["n_routed_experts"] == "moe_config.expert_num"
    assert cross_check(overrides, DEEPSEEK_R1_CONFIG) == {}
    assert set(overrides) == set(DEEPSEEK_R1_CONFIG)


def test_cross_check_names_both_values_and_returns_missing_fields():
    overrides = model_config_overrides(load_mindformers_config(TP16))
    hf = dict(DEEPSEEK_R1_CONFIG, num_hidden_layers=60)
    hf["rope_scaling"] = dict(hf["rope_scaling"], factor=8)
    del hf["n_group"]
    with pytest.raises(MindFormersConfigError) as err:
        cross_check(overrides, hf)
    message = str(err.value)
    assert "model.model_config.num_layers = 61 but config.json has num_hidden_layers = 60" in message
    assert "model.model_config.scaling_factor.factor = 40.0 but config.json has rope_scaling.factor = 8" \
        in message
    assert cross_check(overrides, dict(DEEPSEEK_R1_CONFIG, n_group=None)) == {"n_group": 8}
    # rope scaling fields config.json leaves out take their defaults: no conflict.
    partial_yarn = {"type": "yarn", "factor": 40}
    assert cross_check(overrides, dict(DEEPSEEK_R1_CONFIG, rope_scaling=partial_yarn)) == {}
    with pytest.raises(MindFormersConfigError,
                       match="yarn rope scaling but config.json has rope type 'default'"):
        cross_check(overrides, dict(DEEPSEEK_R1_CONFIG, rope_scaling=None,
                                    rope_parameters={"rope_theta": 10000, "rope_type": "default"}))


def test_mcore_moe_and_rope_scaling_fields_in_hf_names_are_cross_checked(tmp_path):
    """mcore YAMLs write MoE and rope-scaling fields in HF's names in model_config, which
    mindformers merges over config.json: they are compared like the legacy names."""
    cfg = yaml_with(tmp_path, model_config="""\
        num_experts: 8
        topk_group: 1
        norm_topk_prob: true
        rope_scaling: {type: yarn, factor: 4.0, beta_fast: 32}
        """)
    overrides = model_config_overrides(cfg)
    assert overrides["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0}
    assert overrides.sources["rope_scaling"] == "model.model_config.rope_scaling"
    hf = {"num_local_experts": 8, "topk_group": 2, "norm_topk_prob": True,  # Qwen3-MoE's save name
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}
    with pytest.raises(MindFormersConfigError) as err:
        cross_check(overrides, hf)
    assert "model.model_config.topk_group = 1 but config.json has topk_group = 2" in str(err.value)
    assert "num_experts" not in str(err.value)
    assert cross_check(overrides, dict(hf, topk_group=1)) == {}
    with pytest.raises(MindFormersConfigError, match="sets both model.model_config.scaling_factor "
                                                     "and model.model_config.rope_scaling"):
        model_config_overrides(yaml_with(tmp_path, model_config="""\
            scaling_factor: {factor: 4.0}
            rope_scaling: {type: yarn, factor: 4.0}
            """))


@pytest.mark.parametrize("yaml_name, arch, overrides", [
    ("predict_qwen3_moe_tiny.yaml", "Qwen3MoeForCausalLM", dict(MF_QWEN3_MOE, norm_topk_prob=True)),
    ("predict_deepseek_v3_tiny.yaml", "DeepseekV3ForCausalLM",
     dict(MF_DEEPSEEK_V3, rope_parameters=MF_DEEPSEEK_YARN, routed_scaling_factor=2.5,
          norm_topk_prob=True)),
])
def test_tiny_moe_variants_match_the_test_models(tiny_model_factory, yaml_name, arch, overrides):
    """small/predict_{qwen3_moe,deepseek_v3}_tiny.yaml describe the tiny checkpoints the
    MindFormers serve tests run (tests/test_mindformers_backend.py): every field they set agrees
    with vLLM's HF config of the checkpoint (as the configuration step reads it)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_model_factory(arch, **overrides)).to_dict()
    cfg = model_config_overrides(load_mindformers_config(os.path.join(YAML_DIR, "small", yaml_name)))
    assert cross_check(cfg, hf) == {}
    assert {"num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"} <= set(cfg)


def test_legacy_and_hf_key_names_and_float_strings(tmp_path):
    cfg = yaml_with(tmp_path, model_config="""\
        num_heads: 28
        num_key_value_heads: 4
        theta: 1000000.0
        rms_norm_eps: 1e-6      # a string in YAML 1.1
        seq_length: 8192
        moe_config: {expert_num: 8, num_experts_chosen: 2}
        """)
    overrides = model_config_overrides(cfg)
    assert overrides == {"num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1e6,
                         "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
                         "n_routed_experts": 8, "num_experts_per_tok": 2}
    assert overrides.sources["max_position_embeddings"] == "model.model_config.seq_length"
    # transformers 5 keeps rope_theta inside rope_parameters.
    assert cross_check(overrides, {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
                                   "num_attention_heads": 28}) == {
        "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
        "n_routed_experts": 8, "num_experts_per_tok": 2}


def test_conflicting_aliases_and_bad_types_rejected(tmp_path):
    with pytest.raises(MindFormersConfigError, match="sets both model.model_config.num_layers = 4 and "
                                                     "model.model_config.num_hidden_layers = 5"):
        model_config_overrides(yaml_with(tmp_path, model_config="num_layers: 4\nnum_hidden_layers: 5\n"))
    with pytest.raises(MindFormersConfigError, match=r"model\.model_config\.hidden_size in .* must be int"):
        model_config_overrides(yaml_with(tmp_path, model_config="hidden_size: big\n"))


# ---------------------------------------------------------------- shipped yaml_configs


SHIPPED = sorted(glob.glob(os.path.join(YAML_DIR, "**", "*.yaml"), recursive=True))


def test_shipped_set_is_complete():
    names = {os.path.relpath(p, YAML_DIR) for p in SHIPPED}
    assert {"predict_deepseek_r1_671b_w8a8.yaml", "predict_deepseek_r1_671b_w8a8_ep4tp4.yaml",
            "predict_qwen2_5_7b_instruct.yaml", "predict_qwen3_8b.yaml",
            "small/predict_qwen2_tiny.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: os.path.relpath(p, YAML_DIR))
def test_shipped_yaml_loads_validates_and_maps(path):
    cfg = load_mindformers_config(path)
    validate(YamlParallelConfig.from_yaml(cfg))
    defaults = parser_defaults(cfg)
    assert defaults["block_size"] in (16, 128)
    overrides = model_config_overrides(cfg)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert key in overrides


def test_seed_parallel_settings_and_world_sizes():
    tp16 = YamlParallelConfig.from_yaml(load_mindformers_config(TP16))
    ep4tp4 = YamlParallelConfig.from_yaml(load_mindformers_config(EP4TP4))
    assert (tp16.data_parallel, tp16.model_parallel, tp16.pipeline_stage,
            tp16.expert_parallel) == (1, 16, 1, 1)
    assert (ep4tp4.data_parallel, ep4tp4.model_parallel, ep4tp4.pipeline_stage,
            ep4tp4.expert_parallel) == (4, 4, 1, 4)
    assert tp16.world_size == 16 and ep4tp4.world_size == 16
    # Seed 000's commands: -tp 16; and -tp 4 -dp 4 --enable-expert-parallel.
    apply_to_vllm_config(load_mindformers_config(TP16),
                         fake_vllm_config(tp=16, quantization="golden-stick"), LOG)
    apply_to_vllm_config(load_mindformers_config(EP4TP4),
                         fake_vllm_config(tp=4, dp=4, ep=True, quantization="golden-stick"), LOG)


def test_deepseek_yamls_differ_only_in_parallel_layout():
    tp16, ep4tp4 = load_mindformers_config(TP16), load_mindformers_config(EP4TP4)
    assert model_config_overrides(tp16) == model_config_overrides(ep4tp4)
    assert tp16["moe_config"] == ep4tp4["moe_config"]


def test_small_variants_inherit_and_shrink():
    tiny = load_mindformers_config(os.path.join(YAML_DIR, "small", "predict_qwen2_tiny.yaml"))
    assert len(tiny.files) == 2
    assert tiny["model"]["model_config"]["qkv_has_bias"] is True  # inherited from Qwen2.5-7B
    assert parser_defaults(tiny)["tensor_parallel_size"] == 1
    assert parser_defaults(tiny)["block_size"] == 16
    tp2 = load_mindformers_config(os.path.join(YAML_DIR, "small", "predict_qwen2_tiny_tp2.yaml"))
    assert len(tp2.files) == 3 and parser_defaults(tp2)["tensor_parallel_size"] == 2
    ds = load_mindformers_config(os.path.join(YAML_DIR, "small", "predict_deepseek_r1_tiny.yaml"))
    assert ds["model"]["model_config"]["quantization_config"] is None
    assert model_config_overrides(ds)["rope_scaling"]["beta_fast"] == 32.0  # inherited YaRN field


def test_tiny_qwen_variants_match_the_test_models():
    """small/predict_qwen{2,3}_tiny.yaml describe conftest's tiny models (for end-to-end tests)."""
    tiny = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=1024, tie_word_embeddings=False,
                rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    for name in ("predict_qwen2_tiny.yaml", "predict_qwen3_tiny.yaml"):
        overrides = model_config_overrides(load_mindformers_config(os.path.join(YAML_DIR, "small", name)))
        assert cross_check(overrides, tiny) == {"rms_norm_eps": 1e-6}, name


def test_demo_variant_matches_demo_model():
    config_path = os.path.join(ROOT, "demo_model", "config.json")
    if not os.path.exists(config_path):
        pytest.skip("demo_model/ not built (scripts/make_demo_model.py)")
    with open(config_path) as f:
        hf = json.load(f)
    cfg = load_mindformers_config(os.path.join(YAML_DIR, "small", "predict_qwen2_demo.yaml"))
    assert cross_check(model_config_overrides(cfg), hf) == {}
