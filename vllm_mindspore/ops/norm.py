"""RMSNorm: `x * rsqrt(mean(x^2) + eps) * weight`, computed in float32."""

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn, ops

from vllm_mindspore.ops.host import parameter, to_host
from vllm_mindspore.platform import ASCEND, kernel_device


class RMSNorm(nn.Cell):
    """x: [..., hidden] -> [..., hidden]; `weight` is named like the checkpoint's tensor. A
    `stacked` norm has a weight [heads, head_dim] that normalises each head of x [T, heads,
    head_dim] with its own row."""

    def __init__(self, hidden_size: int, eps: float, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(mint.ones(hidden_size, dtype=dtype), name="weight", requires_grad=False)
        self.eps = eps
        self.fused = kernel_device() == ASCEND

    @classmethod
    def stacked(cls, norms: list[tuple["RMSNorm", int]], name: str) -> "RMSNorm":
        """One norm over heads stacked along dim -2: `count` heads for each (norm, count), e.g.
        the q heads then the k heads of a fused q|k tensor (Qwen3's q_norm / k_norm)."""
        first = norms[0][0]
        stacked = cls(first.weight.shape[0], first.eps, first.weight.dtype)
        rows = [np.tile(to_host(norm.weight), (count, 1)) for norm, count in norms]
        stacked.weight = parameter(np.concatenate(rows), first.weight.dtype, f"{name}.weight")
        return stacked

    def construct(self, x):
        if self.fused:
            return ops.rms_norm(x, self.weight, self.eps)[0]
        x32 = x.astype(ms.float32)
        variance = mint.mean(x32 * x32, dim=-1, keepdim=True)
        normed = x32 * ops.rsqrt(variance + self.eps)
        return (normed * self.weight.astype(ms.float32)).astype(x.dtype)
