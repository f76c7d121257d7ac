// The packed-panel matmul shared by the linear and MoE kernels.
//
// W is packed once after loading into panels of 32 output columns, each panel K rows of 32
// contiguous values ([N / 32, K, 32], the last panel zero-padded), so the matmul streams every
// weight exactly once, in order, whatever the number of rows: a decode step of a few tokens is
// bound by memory bandwidth, a prefill step by the kRows x 32 register-blocked inner loop.
//
// bfloat16 weights are packed in pairs of k instead ([N / 32, K / 2, 32, 2], K padded to even),
// the layout of AVX512-BF16's vdpbf16ps: one instruction multiplies two k of 16 columns by the
// row's two bfloat16 activations and adds both products to 16 float32 accumulators (twice the
// float32 FMA's rate). The rows of x are rounded to bfloat16 for it; sums stay float32.
//
// Where vdpbf16ps runs at half the float32 FMA's rate (Intel's AVX512-BF16 cores: 80 against
// 150 GFLOP/s a core measured on an Emerald Rapids), the same panels are widened to float32
// instead (a bfloat16 is a float32's upper half: one shift or mask each) and multiplied by the
// float32 rows of x (not rounded) with FMAs, 8 rows a block; which of the two is faster is
// measured once per process (widen_bf16).
//
// On CPUs with AMX (Intel Sapphire Rapids and later) the same panels are read as tiles: one
// TDPBF16PS multiplies 16 rows x 32 k of x by 32 k x 16 columns of a panel (the pairs layout is
// the tile instruction's too), 8x the multiply-adds per cycle of vdpbf16ps.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

namespace vllm_ms {

constexpr int kPanel = 32;   // output columns per panel: two vectors
// Rows per register block: R rows x 32 columns of accumulators, the panel's vectors and a
// broadcast fill the vector registers. AVX-512: 14 rows, 28 accumulators and 3 more of the 32
// registers (6 rows, as AVX2 takes, read the panel from L2 2.3x as often: float32, standalone,
// a 64-row decode's four matmuls 1.38-1.44 -> 1.15-1.26 ms a layer, an 896-row prefill's
// 15.6-16.0 -> 14.7-15.2 ms). A decode step of up to kRows rows runs as one block, so each
// weight panel is read once.
#if defined(__AVX512F__)
constexpr int kRows = 14;
// The widened bfloat16 block holds four float32 vectors of the panel and two broadcasts.
constexpr int kWidenedRows = 8;
#else
constexpr int kRows = 6;  // each panel half in turn: 12 accumulators of 16
constexpr int kWidenedRows = kRows;
#endif
constexpr int64_t kDepth = 512;  // K per pass, so a panel slice stays in cache across row blocks
// Up to this many rows take the vdpbf16ps blocks even where AMX is there: bound by reading the
// weights either way, and a 16-row tile would compute mostly padding.
constexpr int64_t kAmxMinRows = 4;

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// Whether the bfloat16 matmul may use AMX (UseAmx: VLLM_MS_CPU_AMX; the kernel tests run both).
inline bool amx_wanted = true;

// AMX compiled in (-march=native on an AMX CPU) and granted: Linux hands a process the tile
// registers' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA;
// kernels before 5.16 refuse, and the AVX512-BF16 path runs).
inline bool amx_available() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

// A block kernel asks for one line of its share of the next panel (Lookahead, which
// for_each_block hands each block of an item) every kStepsPerLine steps of k: within the loop
// for an item of 64 rows or more on the model's shapes; what a block leaves goes at the next
// block's start. (The AMX block, whose loop is a few long tile steps, spreads its share evenly
// over them.)
constexpr int64_t kStepsPerLine = 2;

// How a panel of W stores its k: one float32/float16 value per k, or bfloat16 pairs of k (the
// rows of x then enter as pairs too: Step is the element one k step of a row reads).
template <typename W>
struct PanelFormat {
  using Step = float;
  static constexpr int64_t kPerStep = 1;
};
template <>
struct PanelFormat<bf16> {
  using Step = uint32_t;  // two bfloat16 of x: k and k + 1
  static constexpr int64_t kPerStep = 2;
};

// c[0:R, first:first + V kLanes] (+)= a[0:R, 0:depth] . panel[0:depth, same columns]: R x V
// vector accumulators. The loops over them are unrolled by request: left to GCC's later
// unrolling, AVX2's accumulators stayed in registers but were also stored to the stack at every
// k (12 stores for 12 FMAs).
template <int R, int V, typename W>
void block_columns(const float *__restrict a, int64_t lda, const W *__restrict panel,
                   int64_t depth, float *__restrict c, int64_t ldc, bool accumulate,
                   int first) {
  lanes sum[R][V];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      sum[i][v] = accumulate ? load_lanes(c + i * ldc + first + v * kLanes) : lanes{};
  Lookahead ahead = lookahead();
#if defined(__AVX512F__)
  // Two steps of k an iteration: the step that asks for a line is known, and the row pointers
  // that do not fit the registers (14 rows) are reloaded once for both. Standalone (the step's
  // four float32 matmuls, eight layers of weights, alternated four times): 896 rows 16.6-16.9 ->
  // 15.2-16.0 ms a layer, 64 rows 1.29-1.35 -> 1.26-1.32. An AVX2 build (6 rows) was no faster.
#pragma GCC unroll 2
#endif
  for (int64_t k = 0; k < depth; ++k) {
    if (k % kStepsPerLine == 0) ahead.ask();
    lanes b[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      b[v] = load_lanes(panel + k * kPanel + first + v * kLanes);
      // In a register, loaded once a step: GCC otherwise folded the load into each row's FMA
      // for 2-5 rows on AVX2 (4 rows: 88 GFLOP/s, 139 with this, 6 rows 166); AVX-512 builds
      // folded only the 1-row block's, where each vector has one use.
      asm("" : "+v"(b[v]));
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const float ak = a[i * lda + k];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) sum[i][v] += ak * b[v];
    }
  }
  lookahead() = ahead;
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) store_lanes(c + i * ldc + first + v * kLanes, sum[i][v]);
}

