"""MindFormersBackend: mindformers' own mcore inference class (`Inference<Arch>`, registered as
`mcore_<Arch>`) behind the model-backend contract.

One step is one call of the mcore forward with the step's tensors. The decoder returns the
final-normed hidden states; the logits are mf's output layer, a second graph over sampled rows.

- CPU: the mcore cells run this project's kernels (`cpu_substitutes`): the model stays on the
  per-position rope path (`is_prefill=False`) and one graph per padded token count serves any mix
  of prefills, chunks, prefix hits and decodes, with each layer's caches bound to its attention
  cell in this project's CPU layout.
- Ascend: mindformers' own cells and ops, driven as mindformers' inference expects: dynamic
  shapes (its `set_dynamic_inputs`), two graphs chosen by the cell's `phase` and flags
  (`add_flags_custom_mcore`): "prefill" for a step of first prefills only (FlashAttentionScore
  over the new tokens, rope from the table by batch_valid_length, the 128x128 compressed causal
  mask) and "increment" for every other step (decodes, chunks, prefix hits: PagedAttention with
  per-request query lengths and causal mask rows by position, rope gathered by position). The
  caches are graph inputs (per-layer lists, `mutable`) in the layout ReshapeAndCache and
  PagedAttention take: [blocks, block_size, kv_heads, head_dim] keys and values, or one
  [blocks, block_size, 1, kv_lora_rank + rope_dim] latent cache per MLA layer.
"""

import mindspore as ms
import numpy as np
from mindspore import mint, mutable, nn, ops
from safetensors import safe_open

from model_backends import MINDFORMERS
from model_backends.contract import Precision
from model_backends.mindformers import package_limits
from model_backends.mindformers.config import (MLA_ARCHITECTURES, UnsupportedByMindFormersError,
                                               mindformers_config)
from model_backends.native.checkpoint import WeightLoadError, safetensors_files
from model_backends.native.weights import is_mtp_tensor
from vllm_mindspore.ops import GreedyTokens
from vllm_mindspore.ops.attention import prefill_mask
from vllm_mindspore.ops.host import zeros_parameter
from vllm_mindspore.platform import ASCEND, DEVICE, kernel_device

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "DeepseekV3ForCausalLM")


class _CheckpointSlice:
    """A checkpoint tensor as mindformers' weight loaders read it (`get_shape()`, `[...]` ->
    numpy), read through torch: safetensors' numpy reader has no bfloat16 (read as float32).
    `read` tells whether a loader took its data."""

    def __init__(self, name: str, torch_slice):
        self.name = name
        self.torch_slice = torch_slice
        self.read = False

    def get_shape(self):
        return self.torch_slice.get_shape()

    def __getitem__(self, index):
        import torch

        self.read = True
        tensor = self.torch_slice[index]
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


class LogitsHead(nn.Cell):
    """hidden [N, hidden] (final-normed) -> (logits [N, vocab] float32, their greedy tokens [N]
    int32)."""

    def __init__(self, output_layer: nn.Cell):
        super().__init__()
        self.output_layer = output_layer
        self.greedy = GreedyTokens()

    def construct(self, hidden):
        logits = self.output_layer(hidden).astype(ms.float32)
        return logits, self.greedy(logits)


def check_supported(vllm_config, precision: Precision) -> str:
    """-> the architecture; refuses what this backend cannot run yet, naming the alternative."""
    model_config = vllm_config.model_config
    architectures = list(getattr(model_config.hf_config, "architectures", None) or [])
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    problems = []
    if arch is None:
        problems.append(f"architecture(s) {architectures}: the MindFormers backend runs "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)} so far (mindformers 2.0.0 has no "
                        "mcore Llama class)")
    problems += package_limits(vllm_config)
    if precision.bfloat16_weights:
        problems.append("--dtype bfloat16 on CPU: MindSpore has no bfloat16 matmul there (the "
                        "native backend's own kernels have); use float32 or float16")
    if problems:
        raise UnsupportedByMindFormersError(
            "The MindFormers backend cannot run this configuration: " + "; ".join(problems)
            + ". vLLM_MODEL_BACKEND=Native runs it with vllm-mindspore's own implementation.")
    return arch


