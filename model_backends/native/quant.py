"""W8A8 checkpoints in the native models: a model built as usual becomes quantized where the
checkpoint's description says so, before its weights are read.

`prepare(model, description, map_name)` turns each described linear into a quantized one: its
weight becomes an int8 parameter and it gains the scheme's tensors, named as in the checkpoint
(`weight`, `deq_scale`, `quant_bias`, `input_scale`, `input_offset` for W8A8; `weight`,
`weight_scale` for W8A8_DYNAMIC), each with the slice this rank reads (per-output-channel tensors
follow the weight's rows; a row-parallel layer's per-channel activation parameters follow its
columns) and a converter that checks the tensor's dtype and shape. Tensors the computation does
not use (a static linear's weight_scale/weight_offset, a dynamic one's weight_offset, msModelSlim's
float bias of a static linear, which its quant_bias already holds) are checked and dropped.

After loading, `fuse_linears` and the MoE layers combine quantized linears (`fuse`,
`QuantArrays`), and each quantized linear hands its tensors to `vllm_mindspore.ops.quant` for the
device's layout (`compute_arrays`).
"""

from collections.abc import Callable
from typing import NamedTuple

import mindspore as ms
import numpy as np
import torch

from model_backends.native.quant_config import (ASCEND, DESCRIPTION_FILES, DYNAMIC, FLOAT,
                                                GOLDEN_STICK, STATIC, QuantDescription,
                                                QuantDescriptionError)
from vllm_mindspore.ops.host import zeros_parameter
from vllm_mindspore.ops.quant import QuantArrays, concat_arrays
from vllm_mindspore.ops.quant_reference import deq_scale_as_float


# The per-output-channel weight scale of a W8A8_DYNAMIC linear, as each layout names it.
DYNAMIC_SCALE = {ASCEND: "weight_scale", GOLDEN_STICK: "w_scale"}


class QuantTensorError(ValueError):
    """A checkpoint tensor of a quantized layer with the wrong dtype or shape (names the tensor)."""


class TensorSpec(NamedTuple):
    """How one checkpoint tensor of a quantized layer is read: the slice this rank reads (None:
    the whole tensor) and `convert(tensor, checkpoint name) -> array` (raises naming the tensor).
    `optional`: the layer keeps no parameter for it; it is checked when present, then dropped."""

    shard: object
    convert: Callable[[torch.Tensor, str], np.ndarray]
    optional: bool = False


class LinearQuant(NamedTuple):
    scheme: str
    method: str  # ascend | golden-stick
    checkpoint: str  # the checkpoint's module prefix (error messages)
    row_parallel: bool
    tp_rank: int


def collect_tensor_specs(model) -> dict[str, TensorSpec]:
    """Parameter name -> TensorSpec for every tensor of the model's quantized layers."""
    specs = {}
    for name, cell in model.cells_and_names():
        for attr, spec in getattr(cell, "tensor_specs", {}).items():
            specs[f"{name}.{attr}" if name else attr] = spec
    return specs


def missing_tensors_error(model, missing: list[str]) -> str | None:
    """The error for required tensors of quantized layers the checkpoint lacks (parameter names
    in `missing`), naming each checkpoint tensor and the scheme that needs it; None if none."""
    absent, method = [], None
    for name, cell in model.cells_and_names():
        quant = getattr(cell, "quant", None)
        for attr, spec in getattr(cell, "tensor_specs", {}).items():
            if not spec.optional and (f"{name}.{attr}" if name else attr) in missing:
                absent.append(f"{quant.checkpoint}.{attr} ({quant.scheme})")
                method = quant.method
    if not absent:
        return None
    return (f"The {DESCRIPTION_FILES[method]} beside the weights marks these tensors' layers "
            "quantized, but the checkpoint lacks them: "
            f"{', '.join(absent[:8])}{' ...' if len(absent) > 8 else ''} ({len(absent)} in all). "
            "docs/quantization.md lists each scheme's tensors; re-export the checkpoint or mark "
            "the layer FLOAT.")