// c[0:R, 0:32] (+)= a[0:R, 0:depth] . panel[0:depth, 0:32]: the panel's columns at once where
// the R rows' accumulators, the panel's vectors and a broadcast fit the registers (AVX-512: up to
// 14 rows x 2 zmm; AVX2: up to 2 rows x 4 ymm), else its two halves in turn (AVX2: up to 6 rows x 2
// ymm each), which read different cache lines of the panel. A 6 x 32 block in 16-float vectors
// on AVX2 (ymm pairs) had been kept on the stack: 3.6-4.5 GFLOP/s.
template <int R, typename W>
void block(const float *__restrict a, int64_t lda, const W *__restrict panel, int64_t depth,
           float *__restrict c, int64_t ldc, bool accumulate) {
  constexpr int kVectors = kPanel / kLanes;
  if constexpr ((R + 1) * kVectors + 1 <= kVectorRegisters) {
    block_columns<R, kVectors>(a, lda, panel, depth, c, ldc, accumulate, 0);
  } else {
    constexpr int kHalf = kVectors / 2;
    block_columns<R, kHalf>(a, lda, panel, depth, c, ldc, accumulate, 0);
    block_columns<R, kHalf>(a, lda, panel, depth, c, ldc, accumulate, kHalf * kLanes);
  }
}

// The same over bfloat16 pairs: a[i][p] holds row i's k = 2p, 2p + 1; panel [pairs, 32, 2].
template <int R>
void block(const uint32_t *__restrict a, int64_t lda, const bf16 *__restrict panel, int64_t pairs,
           float *__restrict c, int64_t ldc, bool accumulate) {
#if defined(__AVX512BF16__)
  __m512 lo[R], hi[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = accumulate ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
    hi[i] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
  }
  Lookahead ahead = lookahead();
  for (int64_t p = 0; p < pairs; ++p) {
    if (p % kStepsPerLine == 0) ahead.ask();
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kPanel + kPanel);
    for (int i = 0; i < R; ++i) {
      const __m512bh ap = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + p]));
      lo[i] = _mm512_dpbf16_ps(lo[i], ap, b0);
      hi[i] = _mm512_dpbf16_ps(hi[i], ap, b1);
    }
  }
  lookahead() = ahead;
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(c + i * ldc, lo[i]);
    _mm512_storeu_ps(c + i * ldc + 16, hi[i]);
  }
#else
  (void)a, (void)lda, (void)panel, (void)pairs, (void)c, (void)ldc, (void)accumulate;
#endif
}

// The same over bfloat16 pairs widened to float32, x's rows float32: a[i * lda + 2p] and
// a[i * lda + 2p + 1] are row i's k = 2p, 2p + 1 (lda even). One or two rows (a decode) sum the
// odd k apart, so that each accumulator takes one FMA a pair, not a chain of two.
template <int R>
void block(const float *__restrict a, int64_t lda, const bf16 *__restrict panel, int64_t pairs,
           float *__restrict c, int64_t ldc, bool accumulate) {
#if defined(__AVX512F__)
  constexpr bool kOddApart = R <= 2;
  const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 lo[R], hi[R], lo_odd[R], hi_odd[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = accumulate ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
    hi[i] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
    lo_odd[i] = hi_odd[i] = _mm512_setzero_ps();
  }
  Lookahead ahead = lookahead();
  for (int64_t p = 0; p < pairs; ++p) {
    if (p % kStepsPerLine == 0) ahead.ask();
    const __m512i w0 = _mm512_loadu_si512(panel + p * 2 * kPanel);
    const __m512i w1 = _mm512_loadu_si512(panel + p * 2 * kPanel + kPanel);
    // columns 0-15 | 16-31 at k = 2p (the pairs' lower halves) and 2p + 1 (their upper halves)
    const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
    const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(w0, upper));
    const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
    const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(w1, upper));
    for (int i = 0; i < R; ++i) {
      const __m512 a0 = _mm512_set1_ps(a[i * lda + 2 * p]);
      const __m512 a1 = _mm512_set1_ps(a[i * lda + 2 * p + 1]);
      if constexpr (kOddApart) {
        lo[i] = _mm512_fmadd_ps(a0, even0, lo[i]);
        lo_odd[i] = _mm512_fmadd_ps(a1, odd0, lo_odd[i]);
        hi[i] = _mm512_fmadd_ps(a0, even1, hi[i]);
        hi_odd[i] = _mm512_fmadd_ps(a1, odd1, hi_odd[i]);
      } else {
        lo[i] = _mm512_fmadd_ps(a1, odd0, _mm512_fmadd_ps(a0, even0, lo[i]));
        hi[i] = _mm512_fmadd_ps(a1, odd1, _mm512_fmadd_ps(a0, even1, hi[i]));
      }
    }
  }
  lookahead() = ahead;
  for (int i = 0; i < R; ++i) {
    if constexpr (kOddApart) {
      lo[i] = _mm512_add_ps(lo[i], lo_odd[i]);
      hi[i] = _mm512_add_ps(hi[i], hi_odd[i]);
    }
    _mm512_storeu_ps(c + i * ldc, lo[i]);
    _mm512_storeu_ps(c + i * ldc + 16, hi[i]);
  }
