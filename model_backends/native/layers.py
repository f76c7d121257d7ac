"""Building blocks shared by the native models, tensor-parallel aware.

Parameter names match the HF checkpoints' tensor names (`weight`, `bias`), so a model's
`parameters_and_names()` is its checkpoint key list. A layer split over tensor-parallel ranks
declares, per parameter, which slice of the checkpoint tensor this rank holds (`shards`); the
weight loader reads only that slice from the safetensors file.
"""

from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops

from vllm_mindspore.distributed.communication import sized_collective, tp_group
from vllm_mindspore.ops.host import parameter, to_host, zeros_parameter
from vllm_mindspore.ops.linear import pack_panels, packed_dtype, packed_matmul
from vllm_mindspore.ops.quant import QuantLinearMethod
from vllm_mindspore.platform import ASCEND, CPU, kernel_device
from vllm_mindspore.scoped import ScopedSetting


class ShardSpec(NamedTuple):
    """This rank holds checkpoint[start:start + size] along `dim` (the parameter may be longer
    along `dim`: the rest stays zero, as padding)."""

    dim: int
    start: int
    size: int


class ParallelLayout(NamedTuple):
    """The ranks a model is built for: tensor parallel (vLLM's TP group) and expert parallel
    (all DP x TP ranks with --enable-expert-parallel)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


_layout: ScopedSetting[ParallelLayout | None] = ScopedSetting(None)


def building_with_layout(layout: ParallelLayout):
    """Cells built in this block split their weights for `layout` instead of the running vLLM
    process's ranks (the Ascend graph check builds TP/EP graphs in one process)."""
    return _layout.using(layout)


def tp_rank_and_size() -> tuple[int, int]:
    """vLLM's tensor-parallel rank and size (0, 1 outside a vLLM worker)."""
    if _layout.value is not None:
        return _layout.value.tp_rank, _layout.value.tp_size
    from vllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:
        return 0, 1


def ep_rank_and_size() -> tuple[int, int]:
    """Rank and size of the expert-parallel group (all DP x TP ranks) when vLLM's
    --enable-expert-parallel is on for a multi-rank MoE run, else (0, 1)."""
    if _layout.value is not None:
        return _layout.value.ep_rank, _layout.value.ep_size
    from vllm.config import get_current_vllm_config
    from vllm.distributed.parallel_state import get_ep_group

    try:
        parallel = get_current_vllm_config().parallel_config
        group = get_ep_group()
    except AssertionError:
        return 0, 1
    if not parallel.enable_expert_parallel or group.world_size == 1:
        return 0, 1
    return group.rank_in_group, group.world_size


