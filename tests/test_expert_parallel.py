"""Expert parallel as the user guide runs DeepSeek (scaled down): two data-parallel engines
(head + `--headless` secondary), `--enable-expert-parallel`, routed experts split between them,
dispatched with AllGather + AllReduce over MindSpore's mccl. Tokens equal EP off."""

from concurrent.futures import ThreadPoolExecutor

from conftest import PROMPTS, free_port
from test_moe_models import MODELS, finish_deepseek_checkpoint

ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-bytes",
        str(8 << 20), "--block-size", "16")


def greedy(server, model):
    client = server.client()

    def one(prompt):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_dp2_expert_parallel_matches_ep_off(serve, tiny_model_factory):
    arch, overrides = MODELS["deepseek-v3-q-lora"]
    model = tiny_model_factory(arch, **overrides)
    finish_deepseek_checkpoint(model)
    single = serve(model, *ARGS)
    expected = greedy(single, model)
    single.stop()

    dp = ("--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port()),
          "--enable-expert-parallel")
    env = {"VLLM_MS_LOG_STEPS": "1"}
    head = serve(model, *ARGS, *dp, env=env, wait=False)
    secondary = serve(model, *ARGS, *dp, "--headless", "--data-parallel-start-rank", "1",
                      env=env, wait=False)
    head.wait_ready()
    assert greedy(head, model) == expected
    for server in (head, secondary):
        log = server.log_tail(100000)
        assert "MindSpore communication up: rank" in log and "of 2" in log
        assert "graph(s)" in log
