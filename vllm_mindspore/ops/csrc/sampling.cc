// Sampling for vLLM's sampler on the host. Random: the exponential race over each row of
// probabilities, with token j's Exp(1) noise made from SplitMix64 of (row seed, j) on the fly —
// one pass, one logarithm per token, no [rows, vocab] noise tensor. torch's exponential_() fills
// 8 x 8000 values in ~1.2 ms on this project's CPUs, a tenth of a decode step. Greedy: the argmax
// of each row, a vector at a time (torch's argmax on the worker's one torch thread: 0.5 ms for
// 64 x 8000 logits), for vLLM's sampler and as an operator of the logits head's graph. Its rows
// are split between the threads from 131072 logits: in a graph, on logits its previous operator
// had just written on both threads, one thread took 0.1-0.2 ms more for 64 x 8000 than two.

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

inline u64x8 splitmix64(u64x8 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// log(x) for normal x > 0, within ~1e-7: x = 2^e m with m in [0.71, 1.42), log m = 2 atanh(t),
// t = (m - 1) / (m + 1) in [-0.172, 0.172], four terms of the series.
inline f32x8 log_lanes(f32x8 x) {
  i32x8 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  i32x8 e = ((bits >> 23) & 0xff) - 127;
  bits = (bits & 0x7fffff) | 0x3f800000;
  f32x8 m;
  std::memcpy(&m, &bits, sizeof(m));
  const i32x8 high = m > 1.41421356f;  // -1 where m > sqrt(2): m / 2, e + 1
  m = high ? m * 0.5f : m;
  e -= high;
  const f32x8 t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
  const f32x8 series = ((t2 * (1.0f / 7) + 1.0f / 5) * t2 + 1.0f / 3) * t2 + 1.0f;
  return __builtin_convertvector(e, f32x8) * 0.693147181f + 2.0f * t * series;
}

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;  // SplitMix64's increment

// out[r] = the first j where row r of logits (rows `stride` floats apart) takes its maximum, as
// torch.argmax: the first NaN if the row has one, 0 for a row of -inf.
template <typename Index>
void greedy_argmax(const float *logits, int64_t rows, int64_t vocab, int64_t stride, Index *out) {
  vllm_ms::parallel_for(rows, [&](int64_t r) {
    const float *row = logits + r * stride;
    using vllm_ms::int_lanes, vllm_ms::kLanes, vllm_ms::lanes;
    int_lanes lane;
    for (int i = 0; i < kLanes; ++i) lane[i] = i;
    lanes best = lanes{} - INFINITY, x;
    int_lanes best_index = lane, nan = {};
    int64_t j = 0;
    for (; j + kLanes <= vocab; j += kLanes) {
      std::memcpy(&x, row + j, sizeof(x));
      const int_lanes better = x > best;  // strict: a lane keeps its first maximum
      best = better ? x : best;
      best_index = better ? lane + static_cast<int32_t>(j) : best_index;
      nan |= x != x;
    }
    float top = best[0];
    int64_t top_index = best_index[0];
    bool has_nan = nan[0] != 0;
    for (int i = 1; i < kLanes; ++i) {
      has_nan |= nan[i] != 0;
      if (best[i] > top || (best[i] == top && best_index[i] < top_index)) {
        top = best[i];
        top_index = best_index[i];
      }
    }
    for (; j < vocab; ++j) {
      has_nan |= row[j] != row[j];
      if (row[j] > top) {
        top = row[j];
        top_index = j;
      }
    }
    if (has_nan) top_index = std::find_if(row, row + vocab, [](float v) { return v != v; }) - row;
    out[r] = static_cast<Index>(top_index);
  }, rows * vocab >= vllm_ms::kParallelElements);
}

}  // namespace

extern "C" {

// out[r] = argmax_j probs[r, j] / E(r, j), E(r, j) = -log(u) with u uniform on (0, 1) from the top
// 24 bits of SplitMix64(seeds[r] + (j + 1) * gamma). E is Exp(1), so the argmax is a sample of
// probs[r] (as vLLM's random_sample: probs / exponential noise, argmax); a token of probability
// 0 is never drawn (unless the whole row is 0: then token 0). Eight tokens at a time.
void ExponentialRaceArgmax(const float *probs, int64_t rows, int64_t vocab,
                           const int64_t *seeds, int64_t *out) {
  vllm_ms::parallel_for(rows, [&](int64_t r) {
    const float *row = probs + r * vocab;
    const uint64_t seed = static_cast<uint64_t>(seeds[r]);
    f32x8 best = {};
    i32x8 best_index = {};
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const u64x8 lane64 = {1, 2, 3, 4, 5, 6, 7, 8};
    f32x8 p = {};
    for (int64_t j = 0; j < vocab; j += 8) {
      const int64_t n = std::min<int64_t>(8, vocab - j);
      if (n == 8) {
        std::memcpy(&p, row + j, sizeof(p));
      } else {
        p = f32x8{};
        std::memcpy(&p, row + j, n * sizeof(float));
      }
      const u64x8 bits = splitmix64(seed + (static_cast<uint64_t>(j) + lane64) * kGamma);
      // Through int32 (exact below 2^24): AVX2 has no 64-bit integer to float conversion.
      const f32x8 u = (__builtin_convertvector(__builtin_convertvector(bits >> 40, i32x8), f32x8) +
                       0.5f) * (1.0f / 16777216.0f);
      const f32x8 score = p / -log_lanes(u);
      const i32x8 better = score > best;
      best = better ? score : best;
      best_index = better ? lane + static_cast<int32_t>(j) : best_index;
    }
    float top = 0.0f;
    int64_t top_index = 0;
    for (int i = 0; i < 8; ++i) {
      if (best[i] > top || (best[i] == top && best[i] > 0.0f && best_index[i] < top_index)) {
        top = best[i];
        top_index = best_index[i];
      }
    }
    out[r] = top_index;
  }, rows * vocab >= 4 * vllm_ms::kParallelElements);
}

// vLLM's sampler (through ctypes): logits [rows, vocab] float32 -> out [rows] int64.
void GreedyArgmax(const float *logits, int64_t rows, int64_t vocab, int64_t stride,
                  int64_t *out) {
  greedy_argmax(logits, rows, vocab, stride, out);
}

// The logits head's graph (MindSpore AOT op): logits [N, vocab] float32 -> tokens [N] int32.
int GreedyTokens(int nparam, void **params, int *ndims, int64_t **shapes, const char **,
                 void *, void *) {
  if (nparam != 2 || ndims[0] != 2) return 1;
  greedy_argmax(static_cast<const float *>(params[0]), shapes[0][0], shapes[0][1], shapes[0][1],
                static_cast<int32_t *>(params[1]));
  return 0;
}

}  // extern "C"
