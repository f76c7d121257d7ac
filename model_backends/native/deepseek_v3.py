"""DeepSeek-V3 / R1 (and the V2 family's layout) in MindSpore graph mode.

Mirrors HF transformers' `DeepseekV3ForCausalLM` and the official checkpoints' tensor names:
multi-head latent attention (`q_a_proj`/`q_a_layernorm`/`q_b_proj`, or `q_proj` when
`q_lora_rank` is null; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`) over a latent KV cache
of `kv_lora_rank + qk_rope_head_dim` values per token; YaRN rope as vLLM's `deepseek_yarn`, with
the mscale correction of the softmax scale; dense MLP in the first `first_k_dense_replace` layers,
then sigmoid grouped top-k MoE with shared experts. Multi-token-prediction layers (index >=
num_hidden_layers) are not built and their tensors are skipped.
"""

import math

import mindspore as ms
from mindspore import mint, nn, ops

from model_backends.native.layers import (ColumnParallelLinear, ExpertShard, Linear,
                                          RowParallelLinear, packed_weight, tp_rank_and_size)
from model_backends.native.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from model_backends.native.moe import RoutedExperts
from model_backends.native.weights import is_mtp_tensor
from vllm_mindspore import envs
from vllm_mindspore.ops import RMSNorm, RotaryEmbedding
from vllm_mindspore.ops.host import zeros_parameter
from vllm_mindspore.ops.linear import packed_matmul
from vllm_mindspore.ops.mla import MLAAttention
from vllm_mindspore.ops.moe import GroupedTopK
from vllm_mindspore.platform import ASCEND, kernel_device

# HF's DeepseekV3RMSNorm default: q_a_layernorm / kv_a_layernorm are built without the config eps.
_LORA_NORM_EPS = 1e-6


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_and_softmax_scale(config) -> tuple[dict, float]:
    """vLLM's DeepseekV2/V3 reading of `rope_parameters`: any scaled rope becomes `deepseek_yarn`
    (or `deepseek_llama_scaling` when attention_factor == 1), and YaRN multiplies the softmax
    scale by mscale(factor, mscale_all_dim)^2 (the cos/sin tables carry the mscale ratio)."""
    params = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if params.get("rope_type", "default") != "default":
        params["rope_type"] = ("deepseek_llama_scaling" if params.get("attention_factor") == 1.0
                               else "deepseek_yarn")
    if params.get("rope_type") == "deepseek_yarn":
        mscale = yarn_get_mscale(params["factor"], float(params.get("mscale_all_dim", 0) or 0))
        scale *= mscale * mscale
    return params, scale


