// CPU kernels behind vllm_mindspore.ops.attention / ops.mla, called by MindSpore as
// `ops.Custom(func_type="aot")` operators inside the model graph.
//
// One call does one attention layer of a packed step: it writes this step's keys/values into
// the paged cache, then attends every query token over its request's cached context (earlier
// chunks, prefix-cache hits and this step's tokens alike), causally. Any mix of prefill chunks
// and decodes is handled without padding: the work is exactly sum over tokens of (position + 1)
// keys. Shapes depend only on the step's token count T and the fixed request capacity B.
//
// The cache is in the activations' dtype (float32 or float16), or bfloat16 under float32
// activations (--dtype bfloat16 on CPU): values are rounded as they are written and widened to
// float32 as the loops below load them.
// Cache layouts (per block of `bs` slots, chosen for the loops below):
//   MHA key   [num_blocks, KVH, D, bs]   keys transposed in a block: q.K over a block is bs-wide
//                                        FMAs
//   MHA value [num_blocks, KVH, bs, Dv]
//   MLA       [num_blocks, L, bs]        one latent "head" per slot, L = kv_lora_rank + rope dim;
//                                        its first Dv channels are the values
// Step metadata (int32): slot_mapping [T] (-1: padding token, not written), block_tables [B, MB],
// seq_lens [B] (context + this step's tokens), q_lens [B] (this step's tokens; 0: unused row).
// Tokens are packed request after request in the order of the rows.
//
// The MHA kernel may also apply the rotary embedding (RotaryPagedAttention*): each key as it is
// written to the cache and each query as it is loaded, so q|k needs no pass of its own (a kernel
// launch and a write and read of every q and k head, each layer and step).


#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"
#include "gemm.h"  // AMX: amx_wanted, amx_available, TileState

extern "C" int RmsNorm(int, void **, int *, int64_t **, const char **, void *, void *);

namespace {

using namespace vllm_ms;

struct Shape {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, v_head_dim, block_size;
  int64_t num_rows, max_blocks;  // block table: [num_rows, max_blocks]
  int64_t query_stride, key_stride, value_stride;  // elements from one token's query (key,
                                                    // value) to the next's
  bool latent;                   // MLA: one cache, values are its first v_head_dim channels
  float scale;
  Rotary rotary = {};            // applied to the queries and keys (MHA only)
};

// A unit of work: one request's queries [q0, q1) of this step for KV heads [kv0, kv1) and, of
// each KV head's group of query heads, heads [h0, h1) (offsets in the group); on_tiles: the
// request's chunk takes the AMX tiles (run decides it once for all its items).
struct Item {
  int64_t row, kv0, kv1, h0, h1, q0, q1, first_token, context_start;
  bool on_tiles;
};

// Tokens [t0, t0 + n)'s keys (rotated) and values into their cache slots, which are consecutive
// in one block: each transposed key row d of the block gets the n keys' values at once (token by
// token, each 2- or 4-byte write was its own cache line: 2.4% of a prefill step).
template <typename T, typename C>
void write_tokens(const Shape &s, int64_t t0, int64_t n, const T *key, const T *value,
                  C *key_cache, C *value_cache, const int32_t *slot_mapping) {
  const int64_t bs = s.block_size, D = s.head_dim, Dv = s.v_head_dim;
  const int64_t block = slot_mapping[t0] / bs, offset = slot_mapping[t0] % bs;
  thread_local Buffer<float> k;
  k.resize(n * D);
  for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) {
    for (int64_t j = 0; j < n; ++j) {
      convert(key + (t0 + j) * s.key_stride + kvh * D, &k[j * D], D);
      s.rotary.apply(&k[j * D], &k[j * D], t0 + j);
    }
    C *kt = key_cache + (block * s.num_kv_heads + kvh) * D * bs + offset;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < n; ++j) from_float(k[j * D + d], kt + d * bs + j);
    if (!s.latent) {
      for (int64_t j = 0; j < n; ++j)
        convert(value + (t0 + j) * s.value_stride + kvh * Dv,
                value_cache + ((block * s.num_kv_heads + kvh) * bs + offset + j) * Dv, Dv);
    }
  }
}

// The step's written tokens as runs [first, first + count) of consecutive slots in one block.
inline std::vector<std::pair<int64_t, int64_t>> slot_runs(const int32_t *slot_mapping,
                                                          int64_t num_tokens, int64_t bs) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot_mapping[t] < 0) continue;
    const bool extends = !runs.empty() && runs.back().first + runs.back().second == t &&
                         slot_mapping[t] == slot_mapping[t - 1] + 1 && slot_mapping[t] % bs != 0;
    if (extends)
      ++runs.back().second;
    else
      runs.emplace_back(t, 1);
  }
  return runs;
}

// Register-blocked inner loops: R rows (query heads) against one block, a vector of keys or
// value channels at a time held in registers (`lanes`), so each key/value row is loaded once
// for all R rows. Each loop keeps at least eight independent accumulators, so the FMAs pipeline
// instead of waiting on each other, and at most half the vector registers (8 rows' even and odd
// sums with AVX-512, 4 rows' with AVX2). The loops over rows are unrolled by request: left to
// GCC, the accumulators were also stored to the stack at every step.
constexpr int kMaxRows = kVectorRegisters / 4;

