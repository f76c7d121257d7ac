"""CPU stand-ins for the Ascend-only ops of mindformers' mcore inference cells, made of this
project's CPU kernels (vllm_mindspore/ops/csrc). Declared and applied as patches by
`vllm_mindspore.patches.mindformers` (on CPU only); each factory takes the original attribute
and returns its replacement.
"""

import mindspore as ms
from mindformers.parallel_core.inference.tensor_parallel.mappings import (
    reduce_from_model_parallel_region)
from mindspore import mint, nn, ops

from vllm_mindspore.ops import PagedAttention, kernels
from vllm_mindspore.ops.host import to_host
from vllm_mindspore.ops.mla import MLAAttention
from vllm_mindspore.ops.moe import MoEDispatch, group_limited_topk


class RmsNormOp(nn.Cell):
    """P.RmsNorm's call: (x [..., H], weight [H]) -> (y [..., H],), y = x * rsqrt(mean(x^2) +
    eps) * weight computed in float32; x and weight share a dtype."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = ms.Tensor([eps], ms.float32)
        self.kernel = kernels.custom_op("RmsNorm", lambda x, *_: x, lambda x, *_: x)

    def construct(self, x, weight):
        return (self.kernel(x, weight, self.eps),)


def rms_norm_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.norm = RmsNormOp(self.eps)

    return __init__


class RotaryOp(nn.Cell):
    """ApplyRotaryPosEmb's call on per-token tables (rotate_half): (q [T, Hq * D], k [T, Hk * D],
    cos [T, D], sin [T, D], seq_lens) -> (q, k) rotated, same shapes. mf's tables repeat their
    D/2 frequencies twice; the RopeNeox kernel takes each once, as row `t` of a [T, D] table for
    token t."""

    def __init__(self, head_size: int):
        super().__init__()
        self.half = head_size // 2
        self.kernel = kernels.custom_op("RopeNeox",
                                        lambda x, *_: (x[0], x[1] // head_size, head_size),
                                        lambda x, *_: x)

    def construct(self, query, key, cos, sin, seq_lens):
        num_tokens = query.shape[0]
        table = ops.cat((cos[:, :self.half], sin[:, :self.half]), -1).astype(ms.float32)
        rows = ops.arange(0, num_tokens, dtype=ms.int32)
        return (self.kernel(query, rows, table).reshape(num_tokens, -1),
                self.kernel(key, rows, table).reshape(num_tokens, -1))


def rotary_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.rotary_embedding_op = RotaryOp(self.dim)

    return __init__


def paged_attention_construct(original):
    """FlashAttention.construct over the cell's `cpu_attention` (a PagedAttention) and
    `key_cache_cpu` / `value_cache_cpu` (bound by `bind_paged_attention` and the backend's
    cache allocation); the cache arguments of the mcore forward are unused (None)."""
    def construct(self, query, key, value, slot_mapping=None, block_tables=None,
                  batch_valid_length=None, context_lens_tensor=None, q_seq_lens=None,
                  actual_seq_qlen=None, actual_seq_kvlen=None, attn_mask=None,
                  padding_mask=None, prefix=None, key_cache=None, value_cache=None):
        num_tokens, size = query.shape[0], self.hidden_size_per_attention_head
        qk = ops.cat((query.reshape(num_tokens, self.head_num, size),
                      key.reshape(num_tokens, self.kv_head_num, size)), 1)
        return self.cpu_attention(qk, value, self.key_cache_cpu, self.value_cache_cpu, None,
                                  slot_mapping, block_tables, batch_valid_length, q_seq_lens)

    return construct


def bind_paged_attention(core_attention, scale: float, block_size: int) -> PagedAttention:
    """Give one mf FlashAttention cell its CPU kernel; its caches come with allocation."""
    core_attention.cpu_attention = PagedAttention(
        core_attention.head_num, core_attention.kv_head_num,
        core_attention.hidden_size_per_attention_head, scale, block_size)
    return core_attention.cpu_attention


def topk_routing(original):
    """TopKRouter.routing (logits [T, E] float32 -> weights [T, K] float32, expert ids [T, K]
    int32) with the semantics of mf's unfused `topk_routing_with_score_function`, from ops with
    CPU kernels (it calls TopkExt, InplaceScatter and RepeatInterleaveInt): softmax or sigmoid
    scores; an expert bias only steers the choice; grouped routing ranks the groups by the sum of
    their top `topk // group_topk` scores and masks the other groups' experts with 0.0 (HF's
    DeepSeek-V3: top-2 and -inf); weights renormalised (+1e-20) only when `norm_topk_prob` and
    k > 1, then times `moe_router_topk_scaling_factor`. mf's fused path (FusedAddTopKDiv, taken
    with `moe_router_fusion`) is never taken on CPU."""
    def routing(self, logits):
        config = self.config
        if self.score_function == "softmax":
            scores = ops.softmax(logits, -1)
        else:
            scores = ops.sigmoid(logits)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if config.moe_router_group_topk:
            expert_ids = group_limited_topk(choice, self.topk, config.moe_router_num_groups,
                                            config.moe_router_group_topk,
                                            self.topk // config.moe_router_group_topk, 0.0)
        else:
            expert_ids = ops.topk(choice, self.topk)[1].astype(ms.int32)
        weights = ops.gather_elements(scores, 1, expert_ids)
        if config.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        if config.moe_router_topk_scaling_factor:
            weights = weights * config.moe_router_topk_scaling_factor
        return weights, expert_ids

    return routing


def moe_layer_construct(original):
    """MoELayer.construct with the routed experts run by the layer's `cpu_experts` (a
    MoEDispatch on this project's MoeExperts kernel, bound by `bind_moe_experts`) in place of
    MoeInitRoutingV2, GroupedMatmulV4 and MoeTokenUnpermute; mf's router, shared experts and
    tensor-parallel reduction stay. Its data-parallel gather and scatter are not configured
    (data_parallel = 1)."""
    def construct(self, hidden_states, attn_unpadding_idx=None, ffn_padding_idx=None):
        expert_weight, routing_map = self.router(hidden_states)
        output = self.cpu_experts(hidden_states, expert_weight, routing_map)
        if self.use_shared_expert:
            output = mint.add(output, self.shared_experts(hidden_states))
        if self.config.ffn_allreduce:
            output = reduce_from_model_parallel_region(output, self.tp_dp_group)
        return output

    return construct


def bind_moe_experts(moe_layer, prefix: str) -> MoEDispatch:
    """Pack one loaded MoELayer's GroupedMLP weights (weight1 [E, D, 2I] gate|up, weight2
    [E, I, D]) for the CPU kernel and drop the GroupedMLP."""
    experts = moe_layer.experts
    if moe_layer.config.attn_allgather or moe_layer.config.ffn_reduce_scatter:
        raise ValueError("mindformers' data-parallel MoE gather/scatter has no CPU stand-in.")
    moe_layer.cpu_experts = MoEDispatch(experts.num_local_experts)
    moe_layer.cpu_experts.set_weights(to_host(experts.weight1).transpose(0, 2, 1),
                                      to_host(experts.weight2).transpose(0, 2, 1),
                                      experts.weight1.dtype, f"{prefix}.cpu_experts")
    moe_layer.experts = None
    return moe_layer.cpu_experts


def mla_construct(original):
    """MLASelfAttention.construct on this project's MLA CPU kernel: mf's `compute_kv` (input
    norm, projections, q/kv norms, rope) gives the latent [c, k_pe] that the layer's
    `cpu_attention` (MLAAttention, bound by `bind_mla_attention`) writes to `kv_cache_cpu` and
    attends to with W_UK / W_UV absorbed, then mf's `linear_proj`. mf's ReshapeAndCache,
    FlashAttentionScore and PagedAttention are not called; the cache arguments are unused."""
    def construct(self, hidden_states, attention_mask, key_value_states=None,
                  rotary_pos_cos=None, rotary_pos_sin=None, position_ids=None,
                  batch_valid_length=None, block_tables=None, slot_mapping=None, q_seq_lens=None,
                  actual_seq_qlen=None, actual_seq_kvlen=None, context_lens_tensor=None,
                  key_cache=None, value_cache=None, q_seq_lens_cpu=None,
                  batch_valid_length_cpu=None, context_lens_tensor_cpu=None):
        latent, k_pe, q_nope, q_pe = self.compute_kv(hidden_states, batch_valid_length,
                                                     rotary_pos_cos, rotary_pos_sin)
        latent = mint.cat((latent, k_pe.reshape(latent.shape[0], -1)), -1)
        out = self.cpu_attention(q_nope, q_pe, latent, self.kv_cache_cpu, position_ids,
                                 slot_mapping, block_tables, batch_valid_length, q_seq_lens)
        return self.linear_proj(out)

    return construct


def bind_mla_attention(attention, block_size: int) -> MLAAttention:
    """Give one mf MLASelfAttention its CPU kernel, with mf's softmax scale (YaRN mscale
    included); its cache comes with allocation, its absorbed weights with `absorb_mla`."""
    config = attention.config
    attention.cpu_attention = MLAAttention(
        attention.num_attention_heads_per_partition, config.kv_lora_rank, config.qk_head_dim,
        config.qk_pos_emb_head_dim, config.v_head_dim, attention.softmax_scale, block_size)
    return attention.cpu_attention


def absorb_mla(attention, prefix: str) -> None:
    """After mf's process_weights_after_loading: its q_absorb [H, dn, r] and out_absorb
    [H, dv, r] become the kernel's W_UK / W_UV; linear_kv_up_proj (used only by mf's Ascend
    prefill path) and the absorbed copies are dropped."""
    attention.cpu_attention.set_absorbed(to_host(attention.q_absorb),
                                         to_host(attention.out_absorb),
                                         attention.linear_kv_up_proj.weight.dtype,
                                         f"{prefix}.cpu_attention")
    attention.linear_kv_up_proj = None
    attention.q_absorb = attention.out_absorb = None
def world_group_init(original):
    """ProcessGroup.__init__ naming a group that spans MindSpore's whole world (the engine's TP
    ranks, see vllm_mindspore.distributed.communication) by the world group's name: MindSpore's
    CPU AllGather runs on the world group only. The world group exists already, so mindformers
    does not create a copy of it."""
    def __init__(self, group=None, global_ranks=None, size=1, rank=0):
        from mindspore.communication import GlobalComm, get_group_size

        if group is not None and global_ranks is not None \
                and sorted(global_ranks) == list(range(get_group_size())):
            group = GlobalComm.WORLD_COMM_GROUP
        original(self, group, global_ranks, size, rank)

    return __init__
