"""Platform pieces that need no engine: the patch registry, device checks, backend selection."""

import pytest
import torch

from model_backends import MINDFORMERS, NATIVE, select_backend
from vllm_mindspore.patches import PATCHES, SAMPLER_PATCHES, apply_patches
from vllm_mindspore import platform
from vllm_mindspore.platform import ASCEND, CPU, check_world_fits_devices


def test_patch_registry_is_declared_and_idempotent():
    from importlib.metadata import version

    for patch in PATCHES + SAMPLER_PATCHES:
        assert patch.reason and ":" in patch.target
        assert version(patch.package).split("+")[0] == patch.version, patch.target
    apply_patches()
    apply_patches()
    torch.accelerator.empty_cache()  # raised on a CPU-only torch before the patch
    torch.accelerator.empty_host_cache()


def test_bfloat16_on_cpu_needs_avx512_bf16(monkeypatch):
    """--dtype bfloat16 on CPU runs only where the bfloat16 matmul has its instruction."""
    platform.check_dtype_for_device(CPU, "float32")
    monkeypatch.setattr(platform, "cpu_has_bfloat16_dot", lambda: False)
    with pytest.raises(ValueError, match="needs AVX512-BF16.*--dtype float32"):
        platform.check_dtype_for_device(CPU, "bfloat16")
    monkeypatch.setattr(platform, "cpu_has_bfloat16_dot", lambda: True)
    platform.check_dtype_for_device(CPU, "bfloat16")


def test_world_must_fit_the_visible_npus():
    check_world_fits_devices(8, ASCEND, 8)
    check_world_fits_devices(16, CPU, 0)  # CPU ranks are processes, not devices
    with pytest.raises(ValueError, match="runs 16 ranks .* sees 8 NPU"):
        check_world_fits_devices(16, ASCEND, 8)


@pytest.mark.parametrize("env, expected", [
    ({}, NATIVE),
    ({"MINDFORMERS_MODEL_CONFIG": "x.yaml"}, MINDFORMERS),
    ({"vLLM_MODEL_BACKEND": "mindformers"}, MINDFORMERS),
    ({"VLLM_MS_MODEL_BACKEND": "NATIVE", "MINDFORMERS_MODEL_CONFIG": "x.yaml"}, NATIVE),
])
def test_backend_selection(monkeypatch, env, expected):
    for name in ("vLLM_MODEL_BACKEND", "VLLM_MODEL_BACKEND", "VLLM_MS_MODEL_BACKEND",
                 "MINDFORMERS_MODEL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert select_backend().name == expected


def test_unknown_backend_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv("vLLM_MODEL_BACKEND", "Torch")
    with pytest.raises(ValueError, match="valid values: Native, MindFormers"):
        select_backend()
