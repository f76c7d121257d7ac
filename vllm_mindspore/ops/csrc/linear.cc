// CPU kernels behind vllm_mindspore.ops.linear, called by MindSpore as
// `ops.Custom(func_type="aot")` operators: y = x @ W (+ bias), optionally followed by
// silu(gate) * up for a fused gate|up projection.
// The weights are packed in panels (gemm.h): float32/float16 like x, or bfloat16 (in pairs of k,
// x float32, or bfloat16 rows from the decoder layer where AMX takes them; y float32, or
// bfloat16 for the next matmul).

#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"

namespace {

using namespace vllm_ms;

// packed [P, K, 32] (W float32/float16) or [P, ceil(K / 2), 32, 2] (bfloat16 pairs)
template <typename W>
bool packed_shape_fits(int ndims, const int64_t *packed, int64_t K, int64_t N) {
  if constexpr (std::is_same_v<W, bf16>) {
    if (ndims != 4 || packed[1] != (K + 1) / 2 || packed[3] != 2) return false;
  } else if (ndims != 3 || packed[1] != K) {
    return false;
  }
  return packed[0] * kPanel >= N;
}

// x (X) [M, K] . packed W -> y (Y); the bias is in y's dtype, float32 for bfloat16 y.
template <typename X, typename W, typename Y>
int run(void **params, int *ndims, int64_t **shapes, bool has_bias, bool gated) {
  using Bias = Accumulator<Y>;
  const X *x = static_cast<const X *>(params[0]);
  const W *packed = static_cast<const W *>(params[1]);
  const Bias *bias = has_bias ? static_cast<const Bias *>(params[2]) : nullptr;
  Y *out = static_cast<Y *>(params[has_bias ? 3 : 2]);
  const int64_t M = shapes[0][0], K = shapes[0][1];
  const int64_t N = shapes[has_bias ? 3 : 2][1] * (gated ? 2 : 1);
  if (!packed_shape_fits<W>(ndims[1], shapes[1], K, N)) return 1;
  struct Rows {
    Buffer<float> x, y;
  };
  const Scratch<Rows> buffers;
  auto rows_of_x = [&] {  // as the matmul takes them: float32, or bfloat16 over bfloat16 W
    if constexpr (std::is_same_v<X, bf16>) return x;
    else return as_float(x, M * K, buffers->x);
  };
  // silu(gate) * up in the matmul's blocks where the gate/up boundary is a panel boundary
  const bool fused = gated && (N / 2) % kPanel == 0;
  const int64_t columns = fused ? N / 2 : N;
  if constexpr (!std::is_same_v<Y, half>) {
    if (fused || !gated) {  // the matmul writes y itself
      matmul(rows_of_x(), M, K, packed, bias, N, out, columns, true, fused);
      return 0;
    }
  }
  buffers->y.resize(M * columns);
  matmul(rows_of_x(), M, K, packed, bias, N, buffers->y.data(), columns, true, fused);
  if (gated && !fused) {
    silu_and_mul(buffers->y.data(), M, N / 2, out);
  } else {
    convert(buffers->y.data(), out, M * columns);
  }
  return 0;
}

int dispatch(const char **dtypes, void **params, int *ndims, int64_t **shapes, bool has_bias,
             bool gated) {
  auto is = [](const char *dtype, const char *name) { return std::strcmp(dtype, name) == 0; };
  const char *x = dtypes[0], *y = dtypes[has_bias ? 3 : 2];
  if (is(dtypes[1], "bfloat16")) {
    if (!kHasBf16Dot) return 1;
    if (is(x, "float32") && is(y, "float32"))
      return run<float, bf16, float>(params, ndims, shapes, has_bias, gated);
    if (is(x, "bfloat16") && is(y, "float32"))
      return run<bf16, bf16, float>(params, ndims, shapes, has_bias, gated);
    if (is(x, "bfloat16") && is(y, "bfloat16") && !has_bias)
      return run<bf16, bf16, bf16>(params, ndims, shapes, has_bias, gated);
    return 1;
  }
  if (is(x, "float16")) return run<half, half, half>(params, ndims, shapes, has_bias, gated);
  return run<float, float, float>(params, ndims, shapes, has_bias, gated);
}

}  // namespace

extern "C" {

// Whether the bfloat16 matmul uses AMX from now on (`wanted` and available) -> 1 if it does.
int UseAmx(int wanted) {
  vllm_ms::amx_wanted = wanted != 0;
  return vllm_ms::amx_wanted && vllm_ms::amx_available();
}

// Whether the bfloat16 matmul widens its panels for float32 FMAs (`setting` 1), keeps vdpbf16ps
// (0) or takes the one it measures faster on this CPU (-1, the default) -> 1 if it widens.
int WidenBf16(int setting) {
  vllm_ms::widen_bf16_setting = setting;
  return vllm_ms::widen_bf16();
}

// x [M, K], packed [P, K, 32] or [P, ceil(K / 2), 32, 2] -> y [M, N] (dtypes: see run)
int Linear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
           void *, void *) {
  return nparam == 3 ? dispatch(dtypes, params, ndims, shapes, false, false) : 1;
}

// x [M, K], packed (as above), bias [N] -> y [M, N]
int LinearBias(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
               void *, void *) {
  return nparam == 4 ? dispatch(dtypes, params, ndims, shapes, true, false) : 1;
}

// x [M, K], packed gate|up (as above) -> silu(x . gate) * (x . up) [M, I]
int LinearSiluMul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                  void *, void *) {
  return nparam == 3 ? dispatch(dtypes, params, ndims, shapes, false, true) : 1;
}

}  // extern "C"