// s[r][k] = q[r] . key k of the block (row stride lds), for the block's bs keys (stored
// transposed: kt[d][k], in the cache's dtype: widened to float32 as they are loaded). Even and
// odd d accumulate separately.
template <int R, typename C>
void block_scores(const float *__restrict q, const C *__restrict kt, int64_t D, int64_t bs,
                  float *__restrict s, int64_t lds) {
  int64_t c = 0;
  for (; c + kLanes <= bs; c += kLanes) {
    lanes even[R] = {}, odd[R] = {};
    int64_t d = 0;
    Lookahead ahead = lookahead();
    for (; d + 1 < D; d += 2) {
      ahead.ask();
      const lanes k0 = load_lanes(kt + d * bs + c), k1 = load_lanes(kt + (d + 1) * bs + c);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        even[r] += q[r * D + d] * k0;
        odd[r] += q[r * D + d + 1] * k1;
      }
    }
    lookahead() = ahead;
    if (d < D) {
      const lanes k0 = load_lanes(kt + d * bs + c);
      for (int r = 0; r < R; ++r) even[r] += q[r * D + d] * k0;
    }
    for (int r = 0; r < R; ++r) store_lanes(s + r * lds + c, even[r] + odd[r]);
  }
  for (; c < bs; ++c) {  // block sizes that are not a multiple of kLanes
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += q[r * D + d] * to_float(kt[d * bs + c]);
      s[r * lds + c] = acc;
    }
  }
}

// out[r] += sum over the first `keys` keys k of p[r][k] * v[k] (p row stride ldp, v: [keys][Dv]
// in the cache's dtype V), C vectors of channels at a time.
template <int R, int C, typename V>
int64_t block_values_chunks(const float *__restrict p, int64_t ldp, const V *__restrict v,
                            int64_t keys, int64_t Dv, float *__restrict out, int64_t c) {
  for (; c + C * kLanes <= Dv; c += C * kLanes) {
    lanes acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) acc[r][j] = load_lanes(out + r * Dv + c + j * kLanes);
    Lookahead ahead = lookahead();
    for (int64_t k = 0; k < keys; ++k) {
      ahead.ask();
      ahead.ask();
      lanes vk[C];
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) vk[j] = load_lanes(v + k * Dv + c + j * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float pk = p[r * ldp + k];
#pragma GCC unroll 4
        for (int j = 0; j < C; ++j) acc[r][j] += pk * vk[j];
      }
    }
    lookahead() = ahead;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) store_lanes(out + r * Dv + c + j * kLanes, acc[r][j]);
  }
  return c;
}

template <int R, typename V>
void block_values(const float *p, int64_t ldp, const V *v, int64_t keys, int64_t Dv,
                  float *out) {
  constexpr int C = R * 4 <= kVectorRegisters / 2 ? 4 : 2;  // R * C accumulators: half the
                                                           // registers at most
  int64_t c = block_values_chunks<R, C>(p, ldp, v, keys, Dv, out, 0);
  c = block_values_chunks<R, 1>(p, ldp, v, keys, Dv, out, c);
  for (; c < Dv; ++c)
    for (int r = 0; r < R; ++r)
      for (int64_t k = 0; k < keys; ++k)
        out[r * Dv + c] += p[r * ldp + k] * to_float(v[k * Dv + c]);
}

template <typename C, int R = kMaxRows>
void block_scores_n(int rows, const float *q, const C *kt, int64_t D, int64_t bs, float *s,
                    int64_t lds) {
  if constexpr (R > 1) {
    if (rows < R) return block_scores_n<C, R - 1>(rows, q, kt, D, bs, s, lds);
  }
  block_scores<R>(q, kt, D, bs, s, lds);
}

template <typename V, int R = kMaxRows>
void block_values_n(int rows, const float *p, int64_t ldp, const V *v, int64_t keys,
                    int64_t Dv, float *out) {
  if constexpr (R > 1) {
    if (rows < R) return block_values_n<V, R - 1>(rows, p, ldp, v, keys, Dv, out);
  }
  block_values<R>(p, ldp, v, keys, Dv, out);
}

// Blocks are scattered in memory, beyond the hardware prefetcher's reach: a pass over an item's
// blocks asks for the lines of the blocks up to kPrefetchBytes ahead (into L2). One block ahead
// was too little: a decode's few kilobytes per block are computed faster than the next block's
// lines arrive.
constexpr int64_t kPrefetchBytes = 128 * 1024;

// Calls visit(j) for the blocks j = 0 .. num_blocks - 1, prefetching block(j) (`bytes` each)
// kPrefetchBytes ahead of the visits.
template <typename Block, typename Visit>
void visit_prefetched(int64_t num_blocks, int64_t bytes, Block block, Visit visit) {
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / bytes);
  for (int64_t j = 0; j < std::min(ahead, num_blocks); ++j) prefetch(block(j), bytes);
  for (int64_t j = 0; j < num_blocks; ++j) {
    if (j + ahead < num_blocks) prefetch(block(j + ahead), bytes);
    visit(j);
  }
}

// p[0:n] = exp(p - max p[0:n]), p[n:width] = 0; returns the sum of p. A last partial vector
// that fits inside width is computed as a whole one with its lanes past n masked: one exp per
// lane in scalar code was 40% of a prefill's attention on the tiles.
inline float softmax_numerators(float *p, int64_t n, int64_t width) {
  const lanes minus_infinity = lanes{} - std::numeric_limits<float>::infinity();
  lanes lane{};
  for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
  const int64_t whole = n / kLanes * kLanes;
  const bool masked_tail = whole < n && whole + kLanes <= width;
  auto in_row = [&](int64_t k) { return lane < static_cast<float>(n - k); };
  lanes most = minus_infinity;
  for (int64_t k = 0; k < whole; k += kLanes) {
    const lanes x = load_lanes(p + k);
    most = x > most ? x : most;
  }
  if (masked_tail) {
    const lanes x = in_row(whole) ? load_lanes(p + whole) : minus_infinity;
    most = x > most ? x : most;
  }
  float m = horizontal_max(most);
  if (!masked_tail)
    for (int64_t t = whole; t < n; ++t) m = std::max(m, p[t]);
  lanes sum{};
  for (int64_t k = 0; k < whole; k += kLanes) {
    const lanes e = fast_exp(load_lanes(p + k) - m);
    store_lanes(p + k, e);
    sum += e;
  }
  int64_t done = whole;
  if (masked_tail) {
    const lanes e = in_row(whole) ? fast_exp(load_lanes(p + whole) - m) : lanes{};
    store_lanes(p + whole, e);
    sum += e;
    done = whole + kLanes;
  }
  float total = horizontal_sum(sum);
  for (; done < n; ++done) {
    p[done] = fast_exp(p[done] - m);
    total += p[done];
  }
  std::fill(p + done, p + width, 0.0f);
  return total;
}

