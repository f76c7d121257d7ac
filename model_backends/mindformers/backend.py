"""MindFormersBackend: mindformers' own mcore inference class (`Inference<Arch>`, registered as
`mcore_<Arch>`) behind the model-backend contract.

One step is one call of the mcore forward with the step's tensors. On CPU the mcore cells run
this project's kernels (`cpu_substitutes`): the model stays on the per-position rope path
(`is_prefill=False`) and one graph per padded token count serves any mix of prefills, chunks,
prefix hits and decodes, with each layer's caches bound to its attention cell in this project's
CPU layout. The decoder returns the final-normed hidden states; the logits are mf's output layer.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn
from safetensors import safe_open

from model_backends import MINDFORMERS
from model_backends.mindformers import package_limits
from model_backends.mindformers.config import (MLA_ARCHITECTURES, UnsupportedByMindFormersError,
                                               mindformers_config)
from model_backends.native.weights import WeightLoadError, is_mtp_tensor, safetensors_files
from vllm_mindspore.platform import ASCEND, kernel_device

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
    """hidden [N, hidden] (final-normed) -> logits [N, vocab] float32."""

    def __init__(self, output_layer: nn.Cell):
        super().__init__()
        self.output_layer = output_layer

    def construct(self, hidden):
        return self.output_layer(hidden).astype(ms.float32)


# HF's DeepSeek-V3 q_a_layernorm / kv_a_layernorm: built with the RMSNorm default eps.
def check_supported(vllm_config, dtype) -> str:
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
    if kernel_device() != ASCEND and dtype == ms.bfloat16:
        problems.append("--dtype bfloat16 on CPU: MindSpore has no bfloat16 matmul there; use "
                        "float32 or float16")
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

    def __init__(self, network, vllm_config, dtype, mla: bool):
        self.network = network
        self.dtype = dtype
        self.mla = mla  # multi-latent attention: one latent cache per layer
        self.implementation = f"{type(network).__module__}.{type(network).__qualname__}"
        self.hidden_size = vllm_config.model_config.get_hidden_size()
        self.logits_head = LogitsHead(network.model.output_layer)
        self._weight_bytes = 0

    @classmethod
    def build(cls, model_class: str, vllm_config, block_size: int, dtype,
              static_shapes: bool) -> "MindFormersBackend":
        """The mcore network (`model_class`, from the registry) for vLLM's config, weights not
        loaded. On CPU every graph has static shapes (one per padded token count): the
        dynamic-shape Ascend graphs are refused by `check_supported` for now."""
        arch = check_supported(vllm_config, dtype)
        from vllm_mindspore.patches.mindformers import apply_mindformers_patches

        apply_mindformers_patches()
        from mindformers import AutoModel
        from mindformers.core.context import build_mf_context
        from mindspore.nn.utils import no_init_parameters

        from model_backends.mindformers.cpu_substitutes import (bind_mla_attention,
                                                                 bind_paged_attention)

        config = mindformers_config(vllm_config, arch, block_size, dtype, kernel_device())
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
        model.move_lens_to_cpu = False  # MoveTo has no CPU kernel
        # Rope rows gathered by position for every token (the CPU rope takes per-token rows).
        network.add_flags_custom_mcore(is_prefill=False)
        mla = arch in MLA_ARCHITECTURES
        for layer in model.decoder.layers:
            attention = layer.self_attention
            if mla:
                bind_mla_attention(attention, block_size)
            else:
                bind_paged_attention(attention.core_attention, 1.0 / attention.norm_factor,
                                     block_size)
        return cls(network, vllm_config, dtype, mla)

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

    def kv_cache_spec(self, block_size: int, torch_dtype):
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        if self.mla:  # one latent row per token: [c, k_pe]
            return {name: MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                           head_size=cell.cpu_attention.latent_size,
                                           dtype=torch_dtype)
                    for name, cell in self._attention_cells().items()}
        return {name: FullAttentionSpec(block_size=block_size, num_kv_heads=cell.kv_head_num,
                                        head_size=cell.hidden_size_per_attention_head,
                                        dtype=torch_dtype)
                for name, cell in self._attention_cells().items()}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        for name, cell in self._attention_cells().items():
            if self.mla:
                cell.kv_cache_cpu = Parameter(
                    mint.zeros(cell.cpu_attention.cache_shape(num_blocks), dtype=self.dtype),
                    name=f"{name}.kv_cache", requires_grad=False)
                continue
            key_shape, value_shape = cell.cpu_attention.cache_shapes(num_blocks)
            cell.key_cache_cpu = Parameter(mint.zeros(key_shape, dtype=self.dtype),
                                           name=f"{name}.key_cache", requires_grad=False)
            cell.value_cache_cpu = Parameter(mint.zeros(value_shape, dtype=self.dtype),
                                             name=f"{name}.value_cache", requires_grad=False)

    # ---- step ------------------------------------------------------------------------------
    def _arguments(self, step) -> dict:
        """The mcore forward's arguments for one step (StepTensors)."""
        context_lens = step.batch_valid_length.asnumpy() - step.q_seq_lens.asnumpy()
        return dict(input_ids=step.input_ids, positions=step.positions,
                    batch_valid_length=step.batch_valid_length,
                    context_lens_tensor=ms.Tensor.from_numpy(context_lens),
                    q_seq_lens=step.q_seq_lens, block_tables=step.block_tables,
                    slot_mapping=step.slot_mapping)

    def compile_step(self, step) -> None:
        """Compile by running `step` (padding only, as the runner's warm-up steps are): the
        mcore construct is mindformers' jit-wrapped function, and `Cell.compile` would cache its
        graph under another key than the call's."""
        self.forward(step)

    def forward(self, step) -> ms.Tensor:
        """StepTensors (T tokens) -> hidden [T, hidden], final norm applied."""
        return self.network(**self._arguments(step))

    def compile_logits(self, num_rows: int) -> None:
        self.logits_head.compile(ms.Tensor(np.zeros((num_rows, self.hidden_size), np.float32),
                                           self.dtype))

    def logits(self, hidden: ms.Tensor) -> ms.Tensor:
        """hidden [N, hidden] -> [N, vocab] float32."""
        return self.logits_head(hidden)

    def num_compiled_graphs(self) -> int:
        return len(self.network.compile_cache) + len(self.logits_head.compile_cache)