#else
  (void)a, (void)lda, (void)panel, (void)pairs, (void)c, (void)ldc, (void)accumulate;
#endif
}

// The most rows a block takes of x's rows entering as A over panels of W: float32 rows over
// bfloat16 panels are widened (kWidenedRows), the others kRows.
template <typename W, typename A>
constexpr int block_rows_for() {
  return std::is_same_v<W, bf16> && std::is_same_v<A, float> ? kWidenedRows : kRows;
}

// block<rows> for 1 <= rows <= R; A is what x's rows enter as (the overloads above tell the
// kernel by it and W: float over float/float16 panels, bfloat16 pairs (uint32_t) or float over
// bfloat16 panels).
template <typename W, typename A, int R = block_rows_for<W, A>()>
void block_n(int rows, const A *a, int64_t lda, const W *panel, int64_t depth, float *c,
             int64_t ldc, bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return block_n<W, A, R - 1>(rows, a, lda, panel, depth, c, ldc, accumulate);
  }
  block<R>(a, lda, panel, depth, c, ldc, accumulate);
}

// Whether bfloat16 panels are widened for FMAs (1), multiplied by vdpbf16ps (0), or measured (-1:
// the faster of the two on prefill-sized blocks in L1, per row, taken once per process).
inline int widen_bf16_setting = -1;

inline bool widening_is_faster() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  constexpr int64_t kPairs = 128;  // a 16 KB panel and x's rows in L1
  std::vector<bf16> panel(kPairs * 2 * kPanel);
  for (size_t j = 0; j < panel.size(); ++j)
    from_float(0.01f * static_cast<float>(j % 97), &panel[j]);
  std::vector<float> x(kWidenedRows * 2 * kPairs, 0.5f), c(kRows * kPanel);
  std::vector<uint32_t> pairs(kRows * kPairs, 0x3f003f00u);
  auto best_of = [&](auto &&run) {
    double best = 1e30;
    for (int trial = 0; trial < 7; ++trial) {
      const auto start = std::chrono::steady_clock::now();
      for (int call = 0; call < 64; ++call) run();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                          start).count());
    }
    return best;
  };
  const double dot_per_row = best_of([&] {
    block<kRows>(pairs.data(), kPairs, panel.data(), kPairs, c.data(), kPanel, false);
  }) / kRows;
  const double widened_per_row = best_of([&] {
    block<kWidenedRows>(x.data(), 2 * kPairs, panel.data(), kPairs, c.data(), kPanel, false);
  }) / kWidenedRows;
  return widened_per_row < dot_per_row;
#else
  return false;
#endif
}

inline bool widen_bf16() {
  if (widen_bf16_setting >= 0) return widen_bf16_setting != 0;
  static const bool faster = widening_is_faster();
  return faster;
}

// The rows of x as the panels of W read them: x itself, or (bfloat16 W) each row rounded to
// bfloat16 in pairs of k, zero-padded to `steps` pairs. Converted on the threads for a prefill's
// megabytes only (a decode's rows take microseconds, less than waking the other thread).
template <typename W>
const typename PanelFormat<W>::Step *as_steps(const float *x, int64_t M, int64_t K, int64_t steps,
                                              Buffer<uint32_t> &buffer, bool parallel) {
  if constexpr (std::is_same_v<W, bf16>) {
    buffer.resize(M * steps);
    uint32_t *a = buffer.data();
    parallel_for(M, [&](int64_t m) {
      bf16 *row = reinterpret_cast<bf16 *>(a + m * steps);
      convert(x + m * K, row, K);
      if (K % 2) row[K] = bf16{0};
    }, parallel && M * K >= 16 * kParallelElements);
    return a;
  } else {
    return x;
  }
}

// What a block of y is computed in: y's own type, or float32 for bfloat16 rows of y (rounded as
// they are written, for the next matmul's tiles).
template <typename Y>
using Accumulator = std::conditional_t<std::is_same_v<Y, bf16>, float, Y>;

