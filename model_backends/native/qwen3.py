"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (`q_norm`, `k_norm`) before rope."""

from model_backends.native.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
