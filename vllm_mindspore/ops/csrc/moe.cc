// CPU kernel behind vllm_mindspore.ops.moe, called by MindSpore as an `ops.Custom(func_type="aot")`
// operator: the routed experts of one MoE layer for a whole step.
//
// The token copies are grouped by expert on the host side of the kernel (a counting sort), each
// expert runs its gate|up matmul, silu(gate) * up and down matmul over exactly its tokens (the
// weights packed in panels, gemm.h), and each copy's weighted output is summed back into its
// token. MindSpore sees one operator with static shapes, whatever the routing. Softmax top-k
// routing (Qwen3-MoE's) and grouped sigmoid top-k routing (DeepSeek-V3's) are operators of their
// own.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"

namespace {

using namespace vllm_ms;

// w13 [E, P13, D, 32] and w2 [E, P2, I, 32] like x, or bfloat16 pairs [E, P13, D / 2, 32, 2] and
// [E, P2, I / 2, 32, 2] (x float32; D and I even)
template <typename T, typename W>
int run(void **params, int64_t **shapes, int w13_dims) {
  const T *x = static_cast<const T *>(params[0]);
  const int32_t *ids = static_cast<const int32_t *>(params[1]);
  const float *weights = static_cast<const float *>(params[2]);
  const W *w13 = static_cast<const W *>(params[3]);
  const W *w2 = static_cast<const W *>(params[4]);
  T *out = static_cast<T *>(params[5]);
  constexpr int64_t per_step = PanelFormat<W>::kPerStep;
  const int64_t tokens = shapes[0][0], D = shapes[0][1], K = shapes[1][1];
  const int64_t experts = shapes[3][0], I = shapes[4][2] * per_step;
  const int64_t w13_size = shapes[3][1] * D * kPanel, w2_size = shapes[4][1] * I * kPanel;
  if (w13_dims != (per_step == 2 ? 5 : 4) || shapes[3][2] * per_step != D ||
      shapes[3][1] * kPanel < 2 * I || shapes[4][1] * kPanel < D)
    return 1;

  std::vector<int64_t> start, order;
  group_by_expert(ids, tokens * K, experts, start, order);

  Buffer<float> x_buffer;
  const float *xf = as_float(x, tokens * D, x_buffer);
  Buffer<float> copies(tokens * K * D, 0.0f);  // each copy's weighted expert output
  parallel_for_each_claimed(experts, [&](int64_t e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) return;
    thread_local Buffer<float> rows, gate_up, act, down;
    rows.resize(n * D);
    act.resize(n * I);
    down.resize(n * D);
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(rows.data() + j * D, xf + order[start[e] + j] / K * D, D * sizeof(float));
    if (I % kPanel == 0) {  // silu(gate) * up in the matmul's blocks
      matmul(rows.data(), n, D, w13 + e * w13_size, static_cast<const float *>(nullptr), 2 * I,
             act.data(), I, false, true);
    } else {
      gate_up.resize(n * 2 * I);
      matmul(rows.data(), n, D, w13 + e * w13_size, static_cast<const float *>(nullptr), 2 * I,
             gate_up.data(), 2 * I, false);
      silu_and_mul(gate_up.data(), n, I, act.data());
    }
    matmul(act.data(), n, I, w2 + e * w2_size, static_cast<const float *>(nullptr), D,
           down.data(), D, false);
    weigh_copies(down.data(), n, D, order.data() + start[e], weights, copies.data());
  });
  sum_copies(copies.data(), tokens, K, D, out);
  return 0;
}

// Insert expert e into ids[0, chosen), the best so far by descending score (experts arrive in
// increasing order, so of equal scores the lower id stays first) -> the new count (<= K).
template <typename S>
int64_t insert_best(const S *score, int64_t e, int64_t K, int64_t chosen, int32_t *ids) {
  int64_t at = chosen;
  while (at > 0 && to_float(score[e]) > to_float(score[ids[at - 1]])) --at;
  if (at == K) return chosen;
  for (int64_t k = std::min(chosen, K - 1); k > at; --k) ids[k] = ids[k - 1];
  ids[at] = static_cast<int32_t>(e);
  return std::min(chosen + 1, K);
}