// x[0:n] rounded to bfloat16 (as float32 values).
inline void round_to_bfloat16(float *x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    bf16 rounded[kLanes];
    store_lanes(rounded, load_lanes(x + i));
    store_lanes(x + i, load_lanes(rounded));
  }
  for (; i < n; ++i) {
    bf16 rounded;
    from_float(x[i], &rounded);
    x[i] = to_float(rounded);
  }
}

// A prefill chunk's attention on AMX tiles (bfloat16 cache): its query rows and the request's
// keys and values as tiles of 16 rows x 32 bfloat16, scores and outputs accumulated in float32
// tiles, one TDPBF16PS a 16 x 16 x 32 product. The register blocks above run ~20 GFLOP/s a core
// on a prefill's rows; these its products at the tiles' rate, and a decode's few rows keep them.
// The queries and the softmax numerators enter rounded to bfloat16 (as the keys and values in
// the cache already are); each row's sum is of the numerators before rounding. The register
// blocks round them too where the tiles are there (rounds_as_tiles), so that a token's result
// does not depend on how the scheduler chunked its prompt or batched it.
constexpr int64_t kTileRows = 16;   // rows of an A tile or a C tile; keys or channels of a C tile
constexpr int64_t kTileDepth = 32;  // k of one tile product (16 pairs of bfloat16)

// Tiles' reading of a prefill item: every operand is a multiple of a tile (D and Dv of 32 and 16)
// and the block size of whole 16-key groups.
inline bool tiles_fit(const Shape &s) {
  return !s.latent && s.head_dim % kTileDepth == 0 && s.v_head_dim % kTileRows == 0 &&
         s.block_size % kTileRows == 0;
}

// Whether prefill chunks of this attention take the tiles, and every row rounds as they do.
template <typename C>
bool rounds_as_tiles(const Shape &s) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return std::is_same_v<C, bf16> && tiles_fit(s) && amx_wanted && amx_available();
#else
  (void)s;
  return false;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// out[0:16, 16 t : 16 t + 16] = sum over steps s of a[0:16, 32 s : 32 s + 32] . b(t, s) for the
