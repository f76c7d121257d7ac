"""The MindFormers backend end to end: `vLLM_MODEL_BACKEND=MindFormers` plus a YAML from
yaml_configs/ serves the same greedy tokens as the Native backend and HF transformers (through
the mindformers package's own model classes when it is installed, else the native
implementation configured from the YAML, as the log says); YAML parallel settings are overridden
by the CLI, and bad YAMLs stop the server before any worker starts."""

import os

import pytest
from conftest import (PROMPTS, ROOT, HFReference, assert_matches_hf, greedy_tokens,
                      needs_mindformers, slow)

from model_backends import mindformers_installed

SMALL = os.path.join(ROOT, "yaml_configs", "small")
ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(16 << 20))


@pytest.fixture(scope="module")
def qwen2(tiny_model_factory):
    return tiny_model_factory("Qwen2ForCausalLM")  # the shape of predict_qwen2_tiny.yaml


def mindformers_env(yaml_name):
    return {"vLLM_MODEL_BACKEND": "MindFormers",
            "MINDFORMERS_MODEL_CONFIG": os.path.join(SMALL, yaml_name)}


@slow("about 50 s; every run serves mindformers' Qwen3 class here, its Qwen2 class over Ray at "
      "TP=2 (tests/test_deploy_ray.py) and checks its Qwen2 class against HF "
      "(tests/test_mindformers_adapter.py)")
def test_mindformers_backend_serves_hf_tokens(serve, qwen2):
    """The Native backend serves HF's tokens too (tests/test_serve.py): both backends agree."""
    server = serve(qwen2, *ARGS, env=mindformers_env("predict_qwen2_tiny.yaml"))
    tokens = greedy_tokens(server, qwen2, PROMPTS)
    reference = HFReference(qwen2)
    for prompt, ours in zip(PROMPTS, tokens):
        expected, steps = reference.greedy(reference.tokenizer(prompt)["input_ids"], len(ours))
        assert_matches_hf(ours, None, expected, steps, repr(prompt))
    log = server.log_tail(100000)
    assert "Model backend: MindFormers (vLLM_MODEL_BACKEND=MindFormers)" in log
    if mindformers_installed():
        assert ("Built mindformers.models.qwen2.modeling_qwen2_infer.InferenceQwen2ForCausalLM "
                "with MindFormersBackend") in log
    else:
        assert "not installed (make install-mindformers): native implementation" in log
    assert "block_size=16" in log


@needs_mindformers()
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
    reference = HFReference(model)
    for prompt, ours in zip(prompts, tokens):
        ids = reference.tokenizer(prompt)["input_ids"]
        expected, steps = reference.greedy(ids, len(ours))
        assert_matches_hf(ours, None, expected, steps, repr(prompt))


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
    assert "Loaded" not in log and "Compiled the model graph" not in log


def test_unknown_backend_is_rejected(serve, qwen2):
    server = serve(qwen2, *ARGS, env={"vLLM_MODEL_BACKEND": "Torch"}, wait=False)
    server.proc.wait(timeout=120)
    assert server.proc.returncode != 0
    assert "valid values: Native, MindFormers" in server.log_tail(100000)
