#!/usr/bin/env python3
"""Quantize a float Hugging Face checkpoint to W8A8 in msModelSlim's layout (`--layout ascend`,
served with `--quantization ascend`) or MindSpore golden-stick's (`--layout golden-stick`, served
with `--quantization golden-stick`), for tests, demos and benchmarks. Offline, CPU, seconds for
the tiny models.

    python scripts/quantize_w8a8.py FLOAT_DIR OUT_DIR --layout ascend
    python scripts/quantize_w8a8.py FLOAT_DIR OUT_DIR --layout golden-stick --mlp static

What it writes, as the DeepSeek-R1 W8A8 deployments do (docs/quantization.md):
- attention projections (q/k/v/o; DeepSeek's q_a/q_b/kv_a_proj_with_mqa/o): W8A8, static
  per-tensor asymmetric activations calibrated on a few local prompts (min/max of the layer's
  input), symmetric per-output-channel int8 weights;
- MLP, shared and routed experts' projections: W8A8_DYNAMIC (per-token activations at run time,
  per-channel int8 weights), or W8A8 with `--mlp static` (dense MLPs; routed experts stay dynamic);
- embeddings, norms, routers, lm_head and DeepSeek's kv_b_proj: unchanged (FLOAT).

Tensors per layout: see `quantize_static` and `quantize_dynamic` below. The description file (quant_model_description.json
or quantization_description.json) names every tensor's scheme. Calibration text: sentences built in,
plus the first lines of a few Python standard-library modules (nothing is downloaded).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import glob
import json
import re
import shutil
import sys
import sysconfig

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_mindspore.ops import quant_reference as ref  # noqa: E402  (pure numpy)

DESCRIPTION_FILES = {"ascend": "quant_model_description.json",
                     "golden-stick": "quantization_description.json"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa")
MLP = ("gate_proj", "up_proj", "down_proj")
CALIBRATION_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    print('hello, world')\n",
    "Copyright (c) Python Software Foundation. All rights reserved.",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    print(name)\n",
]


def calibration_texts(count: int = 4) -> list[str]:
    texts = list(CALIBRATION_TEXT)
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:count]:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read(1500))
    return texts


def scheme_of(name: str, mlp: str) -> str:
    """Scheme of checkpoint tensor `name` (a `.weight` of a linear, else FLOAT)."""
    if not name.endswith(".weight"):
        return ref.FLOAT
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    if module in ATTENTION:
        return ref.STATIC
    if module in MLP:
        if ".experts." in name:
            return ref.DYNAMIC
        return ref.STATIC if mlp == "static" else ref.DYNAMIC
    return ref.FLOAT


def read_checkpoint(model_dir: str) -> dict[str, "torch.Tensor"]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def calibrate(model_dir: str, modules: set[str]) -> dict[str, tuple[float, float]]:
    """min/max of the input of each named module over the calibration prompts (float32 HF model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ranges: dict[str, list[float]] = {}
    hooks = []
    for name, module in model.named_modules():
        if name in modules:
            def hook(_, inputs, name=name):
                x = inputs[0].detach()
                low, high = ranges.setdefault(name, [float("inf"), float("-inf")])
                ranges[name] = [min(low, float(x.min())), max(high, float(x.max()))]
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for text in calibration_texts():
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :256]
            model(ids)
    for hook in hooks:
        hook.remove()
    missing = modules - set(ranges)
    if missing:
        raise SystemExit(f"calibration did not reach {sorted(missing)[:4]}: are these module names "
                         "of the HF model?")
    return {name: tuple(value) for name, value in ranges.items()}


def quantize_static(weight: np.ndarray, bias: np.ndarray | None, low: float, high: float,
                    layout: str, float_dtype: str) -> dict[str, np.ndarray]:
    """The tensors of a W8A8 (static) linear in `layout`:
    both: weight int8 [N, K], deq_scale [N] = input_scale * weight_scale (float32), quant_bias
    int32 [N] = -input_offset * sum_k W;
    ascend (msModelSlim): input_scale / input_offset [1] in the float dtype, the float bias
    folded into quant_bias (+ round(bias / deq_scale)) and kept as `bias` (described FLOAT),
    weight_scale / weight_offset [N, 1], deq_scale as int64 bits for float16 models;
    golden-stick: input_scale / input_offset float32 repeated per output channel [N], `beta`
    int32 zeros [N], the float bias kept as `bias` and added after dequantization."""
    q, weight_scale = ref.quantize_weight(weight)
    input_scale, input_offset = ref.activation_range_params(low, high)
    scale_dtype = np.float16 if float_dtype == "float16" else np.float32
    if layout == "ascend":
        input_scale = np.float32(np.array([input_scale], scale_dtype)[0])  # as stored
    deq_scale = (np.float32(input_scale) * weight_scale).astype(np.float32)
    quant_bias = -input_offset * q.astype(np.int64).sum(1)
    out = {"weight": q}
    if layout == "ascend":
        if bias is not None:
            quant_bias = quant_bias + np.rint(bias.astype(np.float64) / deq_scale).astype(np.int64)
            out["bias"] = bias
        out["input_scale"] = np.array([input_scale], scale_dtype)
        out["input_offset"] = np.array([input_offset], scale_dtype)
        out["deq_scale"] = (deq_scale.view(np.int32).astype(np.int64) if float_dtype == "float16"
                            else deq_scale)
        out["weight_scale"] = weight_scale.reshape(-1, 1)
        out["weight_offset"] = np.zeros((len(weight_scale), 1), np.float32)
    else:
        rows = len(weight_scale)
        out["input_scale"] = np.full(rows, input_scale, np.float32)
        out["input_offset"] = np.full(rows, input_offset, np.float32)
        out["deq_scale"] = deq_scale
        out["beta"] = np.zeros(rows, np.int32)
        if bias is not None:
            out["bias"] = bias
    out["quant_bias"] = quant_bias.astype(np.int32)
    return out


