// Shared by the plugin's CPU kernels: thread count, float16 / bfloat16 conversions, float vectors
// of one register (GCC vector extensions: 16 lanes in a zmm with AVX-512, 8 in a ymm with AVX2)
// and exp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <vector>

#include "parallel.h"

namespace vllm_ms {

// A kernel's entry point, as MindSpore calls it; kernels that compose others call them through it.
using Kernel = int (*)(int, void **, int *, int64_t **, const char **, void *, void *);

// One argument of a kernel call: data, shape, dtype.
struct Arg {
  void *data;
  std::vector<int64_t> shape;
  const char *dtype;
};

inline int call(Kernel kernel, const std::vector<Arg> &args) {
  std::vector<void *> params;
  std::vector<int> ndims;
  std::vector<std::vector<int64_t>> shape_storage;
  std::vector<int64_t *> shapes;
  std::vector<const char *> dtypes;
  for (const Arg &arg : args) {
    params.push_back(arg.data);
    ndims.push_back(static_cast<int>(arg.shape.size()));
    shape_storage.push_back(arg.shape);
    dtypes.push_back(arg.dtype);
  }
  for (auto &shape : shape_storage) shapes.push_back(shape.data());
  return kernel(static_cast<int>(args.size()), params.data(), ndims.data(), shapes.data(),
                dtypes.data(), nullptr, nullptr);
}

// The number of elements of a kernel input of `ndims` dimensions (an absent optional one: 0).
inline int64_t elements(int ndims, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndims; ++i) n *= shape[i];
  return n;
}

// Memory whose first byte starts a cache line, for the kernels' buffers: an AMX tile's rows and
// a zmm's loads and stores are 64 bytes, and where a buffer starts 16 bytes into a line (glibc's
// malloc) each of them touches two lines. The decoder layer's intermediates in such buffers made
// its matmuls 10-20% slower (a 7 x 128-token prefill 9%). MindSpore's own tensors (weights,
// caches, graph outputs) are 16-byte aligned too; those the kernels cannot choose.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U> &) {}
  T *allocate(size_t n) {
    void *p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T *>(p);
  }
  void deallocate(T *p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAligned<U> &) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U> &) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, LineAligned<T>>;

// Scratch memory of a kernel's calling thread (a Buffer, or a struct of them; they only grow), one
// set for each call in flight, kept from call to call. MindSpore runs a graph's kernels on the
// Python thread or on one of its actor threads, a new one now and then: thread_local buffers were
// allocated, and their pages first touched, once per thread (the decoder layer's, 80 MB at 8192
// bfloat16 tokens: the offline benchmark's first two 8192-token steps 0.71 and 0.60 s, later ones
// 0.39 s).
template <typename T>
class Scratch {
 public:
  Scratch() {
    std::lock_guard<std::mutex> lock(mutex());
    if (idle().empty()) {
      held_ = std::make_unique<T>();
    } else {
      held_ = std::move(idle().back());
      idle().pop_back();
    }
  }
  ~Scratch() {
    std::lock_guard<std::mutex> lock(mutex());
    idle().push_back(std::move(held_));
  }
  Scratch(const Scratch &) = delete;
  Scratch &operator=(const Scratch &) = delete;
  T *operator->() const { return held_.get(); }
  T &operator*() const { return *held_; }

 private:
  static std::mutex &mutex() {
    static std::mutex instance;
    return instance;
  }
  // Never destroyed: a call may still hold a set while the process exits.
  static std::vector<std::unique_ptr<T>> &idle() {
    static auto *instance = new std::vector<std::unique_ptr<T>>;
    return *instance;
  }
  std::unique_ptr<T> held_;
};

// Elementwise kernels (norms, rotary, silu * up) split their rows over the threads from this many
// values on (a 256-token step of a 512-wide model): waking the other thread costs more than a
// 64-token decode step's norm takes (`perf` of that step with 16K here: 30% in futex wake-ups).
constexpr int64_t kParallelElements = 131072;