class ExpertShard(NamedTuple):
    """Routed experts [start, start + count) live on this rank (all of them without EP)."""

    start: int
    count: int

    @classmethod
    def for_rank(cls, num_experts: int) -> "ExpertShard":
        rank, size = ep_rank_and_size()
        if num_experts % size:
            raise ValueError(f"{num_experts} routed experts do not split over the "
                             f"{size} expert-parallel ranks (data x tensor parallel).")
        return cls(rank * (num_experts // size), num_experts // size)

    def local_name(self, name: str) -> str | None:
        """Checkpoint name `...experts.E....` -> this rank's parameter name, or None when
        expert E lives on another rank."""
        head, sep, tail = name.partition(".experts.")
        index, dot, rest = tail.partition(".")
        if not sep or not index.isdigit():
            return name
        local = int(index) - self.start
        return f"{head}.experts.{local}.{rest}" if 0 <= local < self.count else None


def even_split(total: int) -> ShardSpec:
    """Rank's part of `total` rows split evenly (total must divide by the TP size)."""
    rank, size = tp_rank_and_size()
    if total % size:
        raise ValueError(f"{total} does not split evenly over tensor_parallel_size={size}.")
    return ShardSpec(0, rank * (total // size), total // size)


def collect_shards(model: nn.Cell) -> dict[str, ShardSpec]:
    """Parameter name -> ShardSpec for every sharded parameter of `model`."""
    specs = {}
    for name, cell in model.cells_and_names():
        for attr, spec in getattr(cell, "shards", {}).items():
            specs[f"{name}.{attr}" if name else attr] = spec
    return specs


class Linear(nn.Cell):
    """y = x @ weight.T (+ bias), replicated on every rank. x: [T, in] -> [T, out], or
    [T, out / 2] = silu(gate) * up for a fused gate|up projection (`silu_and_mul`).

    `weight` is loaded as the checkpoint stores it, [out, in]; `use_compute_layout` then hands
    it to the device's matmul (vllm_mindspore/ops/linear.py): packed for the C++ kernel on CPU,
    unchanged for MatMul(transpose_b) on Ascend. A linear a W8A8 checkpoint quantizes
    (model_backends/native/quant.py) loads an int8 weight and its scales instead, and runs as
    vllm_mindspore/ops/quant.py's `QuantLinearMethod`.
    """

    quantizable = True  # False: kept in floating point whatever the checkpoint (see quant.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=ms.float32,
                 silu_and_mul: bool = False):
        super().__init__()
        self.out_features = out_features
        self.dtype = dtype
        self.quant = None  # a quant.LinearQuant when the checkpoint quantizes this layer
        self.checkpoint_prefix = None  # its name, set for W8A8 checkpoints (error messages)
        self.quant_method = None  # its device kernel, after loading
        self.weight = zeros_parameter((out_features, in_features), dtype)
        self.bias = zeros_parameter((out_features,), dtype) if bias else None
        self.matmul = ops.MatMul(transpose_b=True)
        self.packed = None  # CPU: the kernel over the packed weight
        self.act = SiluAndMul() if silu_and_mul else None
        self.shards: dict[str, ShardSpec] = {}

    def use_compute_layout(self, prefix: str) -> None:
        if self.quant is not None:
            if self.quant_method is None:
                from model_backends.native import quant

                arrays = quant.compute_arrays(self, self.fuses_bias)
                self.quant_method = QuantLinearMethod(arrays, self.dtype, self.act is not None,
                                                      prefix)
                keep_bias = self.bias is not None and not self.fuses_bias
                bias = self.bias
                quant.drop_loaded(self)
                if keep_bias:  # added after the all-reduce (RowParallelLinear)
                    self.bias = bias
            return
        if kernel_device() == ASCEND or self.packed is not None:
            return
        self.packed = packed_matmul(self.out_features, self.bias is not None and self.fuses_bias,
                                    self.act is not None)
        self.weight = packed_weight(self.weight, packed_dtype(self.weight.dtype), prefix)

    fuses_bias = True  # the bias is added by the matmul (RowParallelLinear adds it after reducing)

    def quant_arrays(self):
        """A quantized layer's loaded tensors as host arrays (vllm_mindspore.ops.quant.QuantArrays),
        for a cell that stacks several (the MoE experts)."""
        from model_backends.native import quant

        return quant.compute_arrays(self, True)

    def project(self, x):
        """x @ weight.T, plus the bias when the layer fuses it, plus the activation."""
        if self.quant_method is not None:
            return self.quant_method(x)
        if self.packed is not None:
            if self.bias is not None and self.fuses_bias:
                return self.packed(x, self.weight, self.bias)
            return self.packed(x, self.weight)
        y = self.matmul(x, self.weight)
        if self.bias is not None and self.fuses_bias:
            y = y + self.bias
        return y if self.act is None else self.act(y)

    def construct(self, x):
        return self.project(x)


def packed_weight(weight, dtype, prefix: str) -> ms.Parameter:
    """A weight [out, in] (a Parameter or host array) as the CPU matmul kernel's packed
    `dtype` Parameter `{prefix}.weight` (vllm_mindspore/ops/linear.py)."""
    return parameter(pack_panels(to_host(weight), dtype), dtype, f"{prefix}.weight")


def fuse_linears(linears: list[Linear], prefix: str, silu_and_mul: bool = False) -> Linear:
    """One Linear computing the loaded `linears` side by side (outputs concatenated in order):
    q|k|v and gate|up run as one matmul each; gate|up may apply silu(gate) * up in the same op.
    Call before `use_compute_layout`. Quantized linears fuse into a quantized one (all of them
    with the same scheme, else an error naming both tensors)."""
    if any(linear.quant is not None for linear in linears):
        from model_backends.native import quant

        first = linears[0]
        fused = Linear(first.weight.shape[1], sum(l.weight.shape[0] for l in linears),
                       first.bias is not None, first.dtype, silu_and_mul)
        if linears[0].quant is None:  # the error names the float one second
            linears = [next(l for l in linears if l.quant is not None)] + [
                l for l in linears if l.quant is None]
        quant.fuse(linears, fused)
        quant.release(fused, "weight")  # the loaded tensors live in fused.quant_host
        quant.release(fused, "bias")
        return fused
    weights = [linear.weight for linear in linears]
    dtype = weights[0].dtype
    fused = Linear(weights[0].shape[1], sum(w.shape[0] for w in weights),
                   linears[0].bias is not None, dtype, silu_and_mul)
    fused.weight = parameter(np.concatenate([to_host(w) for w in weights]), dtype,
                             f"{prefix}.weight")
    if fused.bias is not None:
        fused.bias = parameter(np.concatenate([to_host(linear.bias) for linear in linears]),
                               dtype, f"{prefix}.bias")
    return fused


def use_compute_layouts(model: nn.Cell) -> None:
    """Every layer with a compute layout (linears, LM head) switches to it; after loading and
    after the cells' own post-loading hooks (fusion) have run. Children go before their parents
    (a decoder layer reads its projections' layouts)."""
    for prefix, cell in reversed(list(model.cells_and_names())):
        if hasattr(cell, "use_compute_layout"):
            cell.use_compute_layout(prefix)


class ColumnParallelLinear(Linear):
    """Output features split over TP ranks: x [T, in] -> this rank's [T, shard.size].

    `shard` picks the rows of the checkpoint weight (default: an even split); K/V projections
    pass their own when KV heads are replicated over more ranks than there are heads.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=ms.float32,
                 shard: ShardSpec | None = None):
        shard = shard or even_split(out_features)
        super().__init__(in_features, shard.size, bias, dtype)
        self.shards = {"weight": shard, **({"bias": shard} if bias else {})}


class TensorParallelAllReduce(nn.Cell):
    """Sum of x over the TP ranks (identity with one rank)."""

    def __init__(self):
        super().__init__()
        self.all_reduce = ops.AllReduce(group=tp_group()) if tp_rank_and_size()[1] > 1 else None

    def construct(self, x):
        return x if self.all_reduce is None else self.all_reduce(x)


class RowParallelLinear(Linear):
    """Input features split over TP ranks: x [T, in / tp] -> [T, out], the partial sums
    all-reduced unless `reduce_results` is False (the caller then reduces a sum of several);
    the bias is added once, after the reduction."""

    fuses_bias = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=ms.float32,
                 reduce_results: bool = True):
        shard = even_split(in_features)
        super().__init__(shard.size, out_features, bias, dtype)
        self.shards = {"weight": ShardSpec(1, shard.start, shard.size)}
        self.reduce = TensorParallelAllReduce() if reduce_results else None

    def construct(self, x):
        y = self.project(x)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def vocab_shard(vocab_size: int) -> tuple[int, ShardSpec]:
    """(rows per rank, this rank's ShardSpec) of a vocabulary split over TP ranks."""
    rank, size = tp_rank_and_size()
    per_rank = -(-vocab_size // size)
    start = rank * per_rank
    return per_rank, ShardSpec(0, start, max(0, min(per_rank, vocab_size - start)))


class VocabParallelEmbedding(nn.Cell):
    """ids: [T] -> [T, hidden]; each TP rank holds ceil(vocab / tp) rows (the last padded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=ms.float32):
        super().__init__()
        per_rank, shard = vocab_shard(num_embeddings)
        self.vocab_start, self.vocab_rows = shard.start, shard.size
        self.weight = zeros_parameter((per_rank, embedding_dim), dtype)
        tp_size = tp_rank_and_size()[1]
        self.shards = {"weight": shard} if tp_size > 1 else {}
        self.all_reduce = ops.AllReduce(group=tp_group()) if tp_size > 1 else None

    def construct(self, ids):
        if self.all_reduce is None:
            return ops.gather(self.weight, ids, 0)
        local = ids - self.vocab_start
        mine = ops.logical_and(local >= 0, local < self.vocab_rows)
        rows = ops.gather(self.weight, ops.select(mine, local, ops.zeros_like(local)), 0)
        return self.all_reduce(rows * mine.astype(rows.dtype).expand_dims(1))


class ParallelLMHead(nn.Cell):
    """hidden [N, H] -> logits [N, vocab] in float32; the vocabulary is split like
    VocabParallelEmbedding (whose weight it reuses when embeddings are tied).

    The ranks' logit columns are joined with AllGather, or, where MindSpore's CPU backend runs
    AllGather only on the world group (tensor-parallel subgroups under expert parallel), by
    placing them in a zero [N, vocab] and all-reducing."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype=ms.float32,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp_rank_and_size()
        if tied is None:
            per_rank, shard = vocab_shard(vocab_size)
            self.weight = zeros_parameter((per_rank, hidden_size), dtype)
            self.shards = {"weight": shard} if self.tp_size > 1 else {}
        self.tied = tied
        self.matmul = ops.MatMul(transpose_b=True)
        self.packed = None  # CPU: the kernel over the packed weight
        self.all_gather = self.all_reduce = None
        if self.tp_size > 1:
            from mindspore.communication import GlobalComm

            if kernel_device() == CPU and tp_group() != GlobalComm.WORLD_COMM_GROUP:
                self.all_reduce = ops.AllReduce(group=tp_group())
            else:
                self.all_gather = sized_collective(ops.AllGather, self.tp_size, tp_group())

    def use_compute_layout(self, prefix: str) -> None:
        """CPU: the packed weight of the matmul kernel (a copy when tied: the embedding keeps
        its rows)."""
        if kernel_device() == ASCEND or self.packed is not None:
            return
        weight = self.tied.weight if self.tied is not None else self.weight
        self.packed = packed_matmul(weight.shape[0])
        self.weight = packed_weight(weight, packed_dtype(weight.dtype), prefix)
        self.tied = None

    def construct(self, hidden):
        weight = self.tied.weight if self.tied is not None else self.weight
        if self.packed is not None:
            logits = self.packed(hidden, weight)
        else:
            logits = self.matmul(hidden, weight)
        logits = logits.astype(ms.float32)  # [N, vocab / tp]
        num_rows, per_rank = logits.shape
        if self.all_gather is not None:
            logits = self.all_gather(logits).reshape(self.tp_size, num_rows, per_rank)
            logits = logits.transpose(1, 0, 2).reshape(num_rows, self.tp_size * per_rank)
        elif self.all_reduce is not None:
            pieces = [logits]
            if self.tp_rank > 0:
                pieces.insert(0, mint.zeros((num_rows, self.tp_rank * per_rank), dtype=ms.float32))
            if self.tp_rank < self.tp_size - 1:
                pieces.append(mint.zeros((num_rows, (self.tp_size - 1 - self.tp_rank) * per_rank),
                                         dtype=ms.float32))
            logits = self.all_reduce(mint.cat(pieces, 1))
        if logits.shape[1] == self.vocab_size:  # a full-width slice would still copy
            return logits
        return logits[:, : self.vocab_size]


class SiluAndMul(nn.Cell):
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""

    def construct(self, gate_up):
        gate, up = mint.chunk(gate_up, 2, -1)
        return ops.silu(gate) * up
