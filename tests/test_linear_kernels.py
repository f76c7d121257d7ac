"""The CPU dense-projection and MoE-expert kernels (csrc/linear.cc, csrc/moe.cc over csrc/gemm.h's
packed-panel matmul) against numpy in float64, for every weight dtype the kernels take: float32,
float16 (activations float16 too) and bfloat16 (AVX512-BF16: float32 activations rounded to
bfloat16 at the matmul's input, float32 sums). Shapes cover an odd K, N not a multiple of 32,
decode-sized blocks (1, 8, 9, 15 rows) and several row chunks (300 rows; AMX 1100). bfloat16
weights are checked on each kernel the CPU has: vdpbf16ps, widened to float32 for FMAs (x not
rounded), and AMX tiles."""

import os
import subprocess

import mindspore as ms
import numpy as np
import pytest
from ms_cells import OpCell, call_aot

from vllm_mindspore.ops import kernels
from vllm_mindspore.ops.host import parameter
from vllm_mindspore.ops.linear import pack_panels, packed_dtype, packed_matmul, packing_bfloat16
from vllm_mindspore.ops.moe import GroupedTopK, MoEDispatch, SoftmaxTopK
from vllm_mindspore.ops.quant_reference import to_dtype
from vllm_mindspore.platform import cpu_has_amx, cpu_has_bfloat16_dot

ms.set_context(mode=ms.GRAPH_MODE)
pytestmark = pytest.mark.usefixtures("two_kernel_threads")  # the parallel splits too

MS_DTYPES = {"float32": ms.float32, "float16": ms.float16}
# Sums of float32 products in another order; float16 outputs are rounded once more.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-5}
NEEDS_BFLOAT16_DOT = pytest.mark.skipif(not cpu_has_bfloat16_dot(),
                                        reason="this CPU has no AVX512-BF16")
# bfloat16 weights run on vdpbf16ps ("bfloat16"), widened to float32 for FMAs ("bfloat16-widened",
# the faster on Intel's AVX512-BF16 cores), or on AMX tiles where the CPU has them
# ("bfloat16-amx"; steps of up to 4 rows on vdpbf16ps).
WEIGHT_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=NEEDS_BFLOAT16_DOT),
                 pytest.param("bfloat16-widened", marks=NEEDS_BFLOAT16_DOT),
                 pytest.param("bfloat16-amx", marks=[NEEDS_BFLOAT16_DOT, pytest.mark.skipif(
                     not cpu_has_amx(), reason="this CPU has no AMX-BF16")])]


@pytest.fixture
def weight_kernel(request):
    """(the weights' dtype, whether bfloat16 weights are widened) for request.param, with that
    bfloat16 kernel chosen for the test."""
    dtype, _, unit = request.param.partition("-")
    if kernels.use_amx(unit == "amx") != (unit == "amx"):
        pytest.skip("the CPU reports AMX-BF16, but the kernels cannot use it (Linux refused the "
                    "tile state, or the library was built without -mamx-bf16)")
    assert kernels.widen_bfloat16(unit == "widened") == (unit == "widened")
    yield dtype, unit == "widened"
    kernels.use_amx(True)
    kernels.widen_bfloat16(None)


def silu(x):
    return x / (1.0 + np.exp(-x))


def matmul_inputs(x: np.ndarray, weight_dtype: str, widened: bool) -> np.ndarray:
    """What the kernel multiplies: x as the activation dtype holds it, rounded to bfloat16 when
    the weights are bfloat16 and not widened."""
    return x.astype(np.float64) if widened else to_dtype(x, weight_dtype).astype(np.float64)


def packed_weight(weight: np.ndarray, weight_dtype: str, name: str) -> ms.Parameter:
    """W [out, in] packed as a `weight_dtype` model's linear packs it (bfloat16: float32 model
    inside `packing_bfloat16`)."""
    with packing_bfloat16(weight_dtype == "bfloat16"):
        dtype = packed_dtype(MS_DTYPES.get(weight_dtype, ms.float32))
        return parameter(pack_panels(weight, dtype), dtype, name)


