"""Llama-family decoder (Llama 2/3, and the base of Qwen2/Qwen3) in MindSpore graph mode.

Mirrors HF transformers' `LlamaForCausalLM`: same module tree and tensor names
(`model.layers.N.self_attn.q_proj.weight`, ...), GQA, `head_dim` independent of
hidden_size / num_heads, tied or untied embeddings, any rope scaling vLLM supports.
The forward takes vLLM's packed token batch and returns the last hidden states; the logits of
the rows the step samples from are a second, small graph (`logits_head`). After loading, q/k/v
and gate/up run as one matmul each (`process_weights_after_loading`).
"""

import mindspore as ms
from mindspore import nn

from model_backends.native.layers import (ColumnParallelLinear, Linear, ParallelLMHead,
                                          RowParallelLinear, ShardSpec,
                                          VocabParallelEmbedding, even_split, fuse_linears,
                                          tp_rank_and_size)
from vllm_mindspore import envs
from vllm_mindspore.ops import (AttentionMetadata, GreedyTokens, PagedAttention, RMSNorm,
                                RotaryEmbedding)
from vllm_mindspore.ops.decoder import DecoderLayersKernel, DecoderLayerTensors, LayerMLP
from vllm_mindspore.ops.host import zeros_parameter


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
        rotary = RotaryEmbedding(
            self.head_dim, self.head_dim, config.max_position_embeddings,
            getattr(config, "rope_parameters", None), is_neox_style=True, dtype=dtype,
            heads=self.num_heads + self.num_kv_heads)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, block_size, rotary=rotary)
        self.key_cache = None
        self.value_cache = None

    def allocate_kv_cache(self, num_blocks: int, dtype, layer_name: str) -> None:
        key_shape, value_shape = self.attn.cache_shapes(num_blocks)
        self.key_cache = zeros_parameter(key_shape, dtype, f"{layer_name}.key_cache")
        self.value_cache = zeros_parameter(value_shape, dtype, f"{layer_name}.value_cache")

    def process_weights_after_loading(self, prefix: str) -> None:
        """q|k|v as one projection; q_norm|k_norm as one norm over the stacked q and k heads."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj], f"{prefix}.qkv_proj")
        self.q_proj = self.k_proj = self.v_proj = None
        if self.qk_norm:
            self.qk_norm_ = RMSNorm.stacked(
                [(self.q_norm, self.num_heads), (self.k_norm, self.num_kv_heads)],
                f"{prefix}.qk_norm")
            self.q_norm = self.k_norm = None

    def construct(self, positions, hidden, attn_metadata, prefill_only):
        # q|k|v [T, (H + 2 KVH) * D]: the norm (Qwen3) and the attention (which applies the
        # rotary embedding) read the q and k heads at the front of each row, the attention the
        # values at its end (no split copies).
        qkv = self.qkv_proj(hidden)
        qk = self.qk_norm_(qkv) if self.qk_norm else qkv
        out = self.attn(qk, qkv, self.key_cache, self.value_cache, positions, *attn_metadata,
                        prefill_only)
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

    def process_weights_after_loading(self, prefix: str) -> None:
        """gate|up as one projection that also applies silu(gate) * up."""
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj], f"{prefix}.gate_up_proj",
                                         silu_and_mul=True)
        self.gate_proj = self.up_proj = None

    def layer_mlp(self) -> LayerMLP | None:
        """The MLP as the decoder layers' operator runs it (CPU, float weights), else None."""
        if self.gate_up_proj.packed is None or self.down_proj.packed is None:
            return None
        return LayerMLP(self.gate_up_proj.weight, self.down_proj.weight,
                        self.gate_up_proj.out_features // 2)

    def construct(self, x):
        return self.down_proj(self.gate_up_proj(x))


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
        self.layer_tensors = None  # CPU: the layer in a DecoderLayersKernel (use_compute_layout)

    def make_mlp(self, config, layer_index: int, dtype) -> nn.Cell:
        return LlamaMLP(config.hidden_size, config.intermediate_size, dtype)

    def use_compute_layout(self, prefix: str) -> None:
        """After its projections took their compute layouts: on CPU, the layer's inputs to the
        layers' operator (vllm_mindspore/ops/decoder.py) where nothing else runs between its
        parts (float weights, one tensor-parallel rank, Llama's attention, an MLP the operator
        runs: `layer_mlp`)."""
        attn = self.self_attn
        if not envs.VLLM_MS_CPU_LAYER_KERNEL or not isinstance(attn, LlamaAttention):
            return
        layer_mlp = self.mlp.layer_mlp()
        if (layer_mlp is None or attn.qkv_proj.packed is None or attn.o_proj.packed is None
                or attn.o_proj.bias is not None or tp_rank_and_size()[1] > 1):
            return
        qk_norm = attn.qk_norm_ if attn.qk_norm else None
        norms = [self.input_layernorm, self.post_attention_layernorm] + (
            [qk_norm] if qk_norm is not None else [])
        if not DecoderLayerTensors.applies(norms, attn.attn):
            return
        self.layer_tensors = DecoderLayerTensors(
            self.input_layernorm, attn.qkv_proj.weight, attn.qkv_proj.bias, qk_norm,
            attn.o_proj.weight, self.post_attention_layernorm, layer_mlp, attn.attn)

    def construct(self, positions, hidden, residual, attn_metadata, prefill_only):
        """hidden: the previous layer's output, residual: the stream before it (None for the
        first layer) -> (this layer's output, the stream before it); each norm also does the
        residual add."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata, prefill_only)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Cell):
    def __init__(self, config, decoder_layer_cls, block_size: int, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.CellList([decoder_layer_cls(config, i, block_size, dtype)
                                   for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.runs = None  # CPU: the layers, each run of them in one operator (use_compute_layout)

    def use_compute_layout(self, prefix: str) -> None:
        """After the layers' (children go first): each run of consecutive layers that the
        layers' operator computes becomes one operator; MindSpore's ~40-70 us between two
        operators was ~10% of a batch-1 decode step with one operator a layer."""
        if all(layer.layer_tensors is None for layer in self.layers):
            return
        runs, run = [], []
        for layer in self.layers:
            if layer.layer_tensors is not None:
                run.append(layer)
                continue
            if run:
                runs.append(DecoderLayersKernel(run))
                run = []
            runs.append(layer)
        if run:
            runs.append(DecoderLayersKernel(run))
        self.runs = nn.CellList(runs)

    def construct(self, input_ids, positions, attn_metadata, prefill_only):
        """-> the last layer's hidden states [T, hidden], before the final norm (applied by
        the logits head to the rows that are sampled)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        if self.runs is None:
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, attn_metadata, prefill_only)
        else:
            for run in self.runs:
                hidden, residual = run(positions, hidden, residual, attn_metadata, prefill_only)
        return hidden + residual


