"""Reading HF safetensors checkpoints (single file or sharded with an index) into a Cell.

Tensors are read through torch (safetensors' numpy reader has no bfloat16), cast to the
parameter's dtype and handed to MindSpore without another copy.
"""

import json
import os
from collections.abc import Callable, Iterator

import mindspore as ms
import numpy as np
import torch
from mindspore import nn
from safetensors import safe_open
from vllm.logger import init_logger

logger = init_logger("vllm.vllm_mindspore.weights")

_TORCH_DTYPE = {ms.float32: torch.float32, ms.float16: torch.float16, ms.bfloat16: torch.bfloat16}


class WeightLoadError(ValueError):
    pass


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(
            f"No *.safetensors weights in {model_dir!r}. vllm-mindspore reads HF safetensors "
            "checkpoints (model.safetensors or model-0000x-of-0000y.safetensors + index).")
    return [os.path.join(model_dir, f) for f in files]


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_checkpoint(cell: nn.Cell, model_dir: str,
                    map_name: Callable[[str], str | None] = lambda name: name) -> None:
    """Fill every parameter of `cell` from the checkpoint.

    `map_name` turns a checkpoint name into a parameter name, or None to skip the tensor
    (e.g. rotary caches, layers the model does not build). Missing, unexpected and
    wrongly-shaped tensors are errors that name the tensors involved.
    """
    params = {p.name: p for p in cell.get_parameters() if not p.name.endswith("_cache")}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in iterate_checkpoint(model_dir):
        name = map_name(ckpt_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightLoadError(
                f"Checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)} but the model built "
                f"from config.json expects {tuple(param.shape)}: config.json and the weights in "
                f"{model_dir!r} do not belong together.")
        array = tensor.to(_TORCH_DTYPE.get(param.dtype, torch.float32))
        if array.dtype == torch.bfloat16:
            param.set_data(ms.Tensor(array.float().numpy(), ms.bfloat16))
        else:
            param.set_data(ms.Tensor.from_numpy(np.ascontiguousarray(array.numpy())))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if unexpected or missing:
        raise WeightLoadError(
            f"Weights in {model_dir!r} do not match the model built from its config.json: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} in all), "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(unexpected)} in all).")
    logger.info("Loaded %d tensors from %s", len(loaded), model_dir)
