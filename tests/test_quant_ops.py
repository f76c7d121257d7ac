"""The CPU W8A8 kernels against the numpy reference of the scheme (vllm_mindspore/ops/quant_reference):
the int32 accumulator exactly, the activation quantization exactly (ties included), and each
quantized linear's output exactly (the dequantization is the same IEEE steps); fused silu(gate) * up
and the MoE experts within float tolerance of the reference."""

import mindspore as ms
import numpy as np
import pytest
from ms_cells import OpCell, call_aot

from vllm_mindspore.ops import quant_reference as ref
from vllm_mindspore.ops.quant import (QuantArrays, QuantExperts, QuantLinearMethod, correction,
                                      int32_matmul_op, pack_int8, quantize_dynamic_op,
                                      quantize_static_op)

ms.set_context(mode=ms.GRAPH_MODE)
pytestmark = pytest.mark.usefixtures("two_kernel_threads")  # the parallel splits too


def tensor(array, dtype=None):
    return ms.Tensor(np.ascontiguousarray(array), dtype)


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 61, 45), (13, 130, 70), (200, 40, 70)])
def test_int32_accumulator_is_exact(m, k, n):
    """q . W^T + quant_bias in int32 equals numpy's exact integer product, extremes included
    (-128 * -128 sums; K not a multiple of 4, N not of 32; 200 rows: three row chunks)."""
    g = rng(m)
    q = g.integers(-128, 128, (m, k), dtype=np.int8)
    w = g.integers(-128, 128, (n, k), dtype=np.int8)
    q[0, :] = -128
    w[0, :] = -128  # the largest products
    w[-1, :] = 127
    quant_bias = g.integers(-2**24, 2**24, n).astype(np.int32)
    arrays = QuantArrays("W8A8", w, quant_bias=quant_bias)
    op = int32_matmul_op(n)
    out = OpCell(op)(tensor(q), tensor(pack_int8(w)), tensor(correction(arrays))).asnumpy()
    np.testing.assert_array_equal(out, ref.int_matmul(q, w, quant_bias))
    assert out[0, 0] == 128 * 128 * k + quant_bias[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_static_activation_quantization_is_exact(dtype):
    g = rng(1)
    k = 37
    x = (g.standard_normal((9, k)) * 3).astype(dtype)
    x[0, :8] = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, -200], dtype)  # ties, saturation
    act = ref.activation_params(np.float32(1.0), np.float32(0.0), k)
    act_real = ref.activation_params(np.float32(0.0371), np.float32(-7.0), k,
                                     "float16" if dtype == np.float16 else "float32")
    for a in (act, act_real):
        q = OpCell(quantize_static_op())(tensor(x), tensor(a)).asnumpy()
        np.testing.assert_array_equal(q, ref.quantize_static(x.astype(np.float32), a))
    q = OpCell(quantize_static_op())(tensor(x), tensor(act)).asnumpy()
    assert list(q[0, :8]) == [0, 2, 2, 0, -2, 126, 127, -128]  # half to even, saturated


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dynamic_activation_quantization_is_exact(dtype):
    g = rng(2)
    x = (g.standard_normal((6, 53)) * 5).astype(dtype)
    x[2] = 0  # an all-zero row: scale 1
    q, scale = OpCell(quantize_dynamic_op())(tensor(x))
    ref_q, ref_scale = ref.quantize_dynamic(x.astype(np.float32))
    np.testing.assert_array_equal(q.asnumpy(), ref_q)
    np.testing.assert_array_equal(scale.asnumpy(), ref_scale)
    assert np.abs(ref_q).max() == 127


def random_linear(scheme, n, k, seed, bias=False):
    g = rng(seed)
    weight = g.integers(-127, 128, (n, k), dtype=np.int8)
    fields = dict(weight=weight, bias=g.standard_normal(n).astype(np.float32) if bias else None)
    if scheme == "W8A8":
        fields.update(quant_bias=g.integers(-5000, 5000, n).astype(np.int32),
                      deq_scale=(g.random(n) * 1e-4 + 1e-5).astype(np.float32),
                      input_scale=np.full(k, 0.02, np.float32),
                      input_offset=np.full(k, 3.0, np.float32))
    else:
        fields.update(weight_scale=(g.random(n) * 1e-2 + 1e-3).astype(np.float32))
    return QuantArrays(scheme, **fields)


def reference_linear(arrays: QuantArrays, x):
    return ref.linear(x, arrays.scheme, arrays.weight, quant_bias=arrays.quant_bias,
                      deq_scale=arrays.deq_scale, input_scale=arrays.input_scale,
                      input_offset=arrays.input_offset, weight_scale=arrays.weight_scale,
                      bias=arrays.bias)


@pytest.mark.parametrize("scheme", ["W8A8", "W8A8_DYNAMIC"])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_equals_the_reference(scheme, bias):
    """The whole linear (quantize, int8 products, dequantize, bias) equals the reference bit for
    bit, for decode and prefill sizes (200 rows: three row chunks, a short last block)."""
    arrays = random_linear(scheme, 70, 96, seed=3, bias=bias)
    layer = QuantLinearMethod(arrays, ms.float32, False, "linear")
    for m in (1, 5, 33, 200):
        x = (rng(m).standard_normal((m, 96)) * 2).astype(np.float32)
        y = layer(tensor(x)).asnumpy()
        expected = reference_linear(arrays, x)
        np.testing.assert_array_equal(y, expected)
        assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()


