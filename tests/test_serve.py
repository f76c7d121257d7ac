"""`vllm-mindspore serve` end to end with the `openai` client: correctness against HF with a
batch of concurrent mixed-length prompts, chat, streaming, and clear errors that leave the server
serving."""

import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import PROMPTS, TOKEN_BUDGET, HFReference, assert_matches_hf

MAX_TOKENS = 10
SERVE_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes",
              str(32 << 20), "--max-num-batched-tokens", str(TOKEN_BUDGET))


@pytest.fixture(scope="module")
def qwen2(tiny_model_factory):
    return tiny_model_factory("Qwen2ForCausalLM", tie_word_embeddings=True)


def test_serve_completions_match_hf_and_errors_keep_serving(serve, qwen2):
    server = serve(qwen2, *SERVE_ARGS, env={"VLLM_MS_LOG_STEPS": "1"})
    client = server.client()

    def complete(prompt):
        return client.completions.create(
            model=qwen2, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # submitted together: batched by vLLM
        responses = list(pool.map(complete, PROMPTS))
    reference = HFReference(qwen2)
    for prompt, response in zip(PROMPTS, responses):
        choice = response.choices[0]
        prompt_ids = choice.prompt_token_ids
        ref_tokens, ref_steps = reference.greedy(prompt_ids, MAX_TOKENS)
        assert_matches_hf(choice.token_ids, choice.logprobs.token_logprobs, ref_tokens, ref_steps,
                          f"serve {prompt[:20]!r}")

    # Invalid requests: a clear 400 naming the problem, and the server keeps serving.
    too_long = " ".join(["token"] * 400)
    with pytest.raises(openai.BadRequestError, match="maximum context length|max_model_len|too long"):
        complete(too_long)
    for bad in ({"temperature": -1.0}, {"top_p": 1.5}, {"extra_body": {"top_k": -5}}, {"max_tokens": 0},
                {"extra_body": {"repetition_penalty": 0.0}}):
        args = dict(model=qwen2, prompt="hi", max_tokens=4)
        args.update(bad)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**args)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    again = complete(PROMPTS[2])
    assert again.choices[0].token_ids == responses[2].choices[0].token_ids

    chat = client.chat.completions.create(
        model=qwen2, messages=[{"role": "user", "content": "who are you?"}], max_tokens=8,
        temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8

    stream = client.completions.create(model=qwen2, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == responses[1].choices[0].text

    # The graphs compiled at start-up serve every batch shape above: no step compiles.
    log = server.log_tail(100000)
    compiled = int(re.search(r"(\d+) graphs in all", log).group(1))
    steps = [line for line in log.splitlines() if "step:" in line]
    assert len(steps) > 20
    assert all(f" {compiled} graph(s)" in line for line in steps), steps
    assert "recompiled" not in log
