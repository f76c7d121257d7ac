"""Reading HF safetensors checkpoints (single file or sharded with an index) into a Cell.

Tensors are read through torch (safetensors' numpy reader has no bfloat16), cast to the
parameter's dtype and handed to MindSpore without another copy.
"""

import re
from collections.abc import Callable

import mindspore as ms
import numpy as np
import torch
from mindspore import nn
from safetensors import SafetensorError, safe_open
from vllm.logger import init_logger

from model_backends.native.checkpoint import WeightLoadError, safetensors_files
from model_backends.native.layers import (ShardSpec, collect_shards, tp_rank_and_size,
                                          use_compute_layouts)
from model_backends.native.quant import collect_tensor_specs, missing_tensors_error, prepare
from model_backends.native.quant_config import QuantDescription

logger = init_logger("vllm.vllm_mindspore.weights")

_TORCH_DTYPE = {ms.float32: torch.float32, ms.float16: torch.float16, ms.bfloat16: torch.bfloat16}
# Checkpoint dtypes read (cast to the compute dtype); anything else is refused, not cast.
_CHECKPOINT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def is_mtp_tensor(name: str, num_hidden_layers: int) -> bool:
    """A multi-token-prediction layer's tensor (DeepSeek-V3 checkpoints store them as layers
    past num_hidden_layers): not used for generation."""
    match = _LAYER_INDEX.match(name)
    return bool(match) and int(match.group(1)) >= num_hidden_layers


def _unreadable(path: str, error: Exception, tensor: str | None = None) -> WeightLoadError:
    what = f"tensor {tensor!r} of " if tensor else ""
    return WeightLoadError(
        f"Cannot read {what}safetensors file {path!r} ({type(error).__name__}: {error}): the "
        "file is corrupt or truncated (an interrupted download or copy?). Fetch it again.")


def _read(handle, name: str, shard: ShardSpec | None, model_dir: str) -> torch.Tensor:
    """The whole tensor, or only this rank's slice of it (read straight from the file)."""
    if shard is None:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    full = part.get_shape()
    if shard.dim >= len(full) or shard.start + shard.size > full[shard.dim]:
        raise WeightLoadError(
            f"Checkpoint tensor {name!r} has shape {tuple(full)}, too small for rows "
            f"{shard.start}:{shard.start + shard.size} along dim {shard.dim} of the model built "
            f"from config.json: config.json and the weights in {model_dir!r} do not belong "
            "together.")
    if tp_rank_and_size()[1] == 1 and full[shard.dim] != shard.size:
        # One rank holds the whole tensor: a longer one would be cut silently. (With TP > 1
        # a ShardSpec does not carry the full length, so only "too small" is caught there.)
        raise WeightLoadError(
            f"Checkpoint tensor {name!r} has shape {tuple(full)} but the model built from "
            f"config.json expects {shard.size} along dim {shard.dim}: config.json and the "
            f"weights in {model_dir!r} do not belong together.")
    index = tuple([slice(None)] * shard.dim + [slice(shard.start, shard.start + shard.size)])
    return part[index]


