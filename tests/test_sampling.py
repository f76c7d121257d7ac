"""Sampling through vLLM's own sampler on MindSpore logits: seeds, top-k/top-p/min-p, penalties
(checked against HF logits with vLLM's documented formulas), stops, n > 1."""

import pytest
import torch
from conftest import PROMPTS, HFReference

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir):
    from vllm import LLM

    llm = LLM(model=model_dir, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=16 << 20,
              seed=0)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def tokens(llm, prompts, **params):
    from vllm import SamplingParams

    params.setdefault("max_tokens", MAX_TOKENS)
    outputs = llm.generate(prompts, SamplingParams(**params))
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_seeded_sampling_is_reproducible(llm):
    first = tokens(llm, PROMPTS[:4], temperature=1.0, seed=1234, ignore_eos=True)
    again = tokens(llm, PROMPTS[:4], temperature=1.0, seed=1234, ignore_eos=True)
    other = tokens(llm, PROMPTS[:4], temperature=1.0, seed=99, ignore_eos=True)
    assert first == again
    assert first != other


def test_truncations_that_keep_one_token_equal_greedy(llm):
    greedy = tokens(llm, PROMPTS, temperature=0.0, ignore_eos=True)
    assert tokens(llm, PROMPTS, temperature=1.0, top_k=1, ignore_eos=True) == greedy
    assert tokens(llm, PROMPTS, temperature=1.0, top_p=1e-6, ignore_eos=True) == greedy
    assert tokens(llm, PROMPTS, temperature=1.0, min_p=1.0, ignore_eos=True) == greedy


def test_n_samples_and_logprobs(llm):
    from vllm import SamplingParams

    out = llm.generate([PROMPTS[2]], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6,
                                                    logprobs=3, ignore_eos=True))[0]
    assert len(out.outputs) == 4
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.token_ids) == 6
        for token, step in zip(completion.token_ids, completion.logprobs):
            assert token in step and 3 <= len(step) <= 4
            ranks = sorted(e.rank for t, e in step.items() if t != token or e.rank <= 3)
            assert ranks[:3] == [1, 2, 3]
            assert all(e.logprob <= 0 for e in step.values())


def test_stop_token_ids_stop_strings_and_max_tokens(llm):
    from vllm import SamplingParams

    prompt = PROMPTS[3]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))[0].outputs[0]
    stop_id = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_id)
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    stop_token_ids=[stop_id]))[0].outputs[0]
    assert list(stopped.token_ids) == list(greedy.token_ids[:first + 1])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id

    text = greedy.text
    stop_string = text[len(text) // 2:len(text) // 2 + 2]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                stop=[stop_string]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop_string)]

    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                  ignore_eos=True))[0].outputs[0]
    assert list(short.token_ids) == list(greedy.token_ids[:3]) and short.finish_reason == "length"


def _penalized_greedy(reference: HFReference, prompt_ids, steps, repetition=1.0, presence=0.0,
                      frequency=0.0):
    """Greedy decoding on HF logits with the penalties as vLLM documents them: repetition
    divides positive / multiplies negative logits of tokens in prompt or output; presence and
    frequency subtract per output token (once / per occurrence)."""
    sequence = list(prompt_ids)
    output: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = reference.model(torch.tensor([sequence])).logits[0, -1].double()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[sequence] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition,
                                               logits * repetition), logits)
        counts = torch.bincount(torch.tensor(output, dtype=torch.long),
                                minlength=logits.numel()).double() if output else 0
        logits = logits - frequency * counts - presence * (torch.as_tensor(counts) > 0).double()
        token = int(logits.argmax())
        output.append(token)
        sequence.append(token)
    return output


@pytest.mark.parametrize("penalty", [dict(repetition=1.8), dict(presence=1.5),
                                     dict(frequency=0.9)])
def test_penalties_match_documented_formula(llm, model_dir, penalty):
    from vllm import SamplingParams

    names = {"repetition": "repetition_penalty", "presence": "presence_penalty",
             "frequency": "frequency_penalty"}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            **{names[k]: v for k, v in penalty.items()})
    reference = HFReference(model_dir)
    plain = tokens(llm, PROMPTS[:4], temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:4], params)
    changed = False
    for output, unpenalized in zip(outputs, plain):
        expected = _penalized_greedy(reference, output.prompt_token_ids, MAX_TOKENS, **penalty)
        assert list(output.outputs[0].token_ids) == expected
        changed |= expected != unpenalized[0]
    assert changed, "the penalty changed nothing: the test would not catch it being ignored"


