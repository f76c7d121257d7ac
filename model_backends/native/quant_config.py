"""Which tensors of a W8A8 checkpoint are quantized, and how: the description file beside the
weights, and the two `--quantization` methods registered with vLLM.

- `--quantization ascend`: msModelSlim's layout, described by `quant_model_description.json`.
- `--quantization golden-stick`: MindSpore golden-stick's layout (the MindSpore-Lab A8W8 weights),
  described by `quantization_description.json`.

Both files map each checkpoint tensor name to its scheme: `FLOAT`, `W8A8` (static per-tensor
activations) or `W8A8_DYNAMIC` (per-token activations); keys without a dot are metadata
(`model_quant_type`, ...). What the schemes compute and which tensors each needs is in
docs/quantization.md. Pure Python: importing this module loads neither MindSpore nor torch.
"""

import json
import os
from typing import Any

ASCEND = "ascend"
GOLDEN_STICK = "golden-stick"
DESCRIPTION_FILES = {ASCEND: "quant_model_description.json",
                     GOLDEN_STICK: "quantization_description.json"}
LAYOUT_NAMES = {ASCEND: "msModelSlim", GOLDEN_STICK: "MindSpore golden-stick"}

FLOAT, STATIC, DYNAMIC = "FLOAT", "W8A8", "W8A8_DYNAMIC"
SCHEMES = (FLOAT, STATIC, DYNAMIC)
# Metadata asking for more than W8A8 linears: refused unless absent or FLOAT.
_REFUSED_METADATA = {"kv_cache_type": "KV-cache quantization",
                     "fa_quant_type": "attention (FA) quantization",
                     "reduce_quant_type": "quantized all-reduce"}


class QuantDescriptionError(ValueError):
    """A quantization description that cannot be served; the message names the file and the
    entry."""


def description_path(model_dir: str, method: str) -> str:
    return os.path.join(model_dir, DESCRIPTION_FILES[method])


def find_description(model_dir: str) -> tuple[str, str] | None:
    """(method, path) of the first description file present in `model_dir`, or None."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    for method, name in DESCRIPTION_FILES.items():
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            return method, path
    return None


def unflagged_checkpoint_error(model_dir: str) -> str | None:
    """The error for a W8A8 checkpoint served without --quantization (None when the folder has
    no description file)."""
    found = find_description(model_dir)
    if found is None:
        return None
    method, path = found
    return (f"{path} describes a W8A8-quantized checkpoint ({LAYOUT_NAMES[method]} layout) but "
            f"the model is served without --quantization: serve it with --quantization {method} "
            "(vllm-mindspore keeps its int8 weights int8; see docs/quantization.md).")


class QuantDescription:
    """tensor name -> scheme, read from the method's description file."""

    def __init__(self, method: str, path: str, schemes: dict[str, str], metadata: dict[str, Any]):
        self.method = method
        self.path = path
        self.schemes = schemes
        self.metadata = metadata

    @property
    def layout(self) -> str:
        return LAYOUT_NAMES[self.method]

    @classmethod
    def load(cls, model_dir: str, method: str) -> "QuantDescription":
        if method not in DESCRIPTION_FILES:
            raise QuantDescriptionError(
                f"--quantization {method!r} is not a method of vllm-mindspore; use "
                f"{' or '.join(DESCRIPTION_FILES)}.")
        path = description_path(model_dir, method)
        if not os.path.isfile(path):
            other = find_description(model_dir)
            hint = (f" The folder has {os.path.basename(other[1])} ({LAYOUT_NAMES[other[0]]} "
                    f"layout): serve it with --quantization {other[0]}." if other else
                    " Without a description file the checkpoint is not a W8A8 checkpoint of this "
                    "layout: drop --quantization for a float checkpoint.")
            raise QuantDescriptionError(
                f"--quantization {method} reads {DESCRIPTION_FILES[method]} beside the weights, "
                f"and {model_dir!r} has none.{hint}")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as error:
            raise QuantDescriptionError(
                f"Cannot read the quantization description {path} ({type(error).__name__}: "
                f"{error}): it must be a JSON object of tensor name -> scheme.") from error
        if not isinstance(raw, dict):
            raise QuantDescriptionError(
                f"The quantization description {path} must be a JSON object of tensor name -> "
                f"scheme, found a {type(raw).__name__}.")
        schemes, metadata = {}, {}
        for key, value in raw.items():
            if "." not in key:
                metadata[key] = value
                continue
            if value not in SCHEMES:
                raise QuantDescriptionError(
                    f"{path}: tensor {key!r} has scheme {value!r}, which vllm-mindspore does not "
                    f"run; supported schemes: {', '.join(SCHEMES)}.")
            schemes[key] = value
        for key, what in _REFUSED_METADATA.items():
            if metadata.get(key) not in (None, "", FLOAT):
                value = metadata[key]
                raise QuantDescriptionError(
                    f"{path}: {key} = {value!r} asks for {what}, which vllm-mindspore does not "
                    "support (the KV cache and attention run in the model's float dtype).")
        description = cls(method, path, schemes, metadata)
        description.check_modules()
        return description

    def check_modules(self) -> None:
        """Every tensor of a module (a linear: weight, scales, offsets) has the same scheme; a
        float bias may be marked FLOAT."""
        by_module: dict[str, tuple[str, str]] = {}
        for name, scheme in self.schemes.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "bias" and scheme == FLOAT:
                continue
            first = by_module.setdefault(module, (name, scheme))
            if first[1] != scheme:
                raise QuantDescriptionError(
                    f"{self.path}: tensors of one module must share a scheme, but {first[0]!r} is "
                    f"{first[1]} and {name!r} is {scheme}.")

    def module_scheme(self, prefix: str) -> str:
        """Scheme of the module whose checkpoint tensors start with `prefix.` (its weight's),
        FLOAT when the description does not name it."""
        return self.schemes.get(f"{prefix}.weight", FLOAT)

    def quantized_modules(self) -> dict[str, str]:
        """Checkpoint module prefix -> scheme, for every module with a quantized weight."""
        return {name[:-len(".weight")]: scheme for name, scheme in self.schemes.items()
                if name.endswith(".weight") and scheme != FLOAT}


# ---- vLLM's quantization-config registry ----------------------------------------------------
_registered = False


def register_with_vllm() -> None:
    """Add `ascend` and `golden-stick` to vLLM's quantization methods, so `--quantization` and
    its config checks accept them (idempotent; runs in every vLLM process)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import (QUANTIZATION_METHODS,
                                                         register_quantization_config)

    from model_backends.native.quant_vllm import CONFIGS

    for method, config_cls in CONFIGS.items():
        if method not in QUANTIZATION_METHODS:
            register_quantization_config(method)(config_cls)
    _registered = True
