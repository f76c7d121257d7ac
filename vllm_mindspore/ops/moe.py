"""Mixture-of-experts dispatch: each token's hidden state through its top-k experts, weighted.

Routing (softmax top-k, DeepSeek's grouped sigmoid top-k, ...) belongs to the model; this op
takes its result. Softmax top-k routing (`SoftmaxTopK`) and DeepSeek-V3's grouped sigmoid routing
(`GroupedTopK`) are ops of their own, one C++ operator each on CPU. The experts are loaded as one Cell each, named like the checkpoint
(`experts.E.gate_proj.weight`); after loading, `stack_experts` turns them into two stacked
weights, gate|up and down, and drops the per-expert cells:

- CPU: one C++ operator per layer (`csrc/moe.cc`): the token copies grouped by expert, each
  expert's gate|up matmul, silu(gate) * up and down matmul over exactly its tokens (weights packed
  in panels, see ops/linear.py), the weighted outputs summed back. Static shapes whatever the
  routing, so it runs in the static-shape graphs (a per-expert loop of MindSpore ops has
  data-dependent shapes; running every expert on every token wastes E/K times the work).
- Ascend: MindSpore's fused MoE kernels on w13 [E, D, 2I] and w2 [E, I, D]: MoeInitRoutingV2
  (sort the token copies by expert, count per expert), two GroupedMatmulV4 calls over those
  groups and MoeTokenUnpermute (back to token order, weighted sum over k).

Expert parallel: each rank holds a contiguous range of the routed experts. The ranks' tokens and
routing are all-gathered (every rank has the same token count: the model runner pads the batch
across data-parallel engines), each rank runs its experts over all of them, and the partial
outputs are summed over ranks, each rank keeping its own rows: AllReduce and a slice on CPU
(mccl has neither AlltoAll nor ReduceScatter), ReduceScatter on Ascend. This is used instead of
an AlltoAll exchange because graph mode needs static shapes: an AlltoAll of the token copies
must pad every destination's buffer to the worst case (all T*K copies to one rank), K times the
bytes of the all-gather; AlltoAllV needs the counts on the host (a graph break every layer), and
the fused MoeDistributeDispatch/Combine kernels accept only EP sizes 16/32/64 on Atlas A2.
"""

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops
from mindspore.ops.auto_generate import grouped_matmul_v4

from vllm_mindspore.distributed.communication import sized_collective
from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.host import parameter, to_host
from vllm_mindspore.ops.linear import pack_panels, packed_dtype
from vllm_mindspore.ops.quant import QuantExperts
from vllm_mindspore.platform import ASCEND, kernel_device


def group_limited_topk(choice, top_k: int, num_groups: int, topk_group: int, group_top_n: int,
                       masked_value: float):
    """choice [T, E] float32 -> expert ids [T, top_k] int32: the top-k experts among the
    `topk_group` groups (E / num_groups consecutive experts each) whose best `group_top_n`
    choice scores sum highest; the other groups' experts score `masked_value`. The models
    differ in `group_top_n` and `masked_value` (DeepSeek in HF and vLLM: 2 and -inf; in
    mindformers: top_k // topk_group and 0.0)."""
    num_tokens, num_experts = choice.shape
    per_group = num_experts // num_groups
    grouped = choice.reshape(num_tokens, num_groups, per_group)
    group_scores = ops.topk(grouped, group_top_n)[0].sum(-1)  # [T, G]
    group_ids = ops.topk(group_scores, topk_group)[1]  # [T, topk_group]
    group_mask = mint.sum(ops.one_hot(group_ids, num_groups, ops.ones((), ms.float32),
                                      ops.zeros((), ms.float32)), 1)  # [T, G]
    expert_mask = ops.broadcast_to(group_mask.expand_dims(-1),
                                   (num_tokens, num_groups, per_group))
    masked = ops.select(expert_mask.reshape(num_tokens, num_experts) > 0.5, choice,
                        ops.full_like(choice, masked_value))
    return ops.topk(masked, top_k)[1].astype(ms.int32)