def quantize_dynamic(weight: np.ndarray, bias: np.ndarray | None,
                     layout: str) -> dict[str, np.ndarray]:
    """W8A8_DYNAMIC: weight int8 [N, K] and its per-channel scale (ascend: weight_scale [N, 1]
    and weight_offset [N, 1] zeros; golden-stick: w_scale [N]), and the float bias if any
    (added after dequantization)."""
    q, weight_scale = ref.quantize_weight(weight)
    if layout == "ascend":
        out = {"weight": q, "weight_scale": weight_scale.reshape(-1, 1),
               "weight_offset": np.zeros((len(weight_scale), 1), np.float32)}
    else:
        out = {"weight": q, "w_scale": weight_scale}
    if bias is not None:
        out["bias"] = bias
    return out


def quantize(model_dir: str, out_dir: str, layout: str, mlp: str = "dynamic") -> dict:
    """Write the W8A8 checkpoint of `model_dir` into `out_dir`; returns the description."""
    import torch
    from safetensors.torch import save_file

    tensors = read_checkpoint(model_dir)
    float_dtype = str(next(t for t in tensors.values() if t.is_floating_point()).dtype)
    float_dtype = float_dtype.removeprefix("torch.")
    schemes = {name: scheme_of(name, mlp) for name in tensors}
    static = {name[: -len(".weight")] for name, s in schemes.items() if s == ref.STATIC}
    ranges = calibrate(model_dir, static) if static else {}

    out: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {"model_quant_type": "W8A8_DYNAMIC" if mlp == "dynamic"
                                    else "W8A8"}
    for name, tensor in tensors.items():
        scheme = schemes[name]
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if scheme == ref.FLOAT:
            if name.endswith(".bias") and schemes.get(name[:-5] + ".weight", ref.FLOAT) != ref.FLOAT:
                continue  # written with its linear
            out[name] = tensor
            description[name] = ref.FLOAT
            continue
        weight = tensor.float().numpy()
        bias_tensor = tensors.get(f"{module}.bias")
        bias = None if bias_tensor is None else bias_tensor.float().numpy()
        if scheme == ref.STATIC:
            parts = quantize_static(weight, bias, *ranges[module], layout, float_dtype)
        else:
            parts = quantize_dynamic(weight, bias, layout)
        for leaf, array in parts.items():
            key = f"{module}.{leaf}"
            value = torch.from_numpy(np.ascontiguousarray(array))
            if leaf == "bias":
                value = value.to(tensor.dtype)
            # msModelSlim describes a bias FLOAT; golden-stick gives it its linear's scheme.
            description[key] = ref.FLOAT if leaf == "bias" and layout == "ascend" else scheme
            out[key] = value
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, DESCRIPTION_FILES[layout]), "w") as f:
        json.dump(description, f, indent=2)
    for path in glob.glob(os.path.join(model_dir, "*")):
        base = os.path.basename(path)
        if os.path.isfile(path) and not base.endswith(".safetensors") and not re.match(
                r"model\.safetensors\.index\.json$", base) and base not in DESCRIPTION_FILES.values():
            shutil.copy(path, os.path.join(out_dir, base))
    return description


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="float HF checkpoint (config.json + safetensors)")
    parser.add_argument("out_dir", help="folder to write the W8A8 checkpoint into")
    parser.add_argument("--layout", choices=sorted(DESCRIPTION_FILES), required=True,
                        help="ascend: msModelSlim (serve with --quantization ascend); "
                             "golden-stick: MindSpore golden-stick (--quantization golden-stick)")
    parser.add_argument("--mlp", choices=("dynamic", "static"), default="dynamic",
                        help="scheme of dense MLP projections (routed experts stay dynamic)")
    args = parser.parse_args()
    description = quantize(args.model_dir, args.out_dir, args.layout, args.mlp)
    counts = {s: sum(1 for v in description.values() if v == s) for s in ref.SCHEMES}
    print(f"wrote {args.out_dir} ({args.layout} layout): " + ", ".join(
        f"{n} {s} tensors" for s, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
