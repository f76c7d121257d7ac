"""Mixture-of-experts dispatch: each token's hidden state through its top-k experts, weighted.

Routing (softmax top-k, DeepSeek's grouped sigmoid top-k, ...) belongs to the model; this op
takes its result. The experts are loaded as one Cell each, named like the checkpoint
(`experts.E.gate_proj.weight`), and computed in one of two ways:

- CPU, plain ops, the experts kept as separate Cells (on CPU slicing a stacked expert Parameter
  costs more than the expert's matmul), one of two ways chosen per graph (the token count T of a
  graph is static: one graph per token bucket):
  - small steps (decode): every expert on every token, weighted by its routing weight (zero when
    not chosen). Static shapes, ~7 ops an expert; E/K times the matmul work of the loop.
  - larger steps: a per-expert loop: token rows of the expert, gather, expert MLP, weighted
    `tensor_scatter_add` back. ~12 ops an expert, some with data-dependent shapes, which cost
    ~0.5-0.8 ms more per expert than the static ones on CPU.
  Dense wins while its extra matmul work, about T x 3·D·I MACs per expert, costs less than that
  overhead: T <= _LOOP_OVERHEAD_MACS / (3·D·I) (VLLM_MS_MOE_DENSE_MAX_TOKENS overrides it). On
  2 cores: decode 2-3.5x faster with 8-16 experts; 16 experts of 512x256 break even above T=128.
- Ascend: after loading, `stack_experts` turns them into two stacked weights, gate|up
  `w13 [E, D, 2I]` and down `w2 [E, I, D]`, run by MindSpore's fused MoE kernels:
  MoeInitRoutingV2 (sort the token copies by expert, count per expert), two GroupedMatmulV4
  calls over those groups and MoeTokenUnpermute (back to token order, weighted sum over k).

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
from vllm.logger import init_logger

from vllm_mindspore import envs
from vllm_mindspore.distributed.communication import sized_collective
from vllm_mindspore.ops.host import parameter, to_host
from vllm_mindspore.platform import ASCEND, kernel_device

logger = init_logger("vllm.vllm_mindspore.moe")

# The matmul work (multiply-adds) a CPU core pair does in the time the per-expert loop's
# data-dependent ops cost over static ones: ~0.7 ms at ~35 GMAC/s (measured, MindSpore 2.10).
_LOOP_OVERHEAD_MACS = 25_000_000


class MoEDispatch(nn.Cell):
    """hidden [T, D], topk_weights [T, K] float32, topk_ids [T, K] int32 (global expert ids),
    experts (CellList of this rank's E cells mapping [n, D] -> [n, D], or None once stacked)
    -> [T, D]: sum over k of weight * expert_k(hidden)."""

    def __init__(self, num_experts: int, expert_macs_per_token: int, expert_start: int = 0,
                 ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        self.num_experts = num_experts  # experts on this rank
        # CPU: the largest step (tokens) that runs every expert on every token.
        override = envs.VLLM_MS_MOE_DENSE_MAX_TOKENS
        self.dense_max_tokens = (override if override is not None
                                 else _LOOP_OVERHEAD_MACS // expert_macs_per_token)
        self.grouped = kernel_device() == ASCEND
        if not self.grouped and self.dense_max_tokens:
            logger.info_once("MoE on CPU: steps of at most %d tokens run every expert on every "
                             "token, larger ones loop over the experts", self.dense_max_tokens)
        elif not self.grouped:
            logger.info_once("MoE on CPU: every step loops over the experts")
        self.expert_start = expert_start
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.w13 = None  # [E, D, 2I] gate | up, from stack_experts
        self.w2 = None  # [E, I, D]
        if ep_size > 1:
            self.all_gather = sized_collective(ops.AllGather, ep_size)
            if self.grouped:
                self.reduce_scatter = sized_collective(ops.ReduceScatter, ep_size)
            else:
                self.all_reduce = ops.AllReduce()

    def stack_experts(self, experts, prefix: str) -> None:
        """Per-expert gate|up and down Linear weights ([out, in]) -> the grouped kernels' w13,
        w2."""
        dtype = experts[0].down_proj.weight.dtype
        self.w13 = parameter(np.stack([to_host(e.gate_up_proj.weight).T for e in experts]),
                             dtype, f"{prefix}.w13")
        self.w2 = parameter(np.stack([to_host(e.down_proj.weight).T for e in experts]), dtype,
                            f"{prefix}.w2")

    def construct(self, hidden, topk_weights, topk_ids, experts):
        if self.ep_size == 1:
            return self._local_experts(hidden, topk_weights, topk_ids, experts)
        num_tokens, dim = hidden.shape
        all_hidden = self.all_gather(hidden)  # [EP * T, D]
        all_weights = self.all_gather(topk_weights)
        # Ids travel as float32 (exact for any expert count): int32 collectives are not on CPU.
        all_ids = self.all_gather(topk_ids.astype(ms.float32)).astype(ms.int32)
        out = self._local_experts(all_hidden, all_weights, all_ids - self.expert_start, experts)
        if self.grouped:
            return self.reduce_scatter(out)
        out = self.all_reduce(out.astype(ms.float32))
        return out.reshape(self.ep_size, num_tokens, dim)[self.ep_rank].astype(hidden.dtype)

    def _local_experts(self, hidden, topk_weights, topk_ids, experts):
        """Ids outside [0, num_experts) belong to other ranks and contribute nothing here."""
        if self.grouped:
            return self._grouped_kernels(hidden, topk_weights, topk_ids)
        # T is static in each graph (one per token bucket): the choice is made at compile time.
        if hidden.shape[0] <= self.dense_max_tokens:
            return self._every_expert(hidden, topk_weights, topk_ids, experts)
        return self._per_expert_loop(hidden, topk_weights, topk_ids, experts)

    def _routing_weights(self, topk_weights, topk_ids):
        """[T, K] weights and ids -> [T, E] weight of each local expert, zero where not chosen."""
        one_hot = ops.one_hot(topk_ids, self.num_experts, ops.ones((), ms.float32),
                              ops.zeros((), ms.float32))  # [T, K, E]
        return mint.sum(one_hot * topk_weights.expand_dims(-1), 1)

    def _every_expert(self, hidden, topk_weights, topk_ids, experts):
        weights = self._routing_weights(topk_weights, topk_ids)
        out = mint.zeros(hidden.shape, dtype=ms.float32)
        for e, expert in enumerate(experts):
            out = out + expert(hidden).astype(ms.float32) * weights[:, e:e + 1]
        return out.astype(hidden.dtype)

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
        gate_up = grouped_matmul_v4([sorted_hidden], [self.w13], group_list=counts, split_item=3,
                                    group_type=0, group_list_type=1)[0]  # [T * K, 2I]
        gate, up = mint.split(gate_up, gate_up.shape[-1] // 2, -1)
        out = grouped_matmul_v4([ops.silu(gate) * up], [self.w2], group_list=counts,
                                split_item=3, group_type=0, group_list_type=1)[0]  # [T * K, D]
        # Rows past the local groups are not written by the grouped matmul: clear them.
        rows = ops.arange(0, out.shape[0], dtype=ms.int64).reshape(-1, 1)
        out = mint.where(rows < counts.sum(), out, mint.zeros_like(out))
        return ops.moe_token_unpermute(out, unsort_map, topk_weights.astype(out.dtype))

    def _per_expert_loop(self, hidden, topk_weights, topk_ids, experts):
        num_tokens, dim = hidden.shape
        # Per (token, expert) routing weight, zero where not selected; one extra zero row T.
        weights = mint.cat((self._routing_weights(topk_weights, topk_ids),
                            mint.zeros((1, self.num_experts), dtype=ms.float32)), 0)  # [T + 1, E]
        selected = weights[:num_tokens].transpose(1, 0) > 0  # [E, T]
        # Row T is a zero token every expert also "receives": no expert ever sees an empty
        # batch (index/segment ops crash on zero rows), and it adds zero to a dropped row.
        padded = mint.cat((hidden, mint.zeros((1, dim), dtype=hidden.dtype)), 0)
        pad_row = ops.fill(ms.int64, (1,), num_tokens)
        out = mint.zeros((num_tokens + 1, dim), dtype=ms.float32)
        for e, expert in enumerate(experts):
            rows = mint.cat((ops.nonzero(selected[e]).reshape(-1), pad_row), 0)  # [n_e + 1]
            expert_out = expert(ops.gather(padded, rows, 0)).astype(ms.float32)
            expert_out = expert_out * ops.gather(weights[:, e], rows, 0).expand_dims(-1)
            out = ops.tensor_scatter_add(out, rows.expand_dims(-1), expert_out)
        return out[:num_tokens].astype(hidden.dtype)
