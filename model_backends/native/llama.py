"""Llama-family decoder (Llama 2/3, and the base of Qwen2/Qwen3) in MindSpore graph mode.

Mirrors HF transformers' `LlamaForCausalLM`: same module tree and tensor names
(`model.layers.N.self_attn.q_proj.weight`, ...), GQA, `head_dim` independent of
hidden_size / num_heads, tied or untied embeddings, any rope scaling vLLM supports.
The forward takes vLLM's packed token batch and returns logits only for `logits_index`.
"""

import mindspore as ms
from mindspore import Parameter, mint, nn, ops

from model_backends.native.layers import (ColumnParallelLinear, Linear, ParallelLMHead,
                                          RowParallelLinear,
                                          ShardSpec, SiluAndMul, VocabParallelEmbedding,
                                          even_split, tp_rank_and_size)
from vllm_mindspore.ops import AttentionMetadata, PagedAttention, RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Cell):
    """hidden: [T, hidden] -> [T, hidden]; K/V of this step are written to the layer's cache."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, config, block_size: int, dtype):
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        tp_rank, tp_size = tp_rank_and_size()
        if total_heads % tp_size or (total_kv_heads % tp_size and tp_size % total_kv_heads):
            raise ValueError(f"{total_heads} attention heads / {total_kv_heads} KV heads do not "
                             f"split over tensor_parallel_size={tp_size}.")
        self.num_heads = total_heads // tp_size
        # More ranks than KV heads: each KV head is replicated on tp_size / total_kv_heads ranks.
        self.num_kv_heads = max(1, total_kv_heads // tp_size)
        kv_shard = (even_split(total_kv_heads * self.head_dim) if tp_size <= total_kv_heads else
                    ShardSpec(0, tp_rank * total_kv_heads // tp_size * self.head_dim,
                              self.head_dim))
        hidden = config.hidden_size
        bias = getattr(config, "attention_bias", False) or self.qkv_bias
        self.q_proj = ColumnParallelLinear(hidden, total_heads * self.head_dim, bias, dtype)
        self.k_proj = ColumnParallelLinear(hidden, total_kv_heads * self.head_dim, bias, dtype,
                                           kv_shard)
        self.v_proj = ColumnParallelLinear(hidden, total_kv_heads * self.head_dim, bias, dtype,
                                           kv_shard)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden,
                                        getattr(config, "attention_bias", False), dtype)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, self.head_dim, config.max_position_embeddings,
            getattr(config, "rope_parameters", None), is_neox_style=True, dtype=dtype)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, block_size)
        self.key_cache = None
        self.value_cache = None

    def allocate_kv_cache(self, num_blocks: int, dtype, layer_name: str) -> None:
        self.key_cache = Parameter(mint.zeros(self.attn.cache_shape(num_blocks), dtype=dtype),
                                   name=f"{layer_name}.key_cache", requires_grad=False)
        self.value_cache = Parameter(mint.zeros(self.attn.cache_shape(num_blocks, value=True),
                                                dtype=dtype), name=f"{layer_name}.value_cache",
                                     requires_grad=False)

    def construct(self, positions, hidden, attn_metadata):
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).reshape(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, self.key_cache, self.value_cache, *attn_metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Cell):
    """x [T, hidden] -> [T, hidden]; the intermediate features are split over TP ranks
    (`reduce_results=False` leaves the partial sums for the caller to all-reduce), or not at all
    with `tp_split=False` (an expert that lives whole on one expert-parallel rank)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype,
                 reduce_results: bool = True, tp_split: bool = True):
        super().__init__()
        if tp_split:
            self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, False, dtype)
            self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, False, dtype)
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype,
                                               reduce_results)
        else:
            self.gate_proj = Linear(hidden_size, intermediate_size, False, dtype)
            self.up_proj = Linear(hidden_size, intermediate_size, False, dtype)
            self.down_proj = Linear(intermediate_size, hidden_size, False, dtype)
        self.act = SiluAndMul()

    def construct(self, x):
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Cell):
    """Pre-norm attention + MLP, both residual. Subclasses pick the attention class and, for
    models whose layers differ by index (dense or MoE), the MLP through `make_mlp`."""

    attention_cls = LlamaAttention

    def __init__(self, config, layer_index: int, block_size: int, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(config, block_size, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = self.make_mlp(config, layer_index, dtype)

    def make_mlp(self, config, layer_index: int, dtype) -> nn.Cell:
        return LlamaMLP(config.hidden_size, config.intermediate_size, dtype)

    def construct(self, positions, hidden, attn_metadata):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Cell):
    def __init__(self, config, decoder_layer_cls, block_size: int, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.CellList([decoder_layer_cls(config, i, block_size, dtype)
                                   for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def construct(self, input_ids, positions, attn_metadata):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, attn_metadata)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Cell):
    """(input_ids [T], positions [T], logits_index [N], *AttentionMetadata) -> logits [N, vocab]
    in float32."""

    decoder_layer_cls = LlamaDecoderLayer

    def __init__(self, config, block_size: int, dtype=ms.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, self.decoder_layer_cls, block_size, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, dtype,
            tied=self.model.embed_tokens if self.tie_word_embeddings else None)

    def construct(self, input_ids, positions, logits_index, slot_mapping, block_tables,
                  query_index, query_positions, token_index):
        attn_metadata = (slot_mapping, block_tables, query_index, query_positions, token_index)
        hidden = self.model(input_ids, positions, attn_metadata)
        return self.lm_head(ops.gather(hidden, logits_index, 0))

    def dynamic_inputs(self) -> tuple:
        token_ids = ms.Tensor(shape=[None], dtype=ms.int32)
        return (token_ids, token_ids, token_ids) + AttentionMetadata.dynamic_inputs()

    # ---- KV cache --------------------------------------------------------------------------
    def attention_layers(self) -> dict[str, nn.Cell]:
        """vLLM layer name -> the attention Cell that owns that layer's cache."""
        return {f"model.layers.{i}.self_attn.attn": layer.self_attn
                for i, layer in enumerate(self.model.layers)}

    def kv_cache_spec(self, block_size: int, torch_dtype):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        attn = self.model.layers[0].self_attn
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=attn.num_kv_heads,
                                 head_size=attn.head_dim, dtype=torch_dtype)
        return {name: spec for name in self.attention_layers()}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        for name, layer in self.attention_layers().items():
            layer.allocate_kv_cache(num_blocks, self.dtype, name)

    # ---- weights ---------------------------------------------------------------------------
    def checkpoint_name_to_param(self, name: str) -> str | None:
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name
