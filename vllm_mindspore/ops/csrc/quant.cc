// CPU kernels behind vllm_mindspore.ops.quant: W8A8 linears and MoE experts with int8 weights
// kept int8, activations quantized as the checkpoint's scheme says, products accumulated exactly
// in int32 and dequantized with the stored scales (docs/quantization.md states the arithmetic).
//
// Weights are packed once after loading into panels of 32 output columns, each panel K/4 groups
// of 4 consecutive k for each of its 32 columns ([ceil(N/32), ceil(K/4), 32, 4] int8, zero padded),
// the layout of AVX-512 VNNI's vpdpbusd: one instruction multiplies 4 unsigned activation bytes
// by the 4 signed weight bytes of 16 columns and adds the sums to 16 int32 accumulators. The
// activations enter as q + 128 (unsigned); the 128 * sum_k w[n, k] this adds is subtracted again
// through `corr` (per output column, computed at packing time), so every accumulator is the exact
// int32 sum of q * w. Without VNNI, AVX2 widens each group's bytes to int16 and vpmaddwd sums
// pairs of products into int32: exact as well (|u * w| <= 255 * 128). Without AVX2, a portable
// loop computes the same integers.
//
// Floating-point steps are written one rounding at a time (no fused multiply-add): this file's
// functions are compiled with fp-contract off whatever the library's flags, so the results equal
// a numpy reference of the same steps bit for bit.


#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"

#define VLLM_MS_EXACT __attribute__((optimize("fp-contract=off")))

namespace {

using namespace vllm_ms;

constexpr int kQPanel = 32;  // output columns per panel (two vectors of 16 int32)
constexpr int kQRows = 6;    // activation rows per register block

inline int64_t groups_of_4(int64_t k) { return (k + 3) / 4; }

// ---- activation quantization ---------------------------------------------------------------
// Each writes a row of K4 * 4 bytes holding q + 128 (the padding k >= K holds 128, i.e. q = 0).

inline int8_t saturate_rint(float t) {
  const float r = std::nearbyint(t);  // round half to even (the default rounding mode)
  return static_cast<int8_t>(r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r));
}

// static: q = sat(rint((x * r) + offset)), r = 1 / input_scale (both per tensor or per channel)
template <typename T>
VLLM_MS_EXACT void quantize_static_row(const T *x, int64_t K, const float *r, const float *off,
                                       int8_t *q) {
  for (int64_t k = 0; k < K; ++k) {
    float t = to_float(x[k]) * r[k];
    t = t + off[k];
    q[k] = saturate_rint(t);
  }
}

// dynamic, per row: scale = max|x| * (1 / 127) (1 when the row is zero), q = sat(rint(x / scale))
template <typename T>
VLLM_MS_EXACT float quantize_dynamic_row(const T *x, int64_t K, int8_t *q) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
  float scale = amax * (1.0f / 127.0f);
  if (scale == 0.0f) scale = 1.0f;
  for (int64_t k = 0; k < K; ++k) q[k] = saturate_rint(to_float(x[k]) / scale);
  return scale;
}

inline void to_unsigned(const int8_t *q, int64_t K, int64_t K4, uint8_t *u) {
  for (int64_t k = 0; k < K; ++k) u[k] = static_cast<uint8_t>(q[k]) ^ 0x80;
  for (int64_t k = K; k < K4 * 4; ++k) u[k] = 0x80;
}

