"""vllm-mindspore: a vLLM hardware plugin whose models run as MindSpore graph-mode code.

Entry points (see setup.py):
  vllm.platform_plugins -> `register_platform`: names our Platform class in every vLLM process.
  vllm.general_plugins  -> `register_general`: applies the declared vLLM patches in every process.
Both must stay cheap: they run in the API server, the engine core and every worker.
"""

from vllm_mindspore import envs


def register_platform() -> str | None:
    if envs.VLLM_MS_DISABLE_PLATFORM:
        return None
    return "vllm_mindspore.platform.MindSporePlatform"


def register_general() -> None:
    from vllm_mindspore.patches import apply_patches

    apply_patches()