// N <= 4 tiles t (C tiles 0..N-1, a in tile 4, b in 5-7): a's rows lda bfloat16 apart, b(t, s)
// a tile of 16 pairs of k (rows 64 bytes apart), out's rows ldo floats apart.
template <int N, typename B>
void tile_row(const bf16 *a, int64_t lda, int64_t steps, const B &b, float *out, int64_t ldo) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
  for (int64_t step = 0; step < steps; ++step) {
    _tile_loadd(4, a + step * kTileDepth, lda * sizeof(bf16));
    _tile_loadd(5, b(0, step), 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (N > 1) {
      _tile_loadd(6, b(1, step), 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (N > 2) {
      _tile_loadd(7, b(2, step), 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (N > 3) {
      _tile_loadd(5, b(3, step), 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out, ldo * sizeof(float));
  if constexpr (N > 1) _tile_stored(1, out + kTileRows, ldo * sizeof(float));
  if constexpr (N > 2) _tile_stored(2, out + 2 * kTileRows, ldo * sizeof(float));
  if constexpr (N > 3) _tile_stored(3, out + 3 * kTileRows, ldo * sizeof(float));
}

// tile_row over `tiles` C tiles, four at a time.
template <typename B>
void tile_rows(int64_t tiles, const bf16 *a, int64_t lda, int64_t steps, const B &b, float *out,
               int64_t ldo) {
  for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
    auto shifted = [&](int64_t t, int64_t step) { return b(t0 + t, step); };
    float *o = out + t0 * kTileRows;
    switch (std::min<int64_t>(4, tiles - t0)) {
      case 1: tile_row<1>(a, lda, steps, shifted, o, ldo); break;
      case 2: tile_row<2>(a, lda, steps, shifted, o, ldo); break;
      case 3: tile_row<3>(a, lda, steps, shifted, o, ldo); break;
      default: tile_row<4>(a, lda, steps, shifted, o, ldo); break;
    }
  }
}

// 16 bfloat16 of `first` and 16 of `second` interleaved: first[0], second[0], first[1], ...
inline __m512i interleave16(const bf16 *first, const bf16 *second) {
  const __m512i both = _mm512_inserti64x4(
      _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(first))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i *>(second)), 1);
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, both);
}

// One KV head g of a prefill item (rows: its query rows, q: their scaled, rotated float32 rows
// [rows, D]) into acc [rows, Dv] and l [rows] (the softmax's sums), as attend's loops would.
// keys: the request's keys the item's last query sees (its blocks' first `keys` slots).
template <typename Keys, typename Values, typename Visible>
void attend_on_tiles(const Shape &s, int64_t rows, int64_t keys, const float *q,
                     const Keys &key_block, const Values &value_block, const Visible &visible,
                     float *acc, float *l) {
  const int64_t bs = s.block_size, D = s.head_dim, Dv = s.v_head_dim;
  const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t width = (keys + kTileDepth - 1) / kTileDepth * kTileDepth;
  thread_local Buffer<bf16> q_tiles, k_tiles, v_tiles, p_tiles;
  thread_local Buffer<float> scores, out_tiles;
  // q [padded_rows, D]; keys as tiles of 16 keys [width / 16, D / 2, 16, 2]; values as tiles of
  // 16 channels [Dv / 16, width / 2, 16, 2]; numerators [padded_rows, width]
  q_tiles.resize(padded_rows * D);
  k_tiles.resize(width * D);
  v_tiles.resize(width * Dv);
  scores.resize(padded_rows * width);
  p_tiles.resize(padded_rows * width);
  out_tiles.resize(padded_rows * Dv);
  convert(q, q_tiles.data(), rows * D);
  // the last tile's rows past the item's: zero queries, zero numerators
  std::fill(q_tiles.begin() + rows * D, q_tiles.begin() + padded_rows * D, bf16{0});
  std::fill(p_tiles.begin() + rows * width, p_tiles.begin() + padded_rows * width, bf16{0});
  auto k_tile = [&](int64_t key) { return k_tiles.data() + key / kTileRows * kTileRows * D; };
  auto v_tile = [&](int64_t channel) {
    return v_tiles.data() + channel / kTileRows * width * kTileRows;
  };
  for (int64_t key = 0; key < keys; key += kTileRows) {  // 16 keys of one block at a time
    const bf16 *kt = key_block(key / bs) + key % bs, *v = value_block(key / bs) + key % bs * Dv;
    for (int64_t pair = 0; pair < D / 2; ++pair)
      _mm512_storeu_si512(k_tile(key) + pair * 2 * kTileRows,
                          interleave16(kt + 2 * pair * bs, kt + (2 * pair + 1) * bs));
    for (int64_t k = 0; k < kTileRows; k += 2)
      for (int64_t c = 0; c < Dv; c += kTileRows)
        _mm512_storeu_si512(v_tile(c) + (key + k) * kTileRows,
                            interleave16(v + k * Dv + c, v + (k + 1) * Dv + c));
  }
  // Slots past the last key hold other tokens' data or nothing: zero keys and values, so that
  // their (zero) numerators multiply zeros.
  for (int64_t key = keys; key < width; ++key) {
    for (int64_t pair = 0; pair < D / 2; ++pair)
      for (int64_t half = 0; half < 2; ++half)
        k_tile(key)[(pair * kTileRows + key % kTileRows) * 2 + half] = bf16{0};
    for (int64_t c = 0; c < Dv; ++c)
      v_tile(c)[(key / 2 * kTileRows + c % kTileRows) * 2 + key % 2] = bf16{0};
  }
  for (int64_t r0 = 0; r0 < padded_rows; r0 += kTileRows) {
    // The tile's last row sees the most keys.
    const int64_t seen = visible(std::min(rows, r0 + kTileRows) - 1);
    tile_rows((seen + kTileRows - 1) / kTileRows, q_tiles.data() + r0 * D, D, D / kTileDepth,
              [&](int64_t t, int64_t step) {
                return k_tiles.data() + (t * D / 2 + step * kTileRows) * 2 * kTileRows;
              },
              scores.data() + r0 * width, width);
    // The values' tiles below read the numerators up to `needed` only (seen keys, whole steps).
    const int64_t needed = (seen + kTileDepth - 1) / kTileDepth * kTileDepth;
    for (int64_t r = r0; r < std::min(rows, r0 + kTileRows); ++r) {
      float *p = scores.data() + r * width;
      l[r] = softmax_numerators(p, visible(r), needed);
      convert(p, p_tiles.data() + r * width, needed);
    }
    tile_rows(Dv / kTileRows, p_tiles.data() + r0 * width, width,
              (seen + kTileDepth - 1) / kTileDepth,
              [&](int64_t t, int64_t step) {
                return v_tiles.data() + (t * width / 2 + step * kTileRows) * 2 * kTileRows;
              },
              out_tiles.data() + r0 * Dv, Dv);
  }
  std::memcpy(acc, out_tiles.data(), rows * Dv * sizeof(float));
}
#endif

// One item in two passes over its blocks: every score first (p [rows, keys], keys the item's
// blocks' slots), then an exact softmax per row, then the values. Each block is read once per
// pass and the softmax runs over whole rows of vectors (a per-block online softmax spent more
// time rescaling than the 16-key dot products it wrapped). A block's visit covers the item's KV
// heads, which lie next to each other in the cache: a decode's item reads each block as one
// contiguous run (4 KB for two heads in bfloat16) rather than one short run per KV head's item.
// So that each pass finds its blocks on the way, the scores pass prefetches the values' blocks
// and the values pass the keys' blocks of `next` (the next item this thread runs, if any),
// a line or two per step of their loops (Lookahead): a decode item computes for less time than
// its blocks take to arrive from memory, and asking only at a pass's start left them in flight
// (decode of 64 requests, standalone: 20-25% less time on one thread and on two).
template <typename T, typename C, typename O>
void attend(const Shape &s, const Item &item, const T *query, const C *key_cache,
            const C *value_cache, const int32_t *block_table, O *out, const Item *next,
            const int32_t *next_block_table) {
  const int64_t bs = s.block_size, D = s.head_dim, Dv = s.v_head_dim;
  const int64_t group = s.num_heads / s.num_kv_heads, kv_heads = item.kv1 - item.kv0;
  // Rows of one KV head: r = (query i - q0) * heads + head (rows of one query are adjacent);
  // KV head g's rows follow g - 1's.
  const int64_t heads = item.h1 - item.h0, rows = heads * (item.q1 - item.q0);
  const int64_t all_rows = kv_heads * rows;
  const int64_t visible_max = item.context_start + item.q1;  // keys seen by the last query
  const int64_t num_blocks = (visible_max + bs - 1) / bs, width = num_blocks * bs;
  thread_local Buffer<float> q_buf, acc_buf, l_buf, k_buf, v_buf, p_buf;  // k/v: MLA only
  q_buf.resize(all_rows * D);
  acc_buf.resize(all_rows * Dv);
  l_buf.resize(all_rows);
  p_buf.resize(all_rows * width);
  float *__restrict q = q_buf.data(), *__restrict acc = acc_buf.data();
  float *__restrict p = p_buf.data();
  auto head_of = [&](int64_t g, int64_t h) { return (item.kv0 + g) * group + item.h0 + h; };
  const bool tile_rounding = rounds_as_tiles<C>(s);
  for (int64_t g = 0; g < kv_heads; ++g) {
    for (int64_t i = item.q0; i < item.q1; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        float *qr = q + (g * rows + (i - item.q0) * heads + h) * D;
        convert(query + (item.first_token + i) * s.query_stride + head_of(g, h) * D, qr, D);
        s.rotary.apply(qr, qr, item.first_token + i);
        for (int64_t d = 0; d < D; ++d) qr[d] *= s.scale;
        // the tiles round the queries as they convert them
        if (tile_rounding && !item.on_tiles) round_to_bfloat16(qr, D);
      }
    }
  }
  auto key_block = [&](int64_t j) {  // the item's first KV head's keys; the next head's follow
    return key_cache + (block_table[j] * s.num_kv_heads + item.kv0) * D * bs;
  };
  auto value_block = [&](int64_t j) {
    return value_cache + (block_table[j] * s.num_kv_heads + item.kv0) * bs * Dv;
  };
  auto visible = [&](int64_t r) { return item.context_start + item.q0 + r / heads + 1; };
  auto write_out = [&] {
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t i = item.q0; i < item.q1; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t r = g * rows + (i - item.q0) * heads + h;
          const float inv = 1.0f / l_buf[r];
          O *o = out + ((item.first_token + i) * s.num_heads + head_of(g, h)) * Dv;
          for (int64_t d = 0; d < Dv; ++d) from_float(acc[r * Dv + d] * inv, o + d);
        }
      }
    }
  };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same_v<C, bf16>) {
    if (item.on_tiles) {
      TileState tiles;
      for (int64_t g = 0; g < kv_heads; ++g) {
        attend_on_tiles(
            s, rows, visible_max, q + g * rows * D,
            [&](int64_t j) { return key_block(j) + g * D * bs; },
            [&](int64_t j) { return value_block(j) + g * bs * Dv; }, visible,
            acc + g * rows * Dv, l_buf.data() + g * rows);
      }
      return write_out();
    }
  }