// ---- int8 x int8 -> int32 --------------------------------------------------------------------
// c[i][0:32] = sum over k of u[i][k] * w[k][j] (u = q + 128), for R rows of a panel.
template <int R>
void qblock(const uint8_t *__restrict u, int64_t ldu, const int8_t *__restrict panel, int64_t K4,
            int32_t *__restrict c, int64_t ldc) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  __m512i lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < K4; ++g) {
    const __m512i b0 = _mm512_loadu_si512(panel + g * 128);
    const __m512i b1 = _mm512_loadu_si512(panel + g * 128 + 64);
    for (int i = 0; i < R; ++i) {
      int32_t a4;
      std::memcpy(&a4, u + i * ldu + g * 4, 4);
      const __m512i a = _mm512_set1_epi32(a4);
      lo[i] = _mm512_dpbusd_epi32(lo[i], a, b0);
      hi[i] = _mm512_dpbusd_epi32(hi[i], a, b1);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_si512(c + i * ldc, lo[i]);
    _mm512_storeu_si512(c + i * ldc + 16, hi[i]);
  }
#elif defined(__AVX2__)
  // A quarter of the panel (8 columns) at a time, so that R rows' accumulators fit 16 ymm
  // registers. Widened to int16, a group's 16 weight bytes of 4 columns are one vector of
  // (column, k) pairs; the row's 4 activation bytes, repeated 4 times, are the other. vpmaddwd
  // leaves two partial sums per column (k0 + k1, k2 + k3), added pairwise at the end.
  for (int quarter = 0; quarter < 4; ++quarter) {
    __m256i lo[R], hi[R];  // columns 0-3 and 4-7 of the quarter, two partial sums each
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
    for (int64_t g = 0; g < K4; ++g) {
      const int8_t *group = panel + g * 128 + quarter * 32;
      const __m256i b0 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(group)));
      const __m256i b1 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(group + 16)));
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        int32_t a4;
        std::memcpy(&a4, u + i * ldu + g * 4, 4);
        const __m256i a = _mm256_cvtepu8_epi16(_mm_set1_epi32(a4));
        lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(a, b0));
        hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(a, b1));
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      // hadd within 128-bit lanes gives columns (0, 1, 4, 5 | 2, 3, 6, 7): put them in order.
      const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[i], hi[i]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(c + i * ldc + quarter * 8), sums);
    }
  }
#else  // the other kernels need AVX and F16C only: a portable loop keeps such CPUs served
  for (int i = 0; i < R; ++i) {
    int32_t acc[kQPanel] = {};
    for (int64_t g = 0; g < K4; ++g) {
      const uint8_t *a = u + i * ldu + g * 4;
      const int8_t *b = panel + g * 128;
      for (int j = 0; j < kQPanel; ++j)
        acc[j] += a[0] * b[j * 4] + a[1] * b[j * 4 + 1] + a[2] * b[j * 4 + 2] + a[3] * b[j * 4 + 3];
    }
    std::memcpy(c + i * ldc, acc, sizeof(acc));
  }
#endif
}

template <int R = kQRows>
void qblock_n(int rows, const uint8_t *u, int64_t ldu, const int8_t *panel, int64_t K4, int32_t *c,
              int64_t ldc) {
  if constexpr (R > 1) {
    if (rows < R) return qblock_n<R - 1>(rows, u, ldu, panel, K4, c, ldc);
  }
  qblock<R>(u, ldu, panel, K4, c, ldc);
}

static_assert(kQPanel == kPanel, "the int8 panels go through gemm.h's block loop");

// Where the int8 panels of W (K4 * 4 rows of k each) lie.
inline Panels int8_panels(const int8_t *packed, int64_t K4) { return {packed, K4 * kQPanel * 4}; }

// c [rows, 0:columns] (row stride ldc) = u rows [i, i + rows) . panel p of W + corr, the exact
// int32 sums (wrapping), rows <= kQRows.
inline void int8_block(const uint8_t *u, int64_t K4, const Panels &panels, const int32_t *corr,
                       int64_t i, int64_t rows, int64_t p, int64_t columns, int32_t *c,
                       int64_t ldc) {
  lookahead().flush();  // qblock does not ask for the next panel's lines as it goes
  qblock_n(static_cast<int>(rows), u + i * K4 * 4, K4 * 4, panels.panel<int8_t>(p), K4, c, ldc);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < columns; ++j)  // unsigned: wrapping int32 arithmetic
      c[r * ldc + j] = static_cast<int32_t>(static_cast<uint32_t>(c[r * ldc + j]) +
                                            static_cast<uint32_t>(corr[p * kQPanel + j]));
}

