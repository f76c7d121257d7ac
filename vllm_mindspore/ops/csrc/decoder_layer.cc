// CPU kernel behind vllm_mindspore.ops.decoder: consecutive Llama-family decoder layers (pre-norm
// attention and MLP, both residual) as one operator, running the plugin's own kernels in turn on
// their intermediates. MindSpore spends ~40-70 us between two operators of a graph on these CPUs;
// a layer of separate operators is 7 launches (norm, q|k|v, attention, o, norm, gate|up, down),
// and a model's layers one operator each were still 8 launches a step. The MLP is dense, or
// softmax top-k routed experts (Qwen3-MoE: router, routing, experts).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "gemm.h"  // amx_takes, Buffer

extern "C" {
int RmsNorm(int, void **, int *, int64_t **, const char **, void *, void *);
int AddRmsNorm(int, void **, int *, int64_t **, const char **, void *, void *);
int Linear(int, void **, int *, int64_t **, const char **, void *, void *);
int LinearBias(int, void **, int *, int64_t **, const char **, void *, void *);
int LinearSiluMul(int, void **, int *, int64_t **, const char **, void *, void *);
int SoftmaxTopK(int, void **, int *, int64_t **, const char **, void *, void *);
int MoeExperts(int, void **, int *, int64_t **, const char **, void *, void *);
int RotaryPagedAttentionNeox(int, void **, int *, int64_t **, const char **, void *, void *);
}

namespace {

using vllm_ms::Arg;
using vllm_ms::call;
using vllm_ms::elements;
using vllm_ms::Kernel;

// One layer's inputs to decoder_layer (DecoderLayers gathers them from its own); an optional one
// (residual, qkv_bias, qk_norm, router) is absent when empty.
enum Input {
  kHidden,       // [T, E]
  kResidual,     // [T, E], or [0] (the first layer: the stream starts at hidden)
  kInputNorm,    // [E]
  kEps,          // [1] float32, every norm's
  kQkv,          // packed q|k|v (linear.cc)
  kQkvBias,      // [N] or [0]
  kQkNorm,       // [H + KVH, D] (Qwen3's stacked q_norm | k_norm) or [0]
  kOProj,        // packed [E, H * Dv]
  kPostNorm,     // [E]
  kGateUp,       // packed gate|up [2I, E], or the experts' stacked w13 (moe.cc)
  kDown,         // packed [E, I], or the experts' stacked w2
  kRouter,       // packed [experts, E] (routed experts), or [0] (a dense MLP)
  kKeyCache,     // the attention's (paged_attention.cc) ...
  kValueCache,
  kSlotMapping,
  kBlockTables,
  kSeqLens,
  kQLens,
  kScale,
  kPositions,
  kCosSin,       // ... inputs
  kSizes,        // [4] int32: H (this layer's query heads), I (the MLP's or an expert's
                 // intermediate size), K (experts a token; 0: a dense MLP), renormalize (0 / 1)
  kInputs
};

int decoder_layer(void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  auto input = [&](int i) {
    return Arg{params[i], std::vector<int64_t>(shapes[i], shapes[i] + ndims[i]), dtypes[i]};
  };
  auto present = [&](int i) { return elements(ndims[i], shapes[i]) > 0; };
  if (ndims[kHidden] != 2 || ndims[kKeyCache] != 4 || ndims[kValueCache] != 4 ||
      elements(ndims[kSizes], shapes[kSizes]) != 4) {
    return 1;
  }
  const char *act = dtypes[kHidden];
  const size_t width = std::strcmp(act, "float32") == 0 ? 4 : 2;
  const int64_t padded_tokens = shapes[kHidden][0], E = shapes[kHidden][1];
  // The step's tokens come first, then padding up to a compiled graph size: the layer computes
  // the tokens' rows only (so padding costs nothing) and gives the padding rows zeros.
  const int32_t *q_lens = static_cast<const int32_t *>(params[kQLens]);
  int64_t T = 0;
  for (int64_t row = 0; row < elements(ndims[kQLens], shapes[kQLens]); ++row)
    T += std::max(q_lens[row], 0);
  if (T > padded_tokens) return 1;  // inconsistent metadata: MindSpore raises
  const int64_t kv_heads = shapes[kKeyCache][1], D = shapes[kKeyCache][2];
  const int64_t Dv = shapes[kValueCache][3];
  const int32_t *sizes = static_cast<const int32_t *>(params[kSizes]);
  const int64_t heads = sizes[0], I = sizes[1], top_k = sizes[2];
  if ((top_k > 0) != present(kRouter)) return 1;
  const int64_t N = (heads + kv_heads) * D + kv_heads * Dv;
  const Arg hidden_out{params[kInputs], {T, E}, act};
  const Arg residual_out{params[kInputs + 1], {T, E}, act};
  for (const Arg &out : {hidden_out, residual_out}) {
    std::memset(static_cast<char *>(out.data) + T * E * width, 0,
                static_cast<size_t>((padded_tokens - T) * E) * width);
  }
  // An input of [padded_tokens, ...] as its first T rows.
  auto tokens_of = [&](int i) {
    Arg arg = input(i);
    arg.shape[0] = T;
    return arg;
  };
  // The intermediates, reused from call to call.
  struct Intermediates {
    vllm_ms::Buffer<char> normed, qkv, qk, attn, o, gated, routed_x, logits, weights, ids;
  };
  const vllm_ms::Scratch<Intermediates> buffers;
  auto scratch = [&](vllm_ms::Buffer<char> &buffer, std::vector<int64_t> shape,
                     const char *dtype) {
    const bool wide = std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "int32") == 0;
    const size_t bytes = wide ? 4 : 2;
    buffer.resize(static_cast<size_t>(elements(static_cast<int>(shape.size()), shape.data())) *
                  bytes);
    return Arg{buffer.data(), std::move(shape), dtype};
  };
  // Where AMX takes the step's matmuls (bfloat16 weights, float32 activations), which round
  // their rows of x to bfloat16: the norms, attention and silu(gate) * up write their rows so
  // rounded (the same values, a pass over them and half their bytes fewer).
  const bool rounded_rows = std::strcmp(act, "float32") == 0 &&
                            std::strcmp(dtypes[kQkv], "bfloat16") == 0 &&
                            vllm_ms::amx_takes(T);
  const char *matmul_rows = rounded_rows ? "bfloat16" : act;
  const Arg normed = scratch(buffers->normed, {T, E}, matmul_rows);
  const Arg qkv = scratch(buffers->qkv, {T, N}, act);
  const Arg attn = scratch(buffers->attn, {T, heads, Dv}, matmul_rows);
  const Arg o = scratch(buffers->o, {T, E}, act);
  const Arg qk = present(kQkNorm) ? scratch(buffers->qk, {T, heads + kv_heads, D}, act) : qkv;

