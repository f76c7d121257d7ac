"""Tensor parallel over two `mp` worker processes with MindSpore collectives (mccl on CPU):
same tokens as TP=1, half the weights per rank, failures that end cleanly."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import openai
import psutil
import pytest
from conftest import (PROMPTS, ROOT, TOKEN_BUDGET, HFReference, assert_matches_hf, free_port,
                      needs_mindformers, slow)
from test_moe_models import MODELS as MOE_MODELS
from conftest import real_tiny_checkpoint

MODELS = {
    # MLA heads split (the latent cache replicated), experts split, one all-reduce per MoE.
    "deepseek-v3-q-lora": MOE_MODELS["deepseek-v3-q-lora"],
    "qwen3-moe": MOE_MODELS["qwen3-moe"],
    # GQA split: 2 KV heads over 2 ranks; vocabulary not divisible by 2 (padded shard).
    "llama-untied-odd-vocab": ("LlamaForCausalLM", dict(vocab_size=515)),
    # More ranks than KV heads: the single KV head is replicated; tied embeddings; q/k norm.
    "qwen3-one-kv-head-tied": ("Qwen3ForCausalLM", dict(num_key_value_heads=1,
                                                         tie_word_embeddings=True)),
}


def generate(model_dir, tp, **engine_args):
    """Greedy outputs for PROMPTS (8 tokens, top-2 logprobs) and each rank's weight bytes."""
    from vllm import LLM, SamplingParams

    llm = LLM(**{"model": model_dir, "tensor_parallel_size": tp, "max_model_len": 256,
                 "max_num_seqs": 8, "max_num_batched_tokens": TOKEN_BUDGET,
                 "kv_cache_memory_bytes": 16 << 20, "seed": 0, **engine_args})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params)
    weight_bytes = llm.collective_rpc("weight_bytes")
    llm.llm_engine.engine_core.shutdown()
    return outputs, weight_bytes


def assert_tp2_matches_tp1_and_hf(model_dir, single, single_bytes, double, rank_bytes, context):
    """TP=2 greedy tokens equal TP=1's and HF's; each rank holds about half the weights (only
    norms, routers, replicated KV heads and MLA's latent projections are duplicated)."""
    reference = HFReference(model_dir)
    for one, two in zip(single, double):
        tokens = list(two.outputs[0].token_ids)
        assert tokens == list(one.outputs[0].token_ids)
        logprobs = [step[t].logprob for t, step in zip(tokens, two.outputs[0].logprobs)]
        ref_tokens, ref_steps = reference.greedy(list(two.prompt_token_ids), 8)
        assert_matches_hf(tokens, logprobs, ref_tokens, ref_steps, context)
    assert len(rank_bytes) == 2
    for part in rank_bytes:
        assert 0.45 * single_bytes < part < 0.62 * single_bytes, (rank_bytes, single_bytes)


SLOW_TP2 = {
    "deepseek-v3-q-lora": "about 2 min; every run serves DeepSeek-V3 (MLA + MoE) at TP=2 in "
                          "tests/test_quant_models.py",
    "qwen3-moe": "about 85 s; every run splits MoE experts' intermediate at TP=2 in "
                 "tests/test_quant_models.py (DeepSeek-V3 W8A8)",
    "llama-untied-odd-vocab": "about 70 s; every run splits GQA heads at TP=2 in "
                              "tests/test_deploy_ray.py and here for Qwen3 (the padded vocabulary "
                              "shard only with VLLM_MS_RUN_SLOW=1)",
}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=slow(SLOW_TP2[name])) if name in SLOW_TP2 else name
    for name in MODELS])
def test_tp2_matches_tp1_and_hf_with_half_the_weights(tiny_model_factory, name):
    model_dir = real_tiny_checkpoint(tiny_model_factory, *MODELS[name])
    single, (single_bytes,) = generate(model_dir, 1)
    double, rank_bytes = generate(model_dir, 2)
    assert_tp2_matches_tp1_and_hf(model_dir, single, single_bytes, double, rank_bytes,
                                  f"tp2 {name}")