// Whether y [M, ldy] is written with non-temporal stores (stream_lanes): float32 y of at least
// kStreamedBytes, whose lines are then not read from memory before they are written. Stored
// normally, each line of y was read first: an 8192-token prefill's q|k|v (25 MB) and o
// projections took 17% and 14% longer (standalone, float32). In the model (the same prefill,
// alternated three times) the step took 1226-1290 -> 1167-1241 ms in float32, 318-360 -> 290-321
// in bfloat16 (whose q|k|v, o and down write float32 y); smaller y (a served wave's 896 rows)
// is left to the caches, where the next kernel reads it.
constexpr int64_t kStreamedBytes = int64_t{8} << 20;

template <typename Y>
bool streams(const Y *y, int64_t M, int64_t ldy) {
  if constexpr (std::is_same_v<Y, float>) {
    return M * ldy * static_cast<int64_t>(sizeof(Y)) >= kStreamedBytes && ldy % kLanes == 0 &&
           reinterpret_cast<uintptr_t>(y) % sizeof(lanes) == 0;
  }
  return false;
}

// Rows [0, rows) of one panel of y (`out`, row stride ldy): copied from the block `c` they were
// computed in when that is not y itself (a panel narrower than 32, rows past M, bfloat16 y,
// streamed y), plus the bias (float y; the int8 matmul's exact int32 y has none).
template <typename Y, typename B>
void finish_rows(const Accumulator<Y> *c, int64_t ldc, int64_t rows, Y *out, int64_t ldy,
                 int64_t columns, const B *bias, bool streamed) {
  if constexpr (std::is_same_v<Y, float>) {
    if (streamed && columns == kPanel) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int j = 0; j < kPanel; j += kLanes) {
          lanes v = load_lanes(c + r * ldc + j);
          if (bias != nullptr) v += load_lanes(bias + j);
          stream_lanes(out + r * ldy + j, v);
        }
      }
      return;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    Y *row = out + r * ldy;
    if constexpr (std::is_same_v<Y, bf16>) {
      convert(c + r * ldc, row, columns);  // no bias: a gate|up projection's
    } else {
      if (static_cast<const void *>(c) != out)
        std::memcpy(row, c + r * ldc, columns * sizeof(Y));
      if constexpr (std::is_same_v<Y, float>) {
        if (bias != nullptr)
          for (int64_t j = 0; j < columns; ++j) row[j] += to_float(bias[j]);
      }
    }
  }
}

// silu(g) * u = g / (1 + exp(-g)) * u, a vector at a time.
inline lanes silu_times(lanes g, lanes u) { return g / (1.0f + fast_exp(-g)) * u; }
inline float silu_times(float g, float u) { return g / (1.0f + fast_exp(-g)) * u; }

// Rows [0, rows) of one panel of the fused gate|up projection's output (`out`, row stride ldy)
// = silu(gate) * up, from the block `c` that holds the gate's 32 columns and then the up's, so
// the float32 gate|up rows are never written (92 MB for an 8192-token prefill of a 1408-wide MLP,
// then read again by a separate silu * up pass).
template <typename Y>
void silu_rows(const float *c, int64_t ldc, int64_t rows, Y *out, int64_t ldy, bool streamed) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < kPanel; j += kLanes)
      put_lanes(out + r * ldy + j,
                silu_times(load_lanes(c + r * ldc + j), load_lanes(c + r * ldc + kPanel + j)),
                streamed);
  }
}

// Where the packed weights' panels lie: panel p at base + p * bytes; `paired`: panel
// p + paired is read with it (the up panel of a gate panel: y = silu(gate) * up).
struct Panels {
  const void *base;
  int64_t bytes, paired = 0;

  // Share `part` of `parts` of panel p's bytes (and of its pair's) -> the lines `share` is to
  // ask for. Written field by field: a Lookahead returned by value was stored in parts and read
  // back whole, a read that could not take the stored values and waited for every older store
  // to reach the cache, the block's tile stores included (a 7-prompt wave's q|k|v 550 -> 480
  // us a layer, o 383 -> 350; its for_each_block lines 5.3% -> 1.3% of the step's samples).
  void part(int64_t p, int64_t part, int64_t parts, Lookahead &share) const {
    const int64_t from = bytes * part / parts / 64 * 64, to = bytes * (part + 1) / parts;
    share.next = at(p) + from;
    share.end = at(p) + to;
    share.next_pair = paired != 0 ? at(p + paired) + from : nullptr;
    share.end_pair = paired != 0 ? at(p + paired) + to : nullptr;
  }

  const char *at(int64_t p) const { return static_cast<const char *>(base) + p * bytes; }
  template <typename W>
  const W *panel(int64_t p) const { return reinterpret_cast<const W *>(at(p)); }
};

