"""The Ascend path checked without an NPU: every model is built with the Ascend kernels, cache
layouts and dtypes (bfloat16/float16), its graphs are compiled on CPU for a mixed step (a decode
and a prefill chunk over cached context) and a step of first prefills, and each compile must get
past MindSpore's type and shape inference. On CPU a compile of an Ascend graph then stops at
kernel selection ("Kernel select failed": no CPU kernel for the op or its dtype): inference
passed, and the same graph would infer the same way on an NPU. Anything else (wrong arity, layout or dtype) is a bug that would
stop the first NPU run, and fails here. Kernel numerics are not checked (no NPU).
"""

import re

import numpy as np
import pytest

BLOCK_SIZE = 128  # the Ascend default
MAX_BLOCKS = 3
# Raised by CPU kernel selection, after inference: an op with no CPU kernel ("Unsupported op [X]
# on CPU") or none for the dtype ("Select CPU operator[X] fail! Unsupported data type!").
_KERNEL_SELECT = "Kernel select failed"
_CPP_FRAME = re.compile(r"C\+\+ Call Stack: \(For framework developers\)\s*-+\s*(\S+)")

_COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False)
_DEEPSEEK = dict(_COMMON, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
                 num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                 moe_intermediate_size=128, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 256, "mscale": 1.0,
                                  "mscale_all_dim": 1.0})
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _COMMON),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _COMMON),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _COMMON),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                       norm_topk_prob=True, decoder_sparse_step=1)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK),
    "deepseek-v3-no-q-lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                              dict(_DEEPSEEK, q_lora_rank=None)),
}


def classify(error: Exception) -> str:
    """'kernel-missing' (inference passed), 'backend' (inference passed; a CPU backend limit,
    e.g. collectives without a communication world) or 'inference' (a real bug)."""
    text = str(error)
    if _KERNEL_SELECT in text:
        return "kernel-missing"
    frame = _CPP_FRAME.search(text)
    if frame and frame.group(1).startswith(("mindspore/ops/kernel/cpu/",
                                             "mindspore/ccsrc/backend/")):
        return "backend"
    return "inference"


def step_inputs(prefill_only: bool):
    """Two requests, 9 tokens: a decode at position 130 and a 8-token chunk at 200..207 (mixed),
    or two first prefills of 3 and 6 tokens."""
    import mindspore as ms

    from vllm_mindspore.ops import AttentionMetadata

    if prefill_only:
        num_scheduled, num_computed = np.array([3, 6], np.int32), np.array([0, 0], np.int32)
    else:
        num_scheduled, num_computed = np.array([1, 8], np.int32), np.array([130, 200], np.int32)
    positions = np.concatenate([np.arange(c, c + n) for n, c in zip(num_scheduled, num_computed)])
    block_tables = np.arange(1, 1 + 2 * MAX_BLOCKS, dtype=np.int32).reshape(2, MAX_BLOCKS)
    metadata = AttentionMetadata.build(num_scheduled, num_computed, positions.astype(np.int32),
                                       block_tables, BLOCK_SIZE, len(positions))
    return (ms.Tensor(np.arange(len(positions), dtype=np.int32)),
            ms.Tensor(positions.astype(np.int32)), *metadata.tensors(), prefill_only)


# W8A8 variants (`--quantization ascend`): the linears quantized as scripts/quantize_w8a8.py
# quantizes a checkpoint; `mlp` is its --mlp (dynamic: MLPs and experts per-token, DynamicQuantExt
# + QuantBatchMatmul / GroupedMatmulV4; static: QuantV2 + QuantBatchMatmul with quant_bias).
W8A8 = {"llama-w8a8": ("llama", "static"), "deepseek-v3-w8a8": ("deepseek-v3", "dynamic")}


def quantize_linears(model, mlp: str) -> None:
    """Give the model's linears the W8A8 tensors (zeros, as before loading) the quantization
    script would write for them."""
    import os
    import sys

    import mindspore as ms

    from model_backends.native.layers import Linear
    from model_backends.native.quant import prepare
    from model_backends.native.quant_config import ASCEND, QuantDescription

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    from quantize_w8a8 import scheme_of

    schemes = {f"{name}.weight": scheme_of(f"{name}.weight", mlp)
               for name, cell in model.cells_and_names()
               if isinstance(cell, Linear) and cell.quantizable}
    prepare(model, QuantDescription(ASCEND, "<test>", schemes, {}), lambda name: name)
    for _, cell in model.cells_and_names():  # a unit activation scale (the zeros would give 1/0)
        if getattr(cell, "input_scale", None) is not None:
            cell.input_scale.set_data(ms.Tensor(np.ones(cell.input_scale.shape, np.float32)))


def build_ascend_model(name: str, dtype, tp_size: int = 1, ep_size: int = 1):
    """The model `name` as an Ascend worker builds it (tensor/expert-parallel rank 0 of the
    given sizes), weights post-processed (fused, absorbed, stacked) and caches allocated."""
    import mindspore as ms
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config

    from model_backends import NATIVE, resolve_model_class
    from model_backends.native.layers import ParallelLayout, building_with_layout
    from model_backends.native.weights import process_weights_after_loading
    from vllm_mindspore.platform import ASCEND, building_for

    base, mlp = W8A8.get(name, (name, None))
    config_name, arch, fields = MODELS[base]
    config = getattr(transformers, config_name)(**fields)
    model_cls = resolve_model_class([arch], NATIVE)
    with (set_current_vllm_config(VllmConfig()), building_for(ASCEND),
          building_with_layout(ParallelLayout(0, tp_size, 0, ep_size))):
        model = model_cls(config, BLOCK_SIZE, dtype)
        if mlp is not None:
            quantize_linears(model, mlp)
        process_weights_after_loading(model)
        model.allocate_kv_cache(2 * MAX_BLOCKS + 1, dtype)
        head = model.logits_head()
    jit = ms.JitConfig(jit_level="O0", infer_boost="on")  # as the Ascend worker runs them
    model.set_jit_config(jit)
    head.set_jit_config(jit)
    return model, head, config


