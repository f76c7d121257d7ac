"""The CPU paged-attention kernel (vllm_mindspore/ops/csrc/paged_attention.cc) against numpy
float64 causal attention, for each pair of activation and cache dtypes it takes: float32 over a
float32 cache, float16 over float16, float32 over bfloat16 (--dtype bfloat16 on CPU). Two calls
share the cache: a step of two prefills (one across a block boundary), then a step of a third
prefill beside two decodes that read the first step's keys and values back."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from vllm_mindspore.ops.attention import AttentionMetadata, PagedAttention
from vllm_mindspore.ops.host import parameter, to_host
from vllm_mindspore.ops.quant_reference import to_dtype

ms.set_context(mode=ms.GRAPH_MODE)

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 16, 8
SCALE = HEAD_SIZE ** -0.5
MS_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


class AttentionStep(nn.Cell):
    """One layer's attention call over caches it owns (Parameters, kept between calls)."""

    def __init__(self, cache_dtype):
        super().__init__()
        self.attn = PagedAttention(HEADS, KV_HEADS, HEAD_SIZE, SCALE, BLOCK_SIZE)
        key_shape, value_shape = self.attn.cache_shapes(NUM_BLOCKS)
        self.key_cache = parameter(np.zeros(key_shape, np.float32), cache_dtype, "key_cache")
        self.value_cache = parameter(np.zeros(value_shape, np.float32), cache_dtype, "value_cache")

    def construct(self, qk, v, positions, *metadata):
        return self.attn(qk, v, self.key_cache, self.value_cache, positions, *metadata)


def reference(queries, keys, values):
    """Causal attention of a request's last len(queries) tokens over all its keys/values:
    [n, H, D], [S, KVH, D], [S, KVH, D] -> [n, H, D] (float64)."""
    group = HEADS // KV_HEADS
    keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
    first = len(keys) - len(queries)
    out = np.zeros(queries.shape)
    for i, q in enumerate(queries):
        visible = first + i + 1
        scores = np.einsum("hd,shd->hs", q, keys[:visible]) * SCALE
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[i] = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), values[:visible])
    return out


@pytest.mark.parametrize("dtype, cache_dtype, tolerance", [
    ("float32", "float32", 1e-5), ("float16", "float16", 2e-3), ("float32", "bfloat16", 1e-5)])
def test_paged_attention_matches_numpy(dtype, cache_dtype, tolerance):
    """Each step's output equals numpy attention over the keys/values as the cache stores them
    (rounded to its dtype), with the queries as the activations hold them."""
    g = np.random.default_rng(0)
    step = AttentionStep(MS_DTYPES[cache_dtype])
    block_tables = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 0], [0, 0, 0]], np.int32)
    # Request -> its tokens so far: (queries [S, H, D], keys [S, KVH, D], values [S, KVH, D]).
    history: dict[int, list] = {}
    for new_tokens in ({0: 21, 1: 3}, {0: 1, 1: 1, 2: 9}):
        requests = sorted(new_tokens)
        total = sum(new_tokens.values())
        qk = to_dtype(g.standard_normal((total, HEADS + KV_HEADS, HEAD_SIZE)), dtype)
        v = to_dtype(g.standard_normal((total, KV_HEADS * HEAD_SIZE)), dtype)
        num_computed = np.array([len(history.get(r, [[]])[0]) for r in requests])
        num_scheduled = np.array([new_tokens[r] for r in requests])
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(num_computed,
                                                                          num_scheduled)])
        metadata = AttentionMetadata.build(num_scheduled, num_computed, positions,
                                           block_tables, BLOCK_SIZE, total)
        out = step(ms.Tensor(qk, MS_DTYPES[dtype]), ms.Tensor(v, MS_DTYPES[dtype]),
                   ms.Tensor(positions.astype(np.int32)), *metadata.tensors())
        out = to_host(out).reshape(total, HEADS, HEAD_SIZE)
        start = 0
        for r, n in zip(requests, num_scheduled):
            keys = to_dtype(qk[start:start + n, HEADS:], cache_dtype)
            values = to_dtype(v[start:start + n].reshape(n, KV_HEADS, HEAD_SIZE), cache_dtype)
            queries = qk[start:start + n, :HEADS]
            old = history.get(r, [np.zeros((0, KV_HEADS, HEAD_SIZE))] * 2)
            history[r] = [np.concatenate([old[0], keys]), np.concatenate([old[1], values])]
            expected = reference(queries.astype(np.float64), *history[r])
            np.testing.assert_allclose(out[start:start + n], expected, atol=tolerance,
                                       rtol=tolerance, err_msg=f"request {r}")
            start += n
