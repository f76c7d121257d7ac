"""Consecutive Llama-family decoder layers as one CPU operator (`csrc/decoder_layer.cc`).

A layer's parts are the plugin's CPU kernels already (norms, packed projections, the paged
attention with its rotary embedding). MindSpore spends ~40-70 us between two operators of a graph
on these CPUs, and a decode step at batch 1 is mostly memory-bound matmuls and those gaps. The
operator runs the same kernels in turn on the same tensors, layer after layer, so its outputs
equal the separate operators'. It applies where a layer is nothing else: float weights packed for
the CPU matmul, one tensor-parallel and expert-parallel rank (no collective between the parts),
a dense MLP or softmax top-k routed experts (Qwen3-MoE's), and neox rotary embedding; a model's
consecutive such layers are one operator (`DecoderLayersKernel`).
"""

from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import nn

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.attention import PagedAttention
from vllm_mindspore.ops.norm import RMSNorm


class LayerMLP(NamedTuple):
    """A layer's MLP as the operator runs it: dense (gate_up and down packed as linear.py packs
    them) or routed experts (gate_up and down the experts' stacked w13 and w2 (moe.py), the
    router's packed weight, `top_k` experts a token, their weights renormalised or not)."""

    gate_up: ms.Parameter
    down: ms.Parameter
    intermediate_size: int  # the dense MLP's, or an expert's
    router: ms.Parameter | None = None
    top_k: int = 0
    renormalize: bool = False


class DecoderLayerTensors(nn.Cell):
    """A layer's inputs to the operator besides its KV caches (its attention's, allocated after
    this is built): the same Parameters as the layer's own cells (no copies): the norms' weights
    and eps, the packed projections (linear.py), the optional q|k|v bias and stacked q|k norm
    weight [H + KVH, D], the MLP's (`LayerMLP`), and the attention's rotary table and scale."""

    def __init__(self, input_norm: RMSNorm, qkv, qkv_bias, qk_norm: RMSNorm | None, o_proj,
                 post_norm: RMSNorm, mlp: LayerMLP, attention: PagedAttention):
        super().__init__()
        absent = ms.Tensor(np.zeros(0, np.float32))  # an optional input left out
        self.input_norm, self.post_norm = input_norm.weight, post_norm.weight
        self.eps = input_norm.eps_tensor
        self.qkv, self.o_proj, self.gate_up, self.down = qkv, o_proj, mlp.gate_up, mlp.down
        self.qkv_bias = absent if qkv_bias is None else qkv_bias
        self.qk_norm = absent if qk_norm is None else qk_norm.weight
        self.router = absent if mlp.router is None else mlp.router
        self.cos_sin, self.scale = attention.cos_sin, attention.scale_tensor
        self.sizes = ms.Tensor([attention.num_heads, mlp.intermediate_size, mlp.top_k,
                                int(mlp.renormalize)], ms.int32)

    @staticmethod
    def applies(norms: list[RMSNorm], attention: PagedAttention) -> bool:
        """Whether the kernel computes a layer of these norms and attention as its separate
        operators do: CPU kernels, one eps for every norm, neox rotary inside the attention."""
        return (all(not norm.fused for norm in norms) and len({norm.eps for norm in norms}) == 1
                and attention.neox_rotary)


class DecoderLayersKernel(nn.Cell):
    """(positions, hidden [T, E], residual [T, E] or None (the model's first layer), attention
    metadata, prefill_only) -> (the last layer's output [T, E], the residual stream before it),
    as the layers' own `construct`s chain:
    per layer norm(hidden + residual) -> q|k|v (+ bias) -> [q|k head norm] -> rotary paged
    attention -> o -> norm(+ residual) -> silu(gate) * up -> down, or -> router -> softmax top-k
    -> the experts' weighted sum.

    `layers`: consecutive decoder layers, each with `layer_tensors` (DecoderLayerTensors) and
    `self_attn` (the owner of its `key_cache` and `value_cache`, allocated after this is built)."""

    def __init__(self, layers: list[nn.Cell]):
        super().__init__()
        self.layers = nn.CellList(layers)
        self.absent = ms.Tensor(np.zeros(0, np.float32))
        self.kernel = kernels.custom_op("DecoderLayers", lambda h, *_: (h, h),
                                        lambda h, *_: (h, h))

    def construct(self, positions, hidden, residual, attn_metadata, prefill_only):
        if residual is None:
            residual = self.absent
        layer_inputs = ()  # per layer, in the order of decoder_layer.cc's kLayerInputs
        for layer in self.layers:
            tensors, attention = layer.layer_tensors, layer.self_attn
            layer_inputs = layer_inputs + (
                tensors.input_norm, tensors.eps, tensors.qkv, tensors.qkv_bias, tensors.qk_norm,
                tensors.o_proj, tensors.post_norm, tensors.gate_up, tensors.down, tensors.router,
                attention.key_cache, attention.value_cache, tensors.scale, tensors.cos_sin,
                tensors.sizes)
        slot_mapping, block_tables, batch_valid_length, q_seq_lens = attn_metadata
        return self.kernel(hidden, residual, slot_mapping, block_tables, batch_valid_length,
                           q_seq_lens, positions, *layer_inputs)
