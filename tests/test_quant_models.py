"""W8A8 checkpoints end to end: tiny Qwen2, Llama and DeepSeek-V3 (MLA + MoE experts) quantized
by scripts/quantize_w8a8.py in both layouts, served by `vllm-mindspore serve --quantization
ascend|golden-stick` (or vLLM's offline LLM), against an emulation of the quantized model: HF
transformers on the float checkpoint with every quantized linear (and the routed experts)
replaced by the numpy reference of the scheme fed from the quantized safetensors. TP=2 against
TP=1; resident weight bytes against the float model. Bad checkpoints and descriptions are
loaded in-process by the real loader (seconds, no engine) and must fail naming the tensor or
the flag."""

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import PROMPTS, ROOT, HFReference, finish_deepseek_checkpoint, slow
from test_moe_models import DEEPSEEK
from test_tensor_parallel import generate

sys.path.insert(0, os.path.join(ROOT, "scripts"))

MAX_TOKENS = 8
# Our float32 steps and HF's differ in the last bits; an activation sitting on a rounding boundary
# can then quantize one step apart, which moves logprobs by ~1e-4, and on these tiny random models
# by up to ~1e-2 (measured: reordering the attention kernel's float32 sums, 5e-7 on its outputs,
# moved one TP=2 DeepSeek logprob by 1.0e-2 through a dynamic per-token quantization). A wrong
# scale, offset or layout moves them by far more. Tokens must be equal except where the
# emulation's top two are closer than NEAR_TIE.
NEAR_TIE = 2e-3
LOGPROB_TOL = 2e-2
SERVE_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes",
              str(8 << 20), "--max-num-batched-tokens", "32")