using half = uint16_t;
// bfloat16: the upper half of a float32's bits (a struct, so overloads tell it from half).
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(half x) { return _cvtsh_ss(x); }
inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void from_float(float x, float *out) { *out = x; }
inline void from_float(float x, half *out) { *out = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
// Rounded to nearest, ties to even (as torch and numpy round to bfloat16; finite x).
inline void from_float(float x, bf16 *out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fff + ((bits >> 16) & 1);
  out->bits = static_cast<uint16_t>(bits >> 16);
}

// One vector register of floats, and how many registers there are for a kernel's inner loop.
// 16-lane vectors on AVX2 (a ymm pair each) made GCC keep the matmul's accumulators on the
// stack: 25-37x slower, the engine 24x, on an AVX2-only AMD EPYC.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVectorRegisters = 32;
#else
constexpr int kLanes = 8;
constexpr int kVectorRegisters = 16;
#endif
typedef float lanes __attribute__((vector_size(4 * kLanes)));

inline lanes load_lanes(const float *p) {
  lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline lanes load_lanes(const half *p) {
  lanes v;
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
#else
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#endif
  std::memcpy(&v, &x, sizeof(v));
  return v;
}
// bfloat16: the float32's upper 16 bits, widened / rounded to nearest even (as from_float).
typedef uint16_t bits16_lanes __attribute__((vector_size(2 * kLanes)));
typedef uint32_t bits32_lanes __attribute__((vector_size(4 * kLanes)));
inline lanes load_lanes(const bf16 *p) {
  lanes v;
#if defined(__AVX512F__)
  // One widening load and a shift: GCC compiles the vector-extension conversion below into
  // ymm halves (six instructions), the attention loops' main cost after their FMAs.
  const __m512i bits = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16);
  std::memcpy(&v, &bits, sizeof(v));
#else
  bits16_lanes h;
  std::memcpy(&h, p, sizeof(h));
  const bits32_lanes bits = __builtin_convertvector(h, bits32_lanes) << 16;
  std::memcpy(&v, &bits, sizeof(v));
#endif
  return v;
}
inline void store_lanes(float *p, lanes v) { std::memcpy(p, &v, sizeof(v)); }
// A non-temporal store (past the caches, no read of the line first) of a vector to p, aligned to
// its size.
inline void stream_lanes(float *p, lanes v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
#else
  _mm256_stream_ps(p, reinterpret_cast<__m256>(v));
#endif
}
// store_lanes, or stream_lanes where `streamed` (float32 only).
template <typename T>
inline void put_lanes(T *p, lanes v, bool streamed) {
  if constexpr (std::is_same_v<T, float>) {
    if (streamed) return stream_lanes(p, v);
  }
  store_lanes(p, v);
}
inline void store_lanes(half *p, lanes v) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &v, sizeof(x));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  __m256 x;
  std::memcpy(&x, &v, sizeof(x));
  _mm_storeu_si128(reinterpret_cast<__m128i *>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
}
inline void store_lanes(bf16 *p, lanes v) {
  bits32_lanes bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7fff + ((bits >> 16) & 1);
  const bits16_lanes h = __builtin_convertvector(bits >> 16, bits16_lanes);
  std::memcpy(p, &h, sizeof(h));
}

// The lanes combined pairwise (log2 kLanes dependent steps, not kLanes - 1): the softmax takes a
// sum and a max a row of scores.
template <typename Op>
inline float combine_lanes(lanes v, Op op) {
  float t[kLanes];
  std::memcpy(t, &v, sizeof(t));
  for (int half = kLanes / 2; half > 0; half /= 2)
    for (int i = 0; i < half; ++i) t[i] = op(t[i], t[i + half]);
  return t[0];
}

inline float horizontal_sum(lanes v) {
  return combine_lanes(v, [](float a, float b) { return a + b; });
}

inline float horizontal_max(lanes v) {
  return combine_lanes(v, [](float a, float b) { return std::max(a, b); });
}

// Asks for the cache lines of [start, start + bytes) into L2 (asking for L1 evicted lines still
// in use and measured slower).
inline void prefetch(const void *start, int64_t bytes) {
  const char *p = static_cast<const char *>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 1);
}

// Lines a kernel's loop asks for one or two at a time as it computes: the data its next part
// will read (the next weight panel, the next block's values, the next request's keys). Asked
// for in one burst ahead of the loop, 64 lines or more filled the core's miss buffers and the
// loop's own loads waited behind them (matmuls of 64-128 rows 12-23% longer, a decode step's
// attention 7-13%, standalone). The pair's range (the up panel of a gate panel) follows the
// first.
struct Lookahead {
  const char *next = nullptr, *end = nullptr, *next_pair = nullptr, *end_pair = nullptr;

  void ask() {
    if (next < end) {
      __builtin_prefetch(next, 0, 1);
      next += 64;
    } else if (next_pair < end_pair) {
      __builtin_prefetch(next_pair, 0, 1);
      next_pair += 64;
    }
  }
  // Lines not yet asked for.
  int64_t lines() const { return ((end - next) + (end_pair - next_pair)) / 64; }
  // The rest at once (a loop shorter than its share), and none left.
  void flush() {
    if (next < end) prefetch(next, end - next);
    if (next_pair < end_pair) prefetch(next_pair, end_pair - next_pair);
    *this = {};
  }
};