@pytest.mark.parametrize("weight_kernel", WEIGHT_DTYPES, indirect=True)
# K = 600: AMX takes 18 tile steps and a tail of 24 k, the other kernels two passes of kDepth
# (512 k), over the blocks of a chunk (64 rows: two 32-row blocks) and several chunks (300 rows,
# AMX 1100: three chunks, a last block past the rows); each thread its own range of the panels
# (70 outputs: 3 panels, two ranges of unequal length). On AVX2 blocks
# are 6 rows (8, 9: end in blocks of 2 and 3; a panel in two halves from 3 rows on), on AVX-512 up
# to 14 rows (9: one block; 15: 14 + 1; 64: 4 x 14 + 8).
@pytest.mark.parametrize("rows, in_features", [(1, 37), (4, 600), (8, 37), (9, 37), (15, 37),
                                               (300, 37), (9, 600), (64, 600), (1100, 600)])
# silu_and_mul with 70 outputs: the gate|up boundary inside a panel (a separate silu * up pass);
# with 128 ("aligned"): at a panel boundary (silu * up in the matmul's blocks).
@pytest.mark.parametrize("variant", ["plain", "bias", "silu_and_mul", "silu_and_mul-aligned"])
def test_packed_linear_matches_numpy(weight_kernel, rows, in_features, variant):
    weight_dtype, widened = weight_kernel
    g = np.random.default_rng(rows)
    variant, _, aligned = variant.partition("-")
    out_features = 128 if aligned else 70
    act_dtype = "float16" if weight_dtype == "float16" else "float32"
    x = to_dtype(g.standard_normal((rows, in_features)), act_dtype)
    weight = to_dtype(g.standard_normal((out_features, in_features)) * 0.2, weight_dtype)
    bias = to_dtype(g.standard_normal(out_features), act_dtype)

    expected = matmul_inputs(x, weight_dtype, widened) @ weight.astype(np.float64).T
    args = [ms.Tensor(x, MS_DTYPES[act_dtype])]
    params = [packed_weight(weight, weight_dtype, "weight")]
    if variant == "bias":
        expected = expected + bias
        params.append(parameter(bias, MS_DTYPES[act_dtype], "bias"))
    if variant == "silu_and_mul":
        gate, up = np.split(expected, 2, axis=1)
        expected = silu(gate) * up
    op = packed_matmul(out_features, bias=variant == "bias", silu_and_mul=variant == "silu_and_mul")
    out = OpCell(op, *params)(*args)
    assert out.dtype == MS_DTYPES[act_dtype] and out.shape == expected.shape
    # float32 sums' rounding grows with their size (silu(gate) * up: a product of two sums)
    np.testing.assert_allclose(out.float().asnumpy(), expected, rtol=TOLERANCE[weight_dtype],
                               atol=TOLERANCE[weight_dtype] * max(1.0, np.abs(expected).max()))


def aligned_rows(rows: int, columns: int, offset: int) -> np.ndarray:
    """An uninitialised float32 [rows, columns] array starting `offset` bytes past a 64-byte
    boundary."""
    raw = np.empty(rows * columns + 32, np.float32)
    skip = (-raw.ctypes.data % 64 + offset) // 4
    return raw[skip:skip + rows * columns].reshape(rows, columns)


# float32 y of 8 MiB or more (gemm.h, kStreamedBytes) is written with non-temporal stores where
# its rows start on whole vectors; else, and y 16 bytes past a cache line as glibc's malloc
# returns MindSpore's tensors, with plain stores. Called through the AOT entry point, which
# writes into the test's own (aligned) arrays. 1008 outputs: a last panel of 16 columns.
@pytest.mark.parametrize("offset", [0, 16])
@pytest.mark.parametrize("variant, out_features", [("plain", 1008), ("bias", 1008),
                                                   ("silu_and_mul", 2048)])
