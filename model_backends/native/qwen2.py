"""Qwen2: the Llama decoder with biases on the q/k/v projections."""

from model_backends.native.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2DecoderLayer
