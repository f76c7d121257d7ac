"""The device the plugin runs on, decided from the environment alone (no torch, vLLM or MindSpore
import), so the command line can ask before vLLM starts."""

import glob

from vllm_mindspore import envs

ASCEND = "Ascend"
CPU = "CPU"


def device_for(wanted: str) -> str:
    """The device a VLLM_MS_DEVICE value picks (auto | Ascend | CPU, any case): Ascend when asked
    for, or, for auto, when NPU device nodes exist; else CPU."""
    wanted = wanted.strip().lower()
    if wanted == "ascend":
        return ASCEND
    if wanted == "cpu":
        return CPU
    return ASCEND if glob.glob("/dev/davinci[0-9]*") else CPU


def detect_device() -> str:
    """This process's device (its VLLM_MS_DEVICE, checked by envs)."""
    return device_for(envs.VLLM_MS_DEVICE)
