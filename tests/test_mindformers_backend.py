"""The MindFormers backend end to end: `vLLM_MODEL_BACKEND=MindFormers` plus a YAML from
yaml_configs/ serves the same greedy tokens as the Native backend and HF transformers (through
the mindformers package's own model classes when it is installed, else the native
implementation configured from the YAML, as the log says); YAML parallel settings are overridden
by the CLI, and bad YAMLs stop the server before any worker starts."""

import os

import pytest
from conftest import (MF_DEEPSEEK_V3, MF_DEEPSEEK_YARN, MF_QWEN3_MOE, PROMPTS, ROOT,
                      assert_serves_hf_tokens, greedy_tokens, needs_mindformers,
                      real_tiny_checkpoint, slow)

from model_backends import mindformers_installed

SMALL = os.path.join(ROOT, "yaml_configs", "small")
ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(16 << 20))


@pytest.fixture(scope="module")
def qwen2(tiny_model_factory):
    return tiny_model_factory("Qwen2ForCausalLM")  # the shape of predict_qwen2_tiny.yaml


def mindformers_env(yaml_name):
    return {"vLLM_MODEL_BACKEND": "MindFormers",
            "MINDFORMERS_MODEL_CONFIG": os.path.join(SMALL, yaml_name)}


@slow("about 50 s; every run serves mindformers' Qwen3-MoE class here, its Qwen2 class over Ray at "
      "TP=2 (tests/test_deploy_ray.py) and checks its Qwen2 class against HF "
      "(tests/test_mindformers_adapter.py)")
def test_mindformers_backend_serves_hf_tokens(serve, qwen2):
    """The Native backend serves HF's tokens too (tests/test_serve.py): both backends agree."""
    server = serve(qwen2, *ARGS, env=mindformers_env("predict_qwen2_tiny.yaml"))
    assert_serves_hf_tokens(qwen2, PROMPTS, greedy_tokens(server, qwen2, PROMPTS))
    log = server.log_tail(100000)
    assert "Model backend: MindFormers (vLLM_MODEL_BACKEND=MindFormers)" in log
    if mindformers_installed():
        assert ("Built mindformers.models.qwen2.modeling_qwen2_infer.InferenceQwen2ForCausalLM "
                "with MindFormersBackend") in log
    else:
        assert "not installed (make install-mindformers): native implementation" in log
    assert "block_size=16" in log


@needs_mindformers()
@slow("about 60 s; every run serves mindformers' Qwen3-MoE class (the same attention, rope and norm "
      "cells) the same way with prefix-cache hits checked "
      "(test_mindformers_moe_serves_hf_tokens_with_chunked_prefill_and_prefix_caching), its Qwen3 "
      "class at TP=1 and TP=2 (tests/test_tensor_parallel.py) and step by step against HF "
      "(tests/test_mindformers_adapter.py)")
def test_mindformers_qwen3_serves_hf_tokens_with_chunked_prefill_and_prefix_caching(
        serve, tiny_model_factory):
    """mindformers' InferenceQwen3ForCausalLM behind `vllm-mindspore serve`: steps that mix
    prefill chunks (16-token budget), prefix-cache hits and decodes give HF's greedy tokens."""
    model = tiny_model_factory("Qwen3ForCausalLM")  # the shape of predict_qwen3_tiny.yaml
    server = serve(model, *ARGS, "--enable-chunked-prefill", "--max-num-batched-tokens", "16",
                   "--enable-prefix-caching", env=mindformers_env("predict_qwen3_tiny.yaml"))
    # The second half repeats the first: its prompts hit the prefix cache.
    prompts = PROMPTS + PROMPTS
    tokens = greedy_tokens(server, model, prompts)
    log = server.log_tail(100000)
    assert ("Built mindformers.models.qwen3.modeling_qwen3_infer.InferenceQwen3ForCausalLM "
            "with MindFormersBackend") in log
    assert_serves_hf_tokens(model, prompts, tokens)


# name -> (architecture, tiny-config overrides, YAML, the mindformers class expected to run).
# The same checkpoints as tests/test_mindformers_adapter.py's "qwen3-moe-norm-True" and
# "deepseek-v3-yarn" (which also compare full-vocabulary logprobs with HF).
MOE_MODELS = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(MF_QWEN3_MOE, norm_topk_prob=True),
                  "predict_qwen3_moe_tiny.yaml",
                  "mindformers.models.qwen3_moe.modeling_qwen3_moe_infer."
                  "InferenceQwen3MoeForCausalLM"),
    "deepseek-v3": ("DeepseekV3ForCausalLM",
                    dict(MF_DEEPSEEK_V3, rope_parameters=MF_DEEPSEEK_YARN,
                         routed_scaling_factor=2.5, norm_topk_prob=True),
                    "predict_deepseek_v3_tiny.yaml",
                    "mindformers.models.deepseek3.modeling_deepseek_v3_infer."
                    "InferenceDeepseekV3ForCausalLM"),
}
CHUNKED_PREFIX_ARGS = ("--enable-chunked-prefill", "--max-num-batched-tokens", "16",
                       "--enable-prefix-caching", "--enable-prompt-tokens-details")


def moe_model(tiny_model_factory, name: str) -> str:
    arch, overrides, _, _ = MOE_MODELS[name]
    return real_tiny_checkpoint(tiny_model_factory, arch, overrides, non_negative_bias=True)


