"""Device kernels behind one interface per op.

Each op is a `mindspore.nn.Cell` whose constructor picks the implementation for the device the
platform detected: the plugin's C++ operators on CPU (`kernels.py`; MindSpore registers no fused
LLM kernel there) and the fused Ascend kernels on NPUs. Model code never branches on the device.
"""

from vllm_mindspore.ops.attention import AttentionMetadata, PagedAttention
from vllm_mindspore.ops.greedy import GreedyTokens
from vllm_mindspore.ops.norm import RMSNorm
from vllm_mindspore.ops.rotary import RotaryEmbedding

__all__ = ["AttentionMetadata", "GreedyTokens", "PagedAttention", "RMSNorm", "RotaryEmbedding"]
