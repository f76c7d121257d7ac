"""DeepSeek-V3 (MLA over a latent KV cache, grouped sigmoid MoE, YaRN) and Qwen3-MoE through
`vllm-mindspore serve`, against HF transformers on the same tiny safetensors: a batch of
mixed-length prompts, chunked prefill and prefix caching on. Plus the latent cache's size."""

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import PROMPTS, HFReference, assert_matches_hf, real_tiny_checkpoint

MAX_TOKENS = 10
BLOCK_SIZE = 16
KV_CACHE_BYTES = 4 << 20
SERVE_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes",
              str(KV_CACHE_BYTES), "--max-num-batched-tokens", "32", "--enable-prefix-caching",
              "--enable-prompt-tokens-details", "--block-size", str(BLOCK_SIZE))

# Three layers: layer 0 dense (first_k_dense_replace), layers 1-2 MoE with 8 routed experts in
# 4 groups (2 kept per token), a shared expert, YaRN with the softmax mscale correction.
DEEPSEEK = dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
    first_k_dense_replace=1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 0.8})

MODELS = {
    # DeepSeek-V3/R1 shape: q through a LoRA (q_a_proj, q_a_layernorm, q_b_proj), interleaved rope.
    "deepseek-v3-q-lora": ("DeepseekV3ForCausalLM", dict(
        DEEPSEEK, q_lora_rank=48, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # V2-Lite shape: q_lora_rank null (plain q_proj); neox rope, un-normalised top-k weights.
    "deepseek-v3-no-q-lora": ("DeepseekV3ForCausalLM", dict(
        DEEPSEEK, q_lora_rank=None, rope_interleave=False, routed_scaling_factor=1.5,
        norm_topk_prob=False)),
    # Layers 0 and 2 sparse, layer 1 dense (mlp_only_layers).
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)),
}


def latent_size(config: dict) -> int:
    return config["kv_lora_rank"] + config["qk_rope_head_dim"]


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    def build(name: str) -> str:
        return real_tiny_checkpoint(tiny_model_factory, *MODELS[name])

    return build


@pytest.mark.parametrize("name", list(MODELS))
def test_serve_matches_hf_with_chunked_prefill_and_prefix_caching(serve, models, name):
    model = models(name)
    server = serve(model, *SERVE_ARGS, env={"VLLM_MS_LOG_STEPS": "1"})
    client = server.client()

    def complete(prompt):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True})

    shared = PROMPTS[5]  # ~50 tokens: prefilled in 32-token chunks, then reused from the cache
    first = PROMPTS + [shared + " first"]
    second = [shared + " and the second one", PROMPTS[7] + " again"]
    with ThreadPoolExecutor(len(first)) as pool:  # submitted together: batched by vLLM
        responses = list(pool.map(complete, first))
        responses += list(pool.map(complete, second))
    assert responses[len(first)].usage.prompt_tokens_details.cached_tokens >= 32, (
        "the shared prefix was not served from the prefix cache")

    reference = HFReference(model)
    for prompt, response in zip(first + second, responses):
        choice = response.choices[0]
        ref_tokens, ref_steps = reference.greedy(choice.prompt_token_ids, MAX_TOKENS)
        assert_matches_hf(choice.token_ids, choice.logprobs.token_logprobs, ref_tokens, ref_steps,
                          f"{name} {prompt[:20]!r}")

    # Decodes and full 32-token prefill chunks both ran (and matched HF above).
    step_tokens = {int(n) for n in re.findall(r"step: \d+ reqs, (\d+) tokens",
                                              server.log_tail(100000))}
    assert min(step_tokens) <= 8 and max(step_tokens) == 32, step_tokens

    if name.startswith("deepseek"):
        # vLLM's block accounting saw the latent size: the fixed KV budget buys exactly
        # KV_CACHE_BYTES / (layers * block_size * latent * 4 bytes) blocks.
        config = json.load(open(os.path.join(model, "config.json")))
        blocks = int(re.search(r"KV cache: (\d+) blocks", server.log_tail(100000)).group(1))
        per_block = config["num_hidden_layers"] * BLOCK_SIZE * latent_size(config) * 4
        assert blocks == KV_CACHE_BYTES // per_block


