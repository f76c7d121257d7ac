"""CPU stand-ins for the Ascend-only ops of mindformers' mcore inference cells, made of this
project's CPU kernels (vllm_mindspore/ops/csrc). Declared and applied as patches by
`vllm_mindspore.patches.mindformers` (on CPU only); each factory takes the original attribute
and returns its replacement.
"""

import mindspore as ms
from mindspore import nn, ops

from vllm_mindspore.ops import PagedAttention
from vllm_mindspore.ops import kernels


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
