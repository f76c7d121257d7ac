"""NativeBackend: this project's MindSpore models (`model_backends/native/`) behind the
`ModelBackend` contract.

The model classes are graph-mode Cells taking `StepTensors`' fields as their `construct`
arguments; their final norm + LM head run as a second, small graph (`logits_head()`).
"""

import mindspore as ms
import numpy as np
from vllm.config import set_current_vllm_config

from model_backends import NATIVE, import_target
from model_backends.contract import ModelBackend, StepTensors
from model_backends.native.weights import load_checkpoint, process_weights_after_loading


class NativeBackend:
    name = NATIVE

    def __init__(self, cell, implementation: str, vllm_config, dtype, static_shapes: bool):
        self.cell = cell
        self.implementation = implementation
        self.hidden_size = cell.config.hidden_size
        self.vllm_config = vllm_config
        self.dtype = dtype
        self.static_shapes = static_shapes
        self.head = None  # the logits graph, made once the weights are in their compute layout

    @classmethod
    def build(cls, model_class: str, vllm_config, block_size: int, dtype,
              static_shapes: bool) -> ModelBackend:
        model_cls = import_target(model_class)
        # vLLM's rope tables and the parallel layout (TP/EP ranks) read the current config.
        with set_current_vllm_config(vllm_config):
            cell = model_cls(vllm_config.model_config.hf_text_config, block_size, dtype)
        return cls(cell, model_class.replace(":", "."), vllm_config, dtype, static_shapes)

    def load_weights(self, model_dir: str, quantization: str | None) -> None:
        with set_current_vllm_config(self.vllm_config):  # expert sharding reads the EP layout
            load_checkpoint(self.cell, model_dir, self.cell.checkpoint_name_to_param,
                            quantization)
            process_weights_after_loading(self.cell)
            self.head = self.cell.logits_head()
        if not self.static_shapes:
            self.cell.set_inputs(*self.cell.dynamic_inputs())
            self.head.set_inputs(ms.Tensor(shape=[None, self.hidden_size], dtype=self.dtype))

    def kv_cache_spec(self, block_size: int, torch_dtype) -> dict:
        return self.cell.kv_cache_spec(block_size, torch_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.cell.allocate_kv_cache(num_blocks)

    def compile_step(self, step: StepTensors) -> None:
        self.cell.compile(*step)

    def forward(self, step: StepTensors) -> ms.Tensor:
        return self.cell(*step)

    def compile_logits(self, num_rows: int) -> None:
        self.head.compile(ms.Tensor(np.zeros((num_rows, self.hidden_size), np.float32),
                                    self.dtype))

    def logits(self, hidden: ms.Tensor) -> ms.Tensor:
        return self.head(hidden)

    def num_compiled_graphs(self) -> int:
        return len(self.cell.compile_cache) + len(self.head.compile_cache)

    def weight_bytes(self) -> int:
        return sum(p.nbytes for name, p in self.cell.parameters_and_names()
                   if not name.endswith("_cache"))