#endif
  std::fill(acc, acc + all_rows * Dv, 0.0f);  // the values passes add into it (the tiles write it)
  const int64_t value_bytes = kv_heads * bs * Dv * sizeof(C);
  // The next item's key blocks, spread evenly over this item's values pass (visit j asks for
  // its share up to block `next_blocks * (j + 1) / num_blocks`).
  const int64_t next_blocks = next ? (next->context_start + next->q1 + bs - 1) / bs : 0;
  int64_t next_prefetched = 0;
  // The last of a visit's blocks is asked for by the values loops (Lookahead).
  auto prefetch_next_keys = [&](int64_t j) {
    lookahead().flush();
    const int64_t until = next_blocks * (j + 1) / num_blocks;
    for (; next_prefetched < until; ++next_prefetched) {
      const char *keys = reinterpret_cast<const char *>(
          key_cache + (next_block_table[next_prefetched] * s.num_kv_heads + next->kv0) * D * bs);
      const int64_t bytes = (next->kv1 - next->kv0) * D * bs * sizeof(C);
      if (next_prefetched + 1 < until)
        prefetch(keys, bytes);
      else
        lookahead() = {keys, keys + bytes};
    }
  };
  // Queries before position j * bs see nothing of block j: rows before this one skip it.
  auto first_row = [&](int64_t j) {
    return (std::max(item.q0, j * bs - item.context_start) - item.q0) * heads;
  };

  visit_prefetched(num_blocks, kv_heads * D * bs * sizeof(C), key_block, [&](int64_t j) {
    // this block's values: asked for by the scores loops (Lookahead)
    lookahead().flush();
    if (!s.latent) {
      const char *values = reinterpret_cast<const char *>(value_block(j));
      lookahead() = {values, values + value_bytes};
    }
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float *qg = q + g * rows * D;
      float *pg = p + g * rows * width;
      for (int64_t r0 = first_row(j); r0 < rows; r0 += kMaxRows) {
        const int n = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
        block_scores_n(n, qg + r0 * D, key_block(j) + g * D * bs, D, bs, pg + r0 * width + j * bs,
                       width);
      }
    }
  });
  for (int64_t r = 0; r < all_rows; ++r) {
    l_buf[r] = softmax_numerators(p + r * width, visible(r % rows), width);
    if (tile_rounding) round_to_bfloat16(p + r * width, visible(r % rows));
  }
  auto add_values = [&](int64_t j, int64_t g, const auto *v) {  // v: block j's values [bs, Dv]
    const float *pg = p + g * rows * width;
    float *ag = acc + g * rows * Dv;
    for (int64_t r0 = first_row(j); r0 < rows; r0 += kMaxRows) {
      const int n = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
      // The last of these rows sees the most keys of this block.
      const int64_t keys = std::min<int64_t>(bs, visible(r0 + n - 1) - j * bs);
      block_values_n(n, pg + r0 * width + j * bs, width, v, keys, Dv, ag + r0 * Dv);
    }
  };
  if (s.latent) {  // values: each block's first Dv channels, transposed to [bs, Dv] (one KV head)
    v_buf.resize(bs * Dv);
    visit_prefetched(num_blocks, Dv * bs * sizeof(C), key_block, [&](int64_t j) {
      prefetch_next_keys(j);
      const float *kf = as_float(key_block(j), D * bs, k_buf);
      for (int64_t k = 0; k < bs; ++k)
        for (int64_t d = 0; d < Dv; ++d) v_buf[k * Dv + d] = kf[d * bs + k];
      add_values(j, 0, v_buf.data());
    });
  } else {
    for (int64_t j = 0; j < num_blocks; ++j) {  // prefetched in the scores pass
      prefetch_next_keys(j);
      for (int64_t g = 0; g < kv_heads; ++g) add_values(j, g, value_block(j) + g * bs * Dv);
    }
  }
  lookahead().flush();
  write_out();
}

