"""vLLM's view of a W8A8 checkpoint served by vllm-mindspore (`--quantization ascend` /
`golden-stick`), registered by quant_config.register_with_vllm.

The description file is read and checked when vLLM builds its config, so a bad one fails before
any worker starts; the MindSpore models read it again when they load their weights
(model_backends/native/quant.py). vLLM's torch layers never run, so no quantize method is handed
to them. Module-level classes: vLLM pickles its config into the engine and worker processes.
"""

import os
from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from model_backends.native.quant_config import ASCEND, GOLDEN_STICK, QuantDescription


class MindSporeW8A8Config(QuantizationConfig):
    method = ""

    def __init__(self):
        super().__init__()
        self.description: QuantDescription | None = None

    def get_name(self) -> str:
        return self.method

    def get_supported_act_dtypes(self) -> list:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # read in maybe_update_config, with this plugin's own errors

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MindSporeW8A8Config":
        return cls()

    def get_quant_method(self, layer, prefix: str):
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        if os.path.isdir(model_name):
            self.description = QuantDescription.load(model_name, self.method)


class AscendW8A8Config(MindSporeW8A8Config):
    """msModelSlim's layout: quant_model_description.json."""

    method = ASCEND


class GoldenStickW8A8Config(MindSporeW8A8Config):
    """MindSpore golden-stick's layout: quantization_description.json."""

    method = GOLDEN_STICK


CONFIGS = {ASCEND: AscendW8A8Config, GOLDEN_STICK: GoldenStickW8A8Config}
