"""How the kernel tests run operators: in a small MindSpore Cell, or called straight through the
AOT entry point with ctypes, as MindSpore calls it."""

import ctypes

import numpy as np
from mindspore import nn


class OpCell(nn.Cell):
    """Calls `op(*inputs, *params)` as a graph: runs one custom operator on its own."""

    def __init__(self, op, *params):
        super().__init__()
        self.op = op
        self.params = params

    def construct(self, *inputs):
        return self.op(*inputs, *self.params)


def call_aot(library: str, function: str, arrays: list[np.ndarray]) -> int:
    """Calls `function` of the kernel library at `library` on numpy arrays (inputs, then outputs)
    the way MindSpore's AOT custom ops call it -> its status (0: done)."""
    n = len(arrays)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    params = (ctypes.c_void_p * n)(*(a.ctypes.data for a in arrays))
    ndims = (ctypes.c_int * n)(*(a.ndim for a in arrays))
    shape_ptrs = (ctypes.POINTER(ctypes.c_int64) * n)(
        *(ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes))
    dtypes = (ctypes.c_char_p * n)(*(a.dtype.name.encode() for a in arrays))
    return ctypes.CDLL(library).__getattr__(function)(n, params, ndims, shape_ptrs, dtypes, None,
                                                      None)
