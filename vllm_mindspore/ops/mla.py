"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent KV cache.

Each token caches a single "head" of `kv_lora_rank + qk_rope_head_dim` values: the normalised KV
latent c and the roped key k_pe shared by all heads. `kv_b_proj` holds, per head h, W_UK[h]
(qk_nope_head_dim x kv_lora_rank) and W_UV[h] (v_head_dim x kv_lora_rank), so with weight
absorption

    score(t, s) = (q_nope[t, h] W_UK[h]) . c[s] + q_pe[t, h] . k_pe[s]
    out[t, h]   = (sum_s p(t, s) c[s]) W_UV[h]^T

is multi-query attention of [q_nope W_UK, q_pe] against the cached latent rows, with the first
kv_lora_rank channels of the same rows as values. On CPU every token (prefill chunk or decode)
takes this path through one C++ operator (`csrc/paged_attention.cc`, MLA entry); with float32
activations the latent's norm and rope, the query's absorption and rope before it and the
output's absorption after it are the same operator (`use_absorbed_kernel`). On Ascend, steps
with cached context take it through PagedAttention's MLA mode; a step of first prefills only
expands the new latents into per-head keys and values and runs FlashAttentionScore, as
MindSpore's own inference stack does. W_UK and W_UV are split out of `kv_b_proj.weight` once,
after loading (`absorb_kv_b`).
"""

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.attention import causal_mask_rows, prefill_mask
from vllm_mindspore.ops.host import parameter, to_host
from vllm_mindspore.ops.linear import pack_panels
from vllm_mindspore.ops.norm import RMSNorm
from vllm_mindspore.ops.rotary import RotaryEmbedding
from vllm_mindspore.platform import ASCEND, kernel_device


class MLAAttention(nn.Cell):
    """q_nope [T, H, dn], q_pe [T, H, dr] (roped), latent [T, r + dr] (c normalised, k_pe roped),
    the layer's cache (`cache_shape`), positions and the AttentionMetadata tensors
    -> out [T, H * dv]."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float, block_size: int):
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.latent_size = kv_lora_rank + qk_rope_head_dim
        self.scale = scale
        self.block_size = block_size
        self.fused = kernel_device() == ASCEND
        self.w_uk = None  # [H, dn, r], from absorb_kv_b
        self.w_uv = None  # [H, dv, r]
        self.absorbed_kernel = None  # CPU, float32: from use_absorbed_kernel
        self.bmm = ops.BatchMatMul()
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        if self.fused:
            self.reshape_and_cache = ops.auto_generate.ReshapeAndCache()
            # MLA mode: K is the latent row, V its first `mla_v_dim` channels.
            self.paged_attention = ops.auto_generate.PagedAttention(
                num_heads, scale, 1, mla_v_dim=kv_lora_rank)
            self.flash_attention = ops.auto_generate.FlashAttentionScore(
                head_num=num_heads, scale_value=scale, input_layout="TH")
        else:
            self.kernel = kernels.custom_op(
                "MLAPagedAttention", lambda q, *_: (q[0], q[1], kv_lora_rank), lambda q, *_: q)
            self.scale_tensor = ms.Tensor([scale], ms.float32)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.fused:  # ReshapeAndCache / PagedAttention layout, one KV head
            return (num_blocks, self.block_size, 1, self.latent_size)
        # CPU kernel: latents transposed inside a block (see csrc/paged_attention.cc)
        return (num_blocks, self.latent_size, self.block_size)

    def absorb_kv_b(self, kv_b_weight: ms.Tensor, prefix: str) -> None:
        """kv_b_weight [H * (dn + dv), r] (this rank's heads of kv_b_proj.weight) -> W_UK, W_UV."""
        kv_b = to_host(kv_b_weight).reshape(self.num_heads, -1, self.kv_lora_rank)
        dn = self.qk_nope_head_dim
        self.set_absorbed(kv_b[:, :dn], kv_b[:, dn:], kv_b_weight.dtype, prefix)

    def set_absorbed(self, w_uk, w_uv, dtype, prefix: str) -> None:
        """Host arrays w_uk [H, dn, r] and w_uv [H, dv, r] -> the absorbed weights."""
        self.w_uk = parameter(w_uk, dtype, f"{prefix}.w_uk")
        self.w_uv = parameter(w_uv, dtype, f"{prefix}.w_uv")

    def use_absorbed_kernel(self, kv_norm: RMSNorm, rotary: RotaryEmbedding,
                            prefix: str) -> None:
        """CPU, float32 (not float16): from now on `absorbed` computes the layer's attention from
        its projections in one operator, W_UK and W_UV packed per head for its matmuls
        (linear.py)."""
        if self.fused or kv_norm.fused or self.w_uk.dtype != ms.float32:
            return
        w_uk, w_uv = to_host(self.w_uk), to_host(self.w_uv)
        self.w_uk = parameter(np.stack([pack_panels(w.T, ms.float32) for w in w_uk]),
                              ms.float32, f"{prefix}.w_uk")
        self.w_uv = parameter(np.stack([pack_panels(w, ms.float32) for w in w_uv]),
                              ms.float32, f"{prefix}.w_uv")
        out_features = self.num_heads * self.v_head_dim
        self.absorbed_kernel = kernels.custom_op(
            "MLAAbsorbedAttention", lambda q, *_: (q[0], out_features), lambda q, *_: q)
        self.kv_norm, self.kv_norm_eps = kv_norm.weight, kv_norm.eps_tensor
        self.cos_sin = rotary.cos_sin
        self.interleaved = ms.Tensor([int(not rotary.is_neox_style)], ms.int32)

    def absorbed(self, q, kv_a, cache, positions, slot_mapping, block_tables,
                 batch_valid_length, q_seq_lens):
        """q [T, H * (dn + dr)] (q_b_proj's), kv_a [T, r + dr] (kv_a_proj_with_mqa's), the layer's
        cache, positions and the AttentionMetadata tensors -> out [T, H * dv]: the same as
        `construct` after the latent's norm and both ropes (`use_absorbed_kernel`)."""
        return self.absorbed_kernel(q, kv_a, self.kv_norm, self.kv_norm_eps, positions,
                                    self.cos_sin, self.w_uk, self.w_uv, cache, slot_mapping,
                                    block_tables, batch_valid_length, q_seq_lens,
                                    self.scale_tensor, self.interleaved)

    def construct(self, q_nope, q_pe, latent, cache, positions, slot_mapping, block_tables,
                  batch_valid_length, q_seq_lens, prefill_only: bool = False):
        num_tokens = q_nope.shape[0]
        if self.fused:
            cache_written = self.reshape_and_cache(latent, None, cache, None, slot_mapping)
            q_nope = ops.depend(q_nope, cache_written)
            if prefill_only:
                return self._expanded_flash_attention(q_nope, q_pe, latent, batch_valid_length)
        # Absorb W_UK into the query: [H, T, dn] x [H, dn, r] -> [T, H, r].
        q_latent = self.bmm(q_nope.transpose(1, 0, 2), self.w_uk).transpose(1, 0, 2)
        query = mint.cat((q_latent, q_pe), dim=-1)  # [T, H, r + dr]
        if self.fused:
            masked = 1.0 if query.dtype == ms.bfloat16 else -10000.0
            mask = causal_mask_rows(positions, block_tables.shape[1] * self.block_size, masked,
                                    query.dtype)
            out_latent = self.paged_attention(
                query.reshape(num_tokens, -1), cache, cache, block_tables, batch_valid_length,
                None, None, mask, q_seq_lens).reshape(num_tokens, self.num_heads,
                                                      self.kv_lora_rank)
        else:
            out_latent = self.kernel(query, latent, cache, slot_mapping, block_tables,
                                     batch_valid_length, q_seq_lens, self.scale_tensor)
        # Absorb W_UV into the output: [H, T, r] x [H, dv, r]^T -> [T, H * dv].
        out = self.bmm_nt(out_latent.transpose(1, 0, 2), self.w_uv).transpose(1, 0, 2)
        return out.reshape(num_tokens, self.num_heads * self.v_head_dim)

    def _expanded_flash_attention(self, q_nope, q_pe, latent, batch_valid_length):
        """First prefills only (Ascend): per-head keys [k_nope, k_pe] and values from the new
        latents, then FlashAttentionScore over them -> [T, H * dv]."""
        num_tokens, heads = q_nope.shape[0], self.num_heads
        c = ops.broadcast_to(latent[:, :self.kv_lora_rank].expand_dims(0),
                             (heads, num_tokens, self.kv_lora_rank))  # [H, T, r]
        k_nope = self.bmm_nt(c, self.w_uk).transpose(1, 0, 2)  # [T, H, dn]
        values = self.bmm_nt(c, self.w_uv).transpose(1, 0, 2)  # [T, H, dv]
        k_pe = ops.broadcast_to(latent[:, self.kv_lora_rank:].expand_dims(1),
                                (num_tokens, heads, self.qk_rope_head_dim))
        query = mint.cat((q_nope, q_pe), dim=-1).reshape(num_tokens, -1)
        keys = mint.cat((k_nope, k_pe), dim=-1).reshape(num_tokens, -1)
        return self.flash_attention(query, keys, values.reshape(num_tokens, -1), None, None,
                                    None, prefill_mask(query.dtype), None, batch_valid_length,
                                    batch_valid_length)[3]
