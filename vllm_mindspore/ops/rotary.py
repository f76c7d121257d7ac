"""Rotary position embedding over vLLM's own cos/sin tables.

The tables come from `vllm.model_executor.layers.rotary_embedding.get_rope`, so every rope
scaling vLLM implements (linear, dynamic, yarn, llama3, deepseek_yarn, ...) means here exactly
what it means in vLLM, mscale included.
"""

import functools

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from vllm_mindspore.ops import kernels
from vllm_mindspore.platform import ASCEND, kernel_device


def rope_cos_sin(head_size: int, rotary_dim: int, max_position: int, rope_parameters: dict | None,
                 is_neox_style: bool) -> tuple[np.ndarray, np.ndarray]:
    """-> (cos, sin), each [max_position, rotary_dim // 2] float32."""
    import torch
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = dict(rope_parameters or {})
    if rotary_dim != head_size:
        params.setdefault("partial_rotary_factor", rotary_dim / head_size)
    rope = get_rope(head_size, max_position, is_neox_style=is_neox_style,
                    rope_parameters=params, dtype=torch.float32)
    cache = rope.cos_sin_cache.float().numpy()
    half = cache.shape[-1] // 2
    return np.ascontiguousarray(cache[:, :half]), np.ascontiguousarray(cache[:, half:])


class RotaryEmbedding(nn.Cell):
    """Rotates the first `rotary_dim` channels of every head by its token's position.

    positions [T], x [T, heads, head_size] -> [T, heads, head_size]. Queries and keys are rotated
    in one call (stacked along heads). With `heads`, x is [T, W] and its first `heads` heads of
    each row are rotated (q and k at the front of a fused q|k|v row) -> [T, heads, head_size].
    neox style rotates the two halves; otherwise (GPT-J / DeepSeek "interleaved") even/odd pairs. CPU: one C++ operator (`csrc/norm_rope.cc`);
    Ascend: RotaryPositionEmbedding (mode 0 halves, 1 pairs) for a full-width rotation, else
    the same math from MindSpore ops.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int,
                 rope_parameters: dict | None, is_neox_style: bool = True, dtype=ms.float32,
                 heads: int | None = None):
        super().__init__()
        self.heads = heads
        cos, sin = rope_cos_sin(head_size, rotary_dim, max_position, rope_parameters, is_neox_style)
        self.rotary_dim = rotary_dim
        self.head_size = head_size
        self.is_neox_style = is_neox_style
        self.on_ascend = kernel_device() == ASCEND
        self.fused = self.on_ascend and rotary_dim == head_size
        if self.on_ascend:
            self.cos = Tensor(cos, dtype)
            self.sin = Tensor(sin, dtype)
        else:
            self.cos_sin = Tensor(np.concatenate((cos, sin), -1), ms.float32)

    @functools.cached_property
    def kernel(self):
        """The CPU operator, built when a graph first calls it (not for a table the CPU
        attention applies itself)."""
        heads, head_size = self.heads, self.head_size
        return kernels.custom_op(
            "RopeNeox" if self.is_neox_style else "RopeInterleaved",
            (lambda x, *_: x) if heads is None else (lambda x, *_: (x[0], heads, head_size)),
            lambda x, *_: x)

    def _rotate(self, x, cos, sin):
        rot = x if self.rotary_dim == self.head_size else x[..., : self.rotary_dim]
        if self.is_neox_style:
            x1, x2 = mint.chunk(rot, 2, dim=-1)
            rotated = mint.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1 = rot[..., 0::2]
            x2 = rot[..., 1::2]
            rotated = ops.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
            rotated = rotated.reshape(rot.shape)
        if self.rotary_dim == self.head_size:
            return rotated
        return mint.cat((rotated, x[..., self.rotary_dim:]), dim=-1)

    def construct(self, positions, x):
        if not self.on_ascend:
            return self.kernel(x, positions, self.cos_sin)
        if self.heads is not None and x.ndim == 2:
            x = x[:, :self.heads * self.head_size].reshape(x.shape[0], self.heads, self.head_size)
        cos = ops.gather(self.cos, positions, 0).expand_dims(1)  # [T, 1, rotary_dim // 2]
        sin = ops.gather(self.sin, positions, 0).expand_dims(1)
        if not self.fused:
            return self._rotate(x, cos, sin)
        num_tokens, heads, size = x.shape
        if self.is_neox_style:  # each half of the channels takes the table once
            cos, sin = mint.cat((cos, cos), dim=-1), mint.cat((sin, sin), dim=-1)
        else:  # each pair of channels takes one entry
            cos = ops.stack((cos, cos), -1).reshape(num_tokens, 1, size)
            sin = ops.stack((sin, sin), -1).reshape(num_tokens, 1, size)
        # BSND with one sequence of T tokens; cos/sin 1S1D.
        cos = cos.astype(x.dtype).reshape(1, num_tokens, 1, size)
        sin = sin.astype(x.dtype).reshape(1, num_tokens, 1, size)
        out = ops.rotary_position_embedding(x.reshape(1, num_tokens, heads, size), cos, sin,
                                            0 if self.is_neox_style else 1)
        return out.reshape(num_tokens, heads, size)
