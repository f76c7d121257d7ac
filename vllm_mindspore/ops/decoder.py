"""A Llama-family decoder layer as one CPU operator (`csrc/decoder_layer.cc`).

The layer's parts are the plugin's CPU kernels already (norms, packed projections, the paged
attention with its rotary embedding); MindSpore launches each for ~10 us on these CPUs, and a
decode step at batch 1 is mostly those launches' gaps beside memory-bound matmuls. The operator
runs the same kernels in turn on the same tensors, so its outputs equal the separate operators'.
It applies where a layer is nothing else: float weights packed for the CPU matmul, one
tensor-parallel rank (no all-reduce between the parts), a dense MLP and neox rotary embedding.
"""

import mindspore as ms
import numpy as np
from mindspore import nn

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.attention import PagedAttention
from vllm_mindspore.ops.norm import RMSNorm


class DecoderLayerKernel(nn.Cell):
    """(hidden [T, E], residual [T, E] or None (the first layer), the layer's KV caches,
    positions, attention metadata) -> (out [T, E], the residual stream [T, E]):
    norm(hidden + residual) -> q|k|v (+ bias) -> [q|k head norm] -> rotary paged attention -> o
    -> norm(+ residual) -> silu(gate) * up -> down.

    Built from the layer's own tensors (the same Parameters, no copies): the norms' weights and
    eps, the packed projections (linear.py), the optional q|k|v bias and stacked q|k norm weight
    [H + KVH, D], and the attention's rotary table and scale."""

    def __init__(self, input_norm: RMSNorm, qkv, qkv_bias, qk_norm: RMSNorm | None, o_proj,
                 post_norm: RMSNorm, gate_up, down, attention: PagedAttention,
                 intermediate_size: int):
        super().__init__()
        self.absent = ms.Tensor(np.zeros(0, np.float32))  # an optional input left out
        self.input_norm, self.post_norm = input_norm.weight, post_norm.weight
        self.eps = input_norm.eps_tensor
        self.qkv, self.o_proj, self.gate_up, self.down = qkv, o_proj, gate_up, down
        self.qkv_bias = self.absent if qkv_bias is None else qkv_bias
        self.qk_norm = self.absent if qk_norm is None else qk_norm.weight
        self.cos_sin, self.scale = attention.cos_sin, attention.scale_tensor
        self.sizes = ms.Tensor([attention.num_heads, intermediate_size], ms.int32)
        self.kernel = kernels.custom_op("DecoderLayer", lambda h, *_: (h, h),
                                        lambda h, *_: (h, h))

    @staticmethod
    def applies(norms: list[RMSNorm], attention: PagedAttention) -> bool:
        """Whether the kernel computes a layer of these norms and attention as its separate
        operators do: CPU kernels, one eps for every norm, neox rotary inside the attention."""
        return (all(not norm.fused for norm in norms) and len({norm.eps for norm in norms}) == 1
                and attention.neox_rotary)

    def construct(self, hidden, residual, key_cache, value_cache, positions, slot_mapping,
                  block_tables, batch_valid_length, q_seq_lens):
        if residual is None:
            residual = self.absent
        return self.kernel(hidden, residual, self.input_norm, self.eps, self.qkv, self.qkv_bias,
                           self.qk_norm, self.o_proj, self.post_norm, self.gate_up, self.down,
                           key_cache, value_cache, slot_mapping, block_tables, batch_valid_length,
                           q_seq_lens, self.scale, positions, self.cos_sin, self.sizes)
