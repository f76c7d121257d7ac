"""The model contract (model_backends/contract.py): what the runner may ask of a model backend,
checked on the native backend built as a worker builds it, and run against HF transformers."""

import inspect

import pytest
from conftest import HFReference

from model_backends import MODEL_REGISTRY, NATIVE, import_target
from model_backends.contract import ModelBackend, StepTensors

BLOCK_SIZE = 16
PROMPTS = [[5, 17, 300, 42, 9, 120, 77], [1, 2, 3, 4, 200]]  # two requests, one graph call


@pytest.mark.parametrize("arch", sorted(arch for backend, arch in MODEL_REGISTRY
                                        if backend == NATIVE))
def test_step_tensors_are_the_native_graph_inputs_in_order(arch):
    """The native backend passes StepTensors positionally; Ascend's kernels read the lengths
    by graph-input name, so names and order must both be construct's."""
    model_cls = import_target(MODEL_REGISTRY[(NATIVE, arch)].model)
    arguments = list(inspect.signature(model_cls.construct).parameters)[1:]  # without self
    assert arguments == list(StepTensors._fields)


@pytest.fixture
def graph_mode():
    """The worker's execution mode (graph), restored after the test."""
    import mindspore as ms

    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)


def step(token_ids: list[list[int]], num_computed: list[int], block_tables, num_tokens: int):
    """One graph call: each request's new tokens after its `num_computed` cached ones."""
    import mindspore as ms
    import numpy as np

    from vllm_mindspore.ops import AttentionMetadata

    num_scheduled = np.array([len(ids) for ids in token_ids], np.int32)
    positions = np.concatenate([np.arange(c, c + len(ids), dtype=np.int32)
                                for ids, c in zip(token_ids, num_computed)])
    metadata = AttentionMetadata.build(num_scheduled, np.array(num_computed, np.int32),
                                       positions, block_tables, BLOCK_SIZE, num_tokens)
    pad = (0, num_tokens - len(positions))  # padding: token 0 at position 0, written nowhere
    return StepTensors(ms.Tensor(np.pad(np.concatenate(token_ids).astype(np.int32), pad)),
                       ms.Tensor(np.pad(positions, pad)), *metadata.tensors(), False)