def serve_twice(server, model: str, max_tokens: int = 8) -> tuple[list[list[int]], list[int]]:
    """PROMPTS submitted together (vLLM batches them: prefill chunks of the 16-token budget next
    to decodes), then again once they are done (their full blocks are prefix-cache hits) ->
    (token ids of the 16 completions, cached prompt tokens of the second round's)."""
    from concurrent.futures import ThreadPoolExecutor

    client = server.client()

    def one(prompt):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(one, PROMPTS)) + list(pool.map(one, PROMPTS))
    cached = [r.usage.prompt_tokens_details.cached_tokens or 0 for r in responses[len(PROMPTS):]]
    return [r.choices[0].token_ids for r in responses], cached


@needs_mindformers()
@pytest.mark.parametrize("name", [
    "qwen3-moe",
    pytest.param("deepseek-v3", marks=slow(
        "about 80 s; every run serves mindformers' Qwen3-MoE class here (the same MoE layer and "
        "router substitutes) and checks its DeepSeek-V3 class (MLA + grouped MoE) on the same "
        "checkpoint against HF in-process, with prefills, a chunked prefill, a prefix-cache hit "
        "and decodes in one step (tests/test_mindformers_adapter.py, deepseek-v3-yarn)")),
])
def test_mindformers_moe_serves_hf_tokens_with_chunked_prefill_and_prefix_caching(
        serve, tiny_model_factory, name):
    """mindformers' Qwen3-MoE / DeepSeek-V3 class behind `vllm-mindspore serve` with the YAML of
    its tiny checkpoint: steps that mix prefill chunks, prefix-cache hits and decodes give HF's
    greedy tokens. The Native backend serves HF's tokens on these checkpoints too, and both
    backends give the same tokens: test_native_and_mindformers_moe_serve_the_same_tokens
    (slow)."""
    _, _, yaml_name, model_class = MOE_MODELS[name]
    model = moe_model(tiny_model_factory, name)
    server = serve(model, *ARGS, *CHUNKED_PREFIX_ARGS, env=mindformers_env(yaml_name))
    tokens, cached = serve_twice(server, model)
    log = server.log_tail(100000)
    assert f"Built {model_class} with MindFormersBackend" in log
    assert max(cached) >= 16, f"no prefix-cache hit in the second round: {cached}"
    assert_serves_hf_tokens(model, PROMPTS + PROMPTS, tokens, name)


@needs_mindformers()
@slow("about 2 min per model (two server starts); every run serves each backend on MoE "
      "checkpoints against HF: mindformers' Qwen3-MoE class here, the Native Qwen3-MoE and "
      "DeepSeek-V3 in tests/test_moe_models.py")
@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_native_and_mindformers_moe_serve_the_same_tokens(serve, tiny_model_factory, name):
    """The same checkpoint, arguments and requests through the Native backend and mindformers'
    class: the same greedy tokens, both HF's."""
    _, _, yaml_name, model_class = MOE_MODELS[name]
    model = moe_model(tiny_model_factory, name)
    results = {}
    for backend, env in (("Native", {"vLLM_MODEL_BACKEND": "Native"}),
                         ("MindFormers", mindformers_env(yaml_name))):
        server = serve(model, *ARGS, *CHUNKED_PREFIX_ARGS, env=env)
        results[backend] = serve_twice(server, model)[0]
        log = server.log_tail(100000)
        server.stop()
        expected = model_class if backend == "MindFormers" else "model_backends.native."
        assert f"Built {expected}" in log and f"with {backend}Backend" in log
    assert results["Native"] == results["MindFormers"]
    assert_serves_hf_tokens(model, PROMPTS + PROMPTS, results["Native"], f"{name} Native")


@slow("a server start; every run checks the override both ways: test_mindformers_yaml.py on the "
      "config, test_deploy_ray.py on a TP=2 server")
def test_cli_tensor_parallel_size_overrides_model_parallel(serve, qwen2):
    """predict_qwen2_tiny_tp2.yaml sets model_parallel: 2; --tensor-parallel-size 1 wins."""
    server = serve(qwen2, *ARGS, "--tensor-parallel-size", "1",
                   env=mindformers_env("predict_qwen2_tiny_tp2.yaml"))
    assert len(greedy_tokens(server, qwen2, PROMPTS)[0]) == 8
    assert ("tensor_parallel_size=1 (given explicitly) overrides parallel_config.model_parallel=2"
            in server.log_tail(100000))


@pytest.mark.parametrize("yaml_text, expected", [
    ("parallel_config:\n  data_parallel: 1\n  model_parallel: 2\n  expert_parallel: 4\n",
     "is not divisible by expert_parallel"),
    ("parallel_config:\n  pipeline_stage: 2\n", "pipeline parallelism is not supported"),
    ("model:\n  model_config:\n    hidden_size: 96\n",
     "model.model_config.hidden_size = 96 but config.json has hidden_size = 64"),
    ("base_config: missing_base.yaml\n", "missing_base.yaml"),
])
def test_bad_yaml_stops_before_workers(serve, qwen2, tmp_path, yaml_text, expected):
    path = tmp_path / "predict_bad.yaml"
    path.write_text(yaml_text)
    server = serve(qwen2, *ARGS, env={"vLLM_MODEL_BACKEND": "MindFormers",
                                      "MINDFORMERS_MODEL_CONFIG": str(path)}, wait=False)
    server.proc.wait(timeout=120)
    log = server.log_tail(100000)
    assert server.proc.returncode != 0 and expected in log, log[-3000:]
    assert "Loaded" not in log and "graphs in all" not in log  # no weights read, no compile


def test_unknown_backend_is_rejected(serve, qwen2):
    server = serve(qwen2, *ARGS, env={"vLLM_MODEL_BACKEND": "Torch"}, wait=False)
    server.proc.wait(timeout=120)
    assert server.proc.returncode != 0
    assert "valid values: Native, MindFormers" in server.log_tail(100000)
