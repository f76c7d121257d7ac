"""The docs' cheap commands, run as written (blocks extracted from the Markdown by their
`<!-- run: ID -->` markers): install check, the stack check, `vllm-mindspore models` with and without
the MindFormers backend, the demo-model builder (its --help: the real build trains for ~90 s),
the W8A8 quantization script (on a tiny model) and build_image.sh --dry-run. The serving blocks run in test_deploy_ray.py and
test_deploy_data_parallel.py."""

import os
import sys

from conftest import ROOT
from test_docs_blocks import doc_block, replace_checked, run_block

VENV = os.path.dirname(os.path.dirname(sys.executable))


def test_install_is_complete_and_quick():
    result = run_block(doc_block("install"), ROOT, timeout=600)
    assert "environment ready" in result.stdout + result.stderr


def with_this_venv(block: str) -> str:
    """The block with the documented venv path replaced by this one, if VLLM_MS_VENV moved it."""
    default = os.path.expanduser("~/.cache/vllm-mindspore/venv")
    if os.path.realpath(VENV) == os.path.realpath(default):
        return block
    return replace_checked(block, "~/.cache/vllm-mindspore/venv", VENV)


def test_activate_and_check_the_stack():
    block = with_this_venv(doc_block("activate"))
    result = run_block(block, ROOT, env={k: v for k, v in os.environ.items()}, timeout=120)
    for package in ("torch", "vllm", "mindspore", "numpy", "ray", "vllm-mindspore"):
        assert f"\n{package} " in "\n" + result.stdout, result.stdout


def test_models_lists_every_architecture():
    out = run_block(doc_block("models"), ROOT, timeout=120).stdout
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "DeepseekV3ForCausalLM"):
        assert f"Native       {arch}" in out and f"MindFormers  {arch}" in out, out
    assert "selected backend: Native" in out


def test_mindformers_backend_is_selected_by_the_environment():
    out = run_block(doc_block("backend-models"), ROOT, timeout=120).stdout
    assert out.strip().endswith("selected backend: MindFormers (vLLM_MODEL_BACKEND=MindFormers)"), out


def test_demo_model_builder_takes_the_documented_arguments():
    out = run_block(doc_block("demo-model") + " --help", ROOT, timeout=300).stdout
    assert "out_dir" in out and "--train-steps" in out, out


def test_build_image_dry_run():
    out = run_block(doc_block("build-dry-run"), ROOT, timeout=60).stdout
    assert "docker build --file" in out and "BASE_IMAGE=quay.io/ascend/cann:" in out, out


def test_quantize_script_writes_a_w8a8_checkpoint(tiny_model_factory, tmp_path):
    model = tiny_model_factory("Qwen2ForCausalLM")
    block = replace_checked(with_this_venv(doc_block("quantize")), "demo_model demo_model_w8a8",
                            f"{model} {tmp_path}/w8a8")
    out = run_block(block, ROOT, timeout=300).stdout
    assert "(ascend layout)" in out and "W8A8_DYNAMIC tensors" in out, out
    assert os.path.isfile(tmp_path / "w8a8" / "quant_model_description.json")
