"""Data parallel exactly as the user guide launches it: a head `serve` with
--data-parallel-size 2 --data-parallel-size-local 1 and a `--headless` secondary with
--data-parallel-start-rank 1, on one machine. Requests reach both engines; tokens equal DP=1."""

from conftest import PROMPTS, free_port, greedy_tokens, slow

ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-bytes",
        str(16 << 20))


@slow("about 3 min on 2 cores; every run covers DP=2 with --headless in "
      "tests/test_expert_parallel.py and tests/test_deploy_data_parallel.py")
def test_dp2_headless_matches_dp1(serve, tiny_model_factory):
    model = tiny_model_factory("Qwen2ForCausalLM")
    single = serve(model, *ARGS)
    expected = greedy_tokens(single, model, PROMPTS * 2)
    single.stop()

    rpc_port = str(free_port())
    dp = ("--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", rpc_port)
    env = {"VLLM_MS_LOG_STEPS": "1"}
    head = serve(model, *ARGS, *dp, env=env, wait=False)
    secondary = serve(model, *ARGS, *dp, "--headless", "--data-parallel-start-rank", "1",
                      env=env, wait=False)
    head.wait_ready()
    assert greedy_tokens(head, model, PROMPTS * 2) == expected
    head_log, secondary_log = head.log_tail(100000), secondary.log_tail(100000)
    assert "step:" in head_log, "the head's engine (DP rank 0) ran no step"
    assert "step:" in secondary_log, "the headless engine (DP rank 1) ran no step"
