"""The MindFormers backend's Ascend path checked without an NPU, as test_ascend_graphs checks the
native models': mindformers' own classes are built by MindFormersBackend for Ascend (bfloat16,
block size 128, mindformers' own cells and ops: no CPU substitute), a tiny checkpoint is loaded
by mindformers' loader, the caches are allocated in the Ascend layout, and both graphs are
compiled on CPU through `compile_step` -- the increment graph for a mixed step (a decode and a
prefill chunk over cached context) and the prefill graph for a step of first prefills -- plus
the logits graph. Each compile must get past MindSpore's type and shape inference and stop at
CPU kernel selection (no CPU kernel for FlashAttentionScore, PagedAttention, ReshapeAndCache,
...); any other error is a bug the first NPU run would hit. Kernel numerics are not checked.
"""

import types

import numpy as np
import pytest
from conftest import (MF_DEEPSEEK_V3, MF_QWEN3_MOE, needs_mindformers, real_tiny_checkpoint,
                      slow)
from test_ascend_graphs import BLOCK_SIZE, MAX_BLOCKS, compile_outcome, step_inputs
from test_mindformers_adapter import environment_restored  # noqa: F401

from model_backends.contract import StepTensors

pytestmark = needs_mindformers()


@pytest.fixture(scope="module", autouse=True)
def fresh_mindformers_context():
    """mindformers' context (MFContextOperator) is a process singleton: the first
    build_mf_context of the process sets its environment (RUN_MODE=predict, ...), later ones do
    nothing. A module that built before this one restored the environment (environment_restored,
    as this module does): without RUN_MODE mindformers' AutoModel builds its PyNative training
    class. The context is made again for this module, and left for the next one to make."""
    from vllm_mindspore.patches.mindformers import install_module_stubs

    install_module_stubs()  # `import mindformers` imports training-only modules
    from mindformers.core.context.build_context import MFContextOperator

    MFContextOperator.reset_instance()
    yield
    MFContextOperator.reset_instance()


_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
# name -> (architecture, tiny-config overrides)
MODELS = {
    "qwen3": ("Qwen3ForCausalLM", _SIZES),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(_SIZES, **MF_QWEN3_MOE)),
    # kv_lora_rank 512: mindformers 2.0.0's MLA PagedAttention takes no other (package_limits).
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        MF_DEEPSEEK_V3, hidden_size=256, kv_lora_rank=512, qk_nope_head_dim=32,
        qk_rope_head_dim=64, head_dim=64, v_head_dim=32)),
}


