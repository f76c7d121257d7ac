"""The CPU paged-attention kernels (vllm_mindspore/ops/csrc/paged_attention.cc), MHA/GQA and MLA,
against numpy float64 causal attention, for each pair of activation and cache dtypes they take:
float32 over a float32 cache, float16 over float16, float32 over bfloat16 (--dtype bfloat16 on
CPU; on AMX CPUs also with prefill chunks on the tiles). The calls share the cache: a step of two
prefills (one across a block boundary), a step of a third prefill beside two decodes that read the
first step's keys and values back, one request's decode, and two chunks of prefills after cached
context. The GQA kernel also runs with the rotary embedding applied inside it (neox halves over
part of each head, interleaved pairs over all of it), fed the fused q|k|v rows unrotated."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from vllm.config import VllmConfig, set_current_vllm_config

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.attention import AttentionMetadata, PagedAttention
from vllm_mindspore.ops.host import to_host, zeros_parameter
from vllm_mindspore.ops.mla import MLAAttention
from vllm_mindspore.ops.quant_reference import to_dtype
from vllm_mindspore.ops.rotary import RotaryEmbedding, rope_cos_sin
from vllm_mindspore.platform import cpu_has_amx

ms.set_context(mode=ms.GRAPH_MODE)
pytestmark = pytest.mark.usefixtures("two_kernel_threads")  # the parallel splits too

HEADS, BLOCK_SIZE, NUM_BLOCKS, MAX_POSITION = 4, 16, 8, 64
MS_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


class GroupedQueryStep(nn.Cell):
    """One GQA layer's attention call over caches it owns (Parameters, kept between calls):
    queries [T, H, D] and keys [T, KVH, D] enter stacked, values [T, KVH * D]."""

    KV_HEADS, HEAD_SIZE = 2, 32
    SCALE = HEAD_SIZE ** -0.5

    def __init__(self, cache_dtype):
        super().__init__()
        self.attn = PagedAttention(HEADS, self.KV_HEADS, self.HEAD_SIZE, self.SCALE, BLOCK_SIZE)
        key_shape, value_shape = self.attn.cache_shapes(NUM_BLOCKS)
        self.key_cache = zeros_parameter(key_shape, cache_dtype, "key_cache")
        self.value_cache = zeros_parameter(value_shape, cache_dtype, "value_cache")

    @classmethod
    def tokens(cls, g, n: int):
        """n tokens' (queries [n, H, D], keys [n, KVH, D], values [n, KVH, Dv])."""
        return (g.standard_normal((n, HEADS, cls.HEAD_SIZE)),
                g.standard_normal((n, cls.KV_HEADS, cls.HEAD_SIZE)),
                g.standard_normal((n, cls.KV_HEADS, cls.HEAD_SIZE)))

    @staticmethod
    def inputs(queries, keys, values):
        return np.concatenate([queries, keys], axis=1), values.reshape(len(values), -1)

    @staticmethod
    def rotated(queries, keys, positions):
        """The queries and keys the attention computes with (entered rotated)."""
        return queries, keys

    def construct(self, qk, v, positions, *metadata):
        return self.attn(qk, v, self.key_cache, self.value_cache, positions, *metadata)