// Query rows (query heads x tokens) one work item scores against each block it converts: enough
// to amortise the block's conversion, few enough that a decode batch spreads over the threads.
constexpr int64_t kRowsPerItem = 64;
// A prefill chunk on the tiles repacks the keys and values its queries see once per item, and
// its items are dearer by the keys they see: items of 256 rows, the latest queries first, so
// that the cheap ones even out the threads at the end (items of 64 rows repacked a 128-token
// chunk's keys 4.5 times over).
constexpr int64_t kTileRowsPerItem = 256;

// out: in the activations' dtype T, or bfloat16 under float32 activations (the decoder layer's
// rows for the output projection's AMX tiles).
template <typename T, typename C, typename O>
int run(const Shape &s, const T *query, const T *key, const T *value, C *key_cache,
        C *value_cache, const int32_t *slot_mapping, const int32_t *block_tables,
        const int32_t *seq_lens, const int32_t *q_lens, O *out) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  // Heads of one KV head share each converted block; MLA's many heads are split in chunks so
  // one request's decode still spreads over the threads.
  const int64_t head_chunk = std::min<int64_t>(group, 16);
  const int64_t queries_per_item = std::max<int64_t>(1, kRowsPerItem / head_chunk);
  const bool tiles = rounds_as_tiles<C>(s);
  // Fewer requests than threads (a batch-1 decode): their KV heads go to separate items, so
  // every thread attends (one item held all of a decode's heads while the other threads waited).
  int64_t requests = 0;
  for (int64_t row = 0; row < s.num_rows; ++row) requests += q_lens[row] > 0;
  const int64_t items_per_request = (num_threads + std::max<int64_t>(requests, 1) - 1) /
                                    std::max<int64_t>(requests, 1);
  const int64_t most_kv_per_item = std::max<int64_t>(
      1, (s.num_kv_heads + items_per_request - 1) / items_per_request);
  std::vector<Item> items;
  int64_t token = 0;
  for (int64_t row = 0; row < s.num_rows; ++row) {
    const int64_t q_len = q_lens[row];
    if (q_len <= 0) continue;
    const int64_t context_start = seq_lens[row] - q_len;
    if (context_start < 0 || token + q_len > s.num_tokens ||
        seq_lens[row] > s.max_blocks * s.block_size) {
      return 1;  // inconsistent metadata: MindSpore raises instead of reading out of bounds
    }
    // A decode's KV heads in one item (up to most_kv_per_item), a prefill chunk's one KV head
    // an item.
    // A chunk of at least a tile's rows a KV head takes the tiles for all its queries.
    const bool on_tiles = tiles && head_chunk * q_len >= kTileRows;
    const int64_t queries =
        on_tiles ? std::max<int64_t>(1, kTileRowsPerItem / head_chunk) : queries_per_item;
    const int64_t pieces = (q_len + queries - 1) / queries;
    const int64_t rows_per_kv_head = head_chunk * std::min(q_len, queries);
    const int64_t kv_per_item =
        std::min(most_kv_per_item, std::max<int64_t>(1, kRowsPerItem / rows_per_kv_head));
    for (int64_t kv0 = 0; kv0 < s.num_kv_heads; kv0 += kv_per_item)
      for (int64_t h0 = 0; h0 < group; h0 += head_chunk)
        for (int64_t piece = 0; piece < pieces; ++piece) {
          const int64_t q0 = (on_tiles ? pieces - 1 - piece : piece) * queries;
          items.push_back({row, kv0, std::min(s.num_kv_heads, kv0 + kv_per_item), h0,
                           std::min(group, h0 + head_chunk), q0, std::min(q_len, q0 + queries),
                           token, context_start, on_tiles});
        }
    token += q_len;
  }
  // Padding tokens after the last request: zero output.
  std::memset(static_cast<void *>(out + token * s.num_heads * s.v_head_dim), 0,
              (s.num_tokens - token) * s.num_heads * s.v_head_dim * sizeof(O));
  const int64_t num_items = static_cast<int64_t>(items.size());
  // The cache writes are split over the threads too: a decode step's writes are a cache miss
  // each (the keys are transposed in a block, each slot's lines were evicted since the last
  // step); on one thread they were 8% of a 64-token decode call in `perf`.
  const auto runs = slot_runs(slot_mapping, s.num_tokens, s.block_size);
  parallel_for(
      static_cast<int64_t>(runs.size()),
      [&](int64_t r) {
        write_tokens(s, runs[r].first, runs[r].second, key, value, key_cache, value_cache,
                     slot_mapping);
      },
      num_items > 1);
  auto table_of = [&](const Item &item) { return block_tables + item.row * s.max_blocks; };
  parallel_for_claiming_next(num_items, [&](int64_t n, int64_t next) {
    const Item *after = next >= 0 ? &items[next] : nullptr;
    attend(s, items[n], query, key_cache, value_cache, table_of(items[n]), out, after,
           after ? table_of(*after) : nullptr);
  });
  return 0;
}

// Calls kernel(T{}, C{}) for the activations' and the cache's dtypes: both float32, both
// float16, or float32 activations over a bfloat16 cache (--dtype bfloat16 on CPU).
template <typename Kernel>
int with_dtypes(const char *activations, const char *cache, Kernel kernel) {
  auto is = [](const char *dtype, const char *name) { return std::strcmp(dtype, name) == 0; };
  if (is(activations, "float32") && is(cache, "float32")) return kernel(float{}, float{});
  if (is(activations, "float16") && is(cache, "float16")) return kernel(half{}, half{});
  if (is(activations, "float32") && is(cache, "bfloat16")) return kernel(float{}, bf16{});
  return 1;
}

// Elements from one token's row of x [T, ...] to the next's.
int64_t row_stride(int ndims, const int64_t *shape) {
  int64_t stride = 1;
  for (int i = 1; i < ndims; ++i) stride *= shape[i];
  return stride;
}

