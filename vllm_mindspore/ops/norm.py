"""RMSNorm: `x * rsqrt(mean(x^2) + eps) * weight`, computed in float32."""

import mindspore as ms
from mindspore import Parameter, mint, nn, ops

from vllm_mindspore.platform import ASCEND, DEVICE


class RMSNorm(nn.Cell):
    """x: [..., hidden] -> [..., hidden]; `weight` is named like the checkpoint's tensor."""

    def __init__(self, hidden_size: int, eps: float, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(mint.ones(hidden_size, dtype=dtype), name="weight", requires_grad=False)
        self.eps = eps
        self.fused = DEVICE == ASCEND

    def construct(self, x):
        if self.fused:
            return ops.rms_norm(x, self.weight, self.eps)[0]
        x32 = x.astype(ms.float32)
        variance = mint.mean(x32 * x32, dim=-1, keepdim=True)
        normed = x32 * ops.rsqrt(variance + self.eps)
        return (normed * self.weight.astype(ms.float32)).astype(x.dtype)