class RotaryStep(GroupedQueryStep):
    """The GQA call with the rotary embedding inside the kernel: each token's fused q|k|v row
    [T, (H + 2 KVH) * D] enters as both qk and v, q and k unrotated; neox halves over the first
    ROTARY channels of each head."""

    NEOX, ROTARY = True, 16

    def __init__(self, cache_dtype):
        super().__init__(cache_dtype)
        with set_current_vllm_config(VllmConfig()):  # vLLM's get_rope reads it
            rotary = RotaryEmbedding(self.HEAD_SIZE, self.ROTARY, MAX_POSITION, None, self.NEOX,
                                     heads=HEADS + self.KV_HEADS)
        self.attn = PagedAttention(HEADS, self.KV_HEADS, self.HEAD_SIZE, self.SCALE, BLOCK_SIZE,
                                   rotary=rotary)

    @staticmethod
    def inputs(queries, keys, values):
        rows = np.concatenate([a.reshape(len(a), -1) for a in (queries, keys, values)], axis=1)
        return rows, rows

    @classmethod
    def rotated(cls, queries, keys, positions):
        with set_current_vllm_config(VllmConfig()):
            cos, sin = rope_cos_sin(cls.HEAD_SIZE, cls.ROTARY, MAX_POSITION, None, cls.NEOX)
        cos, sin = cos[positions][:, None], sin[positions][:, None]  # [T, 1, ROTARY / 2]

        def rotate(x):
            x = x.astype(np.float64).copy()
            half = cls.ROTARY // 2
            first = np.arange(half) if cls.NEOX else 2 * np.arange(half)
            second = first + half if cls.NEOX else first + 1
            x1, x2 = x[..., first].copy(), x[..., second].copy()
            x[..., first], x[..., second] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
            return x

        return rotate(queries), rotate(keys)


class RotaryInterleavedStep(RotaryStep):
    """The same with interleaved (GPT-J) pairs over the whole head."""

    NEOX, ROTARY = False, GroupedQueryStep.HEAD_SIZE


class LatentStep(nn.Cell):
    """One MLA layer's kernel call over its latent cache: every head's query [T, H, L] against
    one cached latent row per token [T, L], whose first `RANK` channels are the values."""

    RANK, ROPE = 32, 16
    KV_HEADS, HEAD_SIZE = 1, RANK + ROPE
    SCALE = 0.2

    def __init__(self, cache_dtype):
        super().__init__()
        self.attn = MLAAttention(HEADS, self.RANK, 16, self.ROPE, 16, self.SCALE, BLOCK_SIZE)
        self.cache = zeros_parameter(self.attn.cache_shape(NUM_BLOCKS), cache_dtype, "kv_cache")

    @classmethod
    def tokens(cls, g, n: int):
        latent = g.standard_normal((n, 1, cls.HEAD_SIZE))
        return g.standard_normal((n, HEADS, cls.HEAD_SIZE)), latent, latent[..., :cls.RANK]

    @staticmethod
    def inputs(queries, keys, values):
        return queries, keys.reshape(len(keys), -1)

    rotated = GroupedQueryStep.rotated

    def construct(self, query, latent, positions, *metadata):
        return self.attn.kernel(query, latent, self.cache, *metadata, self.attn.scale_tensor)


def reference(queries, keys, values, scale, tile_rounding=False):
    """Causal attention of a request's last len(queries) tokens over all its keys/values:
    [n, H, D], [S, KVH, D], [S, KVH, Dv] -> [n, H, Dv] (float64). `tile_rounding`: as AMX
    computes it, the scaled queries and the softmax numerators rounded to bfloat16 (each row's
    sum is of the numerators before rounding)."""
    group = HEADS // keys.shape[1]
    keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
    if tile_rounding:
        queries = to_dtype(queries.astype(np.float32) * np.float32(scale), "bfloat16")
        queries, scale = queries.astype(np.float64), 1.0
    first = len(keys) - len(queries)
    out = np.zeros(queries.shape[:2] + values.shape[2:])
    for i, q in enumerate(queries):
        visible = first + i + 1
        scores = np.einsum("hd,shd->hs", q, keys[:visible]) * scale
        p = np.exp(scores - scores.max(-1, keepdims=True))
        numerators = to_dtype(p, "bfloat16").astype(np.float64) if tile_rounding else p
        out[i] = np.einsum("hs,shd->hd", numerators / p.sum(-1, keepdims=True), values[:visible])
    return out