  // Each step as its own operator would run it; the first kernel that refuses its inputs
  // (status != 0) stops the layer, and MindSpore raises.
  std::vector<std::pair<Kernel, std::vector<Arg>>> steps;
  if (present(kResidual)) {
    steps.push_back({AddRmsNorm, {tokens_of(kHidden), tokens_of(kResidual), input(kInputNorm),
                                  input(kEps), normed, residual_out}});
  } else {
    std::memcpy(residual_out.data, params[kHidden], static_cast<size_t>(T * E) * width);
    steps.push_back({RmsNorm, {tokens_of(kHidden), input(kInputNorm), input(kEps), normed}});
  }
  if (present(kQkvBias)) {
    steps.push_back({LinearBias, {normed, input(kQkv), input(kQkvBias), qkv}});
  } else {
    steps.push_back({Linear, {normed, input(kQkv), qkv}});
  }
  if (present(kQkNorm)) steps.push_back({RmsNorm, {qkv, input(kQkNorm), input(kEps), qk}});
  steps.push_back({RotaryPagedAttentionNeox,
                   {qk, qkv, input(kKeyCache), input(kValueCache), tokens_of(kSlotMapping),
                    input(kBlockTables), input(kSeqLens), input(kQLens), input(kScale),
                    tokens_of(kPositions), input(kCosSin), attn}});
  steps.push_back({Linear, {Arg{attn.data, {T, heads * Dv}, matmul_rows}, input(kOProj), o}});
  if (top_k == 0) {
    const Arg gated = scratch(buffers->gated, {T, I}, matmul_rows);
    // In place on the residual stream: the norm reads a row whole before it writes it.
    steps.push_back({AddRmsNorm, {o, residual_out, input(kPostNorm), input(kEps), normed,
                                  residual_out}});
    steps.push_back({LinearSiluMul, {normed, input(kGateUp), gated}});
    steps.push_back({Linear, {gated, input(kDown), hidden_out}});
  } else {
    // The router and the experts take the norm's rows in the activations' dtype (the experts'
    // matmuls round them for AMX themselves, per expert).
    const Arg routed_x = scratch(buffers->routed_x, {T, E}, act);
    const Arg logits = scratch(buffers->logits, {T, shapes[kGateUp][0]}, act);
    const Arg weights = scratch(buffers->weights, {T, top_k}, "float32");
    const Arg ids = scratch(buffers->ids, {T, top_k}, "int32");
    const Arg renormalize{const_cast<int32_t *>(sizes + 3), {1}, "int32"};
    steps.push_back({AddRmsNorm, {o, residual_out, input(kPostNorm), input(kEps), routed_x,
                                  residual_out}});
    steps.push_back({Linear, {routed_x, input(kRouter), logits}});
    steps.push_back({SoftmaxTopK, {logits, renormalize, weights, ids}});
    steps.push_back({MoeExperts, {routed_x, ids, weights, input(kGateUp), input(kDown),
                                  hidden_out}});
  }
  for (const auto &[kernel, args] : steps) {
    if (const int status = call(kernel, args)) return status;
  }
  return 0;
}