class LogitsHead(nn.Cell):
    """hidden [N, hidden] (last layer, before the final norm) -> (logits [N, vocab] float32,
    their greedy tokens [N] int32)."""

    def __init__(self, norm: RMSNorm, lm_head: ParallelLMHead):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.greedy = GreedyTokens()

    def construct(self, hidden):
        logits = self.lm_head(self.norm(hidden))
        return logits, self.greedy(logits)


class LlamaForCausalLM(nn.Cell):
    """(input_ids [T], positions [T], *AttentionMetadata, prefill_only) -> hidden [T, hidden];
    `logits_head()` turns the sampled rows into logits.

    The argument names are the graph's input names: Ascend's fused attention kernels read the
    per-request lengths from the inputs named `batch_valid_length` and `q_seq_lens`.
    `prefill_only` (a constant: one graph per value) marks a step of first prefills only, which
    Ascend runs with FlashAttention; the CPU kernels do not need it.
    """

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

    def construct(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length,
                  q_seq_lens, prefill_only=False):
        attn_metadata = (slot_mapping, block_tables, batch_valid_length, q_seq_lens)
        return self.model(input_ids, positions, attn_metadata, prefill_only)

    def logits_head(self) -> LogitsHead:
        return LogitsHead(self.model.norm, self.lm_head)

    def skips_padding(self) -> bool:
        """Whether every layer runs in the layers' CPU operator, which computes the step's tokens
        only (zeros for the padding rows after them)."""
        return all(layer.layer_tensors is not None for layer in self.model.layers)

    def dynamic_inputs(self) -> tuple:
        token_ids = ms.Tensor(shape=[None], dtype=ms.int32)
        return (token_ids, token_ids) + AttentionMetadata.dynamic_inputs()

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

    def allocate_kv_cache(self, num_blocks: int, dtype) -> None:
        for name, layer in self.attention_layers().items():
            layer.allocate_kv_cache(num_blocks, dtype, name)

    # ---- weights ---------------------------------------------------------------------------
    def checkpoint_name_to_param(self, name: str) -> str | None:
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name
