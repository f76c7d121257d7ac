"""NativeBackend: this project's MindSpore models (`model_backends/native/`) behind the
`ModelBackend` contract.

The model classes are graph-mode Cells taking `StepTensors`' fields as their `construct`
arguments; their final norm + LM head run as a second, small graph (`logits_head()`), or, for
a step of decodes under static shapes, inside the decoder's graph (`StepGraph`).
"""

import mindspore as ms
import numpy as np
from mindspore import nn
from vllm.config import set_current_vllm_config

from model_backends import NATIVE, import_target
from model_backends.contract import ModelBackend, Precision, StepTensors
from model_backends.native.weights import load_checkpoint, process_weights_after_loading
from vllm_mindspore.ops.linear import packing_bfloat16


class StaticGraphs:
    """A Cell's graphs compiled for fixed input shapes, run without `Cell.__call__`'s per-call
    compile check: for every call MindSpore recomputes the arguments' key and looks the graph up
    (`_CellGraphExecutor.compile`), ~0.7-1 ms for a 118-cell decoder on CPU, a tenth of a
    one-token step. A call whose shapes were compiled here runs its graph directly through the
    executor (what `Cell.compile_and_run` does after that check; MindSpore 2.10's
    `_cell_graph_executor`); any other goes through the Cell (compiling, as before)."""

    def __init__(self, cell):
        self.cell = cell
        # arguments' shapes and values -> (compiled phase, the arguments' mutable flags)
        self.phases: dict[tuple, tuple[str, list]] = {}

    @staticmethod
    def signature(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype) if isinstance(a, ms.Tensor) else a for a in args)

    def compile(self, *args) -> None:
        self.cell.compile(*args)
        self.phases[self.signature(args)] = (self.cell.compile_phase,
                                             list(self.cell._has_mutable_args_list or []))

    def __call__(self, *args):
        compiled = self.phases.get(self.signature(args))
        if compiled is None:
            return self.cell(*args)
        from mindspore.graph.api import _cell_graph_executor as executor

        phase, mutable_flags = compiled
        run_args = executor._graph_executor.get_args_for_run(self.cell, args, {}, mutable_flags,
                                                             [], False, False)
        return executor._exec_pip(self.cell, *run_args, phase=phase)


class StepGraph(nn.Cell):
    """The decoder over StepTensors' six tensors (the graph's inputs, under the same names) with
    `prefill_only` fixed, followed by the logits head where there is one: logits [T, vocab]
    float32 of every token and their greedy tokens [T] (a step of decodes samples each one).

    Dynamic shapes: MindSpore's `set_inputs` pins a bool input to the value it was given, so
    each `prefill_only` value is a StepGraph of its own (one graph for steps of first prefills,
    one for the rest). Static shapes: the decoder and the head of a step of decodes, one graph
    (`prefill_only` is always False there)."""

    def __init__(self, model: nn.Cell, prefill_only: bool, head: nn.Cell | None = None):
        super().__init__()
        self.model = model
        self.prefill_only = prefill_only
        self.head = head

    def construct(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length,
                  q_seq_lens):
        hidden = self.model(input_ids, positions, slot_mapping, block_tables, batch_valid_length,
                            q_seq_lens, self.prefill_only)
        if self.head is None:
            return hidden
        return self.head(hidden)


class NativeBackend:
    name = NATIVE

    def __init__(self, cell, implementation: str, vllm_config, block_size: int,
                 precision: Precision, static_shapes: bool):
        self.cell = cell
        self.implementation = implementation
        self.hidden_size = cell.config.hidden_size
        self.vllm_config = vllm_config
        self.block_size = block_size
        self.precision = precision
        self.static_shapes = static_shapes
        self.head = None  # the logits graph, made once the weights are in their compute layout
        # CPU: static graphs called directly; Ascend: one dynamic-shape graph for each
        # `prefill_only` value (StepGraph, made with the head), via the Cells.
        self.graphs = StaticGraphs(cell) if static_shapes else None
        self.dynamic_steps: dict[bool, StepGraph] = {}
        self.head_graphs = None
        self.decode_graphs = None  # static shapes: the decoder and head's graphs, made with the head
        self.skips_padding = False  # known once the weights are in their compute layout

    @classmethod
    def build(cls, model_class: str, vllm_config, block_size: int, precision: Precision,
              static_shapes: bool) -> ModelBackend:
        model_cls = import_target(model_class)
        # vLLM's rope tables and the parallel layout (TP/EP ranks) read the current config.
        with set_current_vllm_config(vllm_config):
            cell = model_cls(vllm_config.model_config.hf_text_config, block_size,
                             precision.ms_compute)
        return cls(cell, model_class.replace(":", "."), vllm_config, block_size, precision,
                   static_shapes)

    def load_weights(self, model_dir: str, quantization: str | None) -> None:
        # expert sharding reads the EP layout
        with (set_current_vllm_config(self.vllm_config),
              packing_bfloat16(self.precision.bfloat16_weights)):
            load_checkpoint(self.cell, model_dir, self.cell.checkpoint_name_to_param,
                            quantization)
            process_weights_after_loading(self.cell)
            self.head = self.cell.logits_head()
        self.skips_padding = self.cell.skips_padding()
        if self.static_shapes:
            self.head_graphs = StaticGraphs(self.head)
            self.decode_graphs = StaticGraphs(StepGraph(self.cell, False, self.head))
        else:
            self.dynamic_steps = {flag: StepGraph(self.cell, flag) for flag in (False, True)}
            for dynamic in self.dynamic_steps.values():
                dynamic.set_inputs(*self.cell.dynamic_inputs())
            self.head.set_inputs(ms.Tensor(shape=[None, self.hidden_size], dtype=self.precision.ms_compute))

    def kv_cache_spec(self) -> dict:
        return self.cell.kv_cache_spec(self.block_size, self.precision.kv_cache)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.cell.allocate_kv_cache(num_blocks, self.precision.ms_kv_cache)

    def compile_step(self, step: StepTensors) -> None:
        if self.graphs:
            self.graphs.compile(*step)
        else:
            self.dynamic_steps[step.prefill_only].compile(*step[:-1])

    def forward(self, step: StepTensors) -> ms.Tensor:
        if self.graphs:
            return self.graphs(*step)
        return self.dynamic_steps[step.prefill_only](*step[:-1])

    def compile_logits(self, num_rows: int) -> None:
        hidden = np.zeros((num_rows, self.hidden_size), np.float32)
        (self.head_graphs or self.head).compile(ms.Tensor(hidden, self.precision.ms_compute))

    def logits(self, hidden: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor]:
        return (self.head_graphs or self.head)(hidden)

    # The decode graph (static shapes) takes the six tensors: its `prefill_only` is False, as
    # every static-shape step's is (the runner's rule; only Ascend's kernels read the flag).
    def compile_decode(self, step: StepTensors) -> None:
        if self.decode_graphs:  # dynamic shapes: `decode` runs the two graphs compiled already
            self.decode_graphs.compile(*step[:-1])

    def decode(self, step: StepTensors) -> tuple[ms.Tensor, ms.Tensor]:
        if self.decode_graphs:
            return self.decode_graphs(*step[:-1])
        return self.logits(self.forward(step))

    def num_compiled_graphs(self) -> int:
        cells = [self.cell, self.head, *self.dynamic_steps.values()]
        if self.decode_graphs:
            cells.append(self.decode_graphs.cell)
        return sum(len(cell.compile_cache) for cell in cells)

    def weight_bytes(self) -> int:
        return sum(p.nbytes for name, p in self.cell.parameters_and_names()
                   if not name.endswith("_cache"))