// This thread's lines to ask for; a kernel keeps a copy in registers for its loop.
inline Lookahead &lookahead() {
  thread_local Lookahead lines;
  return lines;
}

// dst[0:n] = src[0:n], float16 / bfloat16 <-> float32 a vector at a time (one value at a time made
// a float16 batch step slower than a float32 one).
template <typename S, typename D>
inline void convert(const S *src, D *dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_lanes(dst + i, load_lanes(src + i));
  for (; i < n; ++i) from_float(to_float(src[i]), dst + i);
}

// x [n] as float32: x itself, or its conversion in `buffer`.
template <typename T>
const float *as_float(const T *x, int64_t n, Buffer<float> &buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    buffer.resize(n);
    convert(x, buffer.data(), n);
    return buffer.data();
  }
}

// The rotary embedding of a head: its first `rotary` channels (0: none) rotated by its token's
// position, in float32. cos_sin [max_position, rotary] holds cos in its first half and sin in
// its second; neox: the halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), else the pairs
// (x[2i], x[2i + 1]) (GPT-J / "interleaved").
struct Rotary {
  const int32_t *positions = nullptr;  // [T]
  const float *cos_sin = nullptr;
  int64_t rotary = 0, max_position = 0;
  bool neox = true;

  // The rotated channels of token t's head x into y (which may be x).
  template <typename In, typename Out>
  void apply(const In *x, Out *y, int64_t t) const {
    const int64_t half = rotary / 2;
    if (half == 0) return;
    const int64_t position =
        std::min<int64_t>(std::max<int64_t>(positions[t], 0), max_position - 1);
    const float *cos = cos_sin + position * rotary, *sin = cos + half;
    int64_t i = 0;
    if (neox) {  // the halves a vector at a time (scalar: 4% of a prefill step on AMX)
      for (; i + kLanes <= half; i += kLanes) {
        const lanes x1 = load_lanes(x + i), x2 = load_lanes(x + i + half);
        const lanes c = load_lanes(cos + i), s = load_lanes(sin + i);
        store_lanes(y + i, x1 * c - x2 * s);
        store_lanes(y + i + half, x2 * c + x1 * s);
      }
    }
    for (; i < half; ++i) {
      const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
      const float x1 = to_float(x[a]), x2 = to_float(x[b]);
      from_float(x1 * cos[i] - x2 * sin[i], y + a);
      from_float(x2 * cos[i] + x1 * sin[i], y + b);
    }
  }
};

// 2^-k exp(x) for k = round(x / ln 2): Cephes' single-precision polynomial in r = x - k ln 2
// (float or lanes).
template <typename T>
inline T exp_polynomial(T x, T k) {
  const T r = x - k * 0.693359375f + k * 2.12194440e-4f;
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) with Cephes' single-precision polynomial (about 1 ulp) on x clamped to [-87, 88],
// written so the compiler vectorises it.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  float e = exp_polynomial(x, k);
  int32_t bits;
  std::memcpy(&bits, &e, sizeof(bits));
  bits += static_cast<int32_t>(k) << 23;
  std::memcpy(&e, &bits, sizeof(bits));
  return e;
}

// fast_exp on a vector at once (the same polynomial and clamping).
typedef int32_t int_lanes __attribute__((vector_size(4 * kLanes)));

inline lanes fast_exp(lanes x) {
  const lanes lo = lanes{} - 87.0f, hi = lanes{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const lanes y = x * 1.44269504088896341f + 0.5f;
#if defined(__AVX512F__)
  // The same k and result as below (checked on every float but NaN) in two instructions where the
  // floor and the exponent's integer add take several: silu * up of 128 x 1408 values 92 -> 79 us.
  const lanes k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_polynomial(x, k), k);
#else
  lanes k = __builtin_convertvector(__builtin_convertvector(y, int_lanes), lanes);
  k += __builtin_convertvector(k > y, lanes);  // truncation -> floor: -1 where k > y
  lanes e = exp_polynomial(x, k);
  int_lanes bits;
  std::memcpy(&bits, &e, sizeof(bits));
  bits += __builtin_convertvector(k, int_lanes) << 23;
  std::memcpy(&e, &bits, sizeof(bits));
  return e;
#endif
}

}  // namespace vllm_ms
