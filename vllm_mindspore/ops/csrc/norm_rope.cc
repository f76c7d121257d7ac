// CPU kernels behind vllm_mindspore.ops.norm and ops.rotary, called by MindSpore as
// `ops.Custom(func_type="aot")` operators. Each replaces a chain of 6-12 small MindSpore ops
// (each with its own dispatch and intermediate copy) by one pass over the rows.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

using namespace vllm_ms;

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight[r % weight_rows], in float32, for rows of
// `size` values; rows_per_token rows of y per token, read from the start of the token's row of
// x (token stride `x_stride`). With a residual: x + residual is normalised and also returned.
// y is in x's dtype, or bfloat16 under float32 x (rows for the next matmul's AMX tiles).
// A vector at a time: the scalar sum of squares was a chain of dependent adds the compiler may
// not reorder (3% of a prefill step, 8 x 128 tokens).
template <typename T, typename Y>
void rms_norm(const T *x, int64_t x_stride, const T *residual, const T *weight, int64_t rows,
              int64_t rows_per_token, int64_t size, int64_t weight_rows, float eps, Y *y, T *sum) {
  parallel_for(rows, [&](int64_t r) {
    thread_local Buffer<float> buffer;
    const T *xr = x + (r / rows_per_token) * x_stride + (r % rows_per_token) * size;
    const float *v;  // the row (+ residual) in float32
    if (!residual) {
      v = as_float(xr, size, buffer);
    } else {
      buffer.resize(size);
      const T *res = residual + r * size;
      int64_t i = 0;
      for (; i + kLanes <= size; i += kLanes)
        store_lanes(buffer.data() + i, load_lanes(xr + i) + load_lanes(res + i));
      for (; i < size; ++i) buffer[i] = to_float(xr[i]) + to_float(res[i]);
      v = buffer.data();
      convert(v, sum + r * size, size);
    }
    lanes squares{};
    int64_t i = 0;
    for (; i + kLanes <= size; i += kLanes) {
      const lanes vi = load_lanes(v + i);
      squares += vi * vi;
    }
    float total = horizontal_sum(squares);
    for (; i < size; ++i) total += v[i] * v[i];
    const float scale = 1.0f / std::sqrt(total / static_cast<float>(size) + eps);
    const T *w = weight + (r % weight_rows) * size;
    Y *out = y + r * size;
    for (i = 0; i + kLanes <= size; i += kLanes)
      store_lanes(out + i, load_lanes(v + i) * scale * load_lanes(w + i));
    for (; i < size; ++i) from_float(v[i] * scale * to_float(w[i]), out + i);
  }, rows * size >= kParallelElements);
}

// y [T, heads, D]: each head rotated by `rot` (see Rotary), the heads read from the start of the
// token's row of x (token stride `x_stride`).
template <typename T>
void rotary(const T *x, int64_t x_stride, const Rotary &rot, int64_t tokens, int64_t heads,
            int64_t D, T *y) {
  parallel_for(tokens, [&](int64_t t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T *in = x + t * x_stride + h * D;
      T *out = y + (t * heads + h) * D;
      rot.apply(in, out, t);
      if (rot.rotary < D)
        std::memcpy(out + rot.rotary, in + rot.rotary, (D - rot.rotary) * sizeof(T));
    }
  }, tokens * heads * rot.rotary >= kParallelElements);
}

bool is_half(const char *dtype) { return std::strcmp(dtype, "float16") == 0; }


// The output's shape says what is read: its first dimension is the tokens, its last the
// normalised (rotated) size, and each token's values are taken from the start of its row of
// the input, which may be wider (q and k heads at the front of a fused q|k|v row).
struct Rows {
  int64_t tokens, per_token, size, x_stride;
};

Rows rows_of(int64_t **shapes, const int *ndims, int x, int y) {
  int64_t per_token = 1, x_stride = 1;
  for (int i = 1; i < ndims[y] - 1; ++i) per_token *= shapes[y][i];
  for (int i = 1; i < ndims[x]; ++i) x_stride *= shapes[x][i];
  return {shapes[y][0], per_token, shapes[y][ndims[y] - 1], x_stride};
}

template <typename T, typename Y = T>
int norm(void **params, int64_t **shapes, int *ndims, bool with_residual) {
  const int w = with_residual ? 2 : 1;
  const Rows rows = rows_of(shapes, ndims, 0, w + 2);
  if (rows.x_stride < rows.per_token * rows.size) return 1;
  const int64_t weight_rows = ndims[w] == 2 ? shapes[w][0] : 1;  // per-head weights
  rms_norm(static_cast<const T *>(params[0]), rows.x_stride,
           with_residual ? static_cast<const T *>(params[1]) : nullptr,
           static_cast<const T *>(params[w]), rows.tokens * rows.per_token, rows.per_token,
           rows.size, weight_rows, *static_cast<const float *>(params[w + 1]),
           static_cast<Y *>(params[w + 2]),
           with_residual ? static_cast<T *>(params[w + 3]) : nullptr);
  return 0;
}

// A norm's kernel for x's and y's dtypes: both float32, both float16, or float32 x and bfloat16
// y (params[y]).
int norm_of(void **params, int64_t **shapes, int *ndims, const char **dtypes, bool residual) {
  const char *y = dtypes[residual ? 4 : 3];
  if (is_half(dtypes[0])) return norm<half>(params, shapes, ndims, residual);
  if (std::strcmp(y, "bfloat16") == 0) return norm<float, bf16>(params, shapes, ndims, residual);
  return norm<float>(params, shapes, ndims, residual);
}

template <typename T>
int rope(void **params, int64_t **shapes, int *ndims, bool neox) {
  const Rows rows = rows_of(shapes, ndims, 0, 3);
  if (ndims[3] != 3 || rows.x_stride < rows.per_token * rows.size) return 1;
  const Rotary rot{static_cast<const int32_t *>(params[1]), static_cast<const float *>(params[2]),
                   shapes[2][1], shapes[2][0], neox};
  rotary(static_cast<const T *>(params[0]), rows.x_stride, rot, rows.tokens, rows.per_token,
         rows.size, static_cast<T *>(params[3]));
  return 0;
}

}  // namespace

extern "C" {

// x [T, ...], weight [H] (or [heads, H]), eps [1] float32 -> y [T, ..., H] (see Rows)
int RmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
            void *) {
  return nparam == 4 ? norm_of(params, shapes, ndims, dtypes, false) : 1;
}

// x [T, H], residual [T, H], weight [H], eps [1] float32 -> (y = norm(x + residual), x + residual)
int AddRmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
               void *, void *) {
  return nparam == 6 ? norm_of(params, shapes, ndims, dtypes, true) : 1;
}

// x [T, ...], positions [T] int32, cos_sin [max_position, rotary] float32 -> y [T, heads, D]
// (see Rows)
int RopeNeox(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
             void *, void *) {
  if (nparam != 4) return 1;
  return is_half(dtypes[0]) ? rope<half>(params, shapes, ndims, true)
                            : rope<float>(params, shapes, ndims, true);
}

int RopeInterleaved(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    void *, void *) {
  if (nparam != 4) return 1;
  return is_half(dtypes[0]) ? rope<half>(params, shapes, ndims, false)
                            : rope<float>(params, shapes, ndims, false);
}

}  // extern "C"
