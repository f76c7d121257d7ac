"""Expert parallel as the user guide runs DeepSeek (scaled down): two data-parallel engines
(head + `--headless` secondary), `--enable-expert-parallel`, routed experts split between them,
dispatched with AllGather + AllReduce over MindSpore's mccl. Greedy tokens match HF's."""

import pytest

from conftest import (PROMPTS, TOKEN_BUDGET, assert_serves_hf_tokens, finish_deepseek_checkpoint,
                      free_port, greedy_tokens, slow)
from test_moe_models import MODELS

ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-bytes",
        str(8 << 20), "--block-size", "16", "--max-num-batched-tokens", str(TOKEN_BUDGET))


@pytest.fixture(scope="module")
def deepseek(tiny_model_factory):
    arch, overrides = MODELS["deepseek-v3-q-lora"]
    model = tiny_model_factory(arch, **overrides)
    finish_deepseek_checkpoint(model)
    return model


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=slow(
    "4 ranks compiling at once need 3-5 min on 2 cores"))])
def test_dp2_expert_parallel_matches_hf(serve, deepseek, tp):
    """tp=2 is the user guide's DP x TP x EP layout (DP4/TP4/EP4) scaled down: 4 ranks, each
    engine's TP ranks a MindSpore subgroup of the expert-parallel world."""
    model = deepseek
    dp = ("--tensor-parallel-size", str(tp), "--data-parallel-size", "2",
          "--data-parallel-size-local", "1",
          "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port()),
          "--enable-expert-parallel")
    env = {"VLLM_MS_LOG_STEPS": "1"}
    head = serve(model, *ARGS, *dp, env=env, wait=False)
    secondary = serve(model, *ARGS, *dp, "--headless", "--data-parallel-start-rank", "1",
                      env=env, wait=False)
    head.wait_ready(timeout=600)  # 4 ranks compiling on 2 cores
    assert_serves_hf_tokens(model, PROMPTS, greedy_tokens(head, model, PROMPTS))
    for server in (head, secondary):
        log = server.log_tail(100000)
        assert "MindSpore communication up: rank" in log and f"of {2 * tp}" in log
        assert "step:" in log


@slow("about 3 min on 2 cores, most of it the secondary waiting out vLLM's handshake")
def test_mismatched_data_parallel_sizes_stop_both_with_a_clear_error(serve, deepseek):
    """The head says 2 engines, the secondary 4: nothing hangs, both exit, the head says why."""
    common = ("--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(free_port()), "--enable-expert-parallel")
    head = serve(deepseek, *ARGS, "--data-parallel-size", "2", *common, wait=False)
    secondary = serve(deepseek, *ARGS, "--data-parallel-size", "4", *common, "--headless",
                      "--data-parallel-start-rank", "1", wait=False)
    for server in (head, secondary):
        server.proc.wait(240)  # raises TimeoutExpired if either hangs
    assert head.proc.returncode != 0
    assert "Configuration mismatch detected" in head.log_tail(100000)
    assert "same command-line arguments" in head.log_tail(100000)
    assert "EngineCore encountered a fatal error" in secondary.log_tail(100000)