@pytest.fixture
def cache_kernel(request):
    """The cache's dtype for request.param ("bfloat16-amx": AMX tiles for prefill chunks of at
    least 16 query rows a KV head, where the CPU has them, and every row rounded as the tiles
    round it; otherwise the vector loops), with that kernel chosen for the test."""
    cache_dtype, _, unit = request.param.partition("-")
    if kernels.use_amx(unit == "amx") != (unit == "amx"):
        pytest.skip("the CPU reports AMX-BF16, but the kernels cannot use it (Linux refused the "
                    "tile state, or the library was built without -mamx-bf16)")
    yield cache_dtype, unit == "amx"
    kernels.use_amx(True)


@pytest.mark.parametrize("layer", [GroupedQueryStep, RotaryStep, RotaryInterleavedStep, LatentStep],
                         ids=["gqa", "gqa-rotary-neox", "gqa-rotary-interleaved", "mla"])
@pytest.mark.parametrize("dtype, cache_kernel, tolerance", [
    ("float32", "float32", 1e-5), ("float16", "float16", 2e-3), ("float32", "bfloat16", 1e-5),
    pytest.param("float32", "bfloat16-amx", 1e-5, marks=pytest.mark.skipif(
        not cpu_has_amx(), reason="this CPU has no AMX-BF16"))], indirect=["cache_kernel"])
def test_paged_attention_matches_numpy(layer, dtype, cache_kernel, tolerance):
    """Each step's output equals numpy attention over the keys/values as the cache stores them
    (rounded to its dtype), with the queries as the activations hold them (on the tiles: rounded
    as they enter them)."""
    cache_dtype, amx = cache_kernel
    g = np.random.default_rng(0)
    step = layer(MS_DTYPES[cache_dtype])
    block_tables = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 0], [0, 0, 0]], np.int32)
    cached: dict[int, tuple] = {}  # request -> (keys, values) in the cache so far
    # The third step is one request's decode: fewer requests than threads, its KV heads split.
    for new_tokens in ({0: 21, 1: 3}, {0: 1, 1: 1, 2: 9}, {0: 1}, {1: 10, 2: 12}):
        requests = sorted(new_tokens)
        num_scheduled = np.array([new_tokens[r] for r in requests])
        num_computed = np.array([len(cached[r][0]) if r in cached else 0 for r in requests])
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(num_computed,
                                                                          num_scheduled)])
        total = int(num_scheduled.sum())
        queries, keys, values = (to_dtype(a, dtype) for a in layer.tokens(g, total))
        # the step's requests' rows first, as the model runner orders them
        step_tables = block_tables[requests + sorted(set(range(len(block_tables))) -
                                                     set(requests))]
        metadata = AttentionMetadata.build(num_scheduled, num_computed, positions,
                                           step_tables, BLOCK_SIZE, total)
        out = step(*(ms.Tensor(a, MS_DTYPES[dtype]) for a in layer.inputs(queries, keys, values)),
                   ms.Tensor(positions.astype(np.int32)), *metadata.tensors())
        out = to_host(out).reshape(total, HEADS, -1)
        # What the kernel computes with: the queries and keys rotated (in float32) if it rotates
        # them, the keys then rounded to the cache's dtype.
        queries, keys = (a.astype(np.float32) for a in layer.rotated(queries, keys, positions))
        start = 0
        for r, n in zip(requests, num_scheduled):
            new = slice(start, start + n)
            old_keys, old_values = cached.get(r, (keys[:0], values[:0]))
            cached[r] = (np.concatenate([old_keys, to_dtype(keys[new], cache_dtype)]),
                         np.concatenate([old_values, to_dtype(values[new], cache_dtype)]))
            expected = reference(queries[new].astype(np.float64), *cached[r], layer.SCALE,
                                 amx and layer is not LatentStep)
            np.testing.assert_allclose(out[new], expected, atol=tolerance, rtol=tolerance,
                                       err_msg=f"request {r}")
            start += n