// acc [M, N] (row stride ldacc) = u [M, K4 * 4] . packed W + corr, exact int32.
void int8_matmul(const uint8_t *u, int64_t M, int64_t K4, const int8_t *packed, const int32_t *corr,
                 int64_t N, int32_t *acc, int64_t ldacc) {
  const Panels panels = int8_panels(packed, K4);
  for_each_block(M, kRowChunk, kQRows, N, static_cast<const float *>(nullptr), acc, ldacc, true,
                 panels, [&](int64_t i, int64_t rows, int64_t p, int32_t *c, int64_t ldc) {
    int8_block(u, K4, panels, corr, i, rows, p, std::min<int64_t>(kQPanel, N - p * kQPanel), c,
               ldc);
  });
}

// y [M, N] float32 (row stride ldy) = the int8 matmul dequantized block by block:
// dequant(i, rows, n0, columns, acc, c, ldc) turns the int32 sums `acc` (row stride kQPanel) of
// rows [i, i + rows) and columns [n0, n0 + columns) into c. `gated` (N = 2I, I a multiple of 32):
// y [M, I] = silu(gate) * up of the dequantized gate|up, in the same blocks (gemm.h).
template <typename Dequant>
void quant_matmul(const uint8_t *u, int64_t M, int64_t K4, const int8_t *packed,
                  const int32_t *corr, int64_t N, const Dequant &dequant, float *y, int64_t ldy,
                  bool parallel, bool gated) {
  const Panels panels = int8_panels(packed, K4);
  for_each_output_block(gated, M, kRowChunk, kQRows, N, static_cast<const float *>(nullptr), y,
                        ldy, parallel, panels,
                        [&](int64_t i, int64_t rows, int64_t p, float *c, int64_t ldc) {
    const int64_t columns = std::min<int64_t>(kQPanel, N - p * kQPanel);
    int32_t acc[kQRows * kQPanel];
    int8_block(u, K4, panels, corr, i, rows, p, columns, acc, kQPanel);
    dequant(i, rows, p * kQPanel, columns, acc, c, ldc);
  });
}

// ---- dequantization (of one block: acc [rows, columns], row stride kQPanel -> c) ---------------
// static: c = float(acc) * deq_scale (acc already holds + quant_bias), then + bias
VLLM_MS_EXACT void dequant_static(const int32_t *acc, int64_t rows, int64_t columns,
                                  const float *deq, const float *bias, float *c, int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < columns; ++n) {
      float v = static_cast<float>(acc[r * kQPanel + n]) * deq[n];
      if (bias != nullptr) v = v + bias[n];
      c[r * ldc + n] = v;
    }
}

// dynamic: c = (float(acc) * weight_scale) * token_scale, then + bias
VLLM_MS_EXACT void dequant_dynamic(const int32_t *acc, int64_t rows, int64_t columns,
                                   const float *ws, const float *ts, const float *bias, float *c,
                                   int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < columns; ++n) {
      float v = static_cast<float>(acc[r * kQPanel + n]) * ws[n];
      v = v * ts[r];
      if (bias != nullptr) v = v + bias[n];
      c[r * ldc + n] = v;
    }
}

