"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent KV cache.

Each token caches a single "head" of `kv_lora_rank + qk_rope_head_dim` values: the normalised KV
latent c and the roped key k_pe shared by all heads. `kv_b_proj` holds, per head h, W_UK[h]
(qk_nope_head_dim x kv_lora_rank) and W_UV[h] (v_head_dim x kv_lora_rank), so with weight
absorption

    score(t, s) = (q_nope[t, h] W_UK[h]) . c[s] + q_pe[t, h] . k_pe[s]
    out[t, h]   = (sum_s p(t, s) c[s]) W_UV[h]^T

is multi-query attention of [q_nope W_UK, q_pe] against the cached latent rows, with the first
kv_lora_rank channels of the same rows as values. Every token (prefill chunk or decode) takes this
path, so mixed batches need nothing special; it reads the cache exactly once per layer. W_UK and
W_UV are split out of `kv_b_proj.weight` once, after loading (`absorb_kv_b`).
"""

import mindspore as ms
from mindspore import mint, nn, ops

from vllm_mindspore.platform import ASCEND, DEVICE

_MASKED = -1e30


class MLAAttention(nn.Cell):
    """q_nope [T, H, dn], q_pe [T, H, dr] (roped), latent [T, r + dr] (c normalised, k_pe roped),
    cache from `cache_shape`, then the AttentionMetadata tensors -> out [T, H * dv]."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float, block_size: int):
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.latent_size = kv_lora_rank + qk_rope_head_dim
        self.scale = scale
        self.block_size = block_size
        self.fused = DEVICE == ASCEND
        self.w_uk = None  # [H, dn, r], from absorb_kv_b
        self.w_uv = None  # [H, dv, r]
        self.bmm = ops.BatchMatMul()
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        if self.fused:
            self.reshape_and_cache = ops.auto_generate.ReshapeAndCache()
            # Untested (no NPU in CI): PagedAttention's MLA mode reads K from the latent rows and
            # V from their first `mla_v_dim` channels.
            self.paged_attention = ops.auto_generate.PagedAttention(
                num_heads, scale, 1, mla_v_dim=kv_lora_rank)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.fused:  # ReshapeAndCache / PagedAttention layout, one KV head
            return (num_blocks, self.block_size, 1, self.latent_size)
        # CPU: one row per slot (block-major), so scatter_update writes rows in place.
        return (num_blocks * self.block_size, self.latent_size)

    def absorb_kv_b(self, kv_b_weight: ms.Tensor, prefix: str) -> None:
        """kv_b_weight [H * (dn + dv), r] (this rank's heads of kv_b_proj.weight) -> W_UK, W_UV."""
        kv_b = kv_b_weight.reshape(self.num_heads, -1, self.kv_lora_rank)
        dn = self.qk_nope_head_dim
        self.w_uk = ms.Parameter(kv_b[:, :dn].contiguous(), name=f"{prefix}.w_uk",
                                 requires_grad=False)
        self.w_uv = ms.Parameter(kv_b[:, dn:].contiguous(), name=f"{prefix}.w_uv",
                                 requires_grad=False)

    def construct(self, q_nope, q_pe, latent, cache, slot_mapping, block_tables, query_index,
                  query_positions, token_index):
        # Absorb W_UK into the query: [H, T, dn] x [H, dn, r] -> [T, H, r].
        q_latent = self.bmm(q_nope.transpose(1, 0, 2), self.w_uk).transpose(1, 0, 2)
        query = mint.cat((q_latent, q_pe), dim=-1)  # [T, H, r + dr]
        if self.fused:
            out_latent = self._ascend(query, latent, cache, slot_mapping, block_tables,
                                      query_index, query_positions, token_index)
        else:
            out_latent = self._composite(query, latent, cache, slot_mapping, block_tables,
                                         query_index, query_positions, token_index)
        # Absorb W_UV into the output: [H, T, r] x [H, dv, r]^T -> [T, H * dv].
        out = self.bmm_nt(out_latent.transpose(1, 0, 2), self.w_uv).transpose(1, 0, 2)
        return out.reshape(out.shape[0], self.num_heads * self.v_head_dim)

    def _ascend(self, query, latent, cache, slot_mapping, block_tables, query_index,
                query_positions, token_index):
        self.reshape_and_cache(latent.expand_dims(1), None, cache, None, slot_mapping)
        # As in PagedAttention._ascend: every token is a causal "decode" row of its request.
        request_of_token = token_index // query_index.shape[1]
        positions = ops.gather(query_positions.reshape(-1), token_index, 0)
        tables = ops.gather(block_tables, request_of_token, 0)
        return self.paged_attention(query, cache, cache, tables, positions + 1)  # [T, H, r]

    def _composite(self, query, latent, cache, slot_mapping, block_tables, query_index,
                   query_positions, token_index):
        ops.scatter_update(cache, slot_mapping, latent)
        num_reqs, max_query = query_index.shape
        num_ctx_blocks = block_tables.shape[1]
        context_len = num_ctx_blocks * self.block_size
        # One KV head: the context rows of a request are contiguous after the gather, so no
        # transpose is needed anywhere (and the cache Parameter itself is never reshaped).
        rows = (block_tables.reshape(num_reqs, num_ctx_blocks, 1) * self.block_size
                + ops.arange(0, self.block_size, dtype=ms.int32).reshape(1, 1, -1))
        context = ops.gather(cache, rows.reshape(num_reqs, context_len), 0)  # [B, L, r + dr]
        queries = ops.gather(query, query_index.reshape(-1), 0).reshape(
            num_reqs, max_query * self.num_heads, self.latent_size)  # [B, Q * H, r + dr]
        scores = self.bmm_nt(queries, context).astype(ms.float32) * self.scale  # [B, QH, L]
        scores = scores.reshape(num_reqs, max_query, self.num_heads, context_len)
        context_positions = ops.arange(0, context_len, dtype=ms.int32).reshape(1, 1, 1, -1)
        visible = context_positions <= query_positions.reshape(num_reqs, max_query, 1, 1)
        scores = ops.select(visible, scores, ops.full_like(scores, _MASKED))
        probs = ops.softmax(scores, -1).astype(query.dtype).reshape(
            num_reqs, max_query * self.num_heads, context_len)
        out = self.bmm(probs, context)[..., :self.kv_lora_rank]  # [B, QH, r]
        out = out.reshape(num_reqs * max_query, self.num_heads, self.kv_lora_rank)
        return ops.gather(out, token_index, 0)  # [T, H, r]
