"""vllm-mindspore: a vLLM hardware plugin that runs models in MindSpore graph mode."""
from setuptools import find_packages, setup

setup(
    name="vllm-mindspore",
    version="0.1.0",
    description="vLLM platform plugin serving LLMs with MindSpore (Ascend NPUs and CPUs)",
    packages=find_packages(include=["vllm_mindspore", "vllm_mindspore.*",
                                    "model_backends", "model_backends.*"]),
    # The C++ CPU kernels are built from source on first use (vllm_mindspore/ops/kernels.py).
    package_data={"vllm_mindspore.ops": ["csrc/*.cc", "csrc/*.h"]},
    python_requires=">=3.10",
    # The stack is pinned by scripts/install.sh (torch CPU, vLLM from sdist, mindspore + numpy<2);
    # declaring it here would let pip replace those builds.
    install_requires=["pyyaml", "safetensors"],
    entry_points={
        "console_scripts": ["vllm-mindspore = vllm_mindspore.cli:main"],
        "vllm.platform_plugins": ["mindspore = vllm_mindspore:register_platform"],
        "vllm.general_plugins": ["mindspore_models = vllm_mindspore:register_general"],
    },
)
