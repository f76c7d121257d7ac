"""What the model runner needs from a model, whichever backend implements it.

The runner prepares each step on the host (vLLM's packed token batch, `StepTensors`) and talks to
the model only through `ModelBackend`: build it and load its weights, size and allocate the KV
cache, compile the graphs the steps will use, run the decoder, turn sampled rows into logits.
A backend owns its model's cells, caches and compiled graphs; the runner never reaches inside.

This module imports neither MindSpore nor torch (the registry that names backends is read by
processes that never build a model), hence the string annotations.
"""

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import mindspore as ms
    import torch


class Precision(NamedTuple):
    """The dtypes a model runs in, decided once from `--dtype` and the device
    (`vllm_mindspore.platform.precision_for`) and handed to `ModelBackend.build`."""

    compute: "torch.dtype"  # the graphs' activations, and the weights but for `bfloat16_weights`
    bfloat16_weights: bool  # CPU --dtype bfloat16: bfloat16 dense weights in float32 graphs
    kv_cache: "torch.dtype"  # the model's dtype, as vLLM's `--kv-cache-dtype auto` keeps it

    def __str__(self) -> str:  # the build's log line
        def name(dtype) -> str:
            return str(dtype).removeprefix("torch.")

        weights = "bfloat16" if self.bfloat16_weights else name(self.compute)
        return f"{name(self.compute)} graphs, {weights} weights, {name(self.kv_cache)} KV cache"

    @property
    def ms_compute(self) -> "ms.dtype":
        return _to_mindspore(self.compute)

    @property
    def ms_kv_cache(self) -> "ms.dtype":
        return _to_mindspore(self.kv_cache)


def _to_mindspore(dtype: "torch.dtype") -> "ms.dtype":
    import mindspore as ms

    return getattr(ms, str(dtype).removeprefix("torch."))


class StepTensors(NamedTuple):
    """One decoder graph call: T tokens (the step's, request after request, then padding) and
    B request rows (rows past the step's requests have zero lengths). All int32.

    The field order is the native models' `construct` argument order, and the names are the
    graph's input names: Ascend's fused attention kernels read the per-request lengths from the
    inputs named `batch_valid_length` and `q_seq_lens`."""

    input_ids: "ms.Tensor"  # [T], padding: token 0
    positions: "ms.Tensor"  # [T], padding: position 0
    slot_mapping: "ms.Tensor"  # [T]: block_id * block_size + offset; -1: padding, written nowhere
    block_tables: "ms.Tensor"  # [B, max_blocks]
    batch_valid_length: "ms.Tensor"  # [B]: tokens in the cache after this call (context + new)
    q_seq_lens: "ms.Tensor"  # [B]: this call's tokens of each request
    prefill_only: bool  # no request has cached context (Ascend: the FlashAttention graph)


@runtime_checkable
class ModelBackend(Protocol):
    """A model as the runner drives it. Life cycle: `build` -> `load_weights` ->
    `kv_cache_spec` -> `allocate_kv_cache` -> `compile_step`/`compile_logits`/`compile_decode`
    for every shape the steps will use -> `forward` + `logits`, or `decode`, each step.

    Static shapes (CPU): every call is padded to a size compiled in advance, one graph per size.
    Dynamic shapes (Ascend): one graph takes any size (and one more for `prefill_only` steps)."""

    name: str  # the backend, "Native" | "MindFormers"
    implementation: str  # dotted path of the model class that runs (logged, asserted by tests)
    hidden_size: int  # width of `forward`'s output rows (the whole model's, not a TP shard)
    # After `load_weights`: the decoder computes nothing for a call's padding tokens, so a static
    # step may run as one call padded to the next size rather than as several exact ones.
    skips_padding: bool

    @classmethod
    def build(cls, model_class: str, vllm_config, block_size: int, precision: Precision,
              static_shapes: bool) -> "ModelBackend":
        """The model `model_class` ("module:Class", from the registry) with empty weights,
        for vLLM's config (`model_config.hf_text_config`, the parallel sizes), KV-cache
        blocks of `block_size` tokens, in `precision`'s dtypes."""

    def load_weights(self, model_dir: str, quantization: str | None) -> None:
        """Read the HF checkpoint in `model_dir` (this rank's shards of it) and derive the
        compute layout; the model runs after this."""

    def kv_cache_spec(self) -> dict:
        """vLLM layer name -> its `KVCacheSpec` (what vLLM's block manager sizes blocks by), for
        the block size and in the `precision.kv_cache` `build` was given."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache for `num_blocks` blocks (what vLLM granted), in
        `precision.kv_cache` (float32 graphs of a bfloat16 model on CPU keep a bfloat16 cache)."""

    def compile_step(self, step: StepTensors) -> None:
        """Compile the decoder for `step`'s shapes (and `prefill_only` value) without running it."""

    def forward(self, step: StepTensors) -> "ms.Tensor":
        """Run the decoder: writes this call's keys and values to the cache and returns the
        hidden states [T, hidden_size] that `logits` takes (native: before the final norm,
        which `logits` applies; a backend may apply it here instead)."""

    def compile_logits(self, num_rows: int) -> None:
        """Compile the logits graph for `num_rows` rows (any row count under dynamic shapes)."""

    def logits(self, hidden: "ms.Tensor") -> tuple["ms.Tensor", "ms.Tensor"]:
        """Rows [N, hidden_size] of `forward`'s output -> (logits [N, vocab] float32, each
        row's argmax [N] int32, as torch.argmax picks it: `ops.GreedyTokens`), one graph. The
        runner reads only the tokens when they are what vLLM's sampler would return."""

    def compile_decode(self, step: StepTensors) -> None:
        """Compile `decode` for `step`'s shapes without running it."""

    def decode(self, step: StepTensors) -> tuple["ms.Tensor", "ms.Tensor"]:
        """`logits(forward(step))` over all T rows -> (logits [T, vocab], tokens [T]): the
        runner's call for a step of decodes (one token a request, every token sampled). A
        backend runs it as one graph where it can: one graph call a step instead of two."""

    def num_compiled_graphs(self) -> int:
        """Graphs compiled so far (a step that raises it recompiled: the runner warns)."""

    def weight_bytes(self) -> int:
        """Bytes of model weights resident on this rank, KV cache excluded."""