MODELS = {
    "qwen2": ("Qwen2ForCausalLM", {}),  # q/k/v biases
    "llama": ("LlamaForCausalLM", {}),
    "deepseek": ("DeepseekV3ForCausalLM", dict(DEEPSEEK, q_lora_rank=48,
                                               routed_scaling_factor=2.5, norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def quantized(tiny_model_factory, tmp_path_factory):
    """quantized(name, layout, mlp) -> (float folder, W8A8 folder), built once per module."""
    import quantize_w8a8

    cache = {}

    def make(name: str, layout: str, mlp: str = "dynamic"):
        key = (name, layout, mlp)
        if key not in cache:
            arch, overrides = MODELS[name]
            float_dir = tiny_model_factory(arch, **overrides)
            if arch == "DeepseekV3ForCausalLM":
                finish_deepseek_checkpoint(float_dir)
            out = str(tmp_path_factory.mktemp(f"{name}-{layout}-{mlp}"))
            quantize_w8a8.quantize(float_dir, out, layout, mlp)
            cache[key] = (float_dir, out)
        return cache[key]

    return make


# ---- the emulation ----------------------------------------------------------------------------------
class Emulation(HFReference):
    """Greedy generation with HF transformers (float32, the float checkpoint) whose quantized
    linears and routed experts compute the W8A8 scheme with the numpy reference.

    `tp`: as tensor parallelism over `tp` ranks computes it. Only the dynamic row-parallel
    projections (down_proj: dense, shared and routed experts) differ from one rank: each rank
    quantizes its part of the input with its own per-token scale and the dequantized partial
    sums are added (static quantization is per element, so splitting it changes nothing)."""

    def __init__(self, float_dir: str, quant_dir: str, layout: str, tp: int = 1):
        from safetensors.numpy import load_file

        from vllm_mindspore.ops import quant_reference as ref

        super().__init__(float_dir)
        self.ref = ref
        name = {"ascend": "quant_model_description.json",
                "golden-stick": "quantization_description.json"}[layout]
        description = json.load(open(os.path.join(quant_dir, name)))
        tensors = load_file(os.path.join(quant_dir, "model.safetensors"))
        self.layout, self.tp = layout, tp
        modules = dict(self.model.named_modules())
        experts: dict[str, dict] = {}
        for key, scheme in description.items():
            if not key.endswith(".weight") or scheme == ref.FLOAT:
                continue
            prefix = key[: -len(".weight")]
            linear = self.linear_fn(prefix, scheme, tensors)
            head, sep, tail = prefix.partition(".mlp.experts.")
            if sep:
                index, proj = tail.split(".")
                experts.setdefault(head, {}).setdefault(int(index), {})[proj] = linear
            elif prefix in modules:
                parent, _, attr = prefix.rpartition(".")
                setattr(modules[parent], attr, _Module(linear, self.torch))
        for head, table in experts.items():
            if f"{head}.mlp.experts" in modules:
                modules[f"{head}.mlp"].experts = _Experts(table, self.torch)

    def linear_fn(self, prefix, scheme, tensors):
        ref = self.ref
        get = tensors.get
        bias = get(f"{prefix}.bias")
        if scheme == ref.STATIC and self.layout == "ascend":
            bias = None  # msModelSlim folds it into quant_bias
        kwargs = dict(weight=tensors[f"{prefix}.weight"], bias=bias)
        if scheme == ref.STATIC:
            # per tensor (golden-stick repeats the value for each output channel)
            kwargs.update(quant_bias=get(f"{prefix}.quant_bias"),
                          deq_scale=get(f"{prefix}.deq_scale"),
                          input_scale=get(f"{prefix}.input_scale").astype(np.float32)[:1],
                          input_offset=get(f"{prefix}.input_offset").astype(np.float32)[:1])
        else:
            scale = "weight_scale" if self.layout == "ascend" else "w_scale"
            kwargs.update(weight_scale=get(f"{prefix}.{scale}").reshape(-1))
            if self.tp > 1 and prefix.endswith("down_proj"):
                return self.row_parallel_dynamic(kwargs)
        return lambda x: ref.linear(x, scheme, **kwargs)

    def row_parallel_dynamic(self, kwargs):
        """The TP ranks' dynamic partial products of a row-parallel linear, summed."""
        ref, weight, bias = self.ref, kwargs["weight"], kwargs["bias"]
        part = weight.shape[1] // self.tp

        def linear(x):
            y = sum(ref.linear(x[:, r * part:(r + 1) * part], ref.DYNAMIC,
                               weight[:, r * part:(r + 1) * part],
                               weight_scale=kwargs["weight_scale"]) for r in range(self.tp))
            return y if bias is None else (y + bias).astype(np.float32)

        return linear


class _Module:
    """An nn.Module calling a numpy function on the flattened rows."""

    def __new__(cls, fn, torch):
        class Wrapped(torch.nn.Module):
            def forward(self, x):
                rows = x.reshape(-1, x.shape[-1]).detach().to(torch.float32).numpy()
                y = fn(rows)
                return torch.from_numpy(y).reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

        return Wrapped()


class _Experts:
    """HF's routed-experts module (3-D gate_up/down parameters) replaced by per-expert W8A8."""

    def __new__(cls, table, torch):
        class Experts(torch.nn.Module):
            def forward(self, hidden, top_k_index, top_k_weights):
                out = torch.zeros_like(hidden)
                x = hidden.detach().numpy()
                for t in range(hidden.shape[0]):
                    for k in range(top_k_index.shape[1]):
                        e = int(top_k_index[t, k])
                        row = x[t:t + 1]
                        gate, up = table[e]["gate_proj"](row), table[e]["up_proj"](row)
                        g = torch.from_numpy(gate)
                        act = (torch.nn.functional.silu(g) * torch.from_numpy(up)).numpy()
                        down = torch.from_numpy(table[e]["down_proj"](act))[0]
                        out[t] += top_k_weights[t, k] * down
                return out

        return Experts()


def assert_matches_emulation(ours, our_logprobs, ref_tokens, ref_steps, context):
    for step, (mine, expected) in enumerate(zip(ours, ref_tokens)):
        if our_logprobs is not None:
            assert abs(our_logprobs[step] - float(ref_steps[step][mine])) < LOGPROB_TOL, (
                f"{context} step {step}: logprob {our_logprobs[step]} vs emulation "
                f"{float(ref_steps[step][mine])}")
        if mine != expected:
            top2 = ref_steps[step].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, (f"{context} step {step}: token {mine} != emulation {expected} "
                                    f"(top-2 gap {gap:.2e}); ours {ours} vs {ref_tokens}")
            return
    assert len(ours) == len(ref_tokens)


def serve_and_compare(serve, float_dir, quant_dir, layout, context):
    server = serve(quant_dir, *SERVE_ARGS, "--quantization", layout)
    client = server.client()

    def complete(prompt):
        return client.completions.create(
            model=quant_dir, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # submitted together: batched by vLLM
        choices = list(pool.map(complete, PROMPTS))
    emulation = Emulation(float_dir, quant_dir, layout)
    for prompt, choice in zip(PROMPTS, choices):
        ref_tokens, ref_steps = emulation.greedy(choice.prompt_token_ids, MAX_TOKENS)
        assert_matches_emulation(choice.token_ids, choice.logprobs.token_logprobs, ref_tokens,
                                 ref_steps, f"{context} {prompt[:20]!r}")
    return server


# ---- served end to end ---------------------------------------------------------------------------
def test_qwen2_msmodelslim_layout_served_matches_emulation(serve, quantized):
    """--quantization ascend: static attention (q/k/v biases folded into quant_bias, the fused
    q|k|v one int8 matmul), dynamic MLP (fused gate|up with silu)."""
    float_dir, quant_dir = quantized("qwen2", "ascend")
    server = serve_and_compare(serve, float_dir, quant_dir, "ascend", "qwen2 ascend")
    assert "quantization=ascend" in server.log_tail(100000)


SLOW = slow("~40 s each; the default run serves Qwen2 (ascend) and DeepSeek (golden-stick, TP=1 "
             "and 2)")


@SLOW
def test_llama_golden_stick_static_mlp_served_matches_emulation(serve, quantized):
    """--quantization golden-stick with every projection static W8A8 (activation parameters
    repeated per output channel, `beta`; gate|up static with silu fused)."""
    float_dir, quant_dir = quantized("llama", "golden-stick", "static")
    serve_and_compare(serve, float_dir, quant_dir, "golden-stick", "llama golden-stick")


@SLOW
def test_deepseek_msmodelslim_layout_served_matches_emulation(serve, quantized):
    """MLA (static q_a/q_b/kv_a/o, kv_b_proj float and absorbed), a dense first layer, MoE with
    W8A8_DYNAMIC shared and routed experts (one C++ operator per layer)."""
    float_dir, quant_dir = quantized("deepseek", "ascend")
    serve_and_compare(serve, float_dir, quant_dir, "ascend", "deepseek ascend")


def test_deepseek_golden_stick_tp2_and_tp1_match_their_emulations_with_int8_weights(quantized):
    """The flagship's layout (golden-stick, static attention, dynamic MLP and experts), offline.
    TP=1 and TP=2 (heads, experts' intermediate and the int8 weights split with their scales;
    quant_bias of row-parallel layers added once) each equal the emulation of what they compute.
    They are not equal to each other: a dynamic row-parallel projection quantizes each rank's part
    of its input with that part's own per-token scale, as on NPUs. Resident weight bytes: the int8
    model against the float one, and each TP rank against TP=1."""
    float_dir, quant_dir = quantized("deepseek", "golden-stick")
    for tp in (1, 2):
        # 32-token steps: 6 decoder graphs to compile per engine instead of 12
        outputs, rank_bytes = generate(quant_dir, tp, quantization="golden-stick",
                                       max_num_batched_tokens=32)
        emulation = Emulation(float_dir, quant_dir, "golden-stick", tp)
        for output in outputs:
            tokens = list(output.outputs[0].token_ids)
            logprobs = [step[t].logprob for t, step in zip(tokens, output.outputs[0].logprobs)]
            ref_tokens, ref_steps = emulation.greedy(list(output.prompt_token_ids), MAX_TOKENS)
            assert_matches_emulation(tokens, logprobs, ref_tokens, ref_steps, f"deepseek tp{tp}")
        if tp == 1:
            (single_bytes,) = rank_bytes
            # int8 linears hold a quarter of their float32 bytes (docs/quantization.md)
            assert single_bytes < 0.8 * _float_bytes(float_dir), single_bytes
        else:
            assert len(rank_bytes) == 2 and all(b < 0.7 * single_bytes for b in rank_bytes)


def _float_bytes(model_dir):
    """Bytes of the float checkpoint's tensors the model holds (MTP layers excluded)."""
    from safetensors import safe_open

    total = 0
    config = json.load(open(os.path.join(model_dir, "config.json")))
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "np") as f:
                for key in f.keys():
                    if f"layers.{config['num_hidden_layers']}." in key:
                        continue
                    total += f.get_tensor(key).astype(np.float32).nbytes
    return total


# ---- bad input: one clear error naming the tensor or the flag, before any step ---------------------
def load_native(model_dir: str, quantization: str | None):
    """What a worker does with the folder: build the MindSpore model from config.json, read the
    checkpoint with the --quantization method, fuse and lay out the weights."""
    import mindspore as ms
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config

    from model_backends import NATIVE, resolve_model_class
    from model_backends.native.layers import ParallelLayout, building_with_layout
    from model_backends.native.weights import load_checkpoint, process_weights_after_loading

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model_cls = resolve_model_class(config.architectures, NATIVE)
    with set_current_vllm_config(VllmConfig()), building_with_layout(ParallelLayout()):
        model = model_cls(config, 16, ms.float32)
        load_checkpoint(model, model_dir, model.checkpoint_name_to_param, quantization)
        process_weights_after_loading(model)
    return model


def edit_copy(source: str, target: str, tensors=None, description=None) -> str:
    """A copy of the msModelSlim checkpoint `source` with its tensors and/or description edited
    in place by the given functions."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if tensors is not None:
        path = os.path.join(target, "model.safetensors")
        loaded = load_file(path)
        tensors(loaded)
        save_file(loaded, path, metadata={"format": "pt"})
    if description is not None:
        path = os.path.join(target, "quant_model_description.json")
        loaded = json.load(open(path))
        description(loaded)
        json.dump(loaded, open(path, "w"))
    return target


def _made_float(module: str, float_dir: str):
    """Tensors and description of `module` back to the float checkpoint's (one shard of a fused
    projection left unquantized)."""
    def tensors(loaded):
        from safetensors.torch import load_file

        for key in [k for k in loaded if k.startswith(module + ".")]:
            del loaded[key]
        original = load_file(os.path.join(float_dir, "model.safetensors"))
        loaded.update({k: v for k, v in original.items() if k.startswith(module + ".")})

    def description(loaded):
        for key in [k for k in loaded if k.startswith(module + ".")]:
            del loaded[key]
        loaded[f"{module}.weight"] = "FLOAT"

    return tensors, description


Q = "model.layers.0.self_attn.q_proj"


def test_quantized_checkpoint_loads_with_int8_weights(quantized):
    """The layers the description marks quantized hold int8 weights after loading (fused q|k|v
    and gate|up included); the rest keeps the float dtype."""
    import mindspore as ms

    _, quant_dir = quantized("qwen2", "ascend")
    model = load_native(quant_dir, "ascend")
    dtypes = {name: param.dtype for name, param in model.parameters_and_names()}
    assert dtypes["model.layers.0.self_attn.qkv_proj.quant_method.packed"] == ms.int8
    assert dtypes["model.layers.1.mlp.gate_up_proj.quant_method.packed"] == ms.int8
    assert dtypes["model.embed_tokens.weight"] == ms.float32
    assert not any(name.endswith("proj.weight") for name in dtypes), "float copies left behind"


@pytest.mark.parametrize("case", ["missing-tensor", "wrong-dtype", "wrong-shape", "mixed-qkv",
                                  "mixed-gate-up"])
def test_bad_w8a8_checkpoint_names_the_tensor(quantized, tmp_path, case):
    float_dir, quant_dir = quantized("qwen2", "ascend")
    import torch

    if case == "missing-tensor":
        broken = edit_copy(quant_dir, tmp_path / case,
                           tensors=lambda t: t.pop(f"{Q}.deq_scale"))
        message = (rf"quant_model_description.json beside the weights marks these tensors' "
                   rf"layers quantized, but the checkpoint lacks them: {Q}.deq_scale \(W8A8\)")
    elif case == "wrong-dtype":
        def to_float(t):
            t[f"{Q}.weight"] = t[f"{Q}.weight"].to(torch.float32)
        broken = edit_copy(quant_dir, tmp_path / case, tensors=to_float)
        message = rf"'{Q}.weight' has dtype float32 .* but a W8A8 weight is int8"
    elif case == "wrong-shape":
        def truncate(t):
            t[f"{Q}.deq_scale"] = t[f"{Q}.deq_scale"][:-1].clone()
        broken = edit_copy(quant_dir, tmp_path / case, tensors=truncate)
        message = rf"'{Q}.deq_scale' has shape \(127,\), too small for rows 0:128"
    else:
        module = ("model.layers.0.self_attn.k_proj" if case == "mixed-qkv"
                  else "model.layers.1.mlp.up_proj")
        first = Q if case == "mixed-qkv" else "model.layers.1.mlp.gate_proj"
        tensors, description = _made_float(module, float_dir)
        broken = edit_copy(quant_dir, tmp_path / case, tensors, description)
        message = rf"{first}.weight is W8A8(_DYNAMIC)? but {module}.weight is FLOAT: .* fuses"
    with pytest.raises(ValueError, match=message):
        load_native(str(broken), "ascend")


def test_unknown_scheme_and_missing_description_are_refused(quantized, tmp_path):
    from model_backends.native.quant_config import QuantDescription

    _, quant_dir = quantized("qwen2", "ascend")

    def w4a16(loaded):
        loaded[f"{Q}.weight"] = "W4A16"

    broken = edit_copy(quant_dir, tmp_path / "w4a16", description=w4a16)
    with pytest.raises(ValueError, match=rf"tensor '{Q}.weight' has scheme 'W4A16', which "
                                         "vllm-mindspore does not run; supported schemes: FLOAT, "
                                         "W8A8, W8A8_DYNAMIC"):
        QuantDescription.load(str(broken), "ascend")
    with pytest.raises(ValueError, match="--quantization golden-stick reads "
                                         "quantization_description.json .* The folder has "
                                         "quant_model_description.json .* serve it with "
                                         "--quantization ascend"):
        QuantDescription.load(quant_dir, "golden-stick")


def test_vllm_config_accepts_both_methods_and_refuses_a_missing_flag(quantized):
    """vLLM's own parser and config take --quantization ascend / golden-stick (registered in its
    quantization registry) and read the description before any process starts; a W8A8
    checkpoint without the flag is refused, naming it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for layout in ("ascend", "golden-stick"):
        _, quant_dir = quantized("qwen2", layout)
        args = parser.parse_args(["--model", quant_dir, "--quantization", layout])
        config = EngineArgs.from_cli_args(args).create_engine_config()
        assert config.quant_config.get_name() == layout
        assert config.quant_config.description.schemes[f"{Q}.weight"] == "W8A8"
    with pytest.raises(ValueError, match="served without --quantization: serve it with "
                                         "--quantization golden-stick"):
        EngineArgs(model=quant_dir).create_engine_config()
