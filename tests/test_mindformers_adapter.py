"""MindFormersBackend on CPU: mindformers' own mcore classes (InferenceQwen3ForCausalLM,
InferenceQwen2ForCausalLM, InferenceQwen3MoeForCausalLM, InferenceDeepseekV3ForCausalLM) run
this project's steps and give HF transformers' logits and greedy tokens on the same weights
(float32).

The steps are built as the model runner builds them (AttentionMetadata.build, padded to a
compiled token count): several requests of different lengths prefilled together, one of them
in two chunks, a request whose first block is a prefix-cache hit, then decodes of all of them.
"""

import os

import numpy as np
import pytest
from conftest import (MF_DEEPSEEK_V3, MF_DEEPSEEK_YARN, MF_QWEN3_MOE, HFReference,
                      assert_matches_hf, needs_mindformers, real_tiny_checkpoint)

from model_backends.contract import StepTensors
from vllm_mindspore.platform import cpu_has_bfloat16_dot

pytestmark = needs_mindformers()


@pytest.fixture(scope="module", autouse=True)
def environment_restored():
    """mindformers' build_mf_context sets environment variables (MS_ALLOC_CONF, RUN_MODE, ...)
    for the process that builds a model: a worker's. Here that is pytest's, whose later tests and
    their subprocesses must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

BLOCK_SIZE = 16
ROWS, MAX_BLOCKS = 4, 8  # the block table's shape (the runner's request capacity and length)
GRAPH_TOKENS = (8, 32)  # the padded token counts compiled, as the runner's GraphSizes
DECODES = 4
LOGPROB_TOL = 1e-4  # float32 against HF's float32

QWEN3_MOE = MF_QWEN3_MOE
DEEPSEEK = MF_DEEPSEEK_V3  # grouped routing where mindformers and HF agree (see conftest)
YARN = MF_DEEPSEEK_YARN
FIRST_SPARSE_LAYER = {"Qwen3MoeForCausalLM": 0,
                      "DeepseekV3ForCausalLM": DEEPSEEK["first_k_dense_replace"]}
DEEPSEEK_CLASS = ("mindformers.models.deepseek3.modeling_deepseek_v3_infer."
                  "InferenceDeepseekV3ForCausalLM")

# name -> (architecture, tiny-config overrides, the mindformers class expected to run)
MODELS = {
    "qwen3": ("Qwen3ForCausalLM", {},
              "mindformers.models.qwen3.modeling_qwen3_infer.InferenceQwen3ForCausalLM"),
    # Qwen2: q/k/v bias and no q/k norm; tied embeddings and head_dim != hidden / heads.
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, head_dim=24),
              "mindformers.models.qwen2.modeling_qwen2_infer.InferenceQwen2ForCausalLM"),
    # Every layer sparse (mindformers' only layout), top-2 of 8 experts, both weightings.
    **{f"qwen3-moe-norm-{norm}": (
        "Qwen3MoeForCausalLM", dict(QWEN3_MOE, norm_topk_prob=norm),
        "mindformers.models.qwen3_moe.modeling_qwen3_moe_infer.InferenceQwen3MoeForCausalLM")
       for norm in (True, False)},
    # MLA over a latent cache, grouped sigmoid routing with an expert bias, multi-token-
    # prediction tensors in the checkpoint (skipped).
    "deepseek-v3-yarn": ("DeepseekV3ForCausalLM", dict(
        DEEPSEEK, rope_parameters=YARN, routed_scaling_factor=2.5, norm_topk_prob=True),
        DEEPSEEK_CLASS),
    "deepseek-v3-rope": ("DeepseekV3ForCausalLM", dict(
        DEEPSEEK, routed_scaling_factor=1.5, norm_topk_prob=False), DEEPSEEK_CLASS),
}


class Request:
    def __init__(self, prompt: list[int], blocks: list[int], computed: int = 0):
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.blocks = blocks
        self.computed = computed  # tokens already in the cache (a prefix hit counts)
        self.generated: list[int] = []
        self.logprobs: list[np.ndarray] = []  # full-vocabulary, one per generated token


def build(model_class: str, model_dir: str):
    """MindFormersBackend.build + load_weights, as build_backend does for a registry entry."""
    import torch

    from model_backends.mindformers.backend import MindFormersBackend
    from vllm_mindspore.platform import CPU, precision_for

    backend = MindFormersBackend.build(":".join(model_class.rsplit(".", 1)),
                                       vllm_config(model_dir), BLOCK_SIZE,
                                       precision_for(torch.float32, CPU), static_shapes=True)
    backend.load_weights(model_dir, None)
    return backend


def vllm_config(model_dir: str, dtype: str = "float32"):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, dtype=dtype, max_model_len=MAX_BLOCKS * BLOCK_SIZE,
                      block_size=BLOCK_SIZE).create_engine_config()


def make_step(scheduled: list[tuple[Request, int]], num_tokens: int) -> StepTensors:
    import mindspore as ms

    from vllm_mindspore.ops import AttentionMetadata

    block_tables = np.zeros((ROWS, MAX_BLOCKS), np.int32)
    ids, positions = [], []
    for row, (request, count) in enumerate(scheduled):
        block_tables[row, :len(request.blocks)] = request.blocks
        ids += request.tokens[request.computed:request.computed + count]
        positions += range(request.computed, request.computed + count)
    metadata = AttentionMetadata.build(
        np.array([count for _, count in scheduled], np.int32),
        np.array([request.computed for request, _ in scheduled], np.int32),
        np.array(positions, np.int32), block_tables, BLOCK_SIZE, num_tokens)
    padded = np.zeros((2, num_tokens), np.int32)
    padded[0, :len(ids)], padded[1, :len(positions)] = ids, positions
    prefill_only = all(request.computed == 0 for request, _ in scheduled)
    return StepTensors(ms.Tensor(padded[0]), ms.Tensor(padded[1]), *metadata.tensors(),
                       prefill_only)


def run_step(backend, scheduled: list[tuple[Request, int]]) -> None:
    """One step: every request that reaches the end of its known tokens samples greedily."""
    import torch

    num_tokens = next(size for size in GRAPH_TOKENS if size >= sum(c for _, c in scheduled))
    hidden = backend.forward(make_step(scheduled, num_tokens)).asnumpy()
    ends, samplers = 0, []
    for request, count in scheduled:
        ends += count
        request.computed += count
        if request.computed == len(request.tokens):
            samplers.append((request, ends - 1))
    import mindspore as ms

    rows = np.zeros((8, hidden.shape[1]), hidden.dtype)  # a compiled logits row count
    rows[:len(samplers)] = hidden[[index for _, index in samplers]]
    logits, tokens = (t.asnumpy() for t in backend.logits(ms.Tensor(rows)))
    for row, (request, _) in enumerate(samplers):
        logprobs = torch.log_softmax(torch.from_numpy(logits[row]).double(), -1).numpy()
        assert tokens[row] == torch.from_numpy(logits[row]).argmax()  # the head's greedy token
        request.generated.append(int(logprobs.argmax()))
        request.tokens.append(request.generated[-1])
        request.logprobs.append(logprobs)


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tiny_model_factory):
    """(architecture, model dir, backend, requests) after the scenario of the module docstring."""
    import mindspore as ms

    name = request.param
    arch, overrides, model_class = MODELS[name]
    model_dir = real_tiny_checkpoint(tiny_model_factory, arch, overrides, non_negative_bias=True)
    ms.set_context(mode=ms.GRAPH_MODE)  # the device: CPU, MindSpore's default here
    backend = build(model_class, model_dir)
    backend.allocate_kv_cache(num_blocks=8)
    for size in GRAPH_TOKENS:
        backend.compile_step(make_step([], size))
    backend.compile_logits(8)
    compiled = backend.num_compiled_graphs()

    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(3, 512, n).tolist()  # noqa: E731
    short, long_ = Request(prompt(5), [0]), Request(prompt(20), [1, 2])
    chunked = Request(prompt(23), [3, 4])
    # Shares long_'s first block (16 tokens): only its last 6 prompt tokens are computed.
    prefix_hit = Request(long_.tokens[:16] + prompt(6), [1, 5], computed=16)
    run_step(backend, [(short, 5), (long_, 20), (chunked, 7)])
    run_step(backend, [(short, 1), (long_, 1), (chunked, 16), (prefix_hit, 6)])
    requests = [short, long_, chunked, prefix_hit]
    for _ in range(DECODES):
        run_step(backend, [(r, 1) for r in requests])
    return name, model_dir, backend, requests, compiled


def test_the_mindformers_class_runs(served, monkeypatch):
    name, _, backend, _, compiled = served
    assert backend.name == "MindFormers"
    assert backend.implementation == MODELS[name][2]
    first_sparse = FIRST_SPARSE_LAYER.get(MODELS[name][0])
    layers = backend.network.model.decoder.layers
    for layer in [] if first_sparse is None else layers[first_sparse:]:
        # mf's MoELayer, its GroupedMLP packed for the CPU experts kernel and dropped.
        assert type(layer.mlp).__name__ == "MoELayer"
        assert layer.mlp.experts is None and layer.mlp.cpu_experts.w13 is not None
    # Every step ran on the graphs compiled up front: 2 token counts + 1 logits row count.
    assert compiled == len(GRAPH_TOKENS) + 1 == backend.num_compiled_graphs()
    assert backend.weight_bytes() > 0
    # Compiling `decode` for a token count the network has a graph for runs no step (on CPU,
    # compiling the network means running it) and compiles nothing new.
    steps_run = []
    monkeypatch.setattr(backend, "forward", steps_run.append)
    backend.compile_decode(make_step([], GRAPH_TOKENS[0]))
    assert not steps_run and backend.num_compiled_graphs() == compiled


def test_deepseek_kv_cache_is_the_latent(served):
    """One cache per layer of kv_lora_rank + qk_rope_head_dim values a token, as vLLM's
    MLAAttentionSpec accounts for."""
    name, _, backend, _, _ = served
    if MODELS[name][0] != "DeepseekV3ForCausalLM":
        pytest.skip("not an MLA model")
    latent = DEEPSEEK["kv_lora_rank"] + DEEPSEEK["qk_rope_head_dim"]
    for spec in backend.kv_cache_spec().values():
        assert type(spec).__name__ == "MLAAttentionSpec"
        assert spec.page_size_bytes == BLOCK_SIZE * latent * 4
    for layer in backend.network.model.decoder.layers:
        attention = layer.self_attention
        assert type(attention).__name__ == "MLASelfAttention"
        assert tuple(attention.kv_cache_cpu.shape) == (8, latent, BLOCK_SIZE)
        assert attention.linear_kv_up_proj is None  # absorbed into the kernel's W_UK / W_UV


def test_greedy_tokens_and_logprobs_match_hf(served):
    name, model_dir, _, requests, _ = served
    reference = HFReference(model_dir)
    worst = 0.0
    for kind, request in zip(("short", "long", "chunked", "prefix-hit"), requests):
        prompt = request.tokens[:request.prompt_len]
        ref_tokens, ref_steps = reference.greedy(prompt, len(request.generated))
        chosen = [float(lp[t]) for lp, t in zip(request.logprobs, request.generated)]
        assert_matches_hf(request.generated, chosen, ref_tokens, ref_steps, f"{name} {kind}")
        for ours, ref in zip(request.logprobs, ref_steps):
            worst = max(worst, float(np.abs(ours - ref.numpy()).max()))
    assert len(requests[0].generated) == DECODES + 2
    assert worst < LOGPROB_TOL, f"{name}: full-vocabulary logprobs differ from HF by {worst:.2e}"


def test_a_checkpoint_that_does_not_fit_is_refused(tiny_model_factory, monkeypatch):
    """Without add_qkv_bias mindformers builds Qwen2 without q/k/v biases and would drop the
    checkpoint's bias tensors silently."""
    from model_backends.mindformers import config
    from model_backends.native.weights import WeightLoadError

    monkeypatch.setattr(config, "ARCHITECTURE_FIELDS", {})
    model_dir = tiny_model_factory("Qwen2ForCausalLM")
    with pytest.raises(WeightLoadError, match=r"6 checkpoint tensor\(s\) fit no parameter: "
                                              r"model.layers.0.self_attn.k_proj.bias"):
        build(MODELS["qwen2"][2], model_dir)