# ---- converters -------------------------------------------------------------------------------------
def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _float_array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def _require(ok: bool, name: str, tensor: torch.Tensor, what: str) -> None:
    if not ok:
        raise QuantTensorError(
            f"Checkpoint tensor {name!r} has dtype {_dtype_name(tensor)} and shape "
            f"{tuple(tensor.shape)}, but {what}: the checkpoint does not match its quantization "
            "description (docs/quantization.md lists each scheme's tensors).")


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _int8_weight(shape):
    def convert(tensor, name):
        _require(tensor.dtype == torch.int8, name, tensor, "a W8A8 weight is int8")
        _require(tuple(tensor.shape) == tuple(shape), name, tensor,
                 f"the model built from config.json expects {tuple(shape)} for this rank")
        return np.ascontiguousarray(tensor.numpy())
    return convert


def _per_channel(rows: int, kind: str):
    """[N] or [N, 1] -> float32 [N] (`deq_scale`: float32, or int64 holding float32 bits;
    `quant_bias`: int32; `scale`: any float)."""
    def convert(tensor, name):
        _require(tensor.numel() == rows and tensor.dim() in (1, 2) and tensor.shape[0] == rows,
                 name, tensor, f"a per-output-channel tensor of this rank has {rows} values")
        if kind == "deq_scale":
            _require(tensor.dtype in (torch.float32, torch.int64), name, tensor,
                     "deq_scale is float32, or int64 holding float32 bits")
            return deq_scale_as_float(tensor.reshape(rows).numpy())
        if kind == "quant_bias":
            _require(tensor.dtype == torch.int32, name, tensor, "quant_bias is int32")
            return np.ascontiguousarray(tensor.reshape(rows).numpy())
        _require(tensor.dtype in _FLOATS, name, tensor, "a scale is a float tensor")
        return _float_array(tensor.reshape(rows)).astype(np.float32)
    return convert


def _activation_param(columns: int, column_slice: tuple[int, int] | None, offset: bool):
    """input_scale / input_offset: per tensor ([1] or a scalar) or per input channel ([K]; a
    row-parallel layer takes its columns) -> float32 [this rank's K]."""
    def convert(tensor, name):
        if offset:
            _require(tensor.dtype == torch.int8 or tensor.dtype in _FLOATS, name, tensor,
                     "input_offset is int8 or float")
        else:
            _require(tensor.dtype in _FLOATS, name, tensor, "input_scale is a float tensor")
        values = (tensor.numpy().astype(np.float32) if tensor.dtype == torch.int8
                  else _float_array(tensor).astype(np.float32)).reshape(-1)
        if values.size == 1 or np.all(values == values[0]):
            # per tensor; golden-stick may store it repeated (one value per output channel)
            return np.full(columns, values[0], np.float32)
        if column_slice is not None:
            start, size = column_slice
            _require(values.size >= start + size, name, tensor,
                     f"a per-channel activation parameter covers the {start + size}+ input "
                     "features of this layer")
            return np.ascontiguousarray(values[start:start + size])
        _require(values.size == columns, name, tensor,
                 f"an activation parameter has 1 or {columns} values")
        return values
    return convert


def _checked_and_dropped(rows: int | None, zero_because: str | None = None):
    """A tensor the computation does not use: its dtype and rows are checked; `zero_because`:
    it must be all zero, for that reason (else an error naming it)."""
    def convert(tensor, name):
        _require(tensor.dtype in _FLOATS or tensor.dtype in (torch.int8, torch.int32), name,
                 tensor, "this tensor is a float or integer scale/offset")
        if rows is not None:
            _require(tensor.shape[0] == rows, name, tensor,
                     f"a per-output-channel tensor of this rank has {rows} rows")
        if zero_because and np.any(_float_array(tensor).astype(np.float32) != 0):
            raise QuantTensorError(f"Checkpoint tensor {name!r} holds non-zero values: "
                                   f"{zero_because}.")
        return None
    return convert


_SYMMETRIC = ("vllm-mindspore runs W8A8_DYNAMIC weights symmetric (weight_offset all zero), as "
              "the Ascend kernels do")


def _float_bias_dropped(tensor, name):
    _require(tensor.dtype in _FLOATS, name, tensor, "a bias is a float tensor")
    return None


