"""Small MindSpore Cells the kernel tests run operators in."""

from mindspore import nn


class OpCell(nn.Cell):
    """Calls `op(*inputs, *params)` as a graph: runs one custom operator on its own."""

    def __init__(self, op, *params):
        super().__init__()
        self.op = op
        self.params = params

    def construct(self, *inputs):
        return self.op(*inputs, *self.params)