def test_native_backend_fulfils_the_contract(monkeypatch, graph_mode, tiny_model_factory):
    """Built through build_backend as the runner builds it (static shapes, CPU): a prefill of
    two requests then a decode step reading their cached keys and values give HF's logprobs,
    and the graphs compiled up front are the ones the steps run."""
    import mindspore as ms
    import numpy as np
    import torch
    from vllm.config import ModelConfig, VllmConfig

    from model_backends import build_backend
    from vllm_mindspore.platform import CPU, precision_for

    for name in ("vLLM_MODEL_BACKEND", "VLLM_MODEL_BACKEND", "VLLM_MS_MODEL_BACKEND",
                 "MINDFORMERS_MODEL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    vllm_config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32",
                                                      max_model_len=64))
    backend = build_backend(vllm_config, BLOCK_SIZE, precision_for(torch.float32, CPU),
                            static_shapes=True)
    assert isinstance(backend, ModelBackend)
    assert (backend.name, backend.implementation) == (
        NATIVE, "model_backends.native.qwen3.Qwen3ForCausalLM")
    hf_config = vllm_config.model_config.hf_text_config
    assert backend.hidden_size == hf_config.hidden_size

    specs = backend.kv_cache_spec()
    assert list(specs) == [f"model.layers.{i}.self_attn.attn"
                           for i in range(hf_config.num_hidden_layers)]
    weights = backend.weight_bytes()
    backend.allocate_kv_cache(num_blocks=4)
    assert backend.weight_bytes() == weights > 0  # the caches are not weights

    block_tables = np.array([[0, 1], [2, 3]], np.int32)
    prefill = step(PROMPTS, [0, 0], block_tables, num_tokens=16)
    decode_ids = [[11], [400]]
    decode = step(decode_ids, [len(p) for p in PROMPTS], block_tables, num_tokens=2)
    for tensors in (prefill, decode):
        backend.compile_step(tensors)
    rows = 16
    backend.compile_logits(rows)
    backend.compile_decode(decode)
    compiled = backend.num_compiled_graphs()
    assert compiled == 4

    def logprobs(tensors: StepTensors, count: int):
        hidden = backend.forward(tensors)
        assert tuple(hidden.shape) == (len(tensors.input_ids), backend.hidden_size)
        padded = np.zeros((rows, backend.hidden_size), np.float32)
        padded[:count] = hidden.asnumpy()[:count]
        logits, tokens = (t.asnumpy() for t in backend.logits(ms.Tensor(padded)))
        assert logits.dtype == np.float32 and tokens.dtype == np.int32
        # The head's greedy tokens: torch's argmax of its logits, padding rows included.
        np.testing.assert_array_equal(tokens, torch.from_numpy(logits).argmax(-1).numpy())
        logits = logits[:count]
        return torch.log_softmax(torch.from_numpy(logits).double(), -1)

    ours_prefill = logprobs(prefill, sum(len(p) for p in PROMPTS))
    ours_decode = logprobs(decode, len(decode_ids))
    # A step of decodes in one graph: the same logits as the decoder's graph then the head's.
    decoded, decoded_tokens = (torch.from_numpy(t.asnumpy()) for t in backend.decode(decode))
    assert tuple(decoded.shape) == (len(decode_ids), hf_config.vocab_size)
    assert decoded_tokens.tolist() == decoded.argmax(-1).tolist()
    torch.testing.assert_close(torch.log_softmax(decoded.double(), -1), ours_decode,
                               atol=1e-5, rtol=0)
    assert backend.num_compiled_graphs() == compiled  # no step compiled another graph
    # The compiled shapes ran their graphs directly (StaticGraphs), as the Cell would have.
    assert len(backend.graphs.phases) == 2 and len(backend.head_graphs.phases) == 1
    assert len(backend.decode_graphs.phases) == 1
    np.testing.assert_array_equal(backend.forward(decode).asnumpy(),
                                  backend.cell(*decode).asnumpy())
    # A shape compiled nowhere goes through the Cell: it compiles (and still computes).
    wider = step(decode_ids, [len(p) for p in PROMPTS], block_tables, num_tokens=4)
    np.testing.assert_array_equal(backend.forward(wider).asnumpy()[:2],
                                  backend.forward(decode).asnumpy())
    assert backend.num_compiled_graphs() == compiled + 1

    reference = HFReference(model_dir)
    start = 0
    for i, prompt in enumerate(PROMPTS):
        full = reference.prompt_logprobs(prompt + decode_ids[i])
        torch.testing.assert_close(ours_prefill[start:start + len(prompt)], full[:len(prompt)],
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(ours_decode[i], full[len(prompt)], atol=1e-4, rtol=0)
        start += len(prompt)


def test_native_backend_compiles_a_dynamic_graph_for_each_prefill_only_value(
        graph_mode, tiny_model_factory):
    """Dynamic shapes (Ascend's mode; compiled here, not run: running them on CPU stops in
    MindSpore's runtime, `The pointer[value] is null`): a step of first prefills and any other
    step each compile one graph, which then takes any size. The decoder Cell used to take
    `prefill_only` as a seventh input its `set_inputs` did not declare ("expected: 6 and input:
    7"), and `set_inputs` pins a bool input to one value, so each value has a Cell of its own."""
    import numpy as np
    import torch
    from vllm.config import ModelConfig, VllmConfig

    from model_backends import build_backend
    from vllm_mindspore.platform import CPU, precision_for

    model_dir = tiny_model_factory("Qwen2ForCausalLM")
    vllm_config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32",
                                                      max_model_len=64))
    backend = build_backend(vllm_config, BLOCK_SIZE, precision_for(torch.float32, CPU),
                            static_shapes=False)
    backend.allocate_kv_cache(num_blocks=4)
    block_tables = np.array([[0, 1], [2, 3]], np.int32)
    prefill = step(PROMPTS, [0, 0], block_tables, num_tokens=12)
    decode = step([[11], [400]], [len(p) for p in PROMPTS], block_tables, num_tokens=2)
    for tensors in (prefill._replace(prefill_only=True), prefill, decode):
        backend.compile_step(tensors)
    backend.compile_decode(decode)  # nothing more: `decode` runs the two graphs in turn
    backend.compile_logits(3)
    assert backend.num_compiled_graphs() == 3
