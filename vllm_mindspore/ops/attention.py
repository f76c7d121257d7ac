"""Paged attention: write this step's K/V into the paged cache, then attend every query token
over its request's cached context (prefix-cache hits, earlier chunks and this step's tokens
alike), causally.

The batch is vLLM's packed token batch: T tokens, request after request, any mix of prefill
chunks and decodes. `AttentionMetadata` describes it per request row and is built once per step
on the host; its arrays are the model graph's inputs, under the names Ascend's fused kernels
read them by (`batch_valid_length`, `q_seq_lens`).

- CPU: one C++ operator (`csrc/paged_attention.cc`) writes the cache and attends each query over
  exactly its visible keys (no padding to the longest query or context of the step). Built with
  the layer's rotary embedding, it also rotates the keys as it writes them and the queries as it
  loads them: no separate rotary pass (a launch, and a write and read of q and k) per layer.
- Ascend: ReshapeAndCache writes the cache; a step of first prefills only (no request has cached
  context) runs FlashAttentionScore over the new tokens, every other step PagedAttention with the
  per-request query lengths and a causal mask, as MindSpore's own inference stack does.
"""

from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.rotary import RotaryEmbedding
from vllm_mindspore.platform import ASCEND, kernel_device

# Ascend masks: masked positions get this (float16) or 1 (bfloat16, the kernels' convention).
_ASCEND_MASKED = -10000.0
_PREFILL_MASK_SIZE = 128  # FlashAttentionScore's compressed causal mask