// ---- the linear operator ------------------------------------------------------------------------
// params: x [M, K], packed [P, K4, 32, 4], corr [N], (static: act [2, K] = r | offset),
// colp [C, N] = scale | bias; out [M, N] or [M, N / 2] (gated: silu(gate) * up).
template <typename T>
int linear(void **params, int64_t **shapes, bool dynamic, bool gated) {
  const T *x = static_cast<const T *>(params[0]);
  const int8_t *packed = static_cast<const int8_t *>(params[1]);
  const int32_t *corr = static_cast<const int32_t *>(params[2]);
  const float *act = dynamic ? nullptr : static_cast<const float *>(params[3]);
  const int colp_index = dynamic ? 3 : 4;
  const float *colp = static_cast<const float *>(params[colp_index]);
  T *out = static_cast<T *>(params[colp_index + 1]);
  const int64_t M = shapes[0][0], K = shapes[0][1], K4 = shapes[1][1], N = shapes[2][0];
  const int64_t colp_rows = shapes[colp_index][0];
  if (shapes[1][2] != kQPanel || shapes[1][3] != 4 || K4 != groups_of_4(K) ||
      shapes[1][0] * kQPanel < N || shapes[colp_index][1] != N || (gated && N % 2))
    return 1;
  const float *bias = colp_rows > 1 ? colp + N : nullptr;

  struct Rows {
    Buffer<int8_t> q;
    Buffer<uint8_t> u;
    Buffer<float> token_scale, y;
  };
  const Scratch<Rows> buffers;
  Buffer<int8_t> &q = buffers->q;
  Buffer<uint8_t> &u = buffers->u;
  Buffer<float> &token_scale = buffers->token_scale, &y = buffers->y;
  q.resize(K);
  u.resize(M * K4 * 4);
  token_scale.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    if (dynamic)
      token_scale[m] = quantize_dynamic_row(x + m * K, K, q.data());
    else
      quantize_static_row(x + m * K, K, act, act + K, q.data());
    to_unsigned(q.data(), K, K4, u.data() + m * K4 * 4);
  }
  const float *scale_of_row = token_scale.data();
  auto dequant = [&](int64_t i, int64_t rows, int64_t n0, int64_t columns, const int32_t *acc,
                     float *c, int64_t ldc) {
    const float *b = bias != nullptr ? bias + n0 : nullptr;
    if (dynamic)
      dequant_dynamic(acc, rows, columns, colp + n0, scale_of_row + i, b, c, ldc);
    else
      dequant_static(acc, rows, columns, colp + n0, b, c, ldc);
  };
  // silu(gate) * up in the matmul's blocks where the gate/up boundary is a panel boundary
  const bool fused = gated && (N / 2) % kQPanel == 0;
  const int64_t columns = fused ? N / 2 : N;
  float *yf;
  if (std::is_same_v<T, float> && (fused || !gated)) {
    yf = reinterpret_cast<float *>(out);
  } else {
    y.resize(M * columns);
    yf = y.data();
  }
  quant_matmul(u.data(), M, K4, packed, corr, N, dequant, yf, columns, true, fused);
  if (gated && !fused)
    silu_and_mul(yf, M, N / 2, out);
  else if constexpr (!std::is_same_v<T, float>)
    convert(yf, out, M * columns);
  return 0;
}

int dispatch_linear(const char **dtypes, void **params, int64_t **shapes, bool dynamic,
                    bool gated) {
  if (std::strcmp(dtypes[0], "float16") == 0) return linear<half>(params, shapes, dynamic, gated);
  return linear<float>(params, shapes, dynamic, gated);
}

