"""The device the plugin runs on, decided from the environment alone (no torch, vLLM or MindSpore
import), so the command line can ask before vLLM starts."""

import glob

from vllm_mindspore import envs

ASCEND = "Ascend"
CPU = "CPU"


def detect_device() -> str:
    """Ascend when asked for, or when NPU device nodes exist; else CPU."""
    wanted = envs.VLLM_MS_DEVICE.lower()  # auto | ascend | cpu (checked)
    if wanted == "ascend":
        return ASCEND
    if wanted == "cpu":
        return CPU
    return ASCEND if glob.glob("/dev/davinci[0-9]*") else CPU
