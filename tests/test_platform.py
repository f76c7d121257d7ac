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


class Reexecuted(Exception):
    """os.execve's stand-in: what the command would have run again with."""


def test_cli_preloads_tcmalloc_on_cpu_where_installed(monkeypatch, tmp_path):
    import os

    from vllm_mindspore import cli

    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")

    def execve(path, argv, env):
        raise Reexecuted(path, argv, env)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(cli, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"), str(library)))
    monkeypatch.setattr("sys.argv", ["vllm-mindspore", "serve", "demo_model", "--port", "8001"])
    monkeypatch.setenv("VLLM_MS_DEVICE", "CPU")
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    with pytest.raises(Reexecuted) as run:
        cli.preload_tcmalloc()
    path, argv, env = run.value.args
    assert argv[1:] == ["-m", "vllm_mindspore.cli", "serve", "demo_model", "--port", "8001"]
    assert env["LD_PRELOAD"] == f"{library}:/opt/other.so"
    # Already preloaded (the command run again), switched off, on Ascend, or not installed:
    # the command goes on as it is.
    for name, value in [("LD_PRELOAD", str(library)), ("VLLM_MS_CPU_TCMALLOC", "0"),
                        ("VLLM_MS_DEVICE", "Ascend")]:
        with monkeypatch.context() as scoped:
            scoped.setenv(name, value)
            cli.preload_tcmalloc()
    monkeypatch.setattr(cli, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"),))
    cli.preload_tcmalloc()


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_cli_runs_again_with_tcmalloc_where_installed(enabled):
    """The command run as it is started, with the dynamic loader telling which libraries it
    initialises: tcmalloc among them exactly when the command preloads it."""
    import os
    import subprocess
    import sys

    from vllm_mindspore import cli

    installed = [path for path in cli.TCMALLOC_PATHS if os.path.exists(path)]
    if not installed:
        pytest.skip("libtcmalloc_minimal.so.4 is not installed on this machine")
    env = dict(os.environ, LD_DEBUG="files", VLLM_MS_CPU_TCMALLOC=enabled, VLLM_MS_DEVICE="CPU")
    env.pop("LD_PRELOAD", None)
    result = subprocess.run([sys.executable, "-m", "vllm_mindspore.cli", "models"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LlamaForCausalLM" in result.stdout
    assert (f"calling init: {installed[0]}" in result.stderr) == (enabled == "1")


def test_missing_tcmalloc_warning_names_the_preload(monkeypatch, tmp_path):
    from vllm_mindspore import cli

    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    monkeypatch.setattr(cli, "TCMALLOC_PATHS", (str(library),))
    monkeypatch.delenv("VLLM_MS_CPU_TCMALLOC", raising=False)
    maps = "7f0000000000-7f0000001000 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n"
    warning = cli.missing_tcmalloc_warning(maps)
    assert f"LD_PRELOAD={library} python script.py" in warning
    assert "VLLM_MS_CPU_TCMALLOC=0" in warning
    assert cli.missing_tcmalloc_warning(
        maps + f"7f0000002000-7f0000003000 r-xp 00000000 00:00 0 {library}\n") is None
    monkeypatch.setattr(cli, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"),))
    assert "apt-get install -y libtcmalloc-minimal4" in cli.missing_tcmalloc_warning(maps)
    monkeypatch.setenv("VLLM_MS_CPU_TCMALLOC", "0")
    assert cli.missing_tcmalloc_warning(maps) is None


# An offline script's engine (vLLM's LLM, the CPU worker in a process of its own), on a tiny model.
OFFLINE_SCRIPT = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=64, max_num_seqs=2, kv_cache_memory_bytes=4 << 20)
params = SamplingParams(max_tokens=2, ignore_eos=True)  # random sampling may pick EOS first
print("TOKENS", len(llm.generate(["Hello"], params)[0].outputs[0].token_ids))
"""


@pytest.mark.parametrize("preload", [False, True])
def test_offline_engine_warns_without_tcmalloc(preload, tiny_model_factory):
    """An offline script run with or without tcmalloc preloaded: its engine generates either way
    and logs the warning exactly when tcmalloc is missing."""
    import os
    import subprocess
    import sys

    from vllm_mindspore import cli

    library = cli.installed_tcmalloc()
    if preload and library is None:
        pytest.skip("libtcmalloc_minimal.so.4 is not installed on this machine")
    env = dict(os.environ, VLLM_MS_DEVICE="CPU")
    env.pop("VLLM_MS_CPU_TCMALLOC", None)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = library
    result = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT,
                             tiny_model_factory("Qwen3ForCausalLM")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TOKENS 2" in result.stdout
    assert ("tcmalloc is not preloaded" in result.stdout + result.stderr) == (not preload)