def reference_in(arrays: QuantArrays, x, dtype):
    """The reference linear of activations in `dtype` (static W8A8: r and the offset in it too)."""
    x = x.astype(dtype).astype(np.float32)
    if arrays.scheme == "W8A8" and dtype == np.float16:
        act = ref.activation_params(arrays.input_scale, arrays.input_offset, x.shape[1], "float16")
        return ref.dequant_static(ref.int_matmul(ref.quantize_static(x, act), arrays.weight,
                                                 arrays.quant_bias), arrays.deq_scale)
    return reference_linear(arrays, x)


@pytest.mark.parametrize("scheme", ["W8A8", "W8A8_DYNAMIC"])
@pytest.mark.parametrize("outputs", [48, 64])
def test_quantized_gate_up_with_silu_and_float16(scheme, outputs):
    """gate|up with silu(gate) * up: in the matmul's blocks where gate and up meet at a panel
    boundary (64 outputs), in a separate pass otherwise (48); float32 and float16 activations
    (quantized from the float16 values, the output rounded to float16)."""
    arrays = random_linear(scheme, outputs, 48, seed=4)
    for m in (4, 40):
        x = rng(m).standard_normal((m, 48)).astype(np.float32)
        for dtype, rtol in ((np.float32, 1e-5), (np.float16, 2e-3)):
            gate, up = np.split(reference_in(arrays, x, dtype).astype(np.float64), 2, -1)
            expected = gate / (1 + np.exp(-gate)) * up
            y = QuantLinearMethod(arrays, ms.float16 if dtype == np.float16 else ms.float32, True,
                                  "gate_up")(tensor(x.astype(dtype))).asnumpy()
            np.testing.assert_allclose(y.astype(np.float64), expected, rtol=rtol,
                                       atol=rtol * np.abs(expected).max())
            # without the silu: the dequantized gate|up itself, bit for bit
            y = QuantLinearMethod(arrays, ms.float16 if dtype == np.float16 else ms.float32,
                                  False, "plain")(tensor(x.astype(dtype))).asnumpy()
            np.testing.assert_array_equal(y, reference_in(arrays, x, dtype).astype(dtype))


def test_int64_deq_scale_holds_float32_bits():
    deq = np.array([0.00123, 2.5e-5], np.float32)
    as_int64 = deq.view(np.int32).astype(np.int64)  # how fp16 ModelSlim checkpoints store it
    np.testing.assert_array_equal(ref.deq_scale_as_float(as_int64), deq)


@pytest.mark.parametrize("inter", [24, 32])
def test_moe_experts_match_the_reference(inter):
    """Routed experts with per-token dynamic W8A8: each copy's gate|up, silu(gate) * up (in the
    matmul's blocks for inter 32, a separate pass for 24), down, weighted and summed; ids outside
    [0, E) (other ranks' experts) contribute nothing."""
    g = rng(6)
    experts, d, tokens, top_k = 4, 40, 9, 2
    gate_up = [random_linear("W8A8_DYNAMIC", 2 * inter, d, seed=10 + e) for e in range(experts)]
    down = [random_linear("W8A8_DYNAMIC", d, inter, seed=20 + e) for e in range(experts)]
    layer = QuantExperts(gate_up, down, ms.float32, "experts")
    x = g.standard_normal((tokens, d)).astype(np.float32)
    ids = g.integers(-1, experts, (tokens, top_k)).astype(np.int32)
    weights = g.random((tokens, top_k)).astype(np.float32)
    out = OpCell(layer.kernel, layer.w13, layer.c13, layer.s13, layer.w2, layer.c2, layer.s2)(
        tensor(x), tensor(ids), tensor(weights)).asnumpy()
    expected = np.zeros((tokens, d), np.float64)
    for t in range(tokens):
        for k in range(top_k):
            e = ids[t, k]
            if not 0 <= e < experts:
                continue
            h = reference_linear(gate_up[e], x[t:t + 1]).astype(np.float64)
            act = (h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]).astype(np.float32)
            expected[t] += weights[t, k] * reference_linear(down[e], act)[0]
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=2e-3 * np.abs(expected).max())


@pytest.mark.parametrize("flag", ["-mno-avx512vnni", "-mno-avx2"])
def test_paths_without_vnni_are_exact(tmp_path, flag):
    """The kernel built without AVX-512 VNNI (AVX2: bytes widened to int16, vpmaddwd; on a CPU
    without AVX-512 the library's own build) and without AVX2 (the portable loop) gives the same
    int32 accumulators, extremes included (q = w = -128, and q = w = 127: 255 * 127 in the
    kernel's unsigned activation bytes), for a partial and a full-plus-partial row block, K not a
    multiple of 4 and a partial panel; built with the library's own flags plus `flag` and called
    through the same AOT entry point with ctypes."""
    import os
    import subprocess

    from vllm_mindspore.ops import kernels

    lib = str(tmp_path / f"quant{flag}.so")
    subprocess.run(["g++", *kernels.COMPILE_FLAGS, flag, "-o", lib,
                    os.path.join(kernels.CSRC, "quant.cc")], check=True, timeout=300)
    g = rng(7)
    k, n = 67, 40
    for m in (5, 13):
        q = g.integers(-128, 128, (m, k), dtype=np.int8)
        w = g.integers(-128, 128, (n, k), dtype=np.int8)
        q[0], w[0], q[-1], w[-1] = -128, -128, 127, 127
        arrays = QuantArrays("W8A8", w, quant_bias=g.integers(-999, 999, n).astype(np.int32))
        out = np.zeros((m, n), np.int32)
        status = call_aot(lib, "QuantMatmulInt32", [q, pack_int8(w), correction(arrays), out])
        assert status == 0
        np.testing.assert_array_equal(out, ref.int_matmul(q, w, arrays.quant_bias), f"{m} rows")
