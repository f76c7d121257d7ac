"""The part every native MoE layer shares: this rank's routed experts, their dispatch and the
reduction over ranks. Models add their router (`gate`) and, if any, shared experts."""

from mindspore import nn

from model_backends.native.layers import ExpertShard, TensorParallelAllReduce, ep_rank_and_size
from model_backends.native.llama import LlamaMLP
from vllm_mindspore.ops.decoder import LayerMLP
from vllm_mindspore.ops.moe import MoEDispatch


class RoutedExperts(nn.Cell):
    """Base cell of an MoE layer; `experts.E` are named like the checkpoint's tensors.

    Without expert parallel each expert's intermediate features are split over TP ranks and the
    partial sums of all experts (shared ones included) are reduced once, after combining. With
    it, each rank holds whole experts of its range and the dispatch returns complete sums.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype):
        super().__init__()
        shard = ExpertShard.for_rank(num_experts)
        self.expert_parallel = ep_rank_and_size()[1] > 1
        self.experts = nn.CellList([
            LlamaMLP(hidden_size, intermediate_size, dtype, reduce_results=False,
                     tp_split=not self.expert_parallel)
            for _ in range(shard.count)])
        self.dispatch = MoEDispatch(shard.count, shard.start, *ep_rank_and_size())
        self.reduce = TensorParallelAllReduce()
        self.intermediate_size = intermediate_size

    def process_weights_after_loading(self, prefix: str) -> None:
        """The experts become the dispatch's two stacked weights; the per-expert Cells are
        dropped so the weights are not held twice."""
        self.dispatch.stack_experts(self.experts, f"{prefix}.dispatch")
        self.experts = None

    def layer_mlp(self) -> LayerMLP | None:
        """How the decoder layers' operator runs this MLP: not at all, unless a model's router
        is one the operator runs (Qwen3-MoE's softmax top-k: `layer_kernel_experts` + router)."""
        return None

    def layer_kernel_experts(self) -> LayerMLP | None:
        """The routed experts as the decoder layers' operator runs them (the CPU kernel's float
        experts, all on this rank), without a router: a model's `layer_mlp` adds its own."""
        dispatch = self.dispatch
        if (self.expert_parallel or dispatch.grouped or dispatch.quant_experts is not None
                or dispatch.w13 is None):
            return None
        return LayerMLP(dispatch.w13, dispatch.w2, self.intermediate_size)

    def routed(self, hidden, weights, expert_ids):
        """hidden [T, D], weights / expert_ids [T, K] -> routed output [T, D], fully reduced."""
        out = self.dispatch(hidden, weights, expert_ids)
        return out if self.expert_parallel else self.reduce(out)

    def routed_plus_shared(self, hidden, weights, expert_ids, shared_partial):
        """As `routed`, plus the TP-partial output of shared experts, with one reduction."""
        out = self.dispatch(hidden, weights, expert_ids)
        if self.expert_parallel:
            return out + self.reduce(shared_partial)
        return self.reduce(out + shared_partial)