def kernel_draws(probs: torch.Tensor, draws: int, seed: int) -> torch.Tensor:
    """`draws` tokens from one row of probabilities through vLLM's random_sample as the
    runner patches it (the plugin's kernel), each draw with its own seed."""
    from vllm.v1.sample.ops import topk_topp_sampler

    from vllm_mindspore.patches import SAMPLER_PATCHES, apply

    apply(SAMPLER_PATCHES)
    generator = torch.Generator().manual_seed(seed)
    rows = probs.expand(draws, -1).contiguous()
    generators = {row: torch.Generator().manual_seed(int(s)) for row, s in
                  enumerate(torch.randint(0, 2**62, (draws,), generator=generator))}
    return topk_topp_sampler.random_sample(rows, generators)


def test_kernel_random_sampling_draws_from_the_probabilities():
    """The runner's random sampling (exponential race in C++) draws each token with its
    probability: 200k draws over 13 tokens (not a multiple of the kernel's 8 lanes), zeros
    never drawn, every frequency within 4.5 standard errors (a fixed seed: deterministic)."""
    import numpy as np

    from vllm_mindspore.worker.sampling import exponential_race_argmax

    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.05, 0.0, 0.05, 0.05, 0.04, 0.03, 0.02, 0.01,
                          0.0])
    draws = 200_000
    tokens = kernel_draws(probs, draws, seed=0).numpy()
    frequency = np.bincount(tokens, minlength=len(probs)) / draws
    p = probs.numpy()
    assert frequency[p == 0].sum() == 0
    error = np.abs(frequency - p)[p > 0] / np.sqrt(p * (1 - p) / draws)[p > 0]
    assert error.max() < 4.5, (frequency, error)
    # A seed fixes the draw; other seeds draw other tokens.
    seeds = torch.arange(64, dtype=torch.int64)
    rows = probs.expand(64, -1).contiguous()
    assert torch.equal(exponential_race_argmax(rows, seeds), exponential_race_argmax(rows, seeds))
    assert len(set(exponential_race_argmax(rows, seeds).tolist())) > 3


def test_kernel_random_sampling_follows_a_large_vocabulary():
    """A peaked distribution over 8003 tokens (as a temperature-scaled softmax gives): the top
    token's frequency and the mass of the tail match within 4.5 standard errors."""
    import numpy as np

    logits = torch.linspace(0.0, -12.0, 8003)
    probs = logits.softmax(-1)
    draws = 20_000
    tokens = kernel_draws(probs, draws, seed=1).numpy()
    for event, p in ((tokens == 0, float(probs[0])), (tokens >= 100, float(probs[100:].sum()))):
        assert abs(event.mean() - p) < 4.5 * np.sqrt(p * (1 - p) / draws), (event.mean(), p)


@pytest.mark.usefixtures("two_kernel_threads")
def test_kernel_greedy_argmax_picks_torch_argmax_tokens():
    """The runner's greedy argmax (C++) against torch.argmax: ties (the first maximum wins, in
    the 16-lane loop and in the tail), rows of -inf, NaN (the first NaN wins), vocabularies that
    are not a multiple of 16, a row view with a stride, and rows enough for both kernel threads;
    the same kernel as the logits head's operator (`ops.GreedyTokens`, int32 tokens)."""
    import mindspore as ms
    from vllm.v1.sample.sampler import Sampler

    from vllm_mindspore.ops import GreedyTokens
    from vllm_mindspore.patches import SAMPLER_PATCHES, apply
    from vllm_mindspore.worker.sampling import greedy_argmax

    in_graph = GreedyTokens()

    generator = torch.Generator().manual_seed(0)
    for rows, vocab in ((5, 1), (7, 15), (9, 16), (33, 8003), (130, 8000)):
        logits = torch.randn(rows, vocab, generator=generator)
        logits[0] = 1.0  # all equal: token 0
        if vocab > 3:
            logits[1, vocab - 1] = logits[1, 2] = 50.0  # tie between a lane and the tail
            logits[2] = float("-inf")
            logits[3, vocab // 2] = float("nan")
            logits[3, vocab - 1] = float("nan")
            logits[4, 1:] = logits[4, 0] = 9.0  # every lane's first value ties with token 0
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1)), (rows, vocab)
        tokens = in_graph(ms.Tensor(logits.numpy())).asnumpy()
        assert tokens.dtype == "int32" and tokens.tolist() == logits.argmax(-1).tolist()
    wide = torch.randn(6, 8100, generator=generator)
    view = wide[:, :8000]  # rows 8100 floats apart
    assert torch.equal(greedy_argmax(view), view.argmax(dim=-1))
    apply(SAMPLER_PATCHES)
    assert torch.equal(Sampler.greedy_sample(wide), wide.argmax(dim=-1))