def build_for_ascend(model_dir: str, arch: str, dtype: str, static_shapes: bool, plant=None):
    """MindFormersBackend as an Ascend worker builds it (the registry entry vLLM's config
    resolves to on Ascend, weights loaded, caches for 2 * MAX_BLOCKS + 1 blocks); with
    `static_shapes` its graphs take the step's shapes (every dimension known to inference)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    from model_backends import MINDFORMERS, import_target, resolve_entry
    from vllm_mindspore.platform import ASCEND, building_for, precision_for

    # --dtype float32 for vLLM's config: the CPU platform refuses bfloat16; the backend is
    # built in `dtype`, as the Ascend worker builds it in vLLM's dtype.
    vllm_config = EngineArgs(model=model_dir, dtype="float32", block_size=BLOCK_SIZE,
                             max_model_len=MAX_BLOCKS * BLOCK_SIZE).create_engine_config()
    with building_for(ASCEND):
        entry = resolve_entry([arch], MINDFORMERS, vllm_config)
        assert entry.backend.endswith(":MindFormersBackend"), entry.note
        backend = import_target(entry.backend).build(
            entry.model, vllm_config, BLOCK_SIZE, precision_for(getattr(torch, dtype), ASCEND),
            static_shapes=static_shapes)
        backend.load_weights(model_dir, None)
        if plant is not None:
            plant(backend)
        backend.allocate_kv_cache(2 * MAX_BLOCKS + 1)
    return backend


def check_mindformers_ascend_graphs(model_dir: str, arch: str, dtype: str,
                                    static_shapes: bool = False, plant=None):
    """-> (backend, compile outcomes: increment graph, prefill graph, logits graph). `plant`
    (backend -> None) changes the built backend before its caches are allocated (the
    planted-error test)."""
    import mindspore as ms

    from vllm_mindspore.patches.mindformers import cpu_substitutes_suspended

    with cpu_substitutes_suspended():  # applied by the CPU tests of this process, if any ran
        backend = build_for_ascend(model_dir, arch, dtype, static_shapes, plant)
        decoder = types.SimpleNamespace(compile=backend.compile_step)
        outcomes = [compile_outcome(decoder, StepTensors(*step_inputs(prefill_only)))
                    for prefill_only in (False, True)]
        hidden = ms.Tensor(np.zeros((2, backend.hidden_size), np.float32), getattr(ms, dtype))
        outcomes.append(compile_outcome(backend.logits_head, hidden))
    return backend, outcomes


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory):
    def make(name: str) -> str:
        return real_tiny_checkpoint(tiny_model_factory, *MODELS[name])

    return make


# The worker's dynamic-shape graphs, and the same graphs compiled for the steps' shapes, where
# inference knows every dimension (a layout mistake hidden by unknown dimensions shows there).
CASES = [pytest.param("qwen3", "bfloat16", False),
         pytest.param("qwen3", "bfloat16", True),
         *[pytest.param(name, "bfloat16", static, marks=slow("one more mindformers model build"))
           for name in ("qwen3-moe", "deepseek-v3") for static in (False, True)],
         pytest.param("qwen3", "float16", False, marks=slow("the float16 variant of qwen3"))]


@pytest.mark.parametrize("name,dtype,static_shapes", CASES,
                         ids=[f"{c.values[0]}-{c.values[1]}-{'static' if c.values[2] else 'dynamic'}"
                              for c in CASES])
def test_mindformers_ascend_graphs_pass_inference(tiny_model, name, dtype, static_shapes):
    arch = MODELS[name][0]
    backend, outcomes = check_mindformers_ascend_graphs(tiny_model(name), arch, dtype,
                                                        static_shapes)
    # Every graph got past inference (compile_outcome raises otherwise). No decoder graph can
    # fully compile on CPU (Ascend-only ops); the logits graph (a matmul) can in float16.
    assert all(o in ("kernel-missing", "backend") for o in outcomes[:2]), outcomes
    # mindformers' own cells ran, none of the CPU substitutes.
    cells = [cell for _, cell in backend.network.cells_and_names()]
    assert not [c for c in cells if hasattr(c, "cpu_attention") or hasattr(c, "cpu_experts")]
    norms = [c.norm for c in cells if type(c).__name__ == "RMSNorm"]
    assert norms and {type(n).__name__ for n in norms} == {"RmsNorm"}
    # The two graphs were compiled in the phases the steps select.
    assert set(backend._phases) <= set(backend.network.phase_cache)
    # ReshapeAndCache's and PagedAttention's cache layout (their inference does not check the
    # caches' dimensions against the keys: asserted here).
    layer = backend.network.model.decoder.layers[0]
    if arch == "DeepseekV3ForCausalLM":
        config = layer.self_attention.config
        assert backend.value_caches is None
        assert backend.key_caches[0].shape == (
            2 * MAX_BLOCKS + 1, BLOCK_SIZE, 1, config.kv_lora_rank + config.qk_pos_emb_head_dim)
    else:
        hf = MODELS[name][1]
        expected = (2 * MAX_BLOCKS + 1, BLOCK_SIZE, hf["num_key_value_heads"], hf["head_dim"])
        assert {tuple(c.shape) for c in backend.key_caches + backend.value_caches} == {expected}


def test_a_planted_argument_order_error_fails_the_check(tiny_model):
    """The check is not vacuous: the forward's slot_mapping and block_tables swapped (the
    mapping onto mindformers' positional arguments is the adapter's) fail ReshapeAndCache's
    inference on the steps' shapes (and the dynamic graphs' input declaration)."""
    def swapped(backend):
        arguments = backend._ascend_arguments

        def swap(step):
            args = list(arguments(step))
            args[6], args[7] = args[7], args[6]  # block_tables, slot_mapping
            return tuple(args)

        backend._ascend_arguments = swap

    with pytest.raises(AssertionError, match="slot mapping and key must be the same"):
        check_mindformers_ascend_graphs(tiny_model("qwen3"), "Qwen3ForCausalLM", "bfloat16",
                                        True, swapped)


def test_deepseek_with_another_kv_lora_rank_stays_native_on_ascend():
    """mindformers builds MLA's PagedAttention with mla_v_dim=512: on the steps' shapes a
    kv_lora_rank of 32 makes its output 16x too long (caught by the static compile). Such a
    model runs the native implementation on Ascend, and the reason is logged."""
    from types import SimpleNamespace

    from model_backends.mindformers import package_limits
    from vllm_mindspore.platform import ASCEND, building_for

    def config(kv_lora_rank):
        text = SimpleNamespace(kv_lora_rank=kv_lora_rank, q_lora_rank=48, rms_norm_eps=1e-6)
        return SimpleNamespace(
            model_config=SimpleNamespace(hf_config=SimpleNamespace(
                architectures=["DeepseekV3ForCausalLM"]), hf_text_config=text, quantization=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_expert_parallel=False))

    with building_for(ASCEND):
        assert package_limits(config(512)) == []
        assert "mla_v_dim=512" in "; ".join(package_limits(config(32)))
    assert package_limits(config(32)) == []  # CPU: this project's MLA kernel takes any rank