# ---- building ---------------------------------------------------------------------------------------
def make_quantized(linear, scheme: str, method: str, checkpoint: str) -> None:
    """Give `linear` the tensors of `scheme` (see the module docstring)."""
    from model_backends.native.layers import tp_rank_and_size

    out_features, in_features = linear.weight.shape
    weight_shard = linear.shards.get("weight")
    row_parallel = weight_shard is not None and weight_shard.dim == 1
    rows = weight_shard if weight_shard is not None and weight_shard.dim == 0 else None
    columns = (weight_shard.start, weight_shard.size) if row_parallel else None
    linear.weight = zeros_parameter((out_features, in_features), ms.int8)
    specs = {"weight": TensorSpec(weight_shard, _int8_weight((out_features, in_features)))}
    if scheme == STATIC:
        linear.deq_scale = zeros_parameter(out_features, ms.float32)
        linear.quant_bias = zeros_parameter(out_features, ms.int32)
        linear.input_scale = zeros_parameter(in_features, ms.float32)
        linear.input_offset = zeros_parameter(in_features, ms.float32)
        specs.update(
            deq_scale=TensorSpec(rows, _per_channel(out_features, "deq_scale")),
            # Row parallel: the whole quant_bias, added on rank 0 only (see compute_arrays).
            quant_bias=TensorSpec(rows, _per_channel(out_features, "quant_bias")),
            input_scale=TensorSpec(None, _activation_param(in_features, columns, False)),
            input_offset=TensorSpec(None, _activation_param(in_features, columns, True)),
            weight_scale=TensorSpec(rows, _checked_and_dropped(out_features), True),
            weight_offset=TensorSpec(rows, _checked_and_dropped(out_features), True))
        if method == ASCEND and linear.bias is not None:
            # msModelSlim folds the float bias into quant_bias (round(bias / deq_scale)); the
            # Ascend runtimes ignore the bias tensor of a static W8A8 linear.
            release(linear, "bias")
            specs["bias"] = TensorSpec(None, _float_bias_dropped, True)
        if method == GOLDEN_STICK:  # golden-stick writes it beside quant_bias, as zeros
            specs["beta"] = TensorSpec(rows, _checked_and_dropped(
                out_features, "its meaning beyond zero is not established (docs/quantization.md)"),
                True)
    else:
        setattr(linear, DYNAMIC_SCALE[method], zeros_parameter(out_features, ms.float32))
        specs.update({
            DYNAMIC_SCALE[method]: TensorSpec(rows, _per_channel(out_features, "scale")),
            "weight_offset": TensorSpec(rows, _checked_and_dropped(out_features, _SYMMETRIC),
                                        True)})
    linear.tensor_specs = specs
    linear.quant = LinearQuant(scheme, method, checkpoint, row_parallel, tp_rank_and_size()[0])


def prepare(model, description: QuantDescription, map_name: Callable[[str], str | None]) -> None:
    """Quantize the linears the description marks W8A8 / W8A8_DYNAMIC (checkpoint names mapped to
    parameter names by `map_name`; tensors the model skips are ignored). A quantized entry for a
    module that is not a quantizable linear of this model is an error naming the entry."""
    from model_backends.native.layers import Linear

    linears = {name: cell for name, cell in model.cells_and_names() if isinstance(cell, Linear)}
    for name, linear in linears.items():  # the checkpoint's names, but for expert numbering
        linear.checkpoint_prefix = name
    chosen: dict[str, tuple[str, str]] = {}
    for checkpoint, scheme in description.quantized_modules().items():
        name = map_name(f"{checkpoint}.weight")
        if name is None:
            continue  # multi-token-prediction layers, another expert-parallel rank's experts
        prefix = name[: -len(".weight")]
        linear = linears.get(prefix)
        if linear is None or not linear.quantizable:
            raise QuantDescriptionError(
                f"{description.path}: {checkpoint}.weight is {scheme}, but vllm-mindspore runs "
                f"{prefix} in floating point: only the linear projections of attention, MLPs and "
                "experts are quantized (DeepSeek's kv_b_proj, absorbed into the attention, the "
                "routers, embeddings and lm_head must be FLOAT).")
        chosen[prefix] = (checkpoint, scheme)
    _check_experts(linears, chosen, description)
    for prefix, (checkpoint, scheme) in chosen.items():
        make_quantized(linears[prefix], scheme, description.method, checkpoint)