// ---- MoE experts, dynamic per-token W8A8 --------------------------------------------------------
// The token copies are grouped by expert (as csrc/moe.cc does); per expert: the tokens' int8 rows
// (quantized once per token) through gate|up, dequantized, silu(gate) * up, quantized per row,
// through down, dequantized, weighted; the copies of each token summed in k order.
template <typename T>
int moe_experts(void **params, int64_t **shapes) {
  const T *x = static_cast<const T *>(params[0]);
  const int32_t *ids = static_cast<const int32_t *>(params[1]);
  const float *weights = static_cast<const float *>(params[2]);
  const int8_t *w13 = static_cast<const int8_t *>(params[3]);
  const int32_t *corr13 = static_cast<const int32_t *>(params[4]);
  const float *s13 = static_cast<const float *>(params[5]);
  const int8_t *w2 = static_cast<const int8_t *>(params[6]);
  const int32_t *corr2 = static_cast<const int32_t *>(params[7]);
  const float *s2 = static_cast<const float *>(params[8]);
  T *out = static_cast<T *>(params[9]);
  const int64_t tokens = shapes[0][0], D = shapes[0][1], K = shapes[1][1];
  const int64_t experts = shapes[3][0], N13 = shapes[4][1], I = N13 / 2, D2 = shapes[7][1];
  const int64_t D4 = shapes[3][2], I4 = shapes[6][2];
  const int64_t w13_size = shapes[3][1] * int8_panels(nullptr, D4).bytes;
  const int64_t w2_size = shapes[6][1] * int8_panels(nullptr, I4).bytes;
  if (D4 != groups_of_4(D) || I4 != groups_of_4(I) || D2 != D || shapes[3][1] * kQPanel < N13 ||
      shapes[6][1] * kQPanel < D || N13 % 2)
    return 1;

  std::vector<int64_t> start, order;
  group_by_expert(ids, tokens * K, experts, start, order);

  // Every token quantized once (its copies share the row).
  Buffer<uint8_t> ux(tokens * D4 * 4);
  Buffer<float> sx(tokens);
  {
    Buffer<int8_t> q(D);
    for (int64_t t = 0; t < tokens; ++t) {
      sx[t] = quantize_dynamic_row(x + t * D, D, q.data());
      to_unsigned(q.data(), D, D4, ux.data() + t * D4 * 4);
    }
  }
  Buffer<float> copies(tokens * K * D, 0.0f);
  parallel_for_each_claimed(experts, [&](int64_t e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) return;
    thread_local Buffer<uint8_t> rows, act_u;
    thread_local Buffer<float> rows_scale, gate_up, act, act_scale, down;
    thread_local Buffer<int8_t> q;
    rows.resize(n * D4 * 4);
    rows_scale.resize(n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = order[start[e] + j] / K;
      std::memcpy(rows.data() + j * D4 * 4, ux.data() + t * D4 * 4, D4 * 4);
      rows_scale[j] = sx[t];
    }
    auto dequant13 = [&](int64_t i, int64_t count, int64_t n0, int64_t columns,
                         const int32_t *sums, float *c, int64_t ldc) {
      dequant_dynamic(sums, count, columns, s13 + e * N13 + n0, rows_scale.data() + i, nullptr, c,
                      ldc);
    };
    act.resize(n * I);
    if (I % kQPanel == 0) {  // silu(gate) * up in the matmul's blocks
      quant_matmul(rows.data(), n, D4, w13 + e * w13_size, corr13 + e * N13, N13, dequant13,
                   act.data(), I, false, true);
    } else {
      gate_up.resize(n * N13);
      quant_matmul(rows.data(), n, D4, w13 + e * w13_size, corr13 + e * N13, N13, dequant13,
                   gate_up.data(), N13, false, false);
      silu_and_mul(gate_up.data(), n, I, act.data());
    }
    act_u.resize(n * I4 * 4);
    act_scale.resize(n);
    q.resize(I);
    for (int64_t j = 0; j < n; ++j) {
      act_scale[j] = quantize_dynamic_row(act.data() + j * I, I, q.data());
      to_unsigned(q.data(), I, I4, act_u.data() + j * I4 * 4);
    }
    down.resize(n * D);
    quant_matmul(act_u.data(), n, I4, w2 + e * w2_size, corr2 + e * D, D,
                 [&](int64_t i, int64_t count, int64_t n0, int64_t columns, const int32_t *sums,
                     float *c, int64_t ldc) {
                   dequant_dynamic(sums, count, columns, s2 + e * D + n0, act_scale.data() + i,
                                   nullptr, c, ldc);
                 },
                 down.data(), D, false, false);
    weigh_copies(down.data(), n, D, order.data() + start[e], weights, copies.data());
  });
  sum_copies(copies.data(), tokens, K, D, out);
  return 0;
}

// ---- test and reference entry points ------------------------------------------------------------
template <typename T>
int quantize_rows(void **params, int64_t **shapes, bool dynamic) {
  const T *x = static_cast<const T *>(params[0]);
  const int64_t M = shapes[0][0], K = shapes[0][1];
  if (dynamic) {
    int8_t *q = static_cast<int8_t *>(params[1]);
    float *scale = static_cast<float *>(params[2]);
    for (int64_t m = 0; m < M; ++m) scale[m] = quantize_dynamic_row(x + m * K, K, q + m * K);
  } else {
    const float *act = static_cast<const float *>(params[1]);
    int8_t *q = static_cast<int8_t *>(params[2]);
    if (shapes[1][0] != 2 || shapes[1][1] != K) return 1;
    for (int64_t m = 0; m < M; ++m) quantize_static_row(x + m * K, K, act, act + K, q + m * K);
  }
  return 0;
}

}  // namespace

