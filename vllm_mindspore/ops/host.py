"""Weights rearranged on the host once they are loaded (fusing, transposing, splitting,
stacking): numpy in and out, so the same code serves every device and dtype (bfloat16, which
numpy lacks, passes through float32 exactly). And Parameters of zeros: the KV caches, and the
placeholders that loading fills."""

import mindspore as ms
import numpy as np
from mindspore.common.initializer import initializer

_NUMPY = {ms.float32: np.float32, ms.float16: np.float16, ms.int8: np.int8, ms.int32: np.int32}


def to_host(tensor: ms.Tensor) -> np.ndarray:
    if tensor.dtype == ms.bfloat16:
        return tensor.astype(ms.float32).asnumpy()
    return tensor.asnumpy()


def parameter(array: np.ndarray, dtype, name: str) -> ms.Parameter:
    """A Parameter of `dtype` named `name` holding `array`."""
    if dtype == ms.bfloat16:
        tensor = ms.Tensor(np.ascontiguousarray(array, np.float32), ms.bfloat16)
    else:
        tensor = ms.Tensor.from_numpy(np.ascontiguousarray(array, _NUMPY[dtype]))
    return ms.Parameter(tensor, name=name, requires_grad=False)


def zeros_parameter(shape, dtype, name: str | None = None) -> ms.Parameter:
    """A Parameter of zeros whose memory is not written here: KV caches, and weights the
    loader fills. `Parameter(tensor)` copies its tensor twice, through numpy: a 4 GiB cache
    took ~21 s at start-up. An initializer's zeros are pages the OS zeroes as they are first
    touched, so a weight the loader replaces (a W8A8 layer's int8 weight) never takes its
    float size in memory."""
    return ms.Parameter(initializer("zeros", shape, dtype), name=name, requires_grad=False)