class DeepseekAttentionStep(nn.Cell):
    """A DeepSeek-V3 attention layer (model_backends/native/deepseek_v3.py) on a step's hidden
    rows, with its own latent cache."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def construct(self, positions, hidden, *metadata):
        return self.attention(positions, hidden, metadata, False)


def deepseek_attention(q_lora_rank, cache_dtype, absorbed_kernel: bool, monkeypatch):
    """The layer with seeded weights, loaded as the model loads it; `absorbed_kernel`: its
    attention after the projections in one operator (MLAAbsorbedAttention) or in MindSpore's."""
    from types import SimpleNamespace

    from model_backends.native.deepseek_v3 import DeepseekV3Attention
    from model_backends.native.weights import process_weights_after_loading

    config = SimpleNamespace(
        hidden_size=64, num_attention_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, attention_bias=False,
        max_position_embeddings=MAX_POSITION, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
                         "rope_theta": 10000.0})
    monkeypatch.setenv("VLLM_MS_CPU_LAYER_KERNEL", "1" if absorbed_kernel else "0")
    with set_current_vllm_config(VllmConfig()):  # vLLM's get_rope reads it
        attention = DeepseekV3Attention(config, BLOCK_SIZE, ms.float32)
    g = np.random.default_rng(3)
    for name, param in attention.parameters_and_names():
        shape = param.shape
        values = (1 + 0.1 * g.standard_normal(shape) if "layernorm" in name
                  else g.standard_normal(shape) / np.sqrt(shape[-1]))
        param.set_data(ms.Tensor(values.astype(np.float32)))
    process_weights_after_loading(attention)
    assert (attention.attn.absorbed_kernel is not None) == absorbed_kernel
    attention.allocate_kv_cache(NUM_BLOCKS, MS_DTYPES[cache_dtype], "layer")
    return DeepseekAttentionStep(attention)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora", "q-proj"])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_mla_absorbed_kernel_matches_separate_operators(q_lora_rank, cache_dtype, monkeypatch):
    """DeepSeek-V3's attention with the latent's norm and rope, the query's absorption and rope,
    the attention and the output's absorption in one operator equals the same layer with those
    parts as MindSpore's operators and the MLA kernel: the outputs of the step's tokens over
    prefill chunks and decodes (padding rows after them: zeros) and the latent cache."""
    steps = [deepseek_attention(q_lora_rank, cache_dtype, absorbed, monkeypatch)
             for absorbed in (True, False)]
    g = np.random.default_rng(0)
    block_tables = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 0], [0, 0, 0]], np.int32)
    computed = {0: 0, 1: 0, 2: 0}
    for new_tokens in ({0: 21, 1: 3}, {0: 1, 1: 1, 2: 9}, {0: 1}, {1: 10, 2: 12}):
        requests = sorted(new_tokens)
        num_scheduled = np.array([new_tokens[r] for r in requests])
        num_computed = np.array([computed[r] for r in requests])
        total, padded = int(num_scheduled.sum()), int(num_scheduled.sum()) + 3
        positions = np.zeros(padded, np.int32)
        positions[:total] = np.concatenate([np.arange(c, c + n) for c, n in
                                            zip(num_computed, num_scheduled)])
        step_tables = block_tables[requests + sorted(set(range(len(block_tables))) -
                                                     set(requests))]
        metadata = AttentionMetadata.build(num_scheduled, num_computed, positions[:total],
                                           step_tables, BLOCK_SIZE, padded).tensors()
        hidden = ms.Tensor(g.standard_normal((padded, 64)).astype(np.float32))
        fused, separate = (to_host(step(ms.Tensor(positions), hidden, *metadata))
                           for step in steps)
        np.testing.assert_allclose(fused[:total], separate[:total], rtol=2e-5, atol=2e-5)
        assert not fused[total:].any()
        for r, n in new_tokens.items():
            computed[r] += n
    caches = [to_host(step.attention.kv_cache).astype(np.float32) for step in steps]
    np.testing.assert_allclose(caches[0], caches[1], rtol=2e-5, atol=2e-5)