@pytest.mark.parametrize("arch, overrides, dtype, expected", [
    ("LlamaForCausalLM", {}, "float32", "no mcore Llama class"),
    # Where the CPU lacks AVX512-BF16 the platform refuses bfloat16 first (test_platform).
    pytest.param("Qwen3ForCausalLM", {}, "bfloat16", "bfloat16 on CPU",
                 marks=pytest.mark.skipif(not cpu_has_bfloat16_dot(),
                                          reason="this CPU has no AVX512-BF16")),
    # mindformers' Qwen3-MoE drops both fields and makes every layer sparse.
    ("Qwen3MoeForCausalLM", dict(QWEN3_MOE, mlp_only_layers=[1]), "float32",
     r"mlp_only_layers=\[1\] \(config.json\)"),
    ("Qwen3MoeForCausalLM", dict(QWEN3_MOE, decoder_sparse_step=2), "float32",
     r"decoder_sparse_step=2 \(config.json\)"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, q_lora_rank=None), "float32",
     r"q_lora_rank=null \(config.json\)"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, rope_interleave=False), "float32",
     r"rope_interleave=false \(config.json\)"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, rms_norm_eps=1e-5), "float32",
     r"rms_norm_eps=1e-05 \(config.json\)"),
])
def test_unsupported_configurations_are_refused(tiny_model_factory, arch, overrides, dtype,
                                                expected):
    from model_backends.mindformers.backend import check_supported
    from model_backends.mindformers.config import UnsupportedByMindFormersError
    from vllm_mindspore.platform import CPU, precision_for

    config = vllm_config(tiny_model_factory(arch, **overrides), dtype)
    with pytest.raises(UnsupportedByMindFormersError, match=expected):
        check_supported(config, precision_for(config.model_config.dtype, CPU))


@pytest.mark.parametrize("rope, expected", [
    (dict(YARN, mscale_all_dim=0.8), (r"mscale=1.0 != mscale_all_dim=0.8: mindformers' MLA "
                                      r"softmax scale is mscale\(factor, mscale\)\^2")),
    (dict(YARN, attention_factor=1.2), "attention_factor: mindformers' YaRN has no such field"),
])
def test_yarn_mindformers_computes_otherwise_is_refused(rope, expected):
    from types import SimpleNamespace

    from model_backends.mindformers.config import UnsupportedByMindFormersError, rope_settings

    with pytest.raises(UnsupportedByMindFormersError, match=expected):
        rope_settings("DeepseekV3ForCausalLM", SimpleNamespace(rope_parameters=rope))