MINDFORMERS_MODELS = {  # architecture -> the tiny YAML of its shape and mindformers' class
    "Qwen3ForCausalLM": ("predict_qwen3_tiny.yaml",
                         "mindformers.models.qwen3.modeling_qwen3_infer.InferenceQwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("predict_qwen2_tiny.yaml",
                         "mindformers.models.qwen2.modeling_qwen2_infer.InferenceQwen2ForCausalLM"),
}


@needs_mindformers()
@pytest.mark.parametrize("arch", [
    pytest.param(arch, marks=slow("about 2 min; every run serves mindformers' Qwen2 class at TP=2 "
                                  "over Ray against TP=1 (test_deploy_ray.py)"))
    for arch in MINDFORMERS_MODELS])
def test_mindformers_classes_at_tp2_match_tp1_and_hf(tiny_model_factory, monkeypatch, capfd,
                                                      arch):
    """mindformers' own model class on both ranks: its ColumnParallel / RowParallel linears and
    vocabulary-parallel embedding and output layer take their shards in mindformers' loader
    (2 KV heads: one per rank) and reduce / gather through MindSpore's collectives."""
    yaml_name, implementation = MINDFORMERS_MODELS[arch]
    model_dir = tiny_model_factory(arch)
    monkeypatch.setenv("vLLM_MODEL_BACKEND", "MindFormers")
    monkeypatch.setenv("MINDFORMERS_MODEL_CONFIG",
                       os.path.join(ROOT, "yaml_configs", "small", yaml_name))
    single, (single_bytes,) = generate(model_dir, 1)
    double, rank_bytes = generate(model_dir, 2)
    built = [line for line in capfd.readouterr().out.splitlines()
             if f"Built {implementation} with MindFormersBackend" in line]
    assert len(built) == 3, built  # the TP=1 worker and both TP=2 ranks
    assert_tp2_matches_tp1_and_hf(model_dir, single, single_bytes, double, rank_bytes,
                                  f"mindformers tp2 {arch}")


def test_worker_killed_mid_request_fails_requests_and_exits(serve, tiny_model_factory):
    model_dir = tiny_model_factory("LlamaForCausalLM", vocab_size=515)
    server = serve(model_dir, "--tensor-parallel-size", "2", "--max-model-len", "1024",
                   "--kv-cache-memory-bytes", str(16 << 20), "--max-num-seqs", "4",
                   "--max-num-batched-tokens", str(TOKEN_BUDGET))  # 13 graphs, not 30
    port = server.port
    workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "Worker" in " ".join(p.cmdline())]
    assert workers, "no TP worker process found"
    client = server.client()
    stream = client.completions.create(model=model_dir, prompt=PROMPTS[0], max_tokens=900,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running
    workers[-1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    with pytest.raises((openai.APIError, openai.APIConnectionError, Exception)):
        for _ in stream:
            pass
    server.proc.wait(timeout=30)
    assert time.time() - killed_at < 30
    descendants_gone = time.time() + 10
    while time.time() < descendants_gone and any(p.is_running() and p.status() != "zombie"
                                                 for p in workers):
        time.sleep(0.5)
    leftover = [p.pid for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and model_dir in " ".join(p.info["cmdline"])]
    assert not leftover, f"processes left behind: {leftover}"
    assert not [c for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == "LISTEN"]


def test_unreachable_peer_fails_with_clear_error_within_timeout(tmp_path):
    """Rank 0 of a 2-rank MindSpore world whose peer never comes: an error, not a hang."""
    script = textwrap.dedent(f"""
        import os, time
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
        import mindspore as ms
        ms.set_device("CPU")
        from vllm_mindspore.distributed.communication import init_communication
        init_communication(0, 2, dist.group.WORLD, "127.0.0.1", "CPU", [0, 1])
    """)
    start = time.time()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "VLLM_MS_COMM_TIMEOUT": "8",
                                              "GLOG_v": "3"})
    assert result.returncode != 0
    assert "did not come up for rank 0 of 2" in result.stderr
    assert time.time() - start < 60
