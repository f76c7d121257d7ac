"""Paged attention: write this step's K/V into the paged cache, then attend over each request's
cached context (prefix-cache hits, earlier chunks and this step's tokens alike).

The batch is vLLM's packed token batch ([T] tokens of B requests, any mix of prefill chunks and
decodes). `AttentionMetadata` is built once per step by the model runner and shared by all layers.
"""

from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops

from vllm_mindspore.platform import ASCEND, DEVICE

_MASKED = -1e30


class AttentionMetadata(NamedTuple):
    """Host-side (numpy) description of one step. Shapes: T tokens, B requests, Q = max query
    length of the step, NB = max blocks per request in the step."""

    slot_mapping: np.ndarray  # [T] int32: block_id * block_size + offset of each token
    block_tables: np.ndarray  # [B, NB] int32
    query_index: np.ndarray  # [B, Q] int32: token index of each request's i-th query (pad: 0)
    query_positions: np.ndarray  # [B, Q] int32: its position (pad: 0, attends to position 0 only)
    token_index: np.ndarray  # [T] int32: b * Q + i of each token, to unpad the output

    @classmethod
    def build(cls, positions: np.ndarray, query_start_loc: np.ndarray, num_computed: np.ndarray,
              block_table: np.ndarray, block_size: int) -> "AttentionMetadata":
        """positions: [T]; query_start_loc: [B + 1]; num_computed: [B]; block_table: [B, max]."""
        num_scheduled = np.diff(query_start_loc)
        num_reqs = len(num_scheduled)
        request_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        offset_in_request = np.arange(len(positions)) - query_start_loc[request_of_token]
        seq_lens = (num_computed + num_scheduled).astype(np.int32)
        num_blocks = int(-(-seq_lens.max() // block_size))
        block_tables = np.ascontiguousarray(block_table[:num_reqs, :num_blocks], dtype=np.int32)
        slot_mapping = (block_tables[request_of_token, positions // block_size] * block_size
                        + positions % block_size).astype(np.int32)
        max_query = int(num_scheduled.max())
        query_index = np.zeros((num_reqs, max_query), np.int32)
        query_positions = np.zeros((num_reqs, max_query), np.int32)
        query_index[request_of_token, offset_in_request] = np.arange(len(positions))
        query_positions[request_of_token, offset_in_request] = positions
        token_index = (request_of_token * max_query + offset_in_request).astype(np.int32)
        return cls(slot_mapping, block_tables, query_index, query_positions, token_index)

    def tensors(self) -> tuple:
        return tuple(ms.Tensor.from_numpy(np.ascontiguousarray(a, dtype=np.int32)) for a in self)

    @staticmethod
    def dynamic_inputs() -> tuple:
        dims = (1, 2, 2, 2, 1)
        return tuple(ms.Tensor(shape=[None] * d, dtype=ms.int32) for d in dims)


class PagedAttention(nn.Cell):
    """q: [T, H, D], k/v: [T, KVH, D], caches from `cache_shape` -> out [T, H * D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 block_size: int, v_head_size: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.block_size = block_size
        self.fused = DEVICE == ASCEND
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        if self.fused:
            self.reshape_and_cache = ops.auto_generate.ReshapeAndCache()
            self.paged_attention = ops.auto_generate.PagedAttention(
                num_heads, scale, num_kv_heads)

    def cache_shape(self, num_blocks: int, value: bool = False) -> tuple[int, ...]:
        head = self.v_head_size if value else self.head_size
        if self.fused:  # ReshapeAndCache / PagedAttention layout
            return (num_blocks, self.block_size, self.num_kv_heads, head)
        # CPU: head-major blocks, flattened so scatter_update can write rows in place.
        return (num_blocks * self.num_kv_heads * self.block_size, head)

    def construct(self, q, k, v, key_cache, value_cache, slot_mapping, block_tables,
                  query_index, query_positions, token_index):
        if self.fused:
            return self._ascend(q, k, v, key_cache, value_cache, slot_mapping, block_tables,
                                query_index, query_positions, token_index)
        return self._composite(q, k, v, key_cache, value_cache, slot_mapping, block_tables,
                               query_index, query_positions, token_index)

    def _ascend(self, q, k, v, key_cache, value_cache, slot_mapping, block_tables,
                query_index, query_positions, token_index):
        self.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
        # Every token is its own causal "decode" row: its request's blocks, context = position + 1.
        request_of_token = token_index // query_index.shape[1]
        positions = ops.gather(query_positions.reshape(-1), token_index, 0)
        tables = ops.gather(block_tables, request_of_token, 0)
        out = self.paged_attention(q, key_cache, value_cache, tables, positions + 1)
        return out.reshape(out.shape[0], -1)

    def _composite(self, q, k, v, key_cache, value_cache, slot_mapping, block_tables,
                   query_index, query_positions, token_index):
        kvh, bs, group = self.num_kv_heads, self.block_size, self.group
        # Write: row of (token, kv head) in the flattened [blocks, kv heads, block_size] cache.
        head_rows = ops.arange(0, kvh, dtype=ms.int32).reshape(1, kvh) * bs
        rows = ((slot_mapping // bs) * (kvh * bs) + slot_mapping % bs).reshape(-1, 1) + head_rows
        ops.scatter_update(key_cache, rows, k)
        ops.scatter_update(value_cache, rows, v)

        num_reqs, max_query = query_index.shape
        num_ctx_blocks = block_tables.shape[1]
        context = num_ctx_blocks * bs
        # Read: gather each request's context rows straight from the flat cache, ordered
        # [B, KVH, NB, bs] so the result is already [B, KVH, context, D] (a reshape of the cache
        # Parameter would copy all of it every layer; a transpose would copy the context).
        context_rows = (block_tables.reshape(num_reqs, 1, num_ctx_blocks, 1) * (kvh * bs)
                        + head_rows.reshape(1, kvh, 1, 1)
                        + ops.arange(0, bs, dtype=ms.int32).reshape(1, 1, 1, bs))
        keys = ops.gather(key_cache, context_rows, 0).reshape(num_reqs, kvh, context,
                                                                self.head_size)
        values = ops.gather(value_cache, context_rows, 0).reshape(num_reqs, kvh, context,
                                                                  self.v_head_size)
        # Queries padded per request: [B, Q, KVH, G, D] -> [B, KVH, G * Q, D].
        queries = ops.gather(q, query_index.reshape(-1), 0).reshape(
            num_reqs, max_query, kvh, group, self.head_size)
        queries = queries.transpose(0, 2, 3, 1, 4).reshape(num_reqs, kvh, group * max_query,
                                                            self.head_size)
        scores = self.bmm_qk(queries, keys).astype(ms.float32) * self.scale  # [B, KVH, GQ, ctx]
        scores = scores.reshape(num_reqs, kvh, group, max_query, context)
        context_positions = ops.arange(0, context, dtype=ms.int32).reshape(1, 1, 1, 1, -1)
        visible = context_positions <= query_positions.reshape(num_reqs, 1, 1, max_query, 1)
        scores = ops.select(visible, scores, ops.full_like(scores, _MASKED))
        probs = ops.softmax(scores, -1).astype(v.dtype)
        out = self.bmm_pv(probs.reshape(num_reqs, kvh, group * max_query, context), values)
        out = out.reshape(num_reqs, kvh, group, max_query, self.v_head_size).transpose(0, 3, 1, 2, 4)
        out = out.reshape(num_reqs * max_query, self.num_heads * self.v_head_size)
        return ops.gather(out, token_index, 0)
