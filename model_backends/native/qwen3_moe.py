"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm attention) with softmax top-k routed experts.

Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0,
as in HF transformers' `Qwen3MoeDecoderLayer`; other layers keep the dense MLP. Tensor names as
in the checkpoints: `mlp.gate.weight`, `mlp.experts.E.{gate,up,down}_proj.weight`.
"""

from mindspore import nn, ops

from model_backends.native.layers import ExpertShard, packed_weight
from model_backends.native.llama import LlamaForCausalLM
from model_backends.native.moe import RoutedExperts
from model_backends.native.qwen3 import Qwen3DecoderLayer
from vllm_mindspore.ops.decoder import LayerMLP
from vllm_mindspore.ops.host import zeros_parameter
from vllm_mindspore.ops.linear import packed_matmul
from vllm_mindspore.ops.moe import SoftmaxTopK
from vllm_mindspore.platform import ASCEND, kernel_device


class Qwen3MoeTopKRouter(nn.Cell):
    """hidden [T, hidden] -> (weights [T, K] float32, expert ids [T, K] int32): softmax over all
    experts in float32, top-k, renormalised over the k when norm_topk_prob."""

    def __init__(self, config, dtype):
        super().__init__()
        self.weight = zeros_parameter((config.num_experts, config.hidden_size), dtype)
        self.matmul = ops.MatMul(transpose_b=True)
        self.packed = None  # CPU: the kernel over the packed weight
        self.routing = SoftmaxTopK(config.num_experts_per_tok, bool(config.norm_topk_prob))

    def use_compute_layout(self, prefix: str) -> None:
        """CPU: the weight packed for the matmul kernel, in the graphs' dtype (float32 for a
        bfloat16 model: the routing's logits in full precision, as before it was packed)."""
        if kernel_device() == ASCEND or self.packed is not None:
            return
        self.packed = packed_matmul(self.weight.shape[0])
        self.weight = packed_weight(self.weight, self.weight.dtype, prefix)

    def construct(self, hidden):
        if self.packed is not None:
            return self.routing(self.packed(hidden, self.weight))
        return self.routing(self.matmul(hidden, self.weight))


class Qwen3MoeSparseMoeBlock(RoutedExperts):
    def __init__(self, config, dtype):
        super().__init__(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                         dtype)
        self.gate = Qwen3MoeTopKRouter(config, dtype)

    def layer_mlp(self) -> LayerMLP | None:
        """The routed experts as the decoder layers' operator runs them (CPU, float weights, one
        rank)."""
        experts = self.layer_kernel_experts()
        if experts is None or self.gate.packed is None:
            return None
        routing = self.gate.routing
        return experts._replace(router=self.gate.weight, top_k=routing.top_k,
                                renormalize=routing.renormalize)

    def construct(self, hidden):
        weights, expert_ids = self.gate(hidden)
        return self.routed(hidden, weights, expert_ids)


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, layer_index: int, dtype) -> nn.Cell:
        if is_sparse_layer(config, layer_index):
            return Qwen3MoeSparseMoeBlock(config, dtype)
        return super().make_mlp(config, layer_index, dtype)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer

    def checkpoint_name_to_param(self, name: str) -> str | None:
        name = ExpertShard.for_rank(self.config.num_experts).local_name(name)
        return None if name is None else super().checkpoint_name_to_param(name)
