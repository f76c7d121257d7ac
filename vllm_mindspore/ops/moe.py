"""Mixture-of-experts dispatch: each token's hidden state through its top-k experts, weighted.

Routing (softmax top-k, DeepSeek's grouped sigmoid top-k, ...) belongs to the model; this op
takes its result. Experts stay one Cell (one set of Parameters) each, named like the checkpoint
(`experts.E.gate_proj.weight`): on CPU slicing a stacked expert Parameter costs more than the
expert's matmul. The dispatch is a per-expert loop of plain ops (runs on any device): token rows
of the expert, gather, expert MLP, weighted `tensor_scatter_add` back.

Expert parallel: each rank holds a contiguous range of the routed experts. The ranks' tokens and
routing are all-gathered (every rank has the same token count: the model runner pads the batch
across data-parallel engines), each rank runs its experts over all of them, the partial outputs
are all-reduced and each rank keeps its own rows. AllGather + AllReduce is what runs on CPU
(mccl has no AlltoAll).
"""

import mindspore as ms
from mindspore import mint, nn, ops


class MoEDispatch(nn.Cell):
    """hidden [T, D], topk_weights [T, K] float32, topk_ids [T, K] int32, experts (CellList of
    E cells mapping [n, D] -> [n, D]) -> [T, D]: sum over k of weight * expert_k(hidden)."""

    def __init__(self, num_experts: int, expert_start: int = 0, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        self.num_experts = num_experts  # experts on this rank
        self.expert_start = expert_start
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        if ep_size > 1:
            self.all_gather = ops.AllGather()
            self.all_reduce = ops.AllReduce()

    def construct(self, hidden, topk_weights, topk_ids, experts):
        if self.ep_size == 1:
            return self._local_experts(hidden, topk_weights, topk_ids, experts)
        num_tokens, dim = hidden.shape
        all_hidden = self.all_gather(hidden)  # [EP * T, D]
        all_weights = self.all_gather(topk_weights)
        # Ids travel as float32 (exact for any expert count): int32 collectives are not on CPU.
        all_ids = self.all_gather(topk_ids.astype(ms.float32)).astype(ms.int32)
        out = self._local_experts(all_hidden, all_weights, all_ids - self.expert_start, experts)
        out = self.all_reduce(out.astype(ms.float32))
        return out.reshape(self.ep_size, num_tokens, dim)[self.ep_rank].astype(hidden.dtype)

    def _local_experts(self, hidden, topk_weights, topk_ids, experts):
        """Ids outside [0, num_experts) belong to other ranks and select nothing here."""
        num_tokens, dim = hidden.shape
        one_hot = ops.one_hot(topk_ids, self.num_experts, ops.ones((), ms.float32),
                              ops.zeros((), ms.float32))  # [T, K, E]
        # Per (token, expert) routing weight, zero where not selected; one extra zero row T.
        weights = mint.cat((mint.sum(one_hot * topk_weights.expand_dims(-1), 1),
                            mint.zeros((1, self.num_experts), dtype=ms.float32)), 0)  # [T + 1, E]
        selected = mint.sum(one_hot, 1).transpose(1, 0) > 0.5  # [E, T]
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