// One token's routing: logits [E] -> its K experts' ids and weights, best first.
template <typename L>
void softmax_top_k(const L *logits, int64_t E, int64_t K, bool renormalize, float *weights,
                   int32_t *ids) {
  float max = -INFINITY;
  for (int64_t e = 0; e < E; ++e) max = std::max(max, to_float(logits[e]));
  float sum = 0.0f;
  int64_t chosen = 0;
  for (int64_t e = 0; e < E; ++e) {
    sum += std::exp(to_float(logits[e]) - max);
    chosen = insert_best(logits, e, K, chosen, ids);
  }
  float chosen_sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    weights[k] = std::exp(to_float(logits[ids[k]]) - max) / sum;
    chosen_sum += weights[k];
  }
  if (renormalize)
    for (int64_t k = 0; k < K; ++k) weights[k] /= chosen_sum;
}

// DeepSeek-V3's grouped routing, as GroupedTopK's config and factors give it.
struct GroupedRouting {
  int64_t groups, kept_groups, group_top_n;
  bool renormalize;
  float masked, scale;
};

// One token's grouped routing: logits [E] -> its K experts' ids and weights, best first.
// scratch: the token's scores, choice scores and group scores (E + E + groups); best: a group's
// best, then the kept groups (max(group_top_n, kept_groups)).
void grouped_top_k(const float *logits, const float *bias, int64_t E, int64_t K,
                   const GroupedRouting &r, float *scratch, int32_t *best, float *weights,
                   int32_t *ids) {
  float *scores = scratch, *choice = scratch + E, *group_scores = scratch + 2 * E;
  for (int64_t e = 0; e < E; ++e) {
    scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = scores[e] + bias[e];
  }
  // Groups ranked by the sum of their best group_top_n choice scores; the experts of all but
  // the best kept_groups score `masked`.
  const int64_t per_group = E / r.groups;
  for (int64_t g = 0; g < r.groups; ++g) {
    int64_t chosen = 0;
    for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e)
      chosen = insert_best(choice, e, r.group_top_n, chosen, best);
    group_scores[g] = 0.0f;
    for (int64_t n = 0; n < r.group_top_n; ++n) group_scores[g] += choice[best[n]];
  }
  int64_t chosen = 0;
  for (int64_t g = 0; g < r.groups; ++g)
    chosen = insert_best(group_scores, g, r.kept_groups, chosen, best);
  for (int64_t g = 0; g < r.groups; ++g) {
    if (std::find(best, best + r.kept_groups, g) == best + r.kept_groups)
      std::fill(choice + g * per_group, choice + (g + 1) * per_group, r.masked);
  }
  chosen = 0;
  for (int64_t e = 0; e < E; ++e) chosen = insert_best(choice, e, K, chosen, ids);
  // The weights are the chosen experts' scores without the bias.
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    weights[k] = scores[ids[k]];
    sum += weights[k];
  }
  for (int64_t k = 0; k < K; ++k) {
    if (r.renormalize) weights[k] /= sum + 1e-20f;
    weights[k] *= r.scale;
  }
}

template <typename L>
int route(void **params, int64_t **shapes) {
  const L *logits = static_cast<const L *>(params[0]);
  const bool renormalize = *static_cast<const int32_t *>(params[1]) != 0;
  float *weights = static_cast<float *>(params[2]);
  int32_t *ids = static_cast<int32_t *>(params[3]);
  const int64_t tokens = shapes[0][0], E = shapes[0][1], K = shapes[2][1];
  if (K < 1 || K > E || shapes[2][0] != tokens || shapes[3][0] != tokens || shapes[3][1] != K)
    return 1;
  parallel_for(tokens, [&](int64_t t) {
    softmax_top_k(logits + t * E, E, K, renormalize, weights + t * K, ids + t * K);
  }, tokens * E >= 4096);
  return 0;
}

}  // namespace

