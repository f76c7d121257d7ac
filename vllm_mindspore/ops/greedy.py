"""GreedyTokens: logits [N, vocab] float32 -> each row's argmax [N] int32, taken in the logits
head's graph while the logits are still in the caches (CPU) or on the device (Ascend). A step
whose every sampled request is plain greedy reads these tokens instead of the logits
(`worker/sampling.py: argmax_is_the_sample`).

CPU: the plugin's C++ kernel (`csrc/sampling.cc`), the same argmax vLLM's sampler takes on this
platform (the first maximum; the first NaN, as torch.argmax). Ascend: MindSpore's Argmax (which
of equal maxima, or of NaNs, the NPU's kernel picks is not checked here: no NPU).
"""

import mindspore as ms
from mindspore import nn, ops

from vllm_mindspore.ops import kernels
from vllm_mindspore.platform import ASCEND, kernel_device


class GreedyTokens(nn.Cell):
    def __init__(self):
        super().__init__()
        if kernel_device() == ASCEND:
            self.argmax = ops.Argmax(axis=-1, output_type=ms.int32)
        else:
            self.argmax = kernels.custom_op("GreedyTokens", lambda logits: logits[:1],
                                            lambda logits: ms.int32)

    def construct(self, logits):
        return self.argmax(logits)