// MLAAbsorbedAttention's inputs, in its order.
enum AbsorbedInput {
  kQ,            // [T, H * (dn + dr)]: each head's q_nope, then its q_pe (not yet rotated)
  kKvA,          // [T, r + dr]: the latent c (not yet normalised), then k_pe (not yet rotated)
  kKvNorm,       // [r]: kv_a_layernorm's weight
  kEps,          // [1] float32
  kPositions,    // [T] int32
  kCosSin,       // [max_position, dr] float32
  kWUk,          // [H, ceil(r / 32), dn, 32]: each head's W_UK^T packed (linear.py), r outputs
  kWUv,          // [H, ceil(dv / 32), r, 32]: each head's W_UV packed, dv outputs
  kCache,        // [NB, r + dr, bs] (the MLA layout above)
  kSlots,        // the step's metadata, as MLAPagedAttention's
  kBlockTables,
  kSeqLens,
  kQLens,
  kScale,
  kInterleaved,  // [1] int32: 1: the rotary pairs are interleaved (GPT-J), 0: neox halves
  kAbsorbedInputs
};

// For every head h: y's n columns from h * y_head (row stride ldy) = x's k columns from h * x_head
// (row stride ldx) . the head's packed weight; the heads on the threads, a head's rows on one.
void per_head_matmul(const float *x, int64_t ldx, int64_t x_head, int64_t T, int64_t heads,
                     int64_t k, const float *packed, int64_t n, float *y, int64_t ldy,
                     int64_t y_head) {
  const int64_t head_floats = (n + kPanel - 1) / kPanel * k * kPanel;
  parallel_for(heads, [&](int64_t h) {
    thread_local Buffer<float> rows;
    rows.resize(T * k);
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(rows.data() + t * k, x + t * ldx + h * x_head, k * sizeof(float));
    matmul(rows.data(), T, k, packed + h * head_floats, static_cast<const float *>(nullptr), n,
           y + h * y_head, ldy, false);
  }, heads > 1 && T * k * n >= 4096);
}

// PagedAttention and RotaryPagedAttention*: params[0..8] as below, params[nparam - 1] the output.
int paged_attention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    Rotary rotary) {
  const int out = nparam - 1;
  if (ndims[2] != 4 || ndims[out] != 3) return 1;
  const int64_t kv_heads = shapes[2][1], heads = shapes[out][1], D = shapes[2][2];
  const int64_t query_stride = row_stride(ndims[0], shapes[0]);
  const int64_t value_stride = row_stride(ndims[1], shapes[1]);
  const Shape s{shapes[0][0], heads,        kv_heads,     D,
                shapes[3][3], shapes[2][3], shapes[5][0], shapes[5][1],
                query_stride, query_stride, value_stride,
                false,        *static_cast<float *>(params[8]), rotary};
  if (query_stride < (heads + kv_heads) * D || value_stride < kv_heads * s.v_head_dim ||
      rotary.rotary > D || rotary.rotary % 2) {
    return 1;
  }
  return with_dtypes(dtypes[0], dtypes[2], [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    T *qk = static_cast<T *>(params[0]);
    // The values are the last KVH * Dv channels of each row of v (a fused q|k|v row, or v alone).
    T *v = static_cast<T *>(params[1]) + s.value_stride - s.num_kv_heads * s.v_head_dim;
    auto i32 = [&](int i) { return static_cast<const int32_t *>(params[i]); };
    auto attend_into = [&](auto *o) {
      return run(s, qk, qk + s.num_heads * s.head_dim, v, static_cast<C *>(params[2]),
                 static_cast<C *>(params[3]), i32(4), i32(5), i32(6), i32(7), o);
    };
    if constexpr (std::is_same_v<T, float>) {
      if (std::strcmp(dtypes[out], "bfloat16") == 0)
        return attend_into(static_cast<bf16 *>(params[out]));
    }
    return attend_into(static_cast<T *>(params[out]));
  });
}

// The rotary embedding of RotaryPagedAttention*: positions [T] int32 at params[9], cos_sin
// [max_position, rotary] float32 at params[10].
Rotary rotary_of(void **params, int64_t **shapes, bool neox) {
  return {static_cast<const int32_t *>(params[9]), static_cast<const float *>(params[10]),
          shapes[10][1], shapes[10][0], neox};
}

}  // namespace

extern "C" {

void SetNumThreads(int threads) { vllm_ms::num_threads = std::max(1, threads); }

// qk [T, ...] (each token's row starts with its H query heads, then its KVH key heads, D each:
// [T, H + KVH, D], or a fused q|k|v row [T, W]), v [T, W] (its last KVH * Dv channels are the
// token's values), key_cache [NB, KVH, D, bs], value_cache [NB, KVH, bs, Dv], slot_mapping [T],
// block_tables [B, MB], seq_lens [B], q_lens [B], scale [1] (float32) -> out [T, H, Dv]
int PagedAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                   void *, void *) {
  return nparam == 10 ? paged_attention(nparam, params, ndims, shapes, dtypes, {}) : 1;
}

// PagedAttention's inputs, then positions [T] int32 and cos_sin [max_position, rotary] float32
// -> out [T, H, Dv], the query and key heads rotated by the kernel: neox halves, or interleaved
// pairs.
int RotaryPagedAttentionNeox(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **dtypes, void *, void *) {
  if (nparam != 12) return 1;
  return paged_attention(nparam, params, ndims, shapes, dtypes, rotary_of(params, shapes, true));
}

int RotaryPagedAttentionInterleaved(int nparam, void **params, int *ndims, int64_t **shapes,
                                    const char **dtypes, void *, void *) {
  if (nparam != 12) return 1;
  return paged_attention(nparam, params, ndims, shapes, dtypes, rotary_of(params, shapes, false));
}