// y [M, N] (row stride ldy) computed in blocks of `block_rows` rows (the last one the rest) x one
// panel: compute(i, rows, p, c, ldc) writes rows [i, i + rows) of panel p to c, which is y itself
// where the panel is whole (32 columns) and a scratch block otherwise; finish_rows then copies and
// adds the bias. With paired panels (gate|up) y is silu(gate) * up, of N gate columns: the scratch
// block gets the gate's product and the up's, and silu_rows writes y. A block is finished after the
// next block's products: read right after the tiles stored it, its loads waited for those stores
// (the silu's gate|up loads were 30% of its samples in a prefill step). Rows are taken in chunks of
// about `chunk_target`, each chunk against every panel, so a chunk of x stays in the core's L2
// while the weights stream past it (a prefill step's x, megabytes, would otherwise be read from
// memory once per panel). The (chunk, panel) items go one at a time to whichever thread is free: a
// contiguous split gave one thread the short last chunk (128 rows: 96 against 32, the step a third
// slower). Each block of an item asks for its share of the panel of the thread's next item (a panel
// is a new stream of tens of kilobytes the hardware prefetchers reach only after its first misses,
// at each 4 KB page), line by line as it computes (Lookahead), or all of the panel at the item's
// start where the item has at most `burst_blocks` blocks. `parallel` off: the caller already runs
// one matmul per thread.
template <typename ThreadState = NoThreadState, typename Y, typename B, typename Compute>
void for_each_block(int64_t M, int64_t chunk_target, int64_t block_rows, int64_t N, const B *bias,
                    Y *y, int64_t ldy, bool parallel, const Panels &weights,
                    const Compute &compute, int64_t burst_blocks = 1) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t chunks = (M + chunk_target - 1) / chunk_target;
  // Equal chunks of whole blocks rather than full ones and a short remainder.
  const int64_t chunk_rows = ((M + chunks - 1) / chunks + block_rows - 1) / block_rows *
                             block_rows;
  // Each thread its own range of panels first (chunk by chunk), so that a core's L2 holds its
  // share of the weights and a chunk of x rather than all of the weights (AMX, 8192 rows,
  // standalone: 0-28% faster by shape; a wave of 64 x 128-token prefills 4-9% faster in the
  // model, float32 1-3%), and so that a decode's one chunk reads each core's weights as one
  // ascending stream rather than every other panel (standalone, the step's four matmuls of eight
  // layers: 64 rows float32 3-7% faster, bfloat16 on AMX 15-25%, one row float32 5-12%).
  const int64_t ranges = parallel ? std::min({int64_t{num_threads}, panels, kMaxRanges}) : 1;
  auto first_panel = [&](int64_t g) { return panels * g / ranges; };
  auto first_item = [&](int64_t g) { return chunks * first_panel(g); };  // of range g
  auto chunk_and_panel = [&](int64_t item) {  // -> {chunk, panel}
    int64_t g = 0;
    while (item >= first_item(g + 1)) ++g;
    const int64_t width = first_panel(g + 1) - first_panel(g), at = item - first_item(g);
    return std::pair<int64_t, int64_t>{at / width, first_panel(g) + at % width};
  };
  const bool streamed = streams(y, M, ldy);
  parallel_for_claiming_next_in_ranges<ThreadState>(ranges, first_item, [&](int64_t item,
                                                                            int64_t next) {
    const auto [chunk, p] = chunk_and_panel(item);
    const int64_t columns = std::min<int64_t>(kPanel, N - p * kPanel);
    const int64_t next_p = next >= 0 ? chunk_and_panel(next).second : -1;
    const int64_t next_panel = next_p != p ? next_p : -1;
    using Acc = Accumulator<Y>;
    const bool gated = weights.paired != 0;
    const int64_t width = gated ? 2 * kPanel : kPanel;  // of a scratch block
    alignas(64) Acc scratch[2][32 * 2 * kPanel];        // this block's and the previous one's
    struct Block {
      const Acc *c = nullptr;
      int64_t ldc = 0, rows = 0;
      Y *out = nullptr;
    } waiting;  // computed, not yet finished
    auto finish = [&](const Block &b) {
      if constexpr (std::is_same_v<Acc, float>) {  // else never paired (for_each_output_block)
        if (gated) return silu_rows(b.c, b.ldc, b.rows, b.out, ldy, streamed);
      }
      finish_rows(b.c, b.ldc, b.rows, b.out, ldy, columns, bias ? bias + p * kPanel : nullptr,
                  streamed);
    };
    const int64_t begin = chunk * chunk_rows, end = std::min(M, begin + chunk_rows);
    const int64_t blocks = (end - begin + block_rows - 1) / block_rows;
    for (int64_t i = begin; i < end; i += block_rows) {
      if (next_panel >= 0 && blocks <= burst_blocks) {
        if (i == begin) {  // a decode's item
          Lookahead whole_panel;
          weights.part(next_panel, 0, 1, whole_panel);
          whole_panel.flush();
        }
      } else if (next_panel >= 0) {
        lookahead().flush();  // what the previous block did not ask for
        weights.part(next_panel, (i - begin) / block_rows, blocks, lookahead());
      }
      const int64_t rows = std::min(block_rows, end - i);
      Y *out = y + i * ldy + p * kPanel;
      const bool direct = !gated && !streamed && std::is_same_v<Acc, Y> && columns == kPanel;
      Acc *c = direct ? reinterpret_cast<Acc *>(out) : scratch[(i - begin) / block_rows % 2];
      const int64_t ldc = direct ? ldy : width;
      compute(i, rows, p, c, ldc);
      if (gated) compute(i, rows, p + weights.paired, c + kPanel, ldc);
      if (waiting.c != nullptr) finish(waiting);
      waiting = {c, ldc, rows, out};
    }
    finish(waiting);
    if (streamed) _mm_sfence();  // the item's streamed stores are seen before the call returns
    if (blocks > burst_blocks) lookahead().flush();
  }, parallel);
}