def test_large_outputs_match_numpy(offset, variant, out_features):
    g = np.random.default_rng(out_features + offset)
    rows, in_features = 2100, 37
    columns = out_features // 2 if variant == "silu_and_mul" else out_features
    assert rows * columns * 4 >= 8 << 20  # streamed where aligned
    x = g.standard_normal((rows, in_features)).astype(np.float32)
    weight = (g.standard_normal((out_features, in_features)) * 0.2).astype(np.float32)
    bias = g.standard_normal(out_features).astype(np.float32)
    expected = x.astype(np.float64) @ weight.astype(np.float64).T
    arrays = [x, pack_panels(weight, ms.float32)]
    if variant == "bias":
        expected = expected + bias
        arrays.append(bias)
    if variant == "silu_and_mul":
        gate, up = np.split(expected, 2, axis=1)
        expected = silu(gate) * up
    y = aligned_rows(rows, columns, offset)
    y[:] = np.nan
    function = {"plain": "Linear", "bias": "LinearBias", "silu_and_mul": "LinearSiluMul"}[variant]
    assert call_aot(kernels.library_path(), function, [*arrays, y]) == 0
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("weight_kernel", ["float32", *WEIGHT_DTYPES[2:]], indirect=True)
@pytest.mark.parametrize("inter", [40, 64])  # 64: silu * up in the matmul's blocks
def test_moe_experts_match_numpy(weight_kernel, inter):
    """Each token's top-k experts: silu(x . gate) * (x . up) . down, weighted and summed; ids
    outside this rank's experts (-1, 4) contribute nothing."""
    weight_dtype, widened = weight_kernel
    g = np.random.default_rng(0)
    tokens, hidden, experts, top_k = 30, 48, 4, 2
    x = g.standard_normal((tokens, hidden)).astype(np.float32)
    gate_up = [to_dtype(g.standard_normal((2 * inter, hidden)) * 0.2, weight_dtype)
               for _ in range(experts)]
    down = [to_dtype(g.standard_normal((hidden, inter)) * 0.2, weight_dtype)
            for _ in range(experts)]
    ids = g.integers(0, experts, (tokens, top_k)).astype(np.int32)
    ids[0, 1], ids[1, 0] = -1, experts
    weights = g.random((tokens, top_k)).astype(np.float32)

    expected = np.zeros((tokens, hidden))
    for t in range(tokens):
        for k in range(top_k):
            e = ids[t, k]
            if 0 <= e < experts:
                gate, up = np.split(matmul_inputs(x[t], weight_dtype, widened) @ gate_up[e].T, 2)
                act = np.asarray(silu(gate) * up, np.float32)
                expected[t] += weights[t, k] * (matmul_inputs(act, weight_dtype, widened)
                                                @ down[e].T)

    dispatch = MoEDispatch(experts)
    with packing_bfloat16(weight_dtype == "bfloat16"):
        dispatch.set_weights(gate_up, down, ms.float32, "experts")
    assert dispatch.w13.dtype == (ms.bfloat16 if weight_dtype == "bfloat16" else ms.float32)
    out = dispatch(ms.Tensor(x), ms.Tensor(weights), ms.Tensor(ids)).asnumpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_top_k_routing(dtype, renormalize):
    """The routing kernel against numpy: each token's K most probable experts, best first (of
    equal logits the lower id first) and their softmax probabilities, renormalised or not; and
    against MindSpore's softmax and top-k (the op's Ascend path) where no two logits tie."""
    g = np.random.default_rng(0)
    tokens, experts, top_k = 300, 24, 5
    logits = (g.standard_normal((tokens, experts)) * 3).astype(dtype)
    logits[0] = 1.5  # every expert ties
    logits[1, [3, 7, 11, 20]] = logits[1].max() + 1  # a tie across the k-th place
    logits[2, :] = -60000 if dtype == np.float16 else -1e30  # far from 0: softmax's max shift
    logits[2, 9] = logits[2, 9] + 1
    routing = SoftmaxTopK(top_k, renormalize)
    weights, ids = (out.asnumpy() for out in routing(ms.Tensor(logits)))

    wide = logits.astype(np.float64)
    probs = np.exp(wide - wide.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected_ids = np.argsort(-wide, axis=-1, kind="stable")[:, :top_k]
    expected = np.take_along_axis(probs, expected_ids, -1)
    if renormalize:
        expected /= expected.sum(-1, keepdims=True)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(weights, expected, rtol=2e-6, atol=1e-7)
    assert list(ids[0]) == list(range(top_k)) and list(ids[1, :4]) == [3, 7, 11, 20]

    routing.kernel = None  # MindSpore's ops
    ms_weights, ms_ids = (out.asnumpy() for out in routing(ms.Tensor(logits)))
    distinct = np.array([len(np.unique(row)) == experts for row in logits])
    assert distinct.sum() > 0.9 * tokens
    np.testing.assert_array_equal(ids[distinct], ms_ids[distinct])
    np.testing.assert_allclose(weights[distinct], ms_weights[distinct], rtol=2e-6, atol=1e-7)


def grouped_top_k_reference(logits, bias, top_k, groups, kept, top_n, masked, renormalize,
                            scale):
    """DeepSeek-V3's routing as HF writes it, in numpy (float32 scores, stable sorts: of equal
    scores the lower id first)."""
    tokens, experts = logits.shape
    scores = (1 / (1 + np.exp(-logits))).astype(np.float32)
    choice = scores + bias
    best_n = -np.sort(-choice.reshape(tokens, groups, experts // groups), axis=-1)[..., :top_n]
    kept_groups = np.argsort(-best_n.sum(-1), axis=-1, kind="stable")[:, :kept]
    mask = np.zeros((tokens, groups), bool)
    np.put_along_axis(mask, kept_groups, True, -1)
    choice = np.where(np.repeat(mask, experts // groups, -1), choice, np.float32(masked))
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, ids, -1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * np.float32(scale), ids


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_top_k_routing(renormalize):
    """DeepSeek-V3's routing kernel against numpy (ties included: of equal scores the lower id,
    of equal groups the lower group) and against MindSpore's ops (the op's Ascend path) where no
    two scores tie. The bias steers the choice, not the weights."""
    g = np.random.default_rng(1)
    tokens, experts, groups, kept, top_k, scale = 300, 64, 8, 3, 6, 2.5
    logits = (g.standard_normal((tokens, experts)) * 2).astype(np.float32)
    bias = (g.standard_normal(experts) * 0.05).astype(np.float32)
    bias[5] = 3.0  # lifts expert 5 and its group (0) over every other
    logits[1, 0:8] = -9.0
    routing = GroupedTopK(top_k, groups, kept, 2, -1e30, renormalize, scale)
    bias_tensor = ms.Tensor(bias)
    weights, ids = (out.asnumpy() for out in routing(ms.Tensor(logits), bias_tensor))

    expected, expected_ids = grouped_top_k_reference(logits, bias, top_k, groups, kept, 2,
                                                     -1e30, renormalize, scale)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(weights, expected, rtol=2e-6, atol=1e-7)
    assert ids[1, 0] == 5 and weights[1, 0] < weights[1, 1]  # chosen first, weighed unbiased
    # Every score equal (no bias), so every group too: the lower groups, then the lower ids.
    equal = ms.Tensor(np.full((2, experts), 0.5, np.float32))
    tie_weights, tie_ids = (out.asnumpy() for out in routing(
        equal, ms.Tensor(np.zeros(experts, np.float32))))
    assert [list(row) for row in tie_ids] == [list(range(top_k))] * 2
    np.testing.assert_allclose(tie_weights, scale * (1 / top_k if renormalize else
                                                     1 / (1 + np.exp(-0.5))), rtol=1e-6)

    routing.kernel = None  # MindSpore's ops
    ms_weights, ms_ids = (out.asnumpy() for out in routing(ms.Tensor(logits), bias_tensor))
    distinct = np.array([len(np.unique(row + bias)) == experts for row in logits])
    assert distinct.sum() > 0.9 * tokens
    np.testing.assert_array_equal(ids[distinct], ms_ids[distinct])
    np.testing.assert_allclose(weights[distinct], ms_weights[distinct], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("hidden, inter", [(47, 40), (48, 39)])
def test_bfloat16_experts_refuse_odd_sizes(hidden, inter):
    gate_up = [np.zeros((2 * inter, hidden), np.float32)]
    down = [np.zeros((hidden, inter), np.float32)]
    with packing_bfloat16(True), pytest.raises(ValueError, match="need an even hidden size"):
        MoEDispatch(1).set_weights(gate_up, down, ms.float32, "experts")


# The kernels' AMX tile configuration, compiled into a program of its own where GCC inlines it:
# GCC 12's _tile_loadconfig declares that ldtilecfg reads 8 of the configuration's 64 bytes, and
# without the barrier in configure_tiles such a program loaded a configuration of no rows and died
# of SIGSEGV at its first tile load.
TILE_PROGRAM = r"""
#include "gemm.h"
int main() {
  using namespace vllm_ms;
  if (!amx_available()) return 77;
  alignas(64) uint32_t a[32 * kTilePairs];
  alignas(64) bf16 panel[kTilePairs * 2 * kPanel];
  alignas(64) float c[32 * kPanel];
  for (auto &v : a) v = 0x3f803f80u;  // a pair of bfloat16 ones
  for (auto &v : panel) from_float(1.0f, &v);
  configure_tiles(32);
  amx_block<2>(a, kTilePairs, panel, kTilePairs, c, kPanel, nullptr);
  for (float v : c)
    if (v != 2.0f * kTilePairs) return 1;
  return 0;
}
"""


def run_program(tmp_path, name: str, source: str) -> subprocess.CompletedProcess:
    """Build a program over the kernels' headers with the kernels' own flags, and run it."""
    source_path, program = tmp_path / f"{name}.cc", tmp_path / name
    source_path.write_text(source)
    flags = [flag for flag in kernels.COMPILE_FLAGS if flag not in ("-shared", "-fPIC")]
    subprocess.run([os.environ.get("CXX", "g++"), *flags, f"-I{kernels.CSRC}", "-o",
                    str(program), str(source_path)], check=True)
    return subprocess.run([str(program)], capture_output=True, text=True)


@pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX-BF16")
def test_tile_configuration_survives_inlining(tmp_path):
    result = run_program(tmp_path, "tiles", TILE_PROGRAM)
    if result.returncode == 77:
        pytest.skip("Linux refused this process the AMX tile state")
    assert result.returncode == 0, f"the tile program ended with {result.returncode}"


# The kernels' vector exp (silu * up, the attention's softmax) against their scalar exp, bit for
# bit, on floats spread over every exponent and sign, the clamps' edges and the infinities: on
# AVX-512 the vector one floors and scales with roundscale and scalef, the scalar one with floor
# and an integer add to the exponent's bits.
EXP_PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>
#include "common.h"
int main() {
  using namespace vllm_ms;
  const float infinity = std::numeric_limits<float>::infinity();
  std::vector<float> xs = {-infinity, -88.0f, -87.0f, -86.99f, -0.0f, 0.0f, 1e-30f, 0.5f, 88.0f,
                           88.01f, infinity};
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) {
    const uint32_t b = static_cast<uint32_t>(bits);
    float x;
    std::memcpy(&x, &b, sizeof(b));
    if (x == x) xs.push_back(x);  // not NaN
  }
  xs.resize((xs.size() + kLanes - 1) / kLanes * kLanes, 1.0f);
  long mismatches = 0;
  for (size_t i = 0; i < xs.size(); i += kLanes) {
    const lanes e = fast_exp(load_lanes(xs.data() + i));
    for (int j = 0; j < kLanes; ++j) {
      const float want = fast_exp(xs[i + j]);
      if (std::memcmp(&e[j], &want, sizeof(want)) != 0 && mismatches++ < 5)
        std::printf("exp(%a): vector %a, scalar %a\n", xs[i + j], e[j], want);
    }
  }
  std::printf("%ld of %zu differ\n", mismatches, xs.size());
  return mismatches != 0 || xs.size() < 1000000;
}
"""


def test_vector_exp_equals_the_scalar_exp(tmp_path):
    result = run_program(tmp_path, "exp", EXP_PROGRAM)
    assert result.returncode == 0, result.stdout
