"""The W8A8 arithmetic in numpy, one IEEE rounding per step: the reference the CPU kernels
(`csrc/quant.cc`) equal bit for bit, and what tests and `scripts/quantize_w8a8.py` use.

docs/quantization.md states where each step comes from (msModelSlim's format description, the
Ascend operators' references, vllm-ascend and vllm-mindspore). In short, for a linear with int8
weight W [N, K]:

- static (`W8A8`): q = sat8(rint(fl(fl(x * r) + offset))) with r = 1 / input_scale rounded to the
  activation dtype; acc = q . W^T + quant_bias (int32); y = fl(float(acc) * deq_scale).
- dynamic (`W8A8_DYNAMIC`): per row s = fl(max|x| * fl(1/127)) (1 for an all-zero row);
  q = sat8(rint(fl(x / s))); acc = q . W^T (int32); y = fl(fl(float(acc) * weight_scale) * s).

rint rounds half to even; sat8 clamps to [-128, 127]; float() of an int32 rounds to nearest even.
Pure numpy: importing this module loads neither MindSpore nor vLLM.
"""

import numpy as np

STATIC = "W8A8"
DYNAMIC = "W8A8_DYNAMIC"
FLOAT = "FLOAT"
SCHEMES = (STATIC, DYNAMIC, FLOAT)

_F32 = np.float32


def to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded (nearest even) to `dtype` ("float32", "float16", "bfloat16"), returned
    as float32."""
    values = np.asarray(values, _F32)
    if dtype == "float16":
        return values.astype(np.float16).astype(_F32)
    if dtype == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return rounded.astype(np.uint32).view(_F32)
    return values


def deq_scale_as_float(deq_scale: np.ndarray) -> np.ndarray:
    """deq_scale as float32: int64 checkpoints hold the float32's bits in their low 32 bits."""
    deq_scale = np.asarray(deq_scale)
    if deq_scale.dtype == np.int64:
        return (deq_scale & 0xFFFFFFFF).astype(np.uint32).view(_F32)
    return deq_scale.astype(_F32)


def activation_params(input_scale: np.ndarray, input_offset: np.ndarray, in_features: int,
                      dtype: str = "float32") -> np.ndarray:
    """[2, K] float32: r = 1 / input_scale (in float32, then rounded to the activation dtype, as
    AscendQuantV2 takes its scale in x's dtype) and the offset, each broadcast to K channels."""
    scale = np.broadcast_to(np.asarray(input_scale, np.float64).reshape(-1), (in_features,))
    offset = np.broadcast_to(np.asarray(input_offset, np.float64).reshape(-1), (in_features,))
    r = to_dtype((1.0 / scale).astype(_F32), dtype)
    return np.stack([r, to_dtype(offset.astype(_F32), dtype)])


def quantize_static(x: np.ndarray, act: np.ndarray) -> np.ndarray:
    """x [M, K] float32, act [2, K] (r, offset) -> q [M, K] int8."""
    t = (np.asarray(x, _F32) * act[0]).astype(_F32)
    t = (t + act[1]).astype(_F32)
    return np.clip(np.rint(t), -128, 127).astype(np.int8)


def quantize_dynamic(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (q [M, K] int8, per-row scale [M] float32)."""
    x = np.asarray(x, _F32)
    scale = (np.abs(x).max(-1) * _F32(1.0 / 127.0)).astype(_F32)
    scale = np.where(scale == 0, _F32(1.0), scale).astype(_F32)
    q = np.clip(np.rint((x / scale[:, None]).astype(_F32)), -128, 127).astype(np.int8)
    return q, scale


def int_matmul(q: np.ndarray, weight: np.ndarray, quant_bias: np.ndarray | None = None) -> np.ndarray:
    """q [M, K] int8 . weight [N, K] int8 (+ quant_bias) -> int32 [M, N], exact (int64 inside,
    then wrapped to int32 as the kernels' int32 accumulators wrap)."""
    acc = q.astype(np.int64) @ weight.astype(np.int64).T
    if quant_bias is not None:
        acc = acc + np.asarray(quant_bias, np.int64)
    return acc.astype(np.int32)


def dequant_static(acc: np.ndarray, deq_scale: np.ndarray) -> np.ndarray:
    return (acc.astype(_F32) * deq_scale_as_float(deq_scale)).astype(_F32)


def dequant_dynamic(acc: np.ndarray, weight_scale: np.ndarray, token_scale: np.ndarray) -> np.ndarray:
    y = (acc.astype(_F32) * np.asarray(weight_scale, _F32).reshape(-1)).astype(_F32)
    return (y * token_scale[:, None]).astype(_F32)


def linear(x: np.ndarray, scheme: str, weight: np.ndarray, *, quant_bias=None, deq_scale=None,
           input_scale=None, input_offset=None, weight_scale=None, bias=None,
           dtype: str = "float32") -> np.ndarray:
    """One W8A8 linear, x [M, K] float32 -> y [M, N] float32 (before the cast to `dtype`)."""
    x = np.asarray(x, _F32)
    assert scheme in (STATIC, DYNAMIC), scheme
    if scheme == STATIC:
        q = quantize_static(x, activation_params(input_scale, input_offset, x.shape[1], dtype))
        y = dequant_static(int_matmul(q, weight, quant_bias), deq_scale)
    else:
        q, token_scale = quantize_dynamic(x)
        y = dequant_dynamic(int_matmul(q, weight), weight_scale, token_scale)
    if bias is not None:
        y = (y + np.asarray(bias, _F32)).astype(_F32)
    return y


def quantize_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scale [N] float32) with
    scale = max|w| / 127 per row (1 for an all-zero row) and q = sat8(rint(w / scale))."""
    weight = np.asarray(weight, np.float64)
    scale = np.abs(weight).max(-1) / 127.0
    scale = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint(weight / scale[:, None]), -128, 127).astype(np.int8)
    return q, scale.astype(_F32)


def activation_range_params(low: float, high: float) -> tuple[float, int]:
    """Asymmetric per-tensor int8 parameters covering [low, high] (0 included):
    (input_scale, input_offset) with x ~ input_scale * (q - input_offset)."""
    low, high = min(float(low), 0.0), max(float(high), 0.0)
    scale = (high - low) / 255.0 or 1.0
    offset = int(np.clip(np.rint(-128.0 - low / scale), -128, 127))
    return float(np.float32(scale)), offset