def initialize_tensor_parallel(tp_size: int) -> None:
    """mindformers' parallel state for `tp_size` ranks, read by its parallel layers when they
    are built (their shard of the weights, the group of their AllReduce / AllGather). The
    worker has already joined MindSpore's collective world, whose ranks are this engine's TP
    ranks (vllm_mindspore.distributed.communication); mindformers' own
    `build_parallel_context().init_communication()` would init it again and reset MindSpore's
    auto-parallel context. At TP=1 mindformers' layers fall back to size-1 groups by
    themselves."""
    if tp_size == 1:
        return
    from mindformers.parallel_core.inference import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)


class MindFormersBackend:
    """(build, kv_cache_spec, allocate_kv_cache, compile_step, forward, compile_logits, logits,
    num_compiled_graphs, weight_bytes) over a mindformers mcore network."""

    name = MINDFORMERS

    def __init__(self, network, vllm_config, precision: Precision, mla: bool, block_size: int):
        self.network = network
        self.precision = precision
        self.mla = mla  # multi-latent attention: one latent cache per layer
        self.block_size = block_size
        self.ascend = kernel_device() == ASCEND  # mindformers' own Ascend ops, dynamic shapes
        self.implementation = f"{type(network).__module__}.{type(network).__qualname__}"
        self.hidden_size = vllm_config.model_config.get_hidden_size()
        self.skips_padding = False  # mindformers' layers compute every row they are given
        self.logits_head = LogitsHead(network.model.output_layer)
        self._weight_bytes = 0
        # Ascend: the caches as graph inputs (allocate_kv_cache) and the graph the cell is on.
        self.key_caches: list | None = None
        self.value_caches: list | None = None
        self._phase: str | None = None
        self._compiled_steps: set[tuple[int, bool]] = set()  # (tokens, prefill_only)

    @classmethod
    def build(cls, model_class: str, vllm_config, block_size: int, precision: Precision,
              static_shapes: bool) -> "MindFormersBackend":
        """The mcore network (`model_class`, from the registry) for vLLM's config, weights not
        loaded: for Ascend (`kernel_device()`) mindformers' own cells with dynamic shapes, else
        with the CPU substitutes and static shapes (one graph per padded token count)."""
        arch = check_supported(vllm_config, precision)
        from vllm_mindspore.patches.mindformers import apply_mindformers_patches

        apply_mindformers_patches()
        from mindformers import AutoModel
        from mindformers.core.context import build_mf_context
        from mindspore.nn.utils import no_init_parameters

        # mindformers' context sets the process's device (mindspore.set_device): the one this
        # process runs on, also when its cells are built for Ascend (the graph check on CPU).
        config = mindformers_config(vllm_config, arch, block_size, precision.ms_compute, DEVICE)
        build_mf_context(config)
        initialize_tensor_parallel(vllm_config.parallel_config.tensor_parallel_size)
        with no_init_parameters():
            network = AutoModel.from_config(config)
        implementation = f"{type(network).__module__}.{type(network).__qualname__}"
        if implementation != model_class.replace(":", "."):
            raise UnsupportedByMindFormersError(
                f"mindformers built {implementation} for {arch}, not {model_class} as "
                "vllm-mindspore's registry expects: install the pinned mindformers version "
                "(make install-mindformers).")
        model = network.model
        model.return_hidden_states = True  # the logits are a second graph over sampled rows
        mla = arch in MLA_ARCHITECTURES
        if kernel_device() == ASCEND:
            backend = cls(network, vllm_config, precision, mla, block_size)
            backend.prepare_ascend_graphs(static_shapes)
            return backend
        from model_backends.mindformers.cpu_substitutes import (bind_mla_attention,
                                                                 bind_paged_attention)

        model.move_lens_to_cpu = False  # MoveTo has no CPU kernel
        # Rope rows gathered by position for every token (the CPU rope takes per-token rows).
        network.add_flags_custom_mcore(is_prefill=False)
        for layer in model.decoder.layers:
            attention = layer.self_attention
            if mla:
                bind_mla_attention(attention, block_size)
            else:
                bind_paged_attention(attention.core_attention, 1.0 / attention.norm_factor,
                                     block_size)
        return cls(network, vllm_config, precision, mla, block_size)

    def prepare_ascend_graphs(self, static_shapes: bool) -> None:
        """Ascend: the graphs run as mindformers' `jit` runs them (O0, infer_boost). Dynamic
        shapes (the worker's): one decoder graph per phase takes any token and request count
        (mindformers' own `set_dynamic_inputs`: every input, the per-layer cache lists
        included), one logits graph any row count. Static shapes: one graph per shape (the
        Ascend graph check compiles those too: every dimension known, inference checks more)."""
        jit = ms.JitConfig(jit_level="O0", infer_boost="on")
        self.network.set_jit_config(jit)
        self.logits_head.set_jit_config(jit)
        # MindSpore runs the graph cached for a cell phase named "prefill" or "increment" on any
        # call in that phase, whatever its shapes: static graphs take other phase names.
        self._phases = ("prefill_static", "increment_static") if static_shapes else (
            "prefill", "increment")
        if not static_shapes:
            self.network.set_dynamic_inputs()
            self.logits_head.set_inputs(ms.Tensor(shape=[None, self.hidden_size],
                                                  dtype=self.precision.ms_compute))
        self.prefill_mask = prefill_mask(self.precision.ms_compute)
        # PagedAttention's mask: 0 up to the token's position, then -10000 (MLA in bfloat16: 1,
        # the MLA kernel's convention), as mindformers' own vLLM integration builds it.
        bfloat16 = self.precision.ms_compute == ms.bfloat16
        self.masked_value = 1.0 if self.mla and bfloat16 else -10000.0

    # ---- weights ---------------------------------------------------------------------------
    def _checkpoint(self, files: list[str], slices: list[_CheckpointSlice]):
        """(mf name, slice) of every checkpoint tensor but the multi-token-prediction layers'
        (mindformers builds none for generation); each slice is also kept in `slices`."""
        num_layers = len(self.network.model.decoder.layers)
        for path in files:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle)
                    if is_mtp_tensor(name, num_layers):
                        continue
                    slices.append(_CheckpointSlice(name, handle.get_slice(name)))
                    yield self.network.convert_name(name), slices[-1]

    def load_weights(self, model_dir: str, quantization: str | None) -> None:
        """mindformers' loader (name mapping, q|k|v and gate|up stacking, TP slicing). It only
        warns about a parameter it found no tensor for and skips a tensor it has no parameter
        for (say biases of a model built without them): both are errors here."""
        network = self.network
        files = safetensors_files(model_dir)
        embedding = network.model.embedding.word_embeddings.weight
        if embedding is network.model.output_layer.weight:
            # Tied: the shared Parameter took the output layer's name (the last cell it was set
            # on), under which mf's loader would skip the checkpoint's embedding tensor.
            embedding.name = "embedding.word_embeddings.weight"
        params = network.model.get_params_dict()
        slices: list[_CheckpointSlice] = []
        loaded = network.model.load_weights(self._checkpoint(files, slices),
                                            network.generate_mapping(),
                                            network.check_hf_weight(weights_files=files))
        missing = sorted(set(params) - set(loaded))
        unused = sorted(s.name for s in slices if not s.read)
        problems = [f"{len(names)} {what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                    for what, names in (("parameter(s) got no tensor", missing),
                                        ("checkpoint tensor(s) fit no parameter", unused))
                    if names]
        if problems:
            raise WeightLoadError(
                f"The checkpoint in {model_dir!r} does not fit {self.implementation} as "
                f"configured ({'; '.join(problems)}): config.json (or the YAML) and the weights "
                "do not belong together.")
        network.process_weights_after_loading(network.model)
        if self.ascend:  # mf's absorbed MLA weights and GroupedMLP run as they are
            self._weight_bytes = sum(p.nbytes for _, p in network.parameters_and_names())
            return
        from model_backends.mindformers.cpu_substitutes import absorb_mla, bind_moe_experts

        for index, layer in enumerate(network.model.decoder.layers):
            if self.mla:
                absorb_mla(layer.self_attention, f"model.layers.{index}.self_attn")
            if hasattr(layer.mlp, "router"):  # an MoELayer
                bind_moe_experts(layer.mlp, f"model.layers.{index}.mlp")
        self._weight_bytes = sum(p.nbytes for _, p in network.parameters_and_names())

    def weight_bytes(self) -> int:
        return self._weight_bytes

    # ---- KV cache --------------------------------------------------------------------------
    def _attention_cells(self) -> dict[str, nn.Cell]:
        """vLLM layer name -> the mf attention cell holding that layer's caches (MLA: the
        attention layer; else its core attention)."""
        return {f"model.layers.{i}.self_attn.attn":
                layer.self_attention if self.mla else layer.self_attention.core_attention
                for i, layer in enumerate(self.network.model.decoder.layers)}

    def kv_cache_spec(self):
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        if self.mla:  # one latent row per token: [c, k_pe]
            return {name: MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1,
                                           head_size=self._latent_size(cell),
                                           dtype=self.precision.kv_cache)
                    for name, cell in self._attention_cells().items()}
        return {name: FullAttentionSpec(block_size=self.block_size,
                                        num_kv_heads=cell.kv_head_num,
                                        head_size=cell.hidden_size_per_attention_head,
                                        dtype=self.precision.kv_cache)
                for name, cell in self._attention_cells().items()}

    def _latent_size(self, attention) -> int:
        """An MLA layer's cached values per token: kv_lora_rank + the rope dimension."""
        if self.ascend:
            return attention.config.kv_lora_rank + attention.config.qk_pos_emb_head_dim
        return attention.cpu_attention.latent_size

    def _ascend_cache_shapes(self, cell, num_blocks: int) -> tuple:
        """(key cache shape, value cache shape or None) of one layer, as ReshapeAndCache /
        PagedAttention (and MLA's latent write) take them."""
        if self.mla:
            return (num_blocks, self.block_size, 1, self._latent_size(cell)), None
        shape = (num_blocks, self.block_size, cell.kv_head_num, cell.hidden_size_per_attention_head)
        return shape, shape

    def allocate_kv_cache(self, num_blocks: int) -> None:
        dtype = self.precision.ms_kv_cache
        if self.ascend:
            shapes = [self._ascend_cache_shapes(cell, num_blocks)
                      for cell in self._attention_cells().values()]
            self.key_caches = [mint.zeros(key, dtype=dtype) for key, _ in shapes]
            self.value_caches = None if self.mla else [mint.zeros(value, dtype=dtype)
                                                       for _, value in shapes]
            return
        for name, cell in self._attention_cells().items():
            if self.mla:
                cell.kv_cache_cpu = zeros_parameter(cell.cpu_attention.cache_shape(num_blocks),
                                                    dtype, f"{name}.kv_cache")
                continue
            key_shape, value_shape = cell.cpu_attention.cache_shapes(num_blocks)
            cell.key_cache_cpu = zeros_parameter(key_shape, dtype, f"{name}.key_cache")
            cell.value_cache_cpu = zeros_parameter(value_shape, dtype, f"{name}.value_cache")

    # ---- step ------------------------------------------------------------------------------
    def _arguments(self, step) -> dict:
        """The mcore forward's arguments for one step (StepTensors)."""
        context_lens = step.batch_valid_length.asnumpy() - step.q_seq_lens.asnumpy()
        return dict(input_ids=step.input_ids, positions=step.positions,
                    batch_valid_length=step.batch_valid_length,
                    context_lens_tensor=ms.Tensor.from_numpy(context_lens),
                    q_seq_lens=step.q_seq_lens, block_tables=step.block_tables,
                    slot_mapping=step.slot_mapping)

    def _attention_mask(self, step) -> ms.Tensor:
        """Ascend: the prefill graph's compressed causal mask, or the increment graph's causal
        rows [T, max_blocks * block_size] by position (made on the device)."""
        if step.prefill_only:
            return self.prefill_mask
        num_keys = step.block_tables.shape[1] * self.block_size
        keys = ops.arange(0, num_keys, dtype=ms.int32).reshape(1, -1)
        masked = ops.gt(keys, step.positions.reshape(-1, 1)).astype(ms.float32)
        return (masked * self.masked_value).astype(self.precision.ms_compute)

    def _ascend_arguments(self, step) -> tuple:
        """The mcore forward's arguments, positionally (its `set_dynamic_inputs` order):
        input_ids, hidden_states, positions, batch_valid_length, context_lens_tensor,
        q_seq_lens, block_tables, slot_mapping, attention_mask, attn_metadata, the four
        data-parallel padding indices (unused at DP 1), key_cache, value_cache."""
        context_lens = step.batch_valid_length.asnumpy() - step.q_seq_lens.asnumpy()
        return (step.input_ids, None, step.positions, step.batch_valid_length,
                ms.Tensor.from_numpy(context_lens), step.q_seq_lens, step.block_tables,
                step.slot_mapping, self._attention_mask(step), None, None, None, None, None,
                mutable(self.key_caches),
                None if self.value_caches is None else mutable(self.value_caches))

    def _enter_phase(self, prefill_only: bool) -> None:
        """Ascend: put the network on the graph for this step. mindformers' cells read
        `is_prefill` when a graph is compiled, and MindSpore keeps one dynamic-shape graph per
        cell `phase` ("prefill" / "increment") and runs the one the phase names."""
        phase = self._phases[0] if prefill_only else self._phases[1]
        if phase != self._phase:
            self.network.add_flags_custom_mcore(is_prefill=prefill_only)
            self.network.phase = phase
            self._phase = phase

    def compile_step(self, step) -> None:
        """Ascend: compile the step's graph (prefill or increment) without running it; the
        calls of that phase then run it. CPU: compile by running `step` (padding only, as the
        runner's warm-up steps are): the mcore construct is mindformers' jit-wrapped function,
        and `Cell.compile` would cache its graph under another key than the call's."""
        if self.ascend:
            self._enter_phase(step.prefill_only)
            self.network.compile(*self._ascend_arguments(step))
        else:
            self.forward(step)
        self._compiled_steps.add((len(step.input_ids), step.prefill_only))

    def forward(self, step) -> ms.Tensor:
        """StepTensors (T tokens) -> hidden [T, hidden], final norm applied."""
        if self.ascend:
            self._enter_phase(step.prefill_only)
            return self.network(*self._ascend_arguments(step))
        return self.network(**self._arguments(step))

    def compile_logits(self, num_rows: int) -> None:
        self.logits_head.compile(ms.Tensor(np.zeros((num_rows, self.hidden_size), np.float32),
                                           self.precision.ms_compute))

    def logits(self, hidden: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor]:
        """hidden [N, hidden] -> (logits [N, vocab] float32, greedy tokens [N] int32)."""
        return self.logits_head(hidden)

    def compile_decode(self, step) -> None:
        """`decode` runs `forward`'s graph then the head's: compile whichever is missing (the
        runner's warm-up has compiled the network for every token count already, and on CPU
        compiling it means running a step)."""
        if (len(step.input_ids), step.prefill_only) not in self._compiled_steps:
            self.compile_step(step)
        self.compile_logits(len(step.input_ids))

    def decode(self, step) -> tuple[ms.Tensor, ms.Tensor]:
        """StepTensors (T decodes) -> (logits [T, vocab], tokens [T]): the network's graph,
        then the head's (two calls: the mcore forward is mindformers' own jit-wrapped function,
        not wrapped in a graph of ours)."""
        return self.logits(self.forward(step))

    def num_compiled_graphs(self) -> int:
        return len(self.network.compile_cache) + len(self.logits_head.compile_cache)