def test_deepseek_kv_cache_is_the_latent(models):
    """The allocated cache of every layer is one row of kv_lora_rank + qk_rope_head_dim values
    per token slot, and the spec vLLM sizes blocks with says the same."""
    import mindspore as ms
    import torch
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config

    from model_backends.native.deepseek_v3 import DeepseekV3ForCausalLM

    config = AutoConfig.from_pretrained(models("deepseek-v3-q-lora"))
    with set_current_vllm_config(VllmConfig()):  # vLLM's rope tables read it
        model = DeepseekV3ForCausalLM(config, BLOCK_SIZE, ms.float32)
    num_blocks = 5
    model.allocate_kv_cache(num_blocks, ms.float32)
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    layers = model.attention_layers()
    assert len(layers) == config.num_hidden_layers
    for attn in layers.values():
        cache = attn.kv_cache
        assert tuple(cache.shape) == (num_blocks, latent, BLOCK_SIZE)  # CPU: slots innermost
        assert cache.nbytes // (num_blocks * BLOCK_SIZE) == latent * 4
    for spec in model.kv_cache_spec(BLOCK_SIZE, torch.float32).values():
        assert type(spec).__name__ == "MLAAttentionSpec"
        assert spec.page_size_bytes == BLOCK_SIZE * latent * 4


def test_stacked_expert_weights_compute_each_expert(models):
    """Both devices' stacked experts against each checkpoint expert's MLP in numpy: the Ascend
    grouped-matmul layout (silu(x @ w13[e][:, :I]) * (x @ w13[e][:, I:]) @ w2[e]; the fused
    kernels themselves need an NPU, this checks the weights they are given), and the CPU kernel
    run with every token routed to expert e."""
    import mindspore as ms
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config

    from model_backends.native.deepseek_v3 import DeepseekV3ForCausalLM
    from model_backends.native.weights import load_checkpoint, process_weights_after_loading
    from vllm_mindspore.platform import ASCEND, building_for

    model_dir = models("deepseek-v3-q-lora")
    config = AutoConfig.from_pretrained(model_dir)

    def build():
        model = DeepseekV3ForCausalLM(config, BLOCK_SIZE, ms.float32)
        load_checkpoint(model, model_dir, model.checkpoint_name_to_param)
        process_weights_after_loading(model)
        return model

    with set_current_vllm_config(VllmConfig()):
        with building_for(ASCEND):
            ascend = build()
        cpu = build()
    moe = ascend.model.layers[1].mlp
    assert moe.experts is None and cpu.model.layers[1].mlp.experts is None  # stacked
    w13, w2 = moe.dispatch.w13.asnumpy(), moe.dispatch.w2.asnumpy()
    size = config.moe_intermediate_size
    assert w13.shape == (config.n_routed_experts, config.hidden_size, 2 * size)
    assert w2.shape == (config.n_routed_experts, size, config.hidden_size)
    tensors = {}
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    tokens, top_k = 5, config.num_experts_per_tok
    x = np.random.default_rng(0).standard_normal((tokens, config.hidden_size)).astype(np.float32)
    weights = np.full((tokens, top_k), 1.0 / top_k, np.float32)
    for e in range(config.n_routed_experts):
        prefix = f"model.layers.1.mlp.experts.{e}."
        gate, up = (x @ tensors[prefix + p + "_proj.weight"].T for p in ("gate", "up"))
        expected = (gate / (1 + np.exp(-gate)) * up) @ tensors[prefix + "down_proj.weight"].T
        gate, up = x @ w13[e][:, :size], x @ w13[e][:, size:]
        grouped = (gate / (1 + np.exp(-gate)) * up) @ w2[e]
        np.testing.assert_allclose(grouped, expected, rtol=1e-4, atol=1e-5)
        ids = ms.Tensor(np.full((tokens, top_k), e, np.int32))
        kernel = cpu.model.layers[1].mlp.dispatch(ms.Tensor(x), ms.Tensor(weights), ids)
        np.testing.assert_allclose(kernel.asnumpy(), expected, rtol=1e-4, atol=1e-5)
    # MLA: kv_b_proj was split into the absorbed W_UK / W_UV and dropped.
    attn = ascend.model.layers[0].self_attn
    assert attn.kv_b_proj is None
    assert tuple(attn.attn.w_uk.shape) == (config.num_attention_heads, config.qk_nope_head_dim,
                                           config.kv_lora_rank)
    assert tuple(attn.attn.w_uv.shape) == (config.num_attention_heads, config.v_head_dim,
                                           config.kv_lora_rank)
