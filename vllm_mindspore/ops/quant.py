"""W8A8 linears and MoE experts: int8 weights kept int8, activations quantized as the checkpoint's
scheme says, int32 accumulation, dequantization with the stored scales.

Schemes (quant_reference.py has the arithmetic, docs/quantization.md the sources):
- `W8A8`: static per-tensor (or per-channel) asymmetric activations (input_scale, input_offset),
  per-channel weights; quant_bias and deq_scale applied to the int32 accumulator.
- `W8A8_DYNAMIC`: per-token symmetric activations quantized at run time, per-channel weight_scale.

Devices:
- CPU: C++ kernels (`csrc/quant.cc`): the int8 x int8 -> int32 products with AVX-512 VNNI (a
  portable loop otherwise), weights packed in panels after loading, dequantization fused. The
  results equal `quant_reference` exactly.
- Ascend: MindSpore's quantized operators: QuantV2 + QuantBatchMatmul (static), DynamicQuantExt +
  QuantBatchMatmul with per-token scales (dynamic), DynamicQuantExt + GroupedMatmulV4 (MoE).
"""

from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.ops.auto_generate import (DynamicQuantExt, QuantBatchMatmul, QuantV2,
                                         grouped_matmul_v4)

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.host import parameter
from vllm_mindspore.ops.quant_reference import DYNAMIC, STATIC, activation_params
from vllm_mindspore.platform import ASCEND, kernel_device