extern "C" {

// logits [T, E] float32 or float16, renormalize [1] int32 -> weights [T, K] float32, ids [T, K]
// int32: each token's K most probable experts under softmax over its E logits, best first (of
// equal logits the lower id first), their probabilities renormalised to sum 1 if `renormalize`.
int SoftmaxTopK(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                void *, void *) {
  if (nparam != 4 || ndims[0] != 2 || ndims[2] != 2 || ndims[3] != 2) return 1;
  if (std::strcmp(dtypes[0], "float16") == 0) return route<half>(params, shapes);
  if (std::strcmp(dtypes[0], "float32") == 0) return route<float>(params, shapes);
  return 1;
}

// logits [T, E] float32, bias [E] float32, config [4] int32 (groups G, kept groups,
// a group's top n, renormalize 0 / 1), factors [2] float32 (masked, scale) -> weights [T, K]
// float32, ids [T, K] int32: DeepSeek-V3's routing. Sigmoid scores; the bias only steers the
// choice: the E / G consecutive experts of each group, groups ranked by the sum of their best n
// biased scores, the kept groups' experts' K best biased scores (best first, of equal ones the
// lower id first; the other groups' experts score `masked`). The weights are the chosen
// experts' unbiased scores, divided by their sum (+ 1e-20) if renormalize, times scale.
int GroupedTopK(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                void *, void *) {
  if (nparam != 6 || ndims[0] != 2 || ndims[4] != 2 || ndims[5] != 2) return 1;
  const int64_t tokens = shapes[0][0], E = shapes[0][1], K = shapes[4][1];
  if (std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[1], "float32") != 0 ||
      elements(ndims[1], shapes[1]) != E || elements(ndims[2], shapes[2]) != 4 ||
      elements(ndims[3], shapes[3]) != 2 || shapes[4][0] != tokens || shapes[5][0] != tokens ||
      shapes[5][1] != K)
    return 1;
  const int32_t *config = static_cast<const int32_t *>(params[2]);
  const float *factors = static_cast<const float *>(params[3]);
  const GroupedRouting routing{config[0], config[1], config[2], config[3] != 0, factors[0],
                               factors[1]};
  if (routing.groups < 1 || E % routing.groups != 0 || routing.kept_groups < 1 ||
      routing.kept_groups > routing.groups || routing.group_top_n < 1 ||
      routing.group_top_n > E / routing.groups || K < 1 || K > E)
    return 1;
  const float *logits = static_cast<const float *>(params[0]);
  const float *bias = static_cast<const float *>(params[1]);
  float *weights = static_cast<float *>(params[4]);
  int32_t *ids = static_cast<int32_t *>(params[5]);
  parallel_for(tokens, [&](int64_t t) {
    thread_local std::vector<float> scratch;
    thread_local std::vector<int32_t> best;
    scratch.resize(2 * E + routing.groups);
    best.resize(std::max(routing.group_top_n, routing.kept_groups));
    grouped_top_k(logits + t * E, bias, E, K, routing, scratch.data(), best.data(),
                  weights + t * K, ids + t * K);
  }, tokens * E >= 4096);
  return 0;
}

// x [T, D], ids [T, K] int32 (this rank's expert index; others are skipped), weights [T, K]
// float32, w13 [E, P13, D, 32] (gate|up, 2I columns, packed), w2 [E, P2, I, 32] (down, D
// columns, packed), or both in bfloat16 pairs (see run)
//   -> out [T, D] = sum over k of weights[t, k] * expert_ids[t, k](x[t])
int MoeExperts(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
               void *, void *) {
  if (nparam != 6) return 1;
  if (std::strcmp(dtypes[3], "bfloat16") == 0) {
    if (!kHasBf16Dot || std::strcmp(dtypes[0], "float32") != 0) return 1;
    return run<float, bf16>(params, shapes, ndims[3]);
  }
  if (std::strcmp(dtypes[0], "float16") == 0) return run<half, half>(params, shapes, ndims[3]);
  return run<float, float>(params, shapes, ndims[3]);
}

}  // extern "C"