class DeepseekV3Attention(nn.Cell):
    """hidden [T, hidden] -> [T, hidden]; this step's latents are written to the layer's cache."""

    def __init__(self, config, block_size: int, dtype):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        tp_size = tp_rank_and_size()[1]
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} attention heads do not split over "
                             f"tensor_parallel_size={tp_size}.")
        # Heads split over TP ranks; the latent (and its cache) is the same on every rank.
        self.num_heads = total_heads // tp_size
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * self.qk_head_dim, False,
                                               dtype)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * self.qk_head_dim,
                                                 False, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias,
                                         dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + config.v_head_dim), False,
            dtype)
        self.kv_b_proj.quantizable = False  # absorbed into q and o after loading (float)
        self.o_proj = RowParallelLinear(total_heads * config.v_head_dim, hidden, bias, dtype)
        rope_parameters, scale = rope_and_softmax_scale(config)
        # rope_interleave (HF default, the official checkpoints' layout): GPT-J style pairs
        # (x0, x1), (x2, x3)...
        self.rotary_emb = RotaryEmbedding(
            self.qk_rope_head_dim, self.qk_rope_head_dim, config.max_position_embeddings,
            rope_parameters, is_neox_style=not getattr(config, "rope_interleave", True),
            dtype=dtype)
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim,
                                 self.qk_rope_head_dim, config.v_head_dim, scale, block_size)
        self.kv_cache = None

    def allocate_kv_cache(self, num_blocks: int, dtype, layer_name: str) -> None:
        self.kv_cache = zeros_parameter(self.attn.cache_shape(num_blocks), dtype,
                                        f"{layer_name}.kv_cache")

    def construct(self, positions, hidden, attn_metadata, prefill_only):
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        kv_a = self.kv_a_proj_with_mqa(hidden)
        if self.attn.absorbed_kernel is not None:
            return self.o_proj(self.attn.absorbed(q, kv_a, self.kv_cache, positions,
                                                  *attn_metadata))
        q = q.reshape(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope = q[..., :self.qk_nope_head_dim]
        q_pe = q[..., self.qk_nope_head_dim:]
        latent = self.kv_a_layernorm(kv_a[:, :self.kv_lora_rank])
        k_pe = kv_a[:, self.kv_lora_rank:].reshape(num_tokens, 1, self.qk_rope_head_dim)
        # q_pe and k_pe rotated in one call, stacked along heads.
        pe = self.rotary_emb(positions, mint.cat((q_pe, k_pe), dim=1))
        q_pe = pe[:, :self.num_heads]
        latent = mint.cat((latent, pe[:, self.num_heads].reshape(num_tokens, -1)), dim=-1)
        out = self.attn(q_nope, q_pe, latent, self.kv_cache, positions, *attn_metadata,
                        prefill_only)
        return self.o_proj(out)

    def process_weights_after_loading(self, prefix: str) -> None:
        """kv_b_proj only ever runs absorbed into q and o: split it once, then drop it."""
        self.attn.absorb_kv_b(self.kv_b_proj.weight, f"{prefix}.attn")
        self.kv_b_proj = None

    def use_compute_layout(self, prefix: str) -> None:
        """CPU, float32 activations: the attention after the projections in one operator."""
        if envs.VLLM_MS_CPU_LAYER_KERNEL:
            self.attn.use_absorbed_kernel(self.kv_a_layernorm, self.rotary_emb, f"{prefix}.attn")


class DeepseekV3TopkRouter(nn.Cell):
    """hidden [T, hidden] -> (weights [T, K] float32, expert ids [T, K] int32).

    Sigmoid scores; `e_score_correction_bias` only steers the choice: groups ranked by the sum
    of their top-2 biased scores, the best `topk_group` groups kept, top-k experts inside them;
    the weights are the un-biased scores (renormalised if norm_topk_prob) * routed_scaling_factor
    (`GroupedTopK`). The logits are float32 whatever the model's dtype, as in HF.
    """

    def __init__(self, config, dtype):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.weight = zeros_parameter((self.num_experts, config.hidden_size), dtype)
        # float32 in the checkpoints (HF keeps it in float32 whatever the model dtype).
        self.e_score_correction_bias = zeros_parameter((self.num_experts,), ms.float32)
        self.matmul = ops.MatMul(transpose_b=True)
        self.packed = None  # CPU: the kernel over the packed weight
        self.routing = GroupedTopK(config.num_experts_per_tok, config.n_group or 1,
                                   config.topk_group or 1, 2, -1e30, bool(config.norm_topk_prob),
                                   float(config.routed_scaling_factor))

    def use_compute_layout(self, prefix: str) -> None:
        """CPU: the weight packed in float32 for the matmul kernel."""
        if kernel_device() == ASCEND or self.packed is not None:
            return
        self.packed = packed_matmul(self.num_experts)
        self.weight = packed_weight(self.weight, ms.float32, prefix)

    def construct(self, hidden):
        if hidden.dtype != ms.float32:
            hidden = hidden.astype(ms.float32)
        if self.packed is not None:
            logits = self.packed(hidden, self.weight)
        else:
            logits = self.matmul(hidden, self.weight.astype(ms.float32))
        return self.routing(logits, self.e_score_correction_bias)


class DeepseekV3MoE(RoutedExperts):
    """hidden [T, hidden] -> routed experts (weighted) + shared experts."""

    def __init__(self, config, dtype):
        super().__init__(config.n_routed_experts, config.hidden_size,
                         config.moe_intermediate_size, dtype)
        self.gate = DeepseekV3TopkRouter(config, dtype)
        self.has_shared = bool(config.n_shared_experts)
        if self.has_shared:
            self.shared_experts = LlamaMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, dtype,
                reduce_results=False)

    def construct(self, hidden):
        weights, expert_ids = self.gate(hidden)
        if not self.has_shared:
            return self.routed(hidden, weights, expert_ids)
        return self.routed_plus_shared(hidden, weights, expert_ids, self.shared_experts(hidden))


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV3Attention

    def make_mlp(self, config, layer_index: int, dtype) -> nn.Cell:
        if layer_index >= config.first_k_dense_replace:
            return DeepseekV3MoE(config, dtype)
        return super().make_mlp(config, layer_index, dtype)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """(input_ids [T], positions [T], logits_index [N], *AttentionMetadata) -> logits [N, vocab]
    in float32. One latent KV cache per layer: [slots, kv_lora_rank + qk_rope_head_dim]."""

    decoder_layer_cls = DeepseekV3DecoderLayer

    def kv_cache_spec(self, block_size: int, torch_dtype):
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        attn = self.model.layers[0].self_attn
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                head_size=attn.attn.latent_size, dtype=torch_dtype)
        return {name: spec for name in self.attention_layers()}

    def checkpoint_name_to_param(self, name: str) -> str | None:
        if is_mtp_tensor(name, self.config.num_hidden_layers):
            return None
        name = ExpertShard.for_rank(self.config.n_routed_experts).local_name(name)
        return None if name is None else super().checkpoint_name_to_param(name)