PANEL = 32
_DTYPE_NAMES = {ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16"}


class QuantArrays(NamedTuple):
    """A quantized linear's tensors on the host, as loaded (this rank's part): weight int8 [N, K];
    static: quant_bias int32 [N] (already zero on the ranks that must not add it), deq_scale
    float32 [N], input_scale / input_offset float32 [K]; dynamic: weight_scale float32 [N]; bias
    float32 [N] or None (added after dequantization)."""

    scheme: str
    weight: np.ndarray
    quant_bias: np.ndarray | None = None
    deq_scale: np.ndarray | None = None
    input_scale: np.ndarray | None = None
    input_offset: np.ndarray | None = None
    weight_scale: np.ndarray | None = None
    bias: np.ndarray | None = None


def concat_arrays(parts: list[QuantArrays]) -> QuantArrays:
    """Linears side by side (outputs concatenated): one weight and per-channel tensors; the
    activation parameters are the common ones (the caller checked they are equal)."""
    first = parts[0]

    def cat(field):
        values = [getattr(p, field) for p in parts]
        return None if values[0] is None else np.concatenate(values)

    return first._replace(weight=cat("weight"), quant_bias=cat("quant_bias"),
                          deq_scale=cat("deq_scale"), weight_scale=cat("weight_scale"),
                          bias=cat("bias"))


def pack_int8(weight: np.ndarray) -> np.ndarray:
    """int8 [N, K] -> [ceil(N/32), ceil(K/4), 32, 4] int8, zero padded: panels of 32 output
    columns, each 4 consecutive k of a column together (the VNNI kernel's operand layout)."""
    n, k = weight.shape
    panels, groups = -(-n // PANEL), -(-k // 4)
    padded = np.zeros((panels * PANEL, groups * 4), np.int8)
    padded[:n, :k] = weight
    packed = padded.reshape(panels, PANEL, groups, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(packed)


def correction(arrays: QuantArrays) -> np.ndarray:
    """What the CPU kernel adds to each raw accumulator (activations enter as q + 128):
    quant_bias - 128 * sum_k W, int32 [N]."""
    row_sum = arrays.weight.astype(np.int64).sum(1)
    bias = 0 if arrays.quant_bias is None else arrays.quant_bias.astype(np.int64)
    return (bias - 128 * row_sum).astype(np.int32)


class QuantLinearMethod(nn.Cell):
    """x [T, K] -> [T, N] (or [T, N / 2] = silu(gate) * up) for one quantized linear, built from
    its host arrays after loading; holds the device's layout of the weight and its scales."""

    def __init__(self, arrays: QuantArrays, dtype, silu_and_mul: bool, name: str):
        super().__init__()
        assert arrays.scheme in (STATIC, DYNAMIC), (name, arrays.scheme)  # checked at loading
        self.dynamic = arrays.scheme == DYNAMIC
        out_features, in_features = arrays.weight.shape
        self.silu_and_mul = silu_and_mul
        self.ascend = kernel_device() == ASCEND
        if self.ascend:
            self._build_ascend(arrays, dtype, name)
        else:
            self._build_cpu(arrays, dtype, out_features, in_features, name)

    # ---- CPU -----------------------------------------------------------------------------------
    def _build_cpu(self, arrays, dtype, out_features, in_features, name):
        packed = pack_int8(arrays.weight)
        self.packed = parameter(packed, ms.int8, f"{name}.packed")
        self.corr = parameter(correction(arrays), ms.int32, f"{name}.corr")
        scale = arrays.weight_scale if self.dynamic else arrays.deq_scale
        rows = [scale] if arrays.bias is None else [scale, arrays.bias]
        self.colp = parameter(np.stack(rows).astype(np.float32), ms.float32, f"{name}.colp")
        if not self.dynamic:
            act = activation_params(arrays.input_scale, arrays.input_offset, in_features,
                                    _DTYPE_NAMES[dtype])
            self.act = parameter(act, ms.float32, f"{name}.act")
        function = ("QuantLinearDynamic" if self.dynamic else "QuantLinear") + (
            "SiluMul" if self.silu_and_mul else "")
        columns = out_features // 2 if self.silu_and_mul else out_features
        self.kernel = kernels.custom_op(function, lambda x, *_: (x[0], columns),
                                        lambda x, *_: x)

    # ---- Ascend --------------------------------------------------------------------------------
    def _build_ascend(self, arrays, dtype, name):
        self.weight = parameter(arrays.weight, ms.int8, f"{name}.weight")  # [N, K]
        self.matmul = QuantBatchMatmul(transpose_x1=False, transpose_x2=True, dtype=dtype)
        if self.dynamic:
            self.quant = DynamicQuantExt()
            # bfloat16 scales give a bfloat16 output; float32 ones serve float16.
            scale_dtype = ms.bfloat16 if dtype == ms.bfloat16 else ms.float32
            self.weight_scale = parameter(arrays.weight_scale, scale_dtype, f"{name}.weight_scale")
        else:
            self.quant = QuantV2()
            act = activation_params(arrays.input_scale, arrays.input_offset, arrays.weight.shape[1],
                                    _DTYPE_NAMES[dtype])
            self.inv_scale = parameter(act[0], dtype, f"{name}.inv_scale")
            self.offset = parameter(act[1], dtype, f"{name}.input_offset")
            self.deq_scale = parameter(arrays.deq_scale, ms.float32, f"{name}.deq_scale")
            self.quant_bias = parameter(arrays.quant_bias, ms.int32, f"{name}.quant_bias")
        self.bias = None if arrays.bias is None else parameter(arrays.bias, dtype, f"{name}.bias")

    def construct(self, x):
        if not self.ascend:
            if self.dynamic:
                return self.kernel(x, self.packed, self.corr, self.colp)
            return self.kernel(x, self.packed, self.corr, self.act, self.colp)
        if self.dynamic:
            qx, token_scale = self.quant(x, None)
            y = self.matmul(qx, self.weight, self.weight_scale, None, None, token_scale)
        else:
            qx = self.quant(x, self.inv_scale, self.offset, False, "ROUND", ms.int8)
            y = self.matmul(qx, self.weight, self.deq_scale, None, self.quant_bias, None)
        if self.bias is not None:
            y = y + self.bias
        if self.silu_and_mul:
            gate, up = ops.split(y, y.shape[-1] // 2, -1)
            y = ops.silu(gate) * up
        return y


# ---- MoE experts -------------------------------------------------------------------------------
class QuantExperts(nn.Cell):
    """The routed experts of one MoE layer with W8A8_DYNAMIC gate|up and down projections, stacked
    after loading. CPU: one C++ operator per layer (MoeExpertsQuant); Ascend: DynamicQuantExt and
    GroupedMatmulV4 with int8 weights [E, K, N] and per-token scales (`grouped`)."""

    def __init__(self, gate_up: list[QuantArrays], down: list[QuantArrays], dtype, name: str):
        super().__init__()
        # Checked at loading (model_backends/native/quant.py): other schemes are refused there.
        assert all(p.scheme == DYNAMIC and p.bias is None for p in gate_up + down), name
        self.ascend = kernel_device() == ASCEND
        self.dtype = dtype
        if self.ascend:
            scale_dtype = ms.bfloat16 if dtype == ms.bfloat16 else ms.float32
            self.w13 = parameter(np.stack([p.weight.T for p in gate_up]), ms.int8, f"{name}.w13")
            self.w2 = parameter(np.stack([p.weight.T for p in down]), ms.int8, f"{name}.w2")
            self.s13 = parameter(np.stack([p.weight_scale for p in gate_up]), scale_dtype,
                                 f"{name}.s13")
            self.s2 = parameter(np.stack([p.weight_scale for p in down]), scale_dtype, f"{name}.s2")
            self.quant = DynamicQuantExt()
            return
        self.w13 = parameter(np.stack([pack_int8(p.weight) for p in gate_up]), ms.int8,
                             f"{name}.w13")
        self.c13 = parameter(np.stack([correction(p) for p in gate_up]), ms.int32, f"{name}.c13")
        self.s13 = parameter(np.stack([p.weight_scale for p in gate_up]).astype(np.float32),
                             ms.float32, f"{name}.s13")
        self.w2 = parameter(np.stack([pack_int8(p.weight) for p in down]), ms.int8,
                            f"{name}.w2")
        self.c2 = parameter(np.stack([correction(p) for p in down]), ms.int32, f"{name}.c2")
        self.s2 = parameter(np.stack([p.weight_scale for p in down]).astype(np.float32),
                            ms.float32, f"{name}.s2")
        self.kernel = kernels.custom_op("MoeExpertsQuant", lambda x, *_: x, lambda x, *_: x)

    def cpu_experts(self, hidden, topk_ids, topk_weights):
        return self.kernel(hidden, topk_ids, topk_weights, self.w13, self.c13, self.s13, self.w2,
                           self.c2, self.s2)

    def grouped_matmul(self, x, which: int, counts):
        """Ascend: rows of x grouped by expert (counts) through w13 (which=1) or w2 (which=2)."""
        qx, token_scale = self.quant(x, None)
        weight, scale = (self.w13, self.s13) if which == 1 else (self.w2, self.s2)
        y = grouped_matmul_v4([qx], [weight], None, [scale], None, None, None, [token_scale],
                              counts, split_item=3, group_type=0, group_list_type=1)[0]
        return y.astype(self.dtype)


# ---- entry points of the exactness tests ---------------------------------------------------------
def int32_matmul_op(out_features: int):
    """(q [M, K] int8, packed, corr [N] int32) -> q . W^T + corr, int32 [M, N] (the kernel's
    accumulator; corr = quant_bias - 128 * sum_k W gives the scheme's acc + quant_bias)."""
    return kernels.custom_op("QuantMatmulInt32", lambda q, *_: (q[0], out_features),
                             lambda *_: ms.int32)


def quantize_static_op():
    """(x [M, K], act [2, K] float32) -> q [M, K] int8."""
    return kernels.custom_op("QuantizeStatic", lambda x, a: x, lambda *_: ms.int8)


def quantize_dynamic_op():
    """x [M, K] -> (q [M, K] int8, scale [M] float32)."""
    return kernels.custom_op("QuantizeDynamic", lambda x: (x, (x[0],)),
                             lambda x: (ms.int8, ms.float32))