// for_each_block over W's panels, or (`gated`: W a gate|up projection, N = 2I, I a multiple of
// 32) over y [M, I] = silu(gate) * up. The one place panels are paired: for_each_block finishes
// paired blocks with silu_rows, which only a float32 accumulator has.
template <typename ThreadState = NoThreadState, typename B, typename Y, typename Compute>
void for_each_output_block(bool gated, int64_t M, int64_t chunk_target, int64_t block_rows,
                           int64_t N, const B *bias, Y *y, int64_t ldy, bool parallel,
                           Panels weights, const Compute &compute, int64_t burst_blocks = 1) {
  static_assert(std::is_same_v<Accumulator<Y>, float>,
                "y may be gated, and gated blocks are finished in float32: exact int32 y goes "
                "through for_each_block");
  if (gated) weights.paired = N / 2 / kPanel;
  for_each_block<ThreadState>(M, chunk_target, block_rows, gated ? N / 2 : N, bias, y, ldy,
                              parallel, weights, compute, burst_blocks);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kTilePairs = 16;      // pairs of k (32 k) per tile step
// Rows of x per work item (its bfloat16 rows stay in L2; 512 x 1408 k: 1.4 MB). 256 read each
// thread's weights from L3 or memory twice as often: a wave of 7 x 128-token prefills 48.9-53.5 ->
// 46.0-48.2 ms (medians of 20, alternated three times); standalone 896 and 8192 rows 5-8% faster.
constexpr int64_t kAmxRowChunk = 512;
// Items of up to this many blocks (a decode's 33-64 rows) ask for the next panel at their start;
// larger ones spread it over their blocks' tile steps. Against the whole share at each block's
// start (standalone, 8 layers' four matmuls, medians of three alternated): 64 rows 308 -> 268 us,
// 128 rows 486 -> 439, 512 rows 1624 -> 1548; 16-32 rows unchanged.
constexpr int64_t kAmxBurstBlocks = 2;

// Tiles 0-3: c, rows 0-15 | 16-31 x columns 0-15 | 16-31; 4-5: 16 rows of x each; 6-7: the
// panel's columns 0-15 | 16-31. Every tile has rows of 64 bytes (16 float32, 32 bfloat16 or 16
// columns' pairs), 16 of them, or for a block of `block_rows` rows (1-32) tiles 0, 1 and 4 the
// block's first 16 rows or fewer and 2, 3 and 5 the rest. The configuration is each thread's own,
// loaded where it changes.
inline int64_t &configured_rows() {
  thread_local int64_t rows = 0;  // none
  return rows;
}

inline void configure_tiles(int64_t block_rows = 32) {
  if (configured_rows() == block_rows) return;
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  const int64_t top = std::min<int64_t>(block_rows, 16), bottom = block_rows - top;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  for (int t : {0, 1, 4}) config.rows[t] = static_cast<uint8_t>(top);
  for (int t : {2, 3, 5}) {
    config.rows[t] = static_cast<uint8_t>(bottom);
    config.bytes_per_row[t] = bottom > 0 ? 64 : 0;  // none: unconfigured
  }
  // GCC 12's _tile_loadconfig tells the compiler that ldtilecfg reads the first 8 of the 64
  // bytes, so it may drop the stores above: a test program built -O3 loaded a configuration of
  // no rows and died of SIGSEGV at the first tile load. The barrier makes every byte live.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
  configured_rows() = block_rows;
}

// c[0:16 T, 0:32] = (bias[0:32] +) a[0:16 T, 0:pairs] . panel[0:pairs, 32, 2], pairs a multiple
// of kTilePairs; a's rows lda pairs apart, c's rows ldc floats apart. Each tile step asks for an
// even part of this thread's Lookahead (the next panel's lines), and for no line of its own: x's
// chunk is in L2 and the panel arrives by the Lookahead, and asking for the x rows' and the
// panel's lines two steps ahead (64 prefetches a step, most of them L1 hits) took the tile
// loads' slots (standalone, 8 layers' four matmuls: 128 rows 499 -> 413 us a layer, 896 rows
// 2958 -> 2504; 16-64 rows unchanged or faster). The bias is the sums' starting value (a tile
// load of row stride 0): added to c after the tiles' stores, its loads waited for those stores
// (the model's 128-row q|k|v projection 183 -> 153 us).
template <int T>
void amx_block(const uint32_t *a, int64_t lda, const bf16 *panel, int64_t pairs, float *c,
               int64_t ldc, const float *bias) {
  if (bias != nullptr) {
    _tile_loadd(0, bias, 0);
    _tile_loadd(1, bias + 16, 0);
    if constexpr (T == 2) {
      _tile_loadd(2, bias, 0);
      _tile_loadd(3, bias + 16, 0);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (T == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  Lookahead ahead = lookahead();
  const int64_t tile_steps = pairs / kTilePairs;
  const int64_t asks_per_step = (ahead.lines() + tile_steps - 1) / tile_steps;
  for (int64_t p = 0; p < pairs; p += kTilePairs) {
    for (int64_t ask = 0; ask < asks_per_step; ++ask) ahead.ask();
    const bf16 *b = panel + p * 2 * kPanel;
    _tile_loadd(6, b, 2 * kPanel * sizeof(bf16));
    _tile_loadd(7, b + kPanel, 2 * kPanel * sizeof(bf16));
    _tile_loadd(4, a + p, lda * sizeof(uint32_t));
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (T == 2) {
      _tile_loadd(5, a + 16 * lda + p, lda * sizeof(uint32_t));
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  lookahead() = ahead;
  _tile_stored(0, c, ldc * sizeof(float));
  _tile_stored(1, c + 16, ldc * sizeof(float));
  if constexpr (T == 2) {
    _tile_stored(2, c + 16 * ldc, ldc * sizeof(float));
    _tile_stored(3, c + 16 * ldc + 16, ldc * sizeof(float));
  }
}

// A thread's tile configuration, for as long as it computes blocks.
struct TileState {
  TileState() { configure_tiles(); }
  ~TileState() {
    _tile_release();
    configured_rows() = 0;
  }
};

// matmul (below) with bfloat16 panels on AMX over x's rows as bfloat16 pairs of k (a [M, steps]):
// blocks of 32 rows (the last one the rest) x one panel, the k past the last whole tile step (K
// not a multiple of 32) by the vdpbf16ps blocks. A last block short of 32 and 16 rows has tiles
// of its own rows (configure_tiles), so that they read no row past x's and store into y itself:
// padded to whole tiles, with a zero-padded copy of its rows and its sums stored to a scratch
// block and copied, decodes of 8, 15, 17 and 24 rows took 150-158, 150-152, 203-207 and 217-223
// us a layer (standalone, 8 layers' four matmuls), against 131-132, 133-137, 154-162 and 167-176.
template <typename B, typename Y>
void matmul_amx(const uint32_t *a, int64_t M, int64_t steps, const bf16 *packed, const B *bias,
                int64_t N, Y *y, int64_t ldy, bool parallel, bool gated) {
  const int64_t tiled = steps / kTilePairs * kTilePairs;
  const Panels panels{packed, steps * 2 * kPanel * static_cast<int64_t>(sizeof(bf16))};
  // A float32 bias goes into the tiles (amx_block) where they run, zero-padded to whole panels
  // (a tile reads 32 columns); else finish_rows adds it.
  const float *tile_bias = nullptr;
  if constexpr (std::is_same_v<B, float>) {
    if (bias != nullptr && tiled > 0 && !gated) {
      thread_local Buffer<float> padded_bias;
      padded_bias.assign((N + kPanel - 1) / kPanel * kPanel, 0.0f);
      std::copy(bias, bias + N, padded_bias.begin());
      tile_bias = padded_bias.data();
    }
  }
  const B *rows_bias = tile_bias != nullptr ? nullptr : bias;
  for_each_output_block<TileState>(gated, M, kAmxRowChunk, 32, N, rows_bias, y, ldy, parallel,
                                   panels,
                            [&](int64_t i, int64_t rows, int64_t p, float *c, int64_t ldc) {
    const bf16 *panel = panels.panel<bf16>(p);
    if (tiled > 0) {
      const float *panel_bias = tile_bias != nullptr ? tile_bias + p * kPanel : nullptr;
      configure_tiles(rows == 16 ? 32 : rows);  // 16 rows: the whole tiles 0, 1 and 4
      if (rows > 16)
        amx_block<2>(a + i * steps, steps, panel, tiled, c, ldc, panel_bias);
      else
        amx_block<1>(a + i * steps, steps, panel, tiled, c, ldc, panel_bias);
    }
    for (int64_t r = 0; tiled < steps && r < rows; r += kRows)
      block_n(static_cast<int>(std::min<int64_t>(kRows, rows - r)),
              a + (i + r) * steps + tiled, steps, panel + tiled * 2 * kPanel, steps - tiled,
              c + r * ldc, ldc, tiled > 0);
  }, kAmxBurstBlocks);
}
#endif

// Whether a bfloat16 matmul of M rows runs on AMX tiles, which take x's rows as bfloat16.
inline bool amx_takes(int64_t M) { return M > kAmxMinRows && amx_wanted && amx_available(); }

// y [M, N] float32 or bfloat16 (row stride ldy) = x [M, K] float32 . packed W (+ bias), in blocks
// of kRows rows (widened bfloat16: kWidenedRows; M up to that in one block) and chunks of about
// kRowChunk rows (whole blocks);
// `gated` (N = 2I, I a multiple of 32): y [M, I] = silu(gate) * up of the gate|up projection W.
constexpr int64_t kRowChunk = 96;

template <typename W, typename B, typename Y>
void matmul(const float *x, int64_t M, int64_t K, const W *packed, const B *bias, int64_t N,
            Y *y, int64_t ldy, bool parallel = true, bool gated = false) {
  if (M == 0) return;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same_v<W, bf16>) {
    if (amx_takes(M)) {
      const int64_t steps = (K + 1) / 2;
      const Scratch<Buffer<uint32_t>> step_buffer;
      const uint32_t *a = as_steps<bf16>(x, M, K, steps, *step_buffer, parallel);
      return matmul_amx(a, M, steps, packed, bias, N, y, ldy, parallel, gated);
    }
  }
#endif
  constexpr int64_t per_step = PanelFormat<W>::kPerStep;
  const int64_t steps = (K + per_step - 1) / per_step, depth = kDepth / per_step;
  const Panels panels{packed, steps * per_step * kPanel * static_cast<int64_t>(sizeof(W))};
  // a: x's rows as the block kernel reads them, lda apart, a_step elements per step of k; blocks
  // of as many rows as block_n takes for them
  auto run = [&](const auto *a, int64_t lda, int64_t a_step) {
    using A = std::remove_cv_t<std::remove_pointer_t<decltype(a)>>;
    const int64_t block_rows = block_rows_for<W, A>();
    for_each_output_block(gated, M, kRowChunk, std::min(M, block_rows), N, bias, y,
                          ldy, parallel, panels,
                   [&](int64_t i, int64_t rows, int64_t p, float *c, int64_t ldc) {
      const W *panel = panels.panel<W>(p);
      for (int64_t s0 = 0; s0 < steps; s0 += depth)
        block_n(static_cast<int>(rows), a + i * lda + s0 * a_step, lda,
                panel + s0 * per_step * kPanel, std::min(depth, steps - s0), c, ldc, s0 > 0);
    });
  };
  if constexpr (std::is_same_v<W, bf16>) {
    if (widen_bf16()) {
      if (K % 2 == 0) return run(x, K, 2);
      const Scratch<Buffer<float>> even_rows;  // an odd K's rows padded with a zero k
      even_rows->assign(M * (K + 1), 0.0f);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(even_rows->data() + m * (K + 1), x + m * K, K * sizeof(float));
      return run(even_rows->data(), K + 1, 2);
    }
  }
  const Scratch<Buffer<uint32_t>> step_buffer;
  run(as_steps<W>(x, M, K, steps, *step_buffer, parallel), steps, 1);
}

// The same with x's rows already rounded to bfloat16 (the decoder layer's intermediates where
// AMX takes the step): the tiles read them as they are (K even), other kernels as float32.
template <typename B, typename Y>
void matmul(const bf16 *x, int64_t M, int64_t K, const bf16 *packed, const B *bias, int64_t N,
            Y *y, int64_t ldy, bool parallel = true, bool gated = false) {
  if (M == 0) return;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_takes(M) && K % 2 == 0) {
    return matmul_amx(reinterpret_cast<const uint32_t *>(x), M, K / 2, packed, bias, N, y, ldy,
                      parallel, gated);
  }
#endif
  const Scratch<Buffer<float>> widened;
  matmul(as_float(x, M * K, *widened), M, K, packed, bias, N, y, ldy, parallel, gated);
}

// silu(gate) * up, gate|up the two halves of each row of y [M, 2I] -> out [M, I], a vector at
// a time (the scalar loop was not vectorised: 8% of a prefill step).
template <typename T>
void silu_and_mul(const float *y, int64_t M, int64_t I, T *out) {
  parallel_for(M, [&](int64_t m) {
    const float *gate = y + m * 2 * I, *up = gate + I;
    T *o = out + m * I;
    int64_t j = 0;
    for (; j + kLanes <= I; j += kLanes)
      store_lanes(o + j, silu_times(load_lanes(gate + j), load_lanes(up + j)));
    for (; j < I; ++j) from_float(silu_times(gate[j], up[j]), o + j);
  }, M * I >= kParallelElements);
}

// The MoE steps shared by the float and W8A8 expert kernels. The copies c = t * K + k (token t,
// choice k) routed to this rank's experts, grouped by expert (a counting sort): expert e's copies
// are order[start[e] .. start[e + 1]). Ids outside [0, experts) belong to other ranks.
inline void group_by_expert(const int32_t *ids, int64_t copies, int64_t experts,
                            std::vector<int64_t> &start, std::vector<int64_t> &order) {
  start.assign(experts + 1, 0);
  order.resize(copies);
  for (int64_t c = 0; c < copies; ++c)
    if (ids[c] >= 0 && ids[c] < experts) ++start[ids[c] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t c = 0; c < copies; ++c)
    if (ids[c] >= 0 && ids[c] < experts) order[fill[ids[c]]++] = c;
}

// Copy c = order[j] gets weights[c] * down[j] (its expert's output rows, [n, D]) ...
inline void weigh_copies(const float *down, int64_t n, int64_t D, const int64_t *order,
                         const float *weights, float *copies) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t c = order[j];
    for (int64_t d = 0; d < D; ++d) copies[c * D + d] = weights[c] * down[j * D + d];
  }
}

// ... and out [tokens, D] is the sum of each token's K copies, in k order.
template <typename T>
void sum_copies(const float *copies, int64_t tokens, int64_t K, int64_t D, T *out) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t d = 0; d < D; ++d) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += copies[(t * K + k) * D + d];
      from_float(sum, out + t * D + d);
    }
  }
}

}  // namespace vllm_ms