// q [T, H, L], latent [T, L], cache [NB, L, bs], slot_mapping [T], block_tables [B, MB],
// seq_lens [B], q_lens [B], scale [1] (float32) -> out [T, H, Dv] (Dv: the values' channels)
int MLAPagedAttention(int nparam, void **params, int *ndims, int64_t **shapes,
                      const char **dtypes, void *stream, void *extra) {
  if (nparam != 9) return 1;
  const int64_t L = shapes[0][2];
  Shape s{shapes[0][0], shapes[0][1], 1,     L,    shapes[8][2], shapes[2][2], shapes[4][0],
          shapes[4][1], shapes[0][1] * L, L, 0, true,         *static_cast<float *>(params[7])};
  auto i32 = [&](int i) { return static_cast<const int32_t *>(params[i]); };
  return with_dtypes(dtypes[0], dtypes[2], [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    return run(s, static_cast<T *>(params[0]), static_cast<T *>(params[1]),
               static_cast<T *>(nullptr), static_cast<C *>(params[2]),
               static_cast<C *>(nullptr), i32(3), i32(4), i32(5), i32(6),
               static_cast<T *>(params[8]));
  });
}

// One MLA layer's attention after its projections, float32 activations: the latent c
// normalised (kv_a_layernorm) and k_pe rotated into this step's latent rows [T, r + dr]; each
// head's query [q_nope W_UK, rotated q_pe]; MLAPagedAttention over them (the latent rows written
// to the cache); each head's output (sum of p c) W_UV^T. MindSpore spent ~20 operators of a graph
// on these steps (slices, concatenations, transposes, two batched matmuls, the norm and rope).
// The step's tokens (q_lens' sum) are computed, padding rows after them get zeros.
// Inputs: AbsorbedInput's order -> out [T, H * dv].
int MLAAbsorbedAttention(int nparam, void **params, int *ndims, int64_t **shapes,
                         const char **dtypes, void *, void *) {
  if (nparam != kAbsorbedInputs + 1 || ndims[kQ] != 2 || ndims[kKvA] != 2 ||
      ndims[kWUk] != 4 || ndims[kWUv] != 4 || ndims[kCache] != 3 || ndims[kCosSin] != 2 ||
      ndims[kAbsorbedInputs] != 2)
    return 1;
  for (int i : {kQ, kKvA, kKvNorm, kWUk, kWUv, kAbsorbedInputs})
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  const int64_t padded = shapes[kQ][0], heads = shapes[kWUk][0], r = shapes[kKvNorm][0];
  const int64_t dr = shapes[kCosSin][1], L = r + dr, dn = shapes[kWUk][2];
  const int64_t dv = shapes[kAbsorbedInputs][1] / heads;
  if (shapes[kKvA][1] != L || shapes[kCache][1] != L || shapes[kQ][1] != heads * (dn + dr) ||
      shapes[kWUk][1] * kPanel < r || shapes[kWUv][0] != heads || shapes[kWUv][2] != r ||
      shapes[kWUv][1] * kPanel < dv || shapes[kAbsorbedInputs][1] != heads * dv || dr % 2)
    return 1;
  const int32_t *q_lens = static_cast<const int32_t *>(params[kQLens]);
  int64_t T = 0;
  for (int64_t row = 0; row < shapes[kQLens][0]; ++row) T += std::max(q_lens[row], 0);
  if (T > padded) return 1;
  const float *q = static_cast<const float *>(params[kQ]);
  const float *kv_a = static_cast<const float *>(params[kKvA]);
  float *out = static_cast<float *>(params[kAbsorbedInputs]);
  std::memset(out + T * heads * dv, 0, (padded - T) * heads * dv * sizeof(float));
  const Rotary rotary{static_cast<const int32_t *>(params[kPositions]),
                      static_cast<const float *>(params[kCosSin]), dr, shapes[kCosSin][0],
                      *static_cast<const int32_t *>(params[kInterleaved]) == 0};
  struct Intermediates {
    Buffer<float> normed, latent, query, attended;
  };
  const Scratch<Intermediates> buffers;
  buffers->normed.resize(T * r);
  buffers->latent.resize(T * L);
  buffers->query.resize(T * heads * L);
  buffers->attended.resize(T * heads * r);
  float *latent = buffers->latent.data(), *query = buffers->query.data();
  if (const int status = call(RmsNorm, {{const_cast<float *>(kv_a), {T, L}, "float32"},
                                        {params[kKvNorm], {r}, "float32"},
                                        {params[kEps], {1}, "float32"},
                                        {buffers->normed.data(), {T, r}, "float32"}}))
    return status;
  parallel_for(T, [&](int64_t t) {
    std::memcpy(latent + t * L, buffers->normed.data() + t * r, r * sizeof(float));
    rotary.apply(kv_a + t * L + r, latent + t * L + r, t);
    for (int64_t h = 0; h < heads; ++h)
      rotary.apply(q + (t * heads + h) * (dn + dr) + dn, query + (t * heads + h) * L + r, t);
  }, T * heads * dr >= kParallelElements);
  per_head_matmul(q, heads * (dn + dr), dn + dr, T, heads, dn,
                  static_cast<const float *>(params[kWUk]), r, query, heads * L, L);
  const Shape s{T, heads, 1, L, r, shapes[kCache][2], shapes[kBlockTables][0],
                shapes[kBlockTables][1], heads * L, L, 0, true,
                *static_cast<const float *>(params[kScale])};
  auto i32 = [&](int i) { return static_cast<const int32_t *>(params[i]); };
  auto attend = [&](auto *cache) {
    return run(s, query, latent, static_cast<float *>(nullptr), cache, decltype(cache){nullptr},
               i32(kSlots), i32(kBlockTables), i32(kSeqLens), i32(kQLens),
               buffers->attended.data());
  };
  // A float32 or bfloat16 cache (float32 activations: float16 ones take the separate operators).
  int status = 1;
  if (std::strcmp(dtypes[kCache], "float32") == 0)
    status = attend(static_cast<float *>(params[kCache]));
  else if (std::strcmp(dtypes[kCache], "bfloat16") == 0)
    status = attend(static_cast<bf16 *>(params[kCache]));
  if (status) return status;
  per_head_matmul(buffers->attended.data(), heads * r, r, T, heads, r,
                  static_cast<const float *>(params[kWUv]), dv, out, heads * dv, dv);
  return 0;
}

}  // extern "C"