class SoftmaxTopK(nn.Cell):
    """logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int32): softmax over the E
    experts in float32, the K most probable (best first; of equal ones the lower id first),
    renormalised to sum 1 over the K when `renormalize`. CPU: one C++ operator (`csrc/moe.cc`),
    which the decoder layers' operator also runs; Ascend: MindSpore's softmax and top-k."""

    def __init__(self, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.kernel = None
        if kernel_device() != ASCEND:
            self.kernel = kernels.custom_op(
                "SoftmaxTopK", lambda logits, _: ((logits[0], top_k), (logits[0], top_k)),
                lambda *_: (ms.float32, ms.int32))
            self.renormalize_flag = ms.Tensor([int(renormalize)], ms.int32)

    def construct(self, logits):
        if self.kernel is not None:
            return self.kernel(logits, self.renormalize_flag)
        weights, expert_ids = ops.topk(ops.softmax(logits.astype(ms.float32), -1), self.top_k)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdims=True)
        return weights, expert_ids.astype(ms.int32)


class GroupedTopK(nn.Cell):
    """(logits [T, E] float32, bias [E] float32) -> (weights [T, K] float32, expert ids [T, K]
    int32): DeepSeek-V3's routing. Sigmoid scores; the bias only steers the choice: the experts'
    groups ranked as `group_limited_topk` ranks them (HF and vLLM: their best 2, masked -inf),
    the top-k biased scores of the kept groups' experts (best first; of equal ones the lower id
    first); the weights are the chosen experts' unbiased scores, divided by their sum (+1e-20)
    when `renormalize`, times `scale`. CPU: one C++ operator (`csrc/moe.cc`); Ascend: MindSpore's
    ops."""

    def __init__(self, top_k: int, num_groups: int, topk_group: int, group_top_n: int,
                 masked_value: float, renormalize: bool, scale: float):
        super().__init__()
        self.top_k = top_k
        self.grouping = (num_groups, topk_group, group_top_n, masked_value)
        self.renormalize = renormalize
        self.scale = scale
        self.kernel = None
        if kernel_device() != ASCEND:
            self.kernel = kernels.custom_op(
                "GroupedTopK", lambda logits, *_: ((logits[0], top_k), (logits[0], top_k)),
                lambda *_: (ms.float32, ms.int32))
            self.config = ms.Tensor([num_groups, topk_group, group_top_n, int(renormalize)],
                                    ms.int32)
            self.factors = ms.Tensor([masked_value, scale], ms.float32)

    def construct(self, logits, bias):
        if self.kernel is not None:
            return self.kernel(logits, bias, self.config, self.factors)
        scores = ops.sigmoid(logits)
        expert_ids = group_limited_topk(scores + bias, self.top_k, *self.grouping)
        weights = ops.gather_elements(scores, 1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.scale, expert_ids


class MoEDispatch(nn.Cell):
    """hidden [T, D], topk_weights [T, K] float32, topk_ids [T, K] int32 (global expert ids)
    -> [T, D]: sum over k of weight * expert_k(hidden), over this rank's experts (all ranks'
    with expert parallel)."""

    def __init__(self, num_experts: int, expert_start: int = 0, ep_rank: int = 0,
                 ep_size: int = 1):
        super().__init__()
        self.num_experts = num_experts  # experts on this rank
        self.grouped = kernel_device() == ASCEND
        self.expert_start = expert_start
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.w13 = None  # gate | up, from stack_experts
        self.w2 = None  # down
        self.quant_experts = None  # W8A8 experts, from stack_experts
        if not self.grouped:
            self.experts_kernel = kernels.custom_op("MoeExperts", lambda x, *_: x,
                                                    lambda x, *_: x)
        if ep_size > 1:
            self.all_gather = sized_collective(ops.AllGather, ep_size)
            if self.grouped:
                self.reduce_scatter = sized_collective(ops.ReduceScatter, ep_size)
            else:
                self.all_reduce = ops.AllReduce()

    def stack_experts(self, experts, prefix: str) -> None:
        """Per-expert gate|up and down Linear weights ([out, in]) -> one stacked weight each:
        w13 [E, D, 2I] and w2 [E, I, D] for the grouped kernels (Ascend), or each expert's
        packed panels (CPU). W8A8_DYNAMIC experts (int8 weights, per-channel scales) become a
        `QuantExperts` cell (ops/quant.py)."""
        if experts[0].down_proj.quant is not None:
            self.quant_experts = QuantExperts([e.gate_up_proj.quant_arrays() for e in experts],
                                              [e.down_proj.quant_arrays() for e in experts],
                                              experts[0].down_proj.dtype, f"{prefix}.quant")
            return
        self.set_weights([to_host(e.gate_up_proj.weight) for e in experts],
                         [to_host(e.down_proj.weight) for e in experts],
                         experts[0].down_proj.weight.dtype, prefix)

    def set_weights(self, gate_up, down, dtype, prefix: str) -> None:
        """Each expert's float weights as host arrays [out, in]: gate_up [2I, D] (gate first),
        down [D, I] -> w13 and w2 in this device's layout (see `stack_experts`)."""
        if not self.grouped:
            dtype = packed_dtype(dtype)
            hidden, inter = down[0].shape
            if dtype == ms.bfloat16 and (hidden % 2 or inter % 2):
                raise ValueError(
                    f"{prefix}: bfloat16 MoE experts on CPU need an even hidden size and "
                    f"expert intermediate size (this model has {hidden} and {inter}); use "
                    "--dtype float32.")

        def layout(weight):
            return weight.T if self.grouped else pack_panels(weight, dtype)

        self.w13 = parameter(np.stack([layout(w) for w in gate_up]), dtype, f"{prefix}.w13")
        self.w2 = parameter(np.stack([layout(w) for w in down]), dtype, f"{prefix}.w2")

    def construct(self, hidden, topk_weights, topk_ids):
        if self.ep_size == 1:
            return self._local_experts(hidden, topk_weights, topk_ids)
        num_tokens, dim = hidden.shape
        all_hidden = self.all_gather(hidden)  # [EP * T, D]
        all_weights = self.all_gather(topk_weights)
        # Ids travel as float32 (exact for any expert count): int32 collectives are not on CPU.
        all_ids = self.all_gather(topk_ids.astype(ms.float32)).astype(ms.int32)
        out = self._local_experts(all_hidden, all_weights, all_ids - self.expert_start)
        if self.grouped:
            return self.reduce_scatter(out)
        out = self.all_reduce(out.astype(ms.float32))
        return out.reshape(self.ep_size, num_tokens, dim)[self.ep_rank].astype(hidden.dtype)

    def _local_experts(self, hidden, topk_weights, topk_ids):
        """Ids outside [0, num_experts) belong to other ranks and contribute nothing here."""
        if self.grouped:
            return self._grouped_kernels(hidden, topk_weights, topk_ids)
        if self.quant_experts is not None:
            return self.quant_experts.cpu_experts(hidden, topk_ids,
                                                  topk_weights.astype(ms.float32))
        return self.experts_kernel(hidden, topk_ids, topk_weights.astype(ms.float32), self.w13,
                                   self.w2)

    def _grouped_kernels(self, hidden, topk_weights, topk_ids):
        num_experts = self.num_experts
        foreign = mint.logical_or(topk_ids < 0, topk_ids >= num_experts)
        # Other ranks' copies all go to one extra group past the local experts: sorted last,
        # left out of the grouped matmuls, zero-weighted when summed back.
        topk_ids = ops.select(foreign, ops.full_like(topk_ids, num_experts), topk_ids)
        topk_weights = ops.select(foreign, ops.zeros_like(topk_weights), topk_weights)
        # Dropless with per-expert counts: three outputs (the primitive's fourth is dropped).
        sorted_hidden, unsort_map, counts = ops.moe_init_routing_v2(
            hidden, topk_ids, 0, 0, num_experts + 1, 0, 2, False)
        counts = counts[:num_experts].astype(ms.int64)
        if self.quant_experts is not None:  # int8 weights, per-token quantized rows
            gate_up = self.quant_experts.grouped_matmul(sorted_hidden, 1, counts)
        else:
            gate_up = grouped_matmul_v4([sorted_hidden], [self.w13], group_list=counts,
                                        split_item=3, group_type=0,
                                        group_list_type=1)[0]  # [T * K, 2I]
        gate, up = mint.split(gate_up, gate_up.shape[-1] // 2, -1)
        if self.quant_experts is not None:
            out = self.quant_experts.grouped_matmul(ops.silu(gate) * up, 2, counts)
        else:
            out = grouped_matmul_v4([ops.silu(gate) * up], [self.w2], group_list=counts,
                                    split_item=3, group_type=0,
                                    group_list_type=1)[0]  # [T * K, D]
        # Rows past the local groups are not written by the grouped matmul: clear them.
        rows = ops.arange(0, out.shape[0], dtype=ms.int64).reshape(-1, 1)
        out = mint.where(rows < counts.sum(), out, mint.zeros_like(out))
        return ops.moe_token_unpermute(out, unsort_map, topk_weights.astype(out.dtype))