// DecoderLayers' inputs: the step's, then each layer's own group (the order in which
// ops/decoder.py's DecoderLayersKernel passes them), then the two outputs.
constexpr int kStepInputs[] = {kHidden, kResidual, kSlotMapping, kBlockTables, kSeqLens, kQLens,
                               kPositions};
constexpr int kLayerInputs[] = {kInputNorm, kEps, kQkv, kQkvBias, kQkNorm, kOProj, kPostNorm,
                                kGateUp, kDown, kRouter, kKeyCache, kValueCache, kScale, kCosSin,
                                kSizes};
constexpr int kNumStepInputs = sizeof(kStepInputs) / sizeof(kStepInputs[0]);
constexpr int kNumLayerInputs = sizeof(kLayerInputs) / sizeof(kLayerInputs[0]);

}  // namespace

extern "C" {

// (hidden [T, E], residual [T, E] or [0] (the stream starts at hidden), slot_mapping,
// block_tables, seq_lens, q_lens, positions, then per layer the 15 inputs of kLayerInputs) ->
// (the last layer's output [T, E], the residual stream before it [T, E]), as a chain of
// LlamaDecoderLayer.construct returns them. Each layer after the first reads the outputs in
// place: its first norm reads hidden and residual before its last matmul writes hidden.
int DecoderLayers(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                  void *, void *) {
  const int layer_inputs = nparam - kNumStepInputs - 2;
  if (layer_inputs < kNumLayerInputs || layer_inputs % kNumLayerInputs != 0) return 1;
  void *layer_params[kInputs + 2];
  int layer_ndims[kInputs + 2];
  int64_t *layer_shapes[kInputs + 2];
  const char *layer_dtypes[kInputs + 2];
  auto take = [&](int to, int from) {
    layer_params[to] = params[from];
    layer_ndims[to] = ndims[from];
    layer_shapes[to] = shapes[from];
    layer_dtypes[to] = dtypes[from];
  };
  for (int i = 0; i < kNumStepInputs; ++i) take(kStepInputs[i], i);
  take(kInputs, nparam - 2);
  take(kInputs + 1, nparam - 1);
  for (int layer = 0; layer < layer_inputs / kNumLayerInputs; ++layer) {
    for (int i = 0; i < kNumLayerInputs; ++i) {
      take(kLayerInputs[i], kNumStepInputs + layer * kNumLayerInputs + i);
    }
    if (layer > 0) {
      take(kHidden, nparam - 2);
      take(kResidual, nparam - 1);
    }
    if (const int status = decoder_layer(layer_params, layer_ndims, layer_shapes, layer_dtypes)) {
      return status;
    }
  }
  return 0;
}

}  // extern "C"