class AttentionMetadata(NamedTuple):
    """Host arrays of one step (int32), in the order the model graph takes them after
    input_ids and positions. T tokens (the step's, then padding), B request rows (a fixed
    capacity: rows past the step's requests have zero lengths)."""

    slot_mapping: np.ndarray  # [T]: block_id * block_size + offset of each token; -1: padding
    block_tables: np.ndarray  # [B, max_blocks]
    batch_valid_length: np.ndarray  # [B]: tokens in the cache after this step (context + new)
    q_seq_lens: np.ndarray  # [B]: this step's tokens of each request

    @classmethod
    def build(cls, num_scheduled: np.ndarray, num_computed: np.ndarray, positions: np.ndarray,
              block_tables: np.ndarray, block_size: int, num_tokens: int) -> "AttentionMetadata":
        """num_scheduled / num_computed: [R] of the step's R requests; positions: [sum
        num_scheduled]; block_tables: [B, max_blocks], its first R rows the requests'; the
        step is padded to `num_tokens`."""
        num_reqs = len(num_scheduled)
        request_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        slot_mapping = np.full(num_tokens, -1, np.int32)
        slot_mapping[:len(positions)] = (
            block_tables[request_of_token, positions // block_size] * block_size
            + positions % block_size)
        rows = block_tables.shape[0]
        q_seq_lens = np.zeros(rows, np.int32)
        q_seq_lens[:num_reqs] = num_scheduled
        batch_valid_length = np.zeros(rows, np.int32)
        batch_valid_length[:num_reqs] = num_computed + num_scheduled
        return cls(slot_mapping, block_tables, batch_valid_length, q_seq_lens)

    def tensors(self) -> tuple:
        return tuple(ms.Tensor.from_numpy(np.ascontiguousarray(a, dtype=np.int32)) for a in self)

    @staticmethod
    def dynamic_inputs() -> tuple:
        return tuple(ms.Tensor(shape=[None] * d, dtype=ms.int32) for d in (1, 2, 1, 1))


def causal_mask_rows(positions, num_keys: int, masked_value: float, dtype):
    """[T, num_keys]: 0 where key j <= the token's position, masked_value after (Ascend PA)."""
    keys = ops.arange(0, num_keys, dtype=ms.int32).reshape(1, -1)
    return (keys > positions.reshape(-1, 1)).astype(dtype) * masked_value


def prefill_mask(dtype) -> ms.Tensor:
    """FlashAttentionScore's compressed causal mask (upper triangle masked)."""
    value = 1.0 if dtype == ms.bfloat16 else _ASCEND_MASKED
    return ms.Tensor(np.triu(np.ones((_PREFILL_MASK_SIZE, _PREFILL_MASK_SIZE), np.float32), 1)
                     * value, dtype)


class PagedAttention(nn.Cell):
    """qk [T, H + KVH, D] (each token's query heads, then its key heads), v [T, W] (the last
    KVH * Dv channels of each row are the token's values: a fused q|k|v row or the values
    alone), the layer's caches (`cache_shapes`) -> out [T, H * Dv].

    With `rotary` (built with `heads=H + KVH`), q and k enter unrotated and qk may also be the
    fused q|k|v rows [T, W] themselves (q and k heads at the front of each row): the attention
    applies the rotary embedding by `positions`. Without it they enter rotated."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 block_size: int, v_head_size: int | None = None,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.scale = scale
        self.block_size = block_size
        self.fused = kernel_device() == ASCEND
        self.neox_rotary = rotary is not None and rotary.is_neox_style
        self.rotary = rotary if self.fused else None
        if self.fused:
            self.reshape_and_cache = ops.auto_generate.ReshapeAndCache()
            self.flash_attention = ops.auto_generate.FlashAttentionScore(
                head_num=num_heads, scale_value=scale, input_layout="TH")
            self.paged_attention = ops.auto_generate.PagedAttention(num_heads, scale,
                                                                    num_kv_heads)
        else:
            heads, v_size = num_heads, self.v_head_size
            name = "PagedAttention"
            self.cos_sin = None
            if rotary is not None:
                name = f"RotaryPagedAttention{'Neox' if rotary.is_neox_style else 'Interleaved'}"
                self.cos_sin = rotary.cos_sin
            self.kernel = kernels.custom_op(name, lambda qk, *_: (qk[0], heads, v_size),
                                            lambda qk, *_: qk)
            self.scale_tensor = ms.Tensor([scale], ms.float32)

    def cache_shapes(self, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(key cache shape, value cache shape)."""
        kvh, bs = self.num_kv_heads, self.block_size
        if self.fused:  # ReshapeAndCache / PagedAttention layout
            return (num_blocks, bs, kvh, self.head_size), (num_blocks, bs, kvh, self.v_head_size)
        # CPU kernel: keys transposed inside a block (see csrc/paged_attention.cc)
        return (num_blocks, kvh, self.head_size, bs), (num_blocks, kvh, bs, self.v_head_size)

    def _ascend_key_value(self, qk, v):
        """The new keys and values as ReshapeAndCache takes them: [T, KVH * D] (its inference
        counts tokens as all but the last dimension)."""
        num_tokens, values = qk.shape[0], self.num_kv_heads * self.v_head_size
        return (qk[:, self.num_heads:].reshape(num_tokens, self.num_kv_heads * self.head_size),
                v[:, v.shape[1] - values:])

    def construct(self, qk, v, key_cache, value_cache, positions, slot_mapping, block_tables,
                  batch_valid_length, q_seq_lens, prefill_only: bool = False):
        num_tokens = qk.shape[0]
        if not self.fused:
            if self.cos_sin is None:
                out = self.kernel(qk, v, key_cache, value_cache, slot_mapping, block_tables,
                                  batch_valid_length, q_seq_lens, self.scale_tensor)
            else:
                out = self.kernel(qk, v, key_cache, value_cache, slot_mapping, block_tables,
                                  batch_valid_length, q_seq_lens, self.scale_tensor, positions,
                                  self.cos_sin)
            return out.reshape(num_tokens, self.num_heads * self.v_head_size)
        if self.rotary is not None:
            qk = self.rotary(positions, qk)
        q = qk[:, :self.num_heads].reshape(num_tokens, self.num_heads * self.head_size)
        k, v = self._ascend_key_value(qk, v)
        q = ops.depend(q, self.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping))
        if prefill_only:
            # The kernel reads the lengths from the graph inputs named batch_valid_length /
            # q_seq_lens (jit_level O0 + infer_boost); here q == kv (no cached context).
            return self.flash_attention(q, k, v, None, None, None, prefill_mask(q.dtype), None,
                                        batch_valid_length, batch_valid_length)[3]
        mask = causal_mask_rows(positions, block_tables.shape[1] * self.block_size,
                                _ASCEND_MASKED, q.dtype)
        return self.paged_attention(q, key_cache, value_cache, block_tables, batch_valid_length,
                                    None, None, mask, q_seq_lens)
