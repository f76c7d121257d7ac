"""vLLM's greedy and random sampling on the plugin's C++ kernels (`csrc/sampling.cc`).

Greedy: vLLM's sampler takes the argmax with its own C++ kernel on its CPU platform
(`torch.ops._C.greedy_argmax`, absent from this vLLM build) and with torch's `argmax`
elsewhere: 0.5 ms for 64 rows of an 8000-token vocabulary on the worker's one torch thread.
`greedy_argmax` makes the same choice (the first maximum; the first NaN) 16 lanes at a time.

Random: vLLM's sampling with its exponential noise drawn in C++.

Plain greedy: when vLLM's sampler would return each row's argmax of the raw logits and nothing
else (`argmax_is_the_sample`), the runner takes the tokens the logits head's graph computed
(`ops.GreedyTokens`) and skips the sampler and the logits' copy to the host: the runner's host
work of a batch-1 bfloat16 step ~340 -> ~190 us (of ~2.3 ms; the tokens read with `tolist`), of a
64-request float32 decode step ~1.4 -> ~0.7 ms (of ~22 ms; the graph's argmax costs ~0.1-0.3 ms
of it back). Prefill steps take the same way when they want no prompt logprobs.

vLLM's `random_sample(probs, generators)` divides the probabilities by Exp(1) noise from
torch's `exponential_()` and takes the argmax. On CPU that noise costs ~1.2 ms for 8 rows of an
8000-token vocabulary (a tenth of a decode step of this project's demo model); vLLM's own CPU
backend replaces it with a C++ kernel for the same reason. Here each row draws one 64-bit seed
(from its request's generator when the request is seeded, else from torch's default generator,
which vLLM seeds with `--seed`) and the kernel derives every token's noise from it, so seeded
requests stay reproducible and unseeded ones follow `--seed`.
"""

import ctypes
import functools

import torch
from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_mindspore.ops.kernels import library_path

_INT64 = torch.iinfo(torch.int64)


_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_ARGUMENT_TYPES = {  # csrc/sampling.cc's functions
    "ExponentialRaceArgmax": [_POINTER, _INT, _INT, _POINTER, _POINTER],
    "GreedyArgmax": [_POINTER, _INT, _INT, _INT, _POINTER],
}


@functools.cache
def _kernel(name: str):
    function = getattr(ctypes.CDLL(library_path()), name)
    function.argtypes = _ARGUMENT_TYPES[name]
    function.restype = None
    return function


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R] int64, `logits.argmax(dim=-1)`'s tokens (float32 CPU rows of unit
    stride through the kernel, anything else through torch)."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1):
        return logits.argmax(dim=-1).view(-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    _kernel("GreedyArgmax")(logits.data_ptr(), logits.shape[0], logits.shape[1],
                            logits.stride(0), tokens.data_ptr())
    return tokens


def exponential_race_argmax(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (rows summing to 1), seeds [R] int64 -> one token per row [R] int64, drawn
    with probability probs[r, token]; the same seed and row give the same token."""
    probs = probs.to(torch.float32).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    tokens = torch.empty(probs.shape[0], dtype=torch.int64)
    _kernel("ExponentialRaceArgmax")(probs.data_ptr(), probs.shape[0], probs.shape[1], seeds.data_ptr(),
              tokens.data_ptr())
    return tokens


def with_kernel_noise(random_sample):
    """vLLM's `random_sample` -> the same draw through `exponential_race_argmax` (float64
    noise, `use_fp64_gumbel`, stays vLLM's own)."""

    def kernel_random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                             use_fp64_gumbel: bool = False) -> torch.Tensor:
        if use_fp64_gumbel or probs.device.type != "cpu":
            return random_sample(probs, generators, use_fp64_gumbel)
        seeds = torch.randint(_INT64.min, _INT64.max, (probs.shape[0],), dtype=torch.int64)
        for row, generator in generators.items():
            seeds[row] = torch.randint(_INT64.min, _INT64.max, (1,), dtype=torch.int64,
                                       generator=generator)[0]
        return exponential_race_argmax(probs, seeds)

    return kernel_random_sample


def argmax_is_the_sample(metadata: SamplingMetadata) -> bool:
    """Whether vLLM 0.33's `Sampler` returns each row's argmax of the raw logits and nothing
    else for this batch: every request greedy, no logprobs, and nothing that changes the logits
    before the argmax (`Sampler.apply_logits_processors`: allowed token ids, bad words,
    penalties, a thinking budget, and the processors that can change an argmax, of which only
    vLLM's min_tokens and logit_bias are known, and only while no request uses them). The
    caller also needs no structured-output bitmask and no prompt logprobs this step.
    tests/test_sampling.py pins the fields read here to this vLLM's."""
    holder = metadata.thinking_budget_state_holder
    return (metadata.all_greedy and metadata.max_num_logprobs is None
            and not metadata.logprob_token_ids and metadata.no_penalties
            and metadata.allowed_token_ids_mask is None and not metadata.bad_words_token_ids
            and (holder is None or not holder.has_tracked_requests())
            and all(_leaves_argmax(p) for p in metadata.logitsprocs.non_argmax_invariant))


def _leaves_argmax(processor) -> bool:
    if type(processor) is MinTokensLogitsProcessor:
        return not processor.min_toks
    if type(processor) is LogitBiasLogitsProcessor:
        return not processor.biases
    return False  # a custom processor: it may change any row
