"""Dense projections y = x @ W^T (+ bias), W [out, in] as checkpoints store it.

- Ascend: MindSpore's MatMul with transpose_b on W as loaded.
- CPU: the C++ kernel (`csrc/linear.cc`) on W packed after loading into panels of 32 output
  columns ([ceil(out / 32), in, 32]), read once per call in order: at decode batch sizes it runs
  2.5-3x faster than MindSpore's CPU MatMul (bound by memory bandwidth rather than by the
  operand layout), and about as fast at prefill sizes. A fused gate|up projection can apply
  silu(gate) * up in the same call.
- CPU with --dtype bfloat16: the graph computes in float32 (MindSpore's CPU Reshape, Gather,
  Sub... have no bfloat16 kernels), and the dense weights are packed in bfloat16, pairs of input
  features interleaved ([ceil(out / 32), ceil(in / 2), 32, 2]) for AVX512-BF16's vdpbf16ps: the
  kernel rounds x to bfloat16 and sums in float32, at twice the float32 rate.
"""

import mindspore as ms
import numpy as np

from vllm_mindspore.ops import kernels
from vllm_mindspore.scoped import ScopedSetting

PANEL = 32

_bfloat16_weights = ScopedSetting(False)


def packing_bfloat16(enabled: bool):
    """Weights packed in this block (`packed_dtype`) are bfloat16 when `enabled`."""
    return _bfloat16_weights.using(enabled)


def packed_dtype(dtype):
    """The dtype a float weight of a `dtype` model is packed in for the CPU kernels."""
    return ms.bfloat16 if _bfloat16_weights.value else dtype


def pack_panels(weight: np.ndarray, dtype) -> np.ndarray:
    """[out, in] -> [ceil(out / 32), in, 32], the last panel zero-padded; for a bfloat16 `dtype`
    [ceil(out / 32), ceil(in / 2), 32, 2] (in padded to even)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    pairs = dtype == ms.bfloat16
    padded_in = in_features + in_features % 2 if pairs else in_features
    padded = np.zeros((panels * PANEL, padded_in), weight.dtype)
    padded[:out_features, :in_features] = weight
    if pairs:
        packed = padded.reshape(panels, PANEL, padded_in // 2, 2).transpose(0, 2, 1, 3)
    else:
        packed = padded.reshape(panels, PANEL, padded_in).transpose(0, 2, 1)
    return np.ascontiguousarray(packed)


def packed_matmul(out_features: int, bias: bool = False, silu_and_mul: bool = False):
    """The CPU kernel as a MindSpore op: (x [T, in], packed[, bias]) -> [T, out_features], or
    [T, out_features / 2] = silu(gate) * up when `silu_and_mul` (gate|up the two halves)."""
    if silu_and_mul:
        if bias:
            raise ValueError("The fused silu(gate) * up projection has no bias.")
        return kernels.custom_op("LinearSiluMul", lambda x, w: (x[0], out_features // 2),
                                 lambda x, w: x)
    if bias:
        return kernels.custom_op("LinearBias", lambda x, w, b: (x[0], out_features),
                                 lambda x, w, b: x)
    return kernels.custom_op("Linear", lambda x, w: (x[0], out_features), lambda x, w: x)