def load_checkpoint(cell: nn.Cell, model_dir: str,
                    map_name: Callable[[str], str | None] = lambda name: name,
                    quantization: str | None = None) -> None:
    """Fill every parameter of `cell` from the checkpoint.

    `map_name` turns a checkpoint name into a parameter name, or None to skip the tensor
    (e.g. rotary caches, layers the model does not build). Tensor-parallel layers declare the
    slice each rank holds (`collect_shards`); only that slice is read. Missing, unexpected and
    wrongly-shaped tensors are errors that name the tensors involved.

    `quantization` (vLLM's --quantization) names a W8A8 layout (`ascend`, `golden-stick`): the
    linears its description file marks quantized load int8 weights and their scales
    (model_backends/native/quant.py).
    """
    if quantization:
        prepare(cell, QuantDescription.load(model_dir, quantization), map_name)
    params = {name: p for name, p in cell.parameters_and_names() if not name.endswith("_cache")}
    shards = collect_shards(cell)
    specs = collect_tensor_specs(cell)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(path, framework="pt")
        except (SafetensorError, OSError) as error:
            raise _unreadable(path, error) from error
        with handle:
            for ckpt_name in handle.keys():
                name = map_name(ckpt_name)
                if name is None:
                    continue
                param = params.get(name)
                spec = specs.get(name)
                if spec is not None:  # a tensor of a quantized layer
                    try:
                        tensor = _read(handle, ckpt_name, spec.shard, model_dir)
                    except (SafetensorError, OSError) as error:
                        raise _unreadable(path, error, ckpt_name) from error
                    array = spec.convert(tensor, ckpt_name)
                    if param is not None:
                        param.set_data(ms.Tensor.from_numpy(array))
                        loaded.add(name)
                    continue
                if param is None:
                    unexpected.append(ckpt_name)
                    continue
                try:
                    tensor = _read(handle, ckpt_name, shards.get(name), model_dir)
                except (SafetensorError, OSError) as error:
                    raise _unreadable(path, error, ckpt_name) from error
                _assign(param, tensor, ckpt_name, shards.get(name), model_dir)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    quant_error = missing_tensors_error(cell, missing)
    if quant_error:
        raise WeightLoadError(quant_error)
    if unexpected or missing:
        raise WeightLoadError(
            f"Weights in {model_dir!r} do not match the model built from its config.json: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} in all), "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(unexpected)} in all).")
    logger.info("Loaded %d tensors from %s", len(loaded), model_dir)


def process_weights_after_loading(model: nn.Cell) -> None:
    """Let cells derive their compute layout from the checkpoint tensors once they are loaded:
    each cell with a `process_weights_after_loading(prefix)` method gets its own name prefix,
    children before their parents (an MLP fuses gate|up before its MoE layer stacks experts);
    then every linear layer takes the device's matmul layout."""
    for prefix, cell in reversed(list(model.cells_and_names())):
        hook = getattr(cell, "process_weights_after_loading", None)
        if hook is not None:
            hook(prefix)
    use_compute_layouts(model)
    # Parameters made above were named by the cell they were assigned to, without its parents:
    # every parameter takes its full path (graph compilation needs unique names).
    for name, param in model.parameters_and_names():
        param.name = name


def _assign(param, tensor: torch.Tensor, ckpt_name: str, shard: ShardSpec | None,
            model_dir: str) -> None:
    expected = list(param.shape)
    if shard is not None:
        expected[shard.dim] = shard.size  # the parameter may be longer: zero padding
    if list(tensor.shape) != expected:
        raise WeightLoadError(
            f"Checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)} but the model built "
            f"from config.json expects {tuple(expected)}: config.json and the weights in "
            f"{model_dir!r} do not belong together.")
    if tensor.dtype not in _CHECKPOINT_DTYPES:
        raise WeightLoadError(
            f"Checkpoint tensor {ckpt_name!r} in {model_dir!r} has dtype "
            f"{str(tensor.dtype).removeprefix('torch.')}; vllm-mindspore reads float32, float16 "
            "and bfloat16 checkpoints (quantized or integer weights are not supported) except "
            "for the tensors a W8A8 checkpoint's description file marks quantized, served with "
            "--quantization ascend (quant_model_description.json) or --quantization "
            "golden-stick (quantization_description.json).")
    tensor = tensor.to(_TORCH_DTYPE.get(param.dtype, torch.float32))
    if shard is not None and shard.size != param.shape[shard.dim]:
        padded = torch.zeros(tuple(param.shape), dtype=tensor.dtype)
        padded.narrow(shard.dim, 0, shard.size).copy_(tensor)
        tensor = padded
    if tensor.dtype == torch.bfloat16:
        param.set_data(ms.Tensor(tensor.float().numpy(), ms.bfloat16))
    else:
        param.set_data(ms.Tensor.from_numpy(np.ascontiguousarray(tensor.numpy())))
