"""vLLM's greedy and random sampling on the plugin's C++ kernels (`csrc/sampling.cc`).

Greedy: vLLM's sampler takes the argmax with its own C++ kernel on its CPU platform
(`torch.ops._C.greedy_argmax`, absent from this vLLM build) and with torch's `argmax`
elsewhere: 0.5 ms for 64 rows of an 8000-token vocabulary on the worker's one torch thread.
`greedy_argmax` makes the same choice (the first maximum; the first NaN) 16 lanes at a time.

Random: vLLM's sampling with its exponential noise drawn in C++.

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