def compile_outcome(cell, *inputs) -> str:
    """'compiled' or the failure class of compiling `cell` for these inputs."""
    try:
        cell.compile(*inputs)
    except Exception as error:  # noqa: BLE001 - classified below
        outcome = classify(error)
        if outcome == "inference":
            raise AssertionError(f"Ascend graph fails MindSpore's inference:\n{error}") from error
        return outcome
    return "compiled"


def check_ascend_graphs(name: str, dtype, tp_size: int = 1, ep_size: int = 1) -> list[str]:
    import mindspore as ms

    model, head, config = build_ascend_model(name, dtype, tp_size, ep_size)
    outcomes = [compile_outcome(model, *step_inputs(prefill_only))
                for prefill_only in (False, True)]
    hidden = ms.Tensor(np.zeros((2, config.hidden_size), np.float32), dtype)
    outcomes.append(compile_outcome(head, hidden))
    return outcomes


CASES = [(name, "bfloat16", 1, 1) for name in MODELS] + [
    ("llama", "float16", 1, 1),
    ("deepseek-v3", "float16", 1, 1),
    ("llama", "bfloat16", 2, 1),  # TP: column/row-parallel linears, all-reduce, LM head gather
    ("qwen3-moe", "bfloat16", 2, 1),  # TP-split experts
    ("deepseek-v3", "bfloat16", 2, 1),  # MLA heads split, latent cache replicated
    ("qwen3-moe", "bfloat16", 1, 2),  # EP: all-gather dispatch, reduce-scatter combine
    ("deepseek-v3", "bfloat16", 2, 4),  # DP x TP x EP (the user guide's DP4/TP4/EP4 layout)
    # W8A8: static everywhere (QuantV2 + QuantBatchMatmul, quant_bias of row-parallel layers),
    # float16; static attention with dynamic MLPs and experts (DynamicQuantExt, GroupedMatmulV4
    # with int8 weights), bfloat16, the flagship's DP x TP x EP layout scaled down.
    ("llama-w8a8", "float16", 2, 1),
    ("deepseek-v3-w8a8", "bfloat16", 2, 4),
]


@pytest.mark.parametrize("name,dtype,tp_size,ep_size", CASES,
                         ids=[f"{n}-{d}-tp{t}-ep{e}" for n, d, t, e in CASES])
def test_ascend_graphs_pass_inference(name, dtype, tp_size, ep_size):
    import mindspore as ms

    outcomes = check_ascend_graphs(name, getattr(ms, dtype), tp_size, ep_size)
    # Every graph got past inference; on CPU none can fully compile (no Ascend kernels).
    assert all(o in ("kernel-missing", "backend") for o in outcomes), outcomes


def test_a_planted_layout_error_fails_the_check(monkeypatch):
    """The check is not vacuous: ReshapeAndCache given keys as [T, KVH, D] (KVH > 1), a
    mistake this project once had, is an inference error."""
    import mindspore as ms

    from vllm_mindspore.ops import attention

    def heads_kept(self, qk, v):
        return qk[:, self.num_heads:], v

    monkeypatch.setattr(attention.PagedAttention, "_ascend_key_value", heads_kept)
    with pytest.raises(AssertionError, match="slot mapping and key must be the same"):
        check_ascend_graphs("llama", ms.bfloat16)


def test_a_planted_dtype_error_fails_the_check(monkeypatch):
    """A float32 query for the bfloat16 cache (PagedAttention needs them equal) is caught."""
    import mindspore as ms

    from vllm_mindspore.ops import attention

    original = attention.PagedAttention._ascend_key_value

    def float32_key_value(self, qk, v):
        key, value = original(self, qk, v)
        return key.astype(ms.float32), value.astype(ms.float32)

    monkeypatch.setattr(attention.PagedAttention, "_ascend_key_value", float32_key_value)
    with pytest.raises(AssertionError, match="Data type conversion is not supported"):
        check_ascend_graphs("llama", ms.bfloat16)


def test_float32_is_refused_on_ascend():
    from vllm_mindspore.platform import ASCEND, check_dtype_for_device

    with pytest.raises(ValueError, match="--dtype bfloat16"):
        check_dtype_for_device(ASCEND, "float32")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_lengths_are_graph_inputs_named_as_the_kernels_read_them(name):
    """Ascend's fused attention kernels (infer_boost) read the per-request lengths from the
    top-level graph inputs named batch_valid_length and q_seq_lens, on the host."""
    import inspect

    from model_backends import NATIVE, resolve_model_class

    model_cls = resolve_model_class([MODELS[name][1]], NATIVE)
    arguments = list(inspect.signature(model_cls.construct).parameters)
    assert {"batch_valid_length", "q_seq_lens", "block_tables", "slot_mapping"} <= set(arguments)