def _check_experts(linears, chosen, description: QuantDescription) -> None:
    """The routed experts of a layer run as one operator: all W8A8_DYNAMIC or all FLOAT."""
    layers: dict[str, list[str]] = {}
    for prefix in linears:
        head, sep, _ = prefix.partition(".experts.")
        if sep:
            layers.setdefault(head, []).append(prefix)
    for head, prefixes in layers.items():
        schemes = [chosen.get(p, (p, FLOAT)) for p in prefixes]
        quantized = [entry for entry in schemes if entry[1] != FLOAT]
        if not quantized:
            continue
        first = quantized[0]
        for checkpoint, scheme in schemes:
            if scheme != DYNAMIC:
                raise QuantDescriptionError(
                    f"{description.path}: the routed experts of {head} run as one operator and "
                    f"must all be W8A8_DYNAMIC (or all FLOAT), but {first[0]}.weight is "
                    f"{first[1]} and {checkpoint}.weight is {scheme}.")


def host_arrays(linear) -> QuantArrays:
    """A quantized linear's loaded tensors (or its fused ones) as host arrays."""
    stored = getattr(linear, "quant_host", None)
    if stored is not None:
        return stored
    quant = linear.quant

    def host(param):
        return None if param is None else param.asnumpy()

    bias = None
    if linear.bias is not None:
        bias = linear.bias.astype(ms.float32).asnumpy()
    if quant.scheme == STATIC:
        return QuantArrays(STATIC, host(linear.weight), quant_bias=host(linear.quant_bias),
                           deq_scale=host(linear.deq_scale), input_scale=host(linear.input_scale),
                           input_offset=host(linear.input_offset), bias=bias)
    return QuantArrays(DYNAMIC, host(linear.weight),
                       weight_scale=host(getattr(linear, DYNAMIC_SCALE[quant.method])), bias=bias)


def release(cell, attr: str) -> None:
    """Drop parameter `attr` of `cell` (MindSpore keeps a parameter set to None in the cell's
    parameter table, which compiling then trips over); the attribute reads None afterwards."""
    if attr in cell._params:  # pylint: disable=protected-access
        delattr(cell, attr)
    object.__setattr__(cell, attr, None)


def drop_loaded(linear) -> None:
    """Release the loaded tensors once a device layout (or a fused linear) holds them."""
    for attr in ("weight", "deq_scale", "quant_bias", "input_scale", "input_offset", "bias",
                 *DYNAMIC_SCALE.values()):
        release(linear, attr)
    linear.quant_host = None


def fuse(linears: list, fused) -> None:
    """`fused` (a new Linear) computes the quantized `linears` side by side: same scheme, and for
    W8A8 the same activation parameters (one quantization of the shared input), else an error
    naming both tensors."""
    first = linears[0].quant
    for other in linears[1:]:
        scheme = FLOAT if other.quant is None else other.quant.scheme
        if scheme != first.scheme:
            raise QuantDescriptionError(
                f"{first.checkpoint}.weight is {first.scheme} but {other.checkpoint_prefix}.weight "
                f"is {scheme}: vllm-mindspore fuses these projections into one matmul, which "
                "cannot mix quantized and float (or static and dynamic) shards. Quantize them "
                "with one scheme (scripts/quantize_w8a8.py does).")
    parts = [host_arrays(linear) for linear in linears]
    if first.scheme == STATIC:
        for linear, part in zip(linears[1:], parts[1:]):
            for field in ("input_scale", "input_offset"):
                if not np.array_equal(getattr(parts[0], field), getattr(part, field)):
                    raise QuantDescriptionError(
                        f"{first.checkpoint}.{field} and {linear.quant.checkpoint}.{field} "
                        "differ: vllm-mindspore fuses these projections into one matmul over "
                        "one quantization of their common input, so their activation "
                        "parameters must be equal.")
    fused.quant = first
    fused.quant_host = concat_arrays(parts)
    for linear in linears:
        drop_loaded(linear)


def compute_arrays(linear, fuses_bias: bool) -> QuantArrays:
    """The tensors the device layout is built from: a row-parallel layer's quant_bias only on
    TP rank 0 (the partial sums are all-reduced), its float bias added after the reduction."""
    arrays = host_arrays(linear)
    quant = linear.quant
    if quant.row_parallel and quant.tp_rank != 0 and arrays.quant_bias is not None:
        arrays = arrays._replace(quant_bias=np.zeros_like(arrays.quant_bias))
    if not fuses_bias:
        arrays = arrays._replace(bias=None)
    return arrays
