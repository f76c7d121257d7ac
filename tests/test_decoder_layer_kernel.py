"""Consecutive decoder layers as one CPU operator (vllm_mindspore/ops/decoder.py) against the same
layers as their separate operators: the same kernels in the same order, so the same bits, over
steps that mix prefills, a chunked prefill, decodes and padding. With bfloat16 weights (--dtype bfloat16 on
CPU) too: where AMX takes a step, the operator's norms and silu * up write their rows rounded to
bfloat16 for the tiles, which the separate operators' matmuls round as they read them. Its
agreement with HF transformers is test_correctness.py's (the operator is the default)."""

import mindspore as ms
import numpy as np
import pytest

from vllm_mindspore.ops.attention import AttentionMetadata
from vllm_mindspore.ops.decoder import DecoderLayersKernel
from vllm_mindspore.ops.linear import packing_bfloat16
from vllm_mindspore.platform import cpu_has_bfloat16_dot

ms.set_context(mode=ms.GRAPH_MODE)

BLOCK_SIZE = 16
NUM_BLOCKS = 12
ROWS = 4  # request rows of the attention metadata
PADDED_TOKENS = 40

MODELS = {
    # q/k/v bias, tied embeddings, an intermediate size whose gate|up halves are not whole
    # panels of the packed matmul (the kernel's unfused silu * up).
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, intermediate_size=72)),
    "qwen3": ("Qwen3ForCausalLM", dict(num_hidden_layers=3)),  # q/k head norms
    "llama": ("LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=16)),
    # Layer 1 dense (mlp_only_layers) between two sparse ones (their router, softmax top-k and
    # experts in the operator too), with and without renormalised expert weights.
    **{f"qwen3-moe-norm-{norm}": ("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=norm)) for norm in (True, False)},
}
# The same model with its sparse layers kept out of the operator (as W8A8 experts are): the dense
# layer alone is one operator, between two layers of separate operators, and takes the residual
# stream of the layer before it.
MODELS["qwen3-moe-dense-layer-alone"] = MODELS["qwen3-moe-norm-True"]

# Steps of requests (tokens this step, tokens before it): A and B prefill (B in chunks), then A
# decodes beside B's second chunk and a new request C, then a step with no padding (its last
# token in the last, partial block of rows of a matmul) where B and C go on.
STEPS = [[(7, 0), (12, 0)], [(1, 7), (8, 12), (5, 0)], [(1, 8), (19, 20), (20, 5)]]


def build(arch: str, model_dir: str, layer_kernel: bool, bfloat16: bool, monkeypatch):
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config

    from model_backends.native.llama import LlamaForCausalLM
    from model_backends.native.qwen2 import Qwen2ForCausalLM
    from model_backends.native.qwen3 import Qwen3ForCausalLM
    from model_backends.native.qwen3_moe import Qwen3MoeForCausalLM
    from model_backends.native.weights import load_checkpoint, process_weights_after_loading

    classes = {cls.__name__: cls for cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                             Qwen3MoeForCausalLM)}
    monkeypatch.setenv("VLLM_MS_CPU_LAYER_KERNEL", "1" if layer_kernel else "0")
    with set_current_vllm_config(VllmConfig()):  # vLLM's rope tables read it
        model = classes[arch](AutoConfig.from_pretrained(model_dir), BLOCK_SIZE, ms.float32)
    with packing_bfloat16(bfloat16):
        load_checkpoint(model, model_dir, model.checkpoint_name_to_param)
        process_weights_after_loading(model)
    model.allocate_kv_cache(NUM_BLOCKS, ms.bfloat16 if bfloat16 else ms.float32)
    return model


def run_steps(model, vocab_size: int, padded: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """-> (each step's hidden states [PADDED_TOKENS, hidden] (`padded`; else the step's tokens),
    every layer's key and value cache after the steps)."""
    rng = np.random.default_rng(0)
    # Request r holds blocks 3r, 3r + 1, 3r + 2, in a scrambled order.
    block_tables = np.zeros((ROWS, 3), np.int32)
    block_tables[:3] = rng.permutation(9).reshape(3, 3)
    outputs = []
    for step in STEPS:
        scheduled = np.array([n for n, _ in step], np.int32)
        computed = np.array([c for _, c in step], np.int32)
        positions = np.concatenate([np.arange(c, c + n) for n, c in step]).astype(np.int32)
        size = PADDED_TOKENS if padded else len(positions)
        metadata = AttentionMetadata.build(scheduled, computed, positions, block_tables,
                                           BLOCK_SIZE, size)
        ids = np.zeros(size, np.int32)
        ids[:len(positions)] = rng.integers(0, vocab_size, len(positions))
        padded_positions = np.zeros(size, np.int32)
        padded_positions[:len(positions)] = positions
        hidden = model(ms.Tensor(ids), ms.Tensor(padded_positions), *metadata.tensors())
        outputs.append(hidden.asnumpy())
    caches = [cache.astype(ms.float32).asnumpy()
              for layer in model.attention_layers().values()
              for cache in (layer.key_cache, layer.value_cache)]
    return outputs, caches


@pytest.mark.parametrize("weights", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not cpu_has_bfloat16_dot(), reason="this CPU has no AVX512-BF16"))])
@pytest.mark.parametrize("name", list(MODELS))
def test_layer_kernel_equals_separate_operators(tiny_model_factory, monkeypatch, name, weights):
    from model_backends.native.qwen3_moe import Qwen3MoeSparseMoeBlock

    arch, overrides = MODELS[name]
    model_dir = tiny_model_factory(arch, **overrides)
    bfloat16 = weights == "bfloat16"
    alone = name == "qwen3-moe-dense-layer-alone"
    if alone:
        monkeypatch.setattr(Qwen3MoeSparseMoeBlock, "layer_mlp", lambda self: None)
    one_operator = build(arch, model_dir, True, bfloat16, monkeypatch)
    separate = build(arch, model_dir, False, bfloat16, monkeypatch)
    expected = [False, True, False] if alone else [True] * one_operator.config.num_hidden_layers
    assert [layer.layer_tensors is not None for layer in one_operator.model.layers] == expected
    # Each run of consecutive such layers is one operator, in the layers' order.
    runs = one_operator.model.runs
    operators = [isinstance(run, DecoderLayersKernel) for run in runs]
    assert operators == (expected if not all(expected) else [True])
    assert [layer for run, operator in zip(runs, operators)
            for layer in (run.layers if operator else [run])] == list(one_operator.model.layers)
    assert all(layer.layer_tensors is None for layer in separate.model.layers)
    assert separate.model.runs is None
    vocab = one_operator.config.vocab_size
    # The operator computes a step's tokens only and gives the padding rows zeros, where the
    # separate operators compute those rows too. Their sparse layers route the padding rows to
    # experts, whose matmuls pick AMX tiles or vector blocks by how many rows they get: so the
    # MoE model's bfloat16 steps here carry no padding.
    padded = not (arch == "Qwen3MoeForCausalLM" and bfloat16)
    (fused_out, fused_caches), (ref_out, ref_caches) = (run_steps(m, vocab, padded)
                                                        for m in (one_operator, separate))
    for step, (fused, ref) in enumerate(zip(fused_out, ref_out)):
        tokens = sum(n for n, _ in STEPS[step])
        assert np.abs(ref[:tokens]).max() > 0
        np.testing.assert_array_equal(fused[:tokens], ref[:tokens], err_msg=f"step {step}")
        if expected[-1]:  # the last layer is the operator: nothing computed past the tokens
            assert not fused[tokens:].any()
    for fused, ref in zip(fused_caches, ref_caches):
        assert np.abs(ref).max() > 0
        np.testing.assert_array_equal(fused, ref)
