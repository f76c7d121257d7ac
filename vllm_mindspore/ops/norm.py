"""RMSNorm: `x * rsqrt(mean(x^2) + eps) * weight`, computed in float32, optionally on the sum of
x and a residual (the decoder's pre-norm residual stream, vLLM's fused_add_rms_norm).

CPU: one C++ operator (`csrc/norm_rope.cc`); Ascend: MindSpore's RmsNorm kernel (the backend
fuses a preceding Add into AddRmsNorm itself).
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn, ops

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.host import parameter, to_host
from vllm_mindspore.platform import ASCEND, kernel_device


class RMSNorm(nn.Cell):
    """x: [..., hidden] -> [..., hidden]; with `residual`: (norm(x + residual), x + residual).
    `weight` is named like the checkpoint's tensor. A `stacked` norm has a weight [heads,
    head_dim]: it takes the first heads * head_dim channels of each row of x [T, W] (q and k at
    the front of a fused q|k|v row) and normalises each head with its own row -> [T, heads,
    head_dim]."""

    def __init__(self, hidden_size: int, eps: float, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(mint.ones(hidden_size, dtype=dtype), name="weight", requires_grad=False)
        self.eps = eps
        self.fused = kernel_device() == ASCEND
        if not self.fused:
            self.eps_tensor = ms.Tensor([eps], ms.float32)
            self.norm_kernel = kernels.custom_op("RmsNorm", lambda x, *_: x, lambda x, *_: x)
            self.add_norm_kernel = kernels.custom_op(
                "AddRmsNorm", lambda x, *_: (x, x), lambda x, *_: (x, x))

    @classmethod
    def stacked(cls, norms: list[tuple["RMSNorm", int]], name: str) -> "RMSNorm":
        """One norm over heads stacked along dim -2: `count` heads for each (norm, count), e.g.
        the q heads then the k heads of a fused q|k tensor (Qwen3's q_norm / k_norm)."""
        first = norms[0][0]
        stacked = cls(first.weight.shape[0], first.eps, first.weight.dtype)
        rows = [np.tile(to_host(norm.weight), (count, 1)) for norm, count in norms]
        stacked.weight = parameter(np.concatenate(rows), first.weight.dtype, f"{name}.weight")
        heads, size = stacked.weight.shape
        stacked.heads = heads
        if not stacked.fused:
            stacked.norm_kernel = kernels.custom_op("RmsNorm", lambda x, *_: (x[0], heads, size),
                                                    lambda x, *_: x)
        return stacked

    heads = None

    def construct(self, x, residual=None):
        if not self.fused:
            if residual is None:
                return self.norm_kernel(x, self.weight, self.eps_tensor)
            return self.add_norm_kernel(x, residual, self.weight, self.eps_tensor)
        if self.heads is not None:
            size = self.weight.shape[1]
            x = x[:, :self.heads * size].reshape(x.shape[0], self.heads, size)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)[0]
        x = x + residual
        return ops.rms_norm(x, self.weight, self.eps)[0], x