def test_argmax_is_the_sample_only_for_plain_greedy_batches(model_dir):
    """A step of decodes reads the logits head's greedy tokens instead of running vLLM's
    sampler only when the sampler would return the raw argmax: checked on vLLM's own InputBatch
    for every sampling parameter that changes a greedy token (the engine tests of this file and
    tests/test_reliability_serving.py see each take effect), a custom logits processor, and a
    mixed batch. vLLM's SamplingMetadata and built-in processors are pinned to the ones the
    rule was written for, so that a vLLM upgrade reviews it."""
    import dataclasses

    from vllm import SamplingParams
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, build_logitsprocs
    from vllm.v1.sample.logits_processor.interface import LogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    from vllm_mindspore.worker.sampling import argmax_is_the_sample

    assert {f.name for f in dataclasses.fields(SamplingMetadata)} == {
        "temperature", "all_greedy", "all_random", "top_p", "top_k", "generators",
        "max_num_logprobs", "no_penalties", "prompt_token_ids", "frequency_penalties",
        "presence_penalties", "repetition_penalties", "output_token_ids",
        "allowed_token_ids_mask", "bad_words_token_ids", "logitsprocs", "logprob_token_ids",
        "spec_token_ids", "thinking_budget_state_holder"}
    assert [c.__name__ for c in BUILTIN_LOGITS_PROCESSORS] == [
        "MinTokensLogitsProcessor", "LogitBiasLogitsProcessor", "MinPLogitsProcessor"]

    class Custom(LogitsProcessor):
        def __init__(self, *args):
            pass

        @classmethod
        def validate_params(cls, params):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            return logits

    config = VllmConfig(model_config=ModelConfig(model=model_dir, max_model_len=64))

    def plain_greedy(*requests: SamplingParams, custom=()) -> bool:
        batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64,
                           device=torch.device("cpu"), vocab_size=1000, block_sizes=[16],
                           max_num_blocks_per_req=[4],
                           logitsprocs=build_logitsprocs(config, torch.device("cpu"), False,
                                                         False, custom))
        for i, params in enumerate(requests):
            batch.add_request(CachedRequestState(
                req_id=str(i), prompt_token_ids=[1, 2, 3], mm_features=[],
                sampling_params=params, generator=None, block_ids=([0],),
                num_computed_tokens=0, output_token_ids=[]))
        batch.refresh_metadata()
        return argmax_is_the_sample(batch.sampling_metadata)

    greedy = SamplingParams(temperature=0)
    bad_words = SamplingParams(temperature=0)
    bad_words._bad_words_token_ids = [[7]]
    assert plain_greedy(greedy, SamplingParams(temperature=0, min_p=0.5, top_k=3))
    for changed in (SamplingParams(temperature=0.8), SamplingParams(temperature=0, logprobs=2),
                    SamplingParams(temperature=0, repetition_penalty=1.2),
                    SamplingParams(temperature=0, presence_penalty=0.5),
                    SamplingParams(temperature=0, frequency_penalty=0.5),
                    SamplingParams(temperature=0, logit_bias={5: 10.0}),
                    SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[2]),
                    SamplingParams(temperature=0, allowed_token_ids=[1, 2]), bad_words):
        assert not plain_greedy(greedy, changed), changed
    assert not plain_greedy(greedy, custom=(Custom,))
