"""Building blocks shared by the native models. Parameter names match the HF checkpoints'
tensor names (`weight`, `bias`), so a model's `parameters_and_names()` is its checkpoint key list."""

import mindspore as ms
from mindspore import Parameter, mint, nn, ops


def _empty(shape, dtype) -> Parameter:
    # Filled by the weight loader; zeros keep an unloaded tensor deterministic.
    return Parameter(mint.zeros(shape, dtype=dtype), requires_grad=False)


class Linear(nn.Cell):
    """y = x @ weight.T (+ bias). x: [T, in_features] -> [T, out_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=ms.float32):
        super().__init__()
        self.weight = _empty((out_features, in_features), dtype)
        self.bias = _empty((out_features,), dtype) if bias else None
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        y = self.matmul(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y


class Embedding(nn.Cell):
    """ids: [T] -> [T, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=ms.float32):
        super().__init__()
        self.weight = _empty((num_embeddings, embedding_dim), dtype)

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


class SiluAndMul(nn.Cell):
    """gate, up: [T, I] -> silu(gate) * up."""

    def construct(self, gate, up):
        return ops.silu(gate) * up