extern "C" {

// x [M, K], packed [P, K4, 32, 4] int8, corr [N] int32, act [2, K] float32, colp [1|2, N] float32
// (deq_scale | bias) -> y [M, N]
int QuantLinear(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *,
                void *) {
  return nparam == 6 ? dispatch_linear(dtypes, params, shapes, false, false) : 1;
}

int QuantLinearSiluMul(int nparam, void **params, int *, int64_t **shapes, const char **dtypes,
                       void *, void *) {
  return nparam == 6 ? dispatch_linear(dtypes, params, shapes, false, true) : 1;
}

// x [M, K], packed, corr [N], colp [1|2, N] float32 (weight_scale | bias) -> y [M, N]
int QuantLinearDynamic(int nparam, void **params, int *, int64_t **shapes, const char **dtypes,
                       void *, void *) {
  return nparam == 5 ? dispatch_linear(dtypes, params, shapes, true, false) : 1;
}

int QuantLinearDynamicSiluMul(int nparam, void **params, int *, int64_t **shapes,
                              const char **dtypes, void *, void *) {
  return nparam == 5 ? dispatch_linear(dtypes, params, shapes, true, true) : 1;
}

// x [T, D], ids [T, K] int32, weights [T, K] float32, w13 [E, P13, D4, 32, 4] int8,
// corr13 [E, 2I] int32, s13 [E, 2I] float32, w2 [E, P2, I4, 32, 4] int8, corr2 [E, D] int32,
// s2 [E, D] float32 -> out [T, D]
int MoeExpertsQuant(int nparam, void **params, int *, int64_t **shapes, const char **dtypes,
                    void *, void *) {
  if (nparam != 10) return 1;
  if (std::strcmp(dtypes[0], "float16") == 0) return moe_experts<half>(params, shapes);
  return moe_experts<float>(params, shapes);
}

// q [M, K] int8, packed, corr [N] -> acc [M, N] int32 = q . W^T + corr (the exact accumulator)
int QuantMatmulInt32(int nparam, void **params, int *, int64_t **shapes, const char **, void *,
                     void *) {
  if (nparam != 4) return 1;
  const int8_t *q = static_cast<const int8_t *>(params[0]);
  const int64_t M = shapes[0][0], K = shapes[0][1], K4 = shapes[1][1], N = shapes[2][0];
  if (K4 != groups_of_4(K) || shapes[3][1] != N) return 1;
  Buffer<uint8_t> u(M * K4 * 4);
  for (int64_t m = 0; m < M; ++m) to_unsigned(q + m * K, K, K4, u.data() + m * K4 * 4);
  int8_matmul(u.data(), M, K4, static_cast<const int8_t *>(params[1]),
              static_cast<const int32_t *>(params[2]), N, static_cast<int32_t *>(params[3]), N);
  return 0;
}

// x [M, K], act [2, K] -> q [M, K] int8
int QuantizeStatic(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *,
                   void *) {
  if (nparam != 3) return 1;
  if (std::strcmp(dtypes[0], "float16") == 0) return quantize_rows<half>(params, shapes, false);
  return quantize_rows<float>(params, shapes, false);
}

// x [M, K] -> (q [M, K] int8, scale [M] float32)
int QuantizeDynamic(int nparam, void **params, int *, int64_t **shapes, const char **dtypes,
                    void *, void *) {
  if (nparam != 3) return 1;
  if (std::strcmp(dtypes[0], "float16") == 0) return quantize_rows<half>(params, shapes, true);
  return quantize_rows<float>(params, shapes, true);
}

}  // extern "C"
