"""Offline throughput and batch-1 decode latency of vllm-mindspore, side by side with HF
transformers `generate` on the same model and workload, in the same run.

Workload (defaults): 64 prompts of 128 random token ids, 128 output tokens each, greedy,
ignore_eos. Batch-1 decode: one prompt, ms per decode step = (t(1 + N tokens) - t(1 token)) / N.

    python benchmarks/throughput.py --model demo_model [--num-prompts 64 --input-len 128 ...]
    python benchmarks/throughput.py --build tiny-deepseek-v3   # or tiny-qwen3-moe

`--build` saves a seeded random model of that architecture (demo-model sized: hidden 256, 4
layers, the demo tokenizer) into a temporary folder with HF transformers and benchmarks it.
"""

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMMON = dict(vocab_size=3072, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
               num_attention_heads=8, max_position_embeddings=2048, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=2, pad_token_id=0)
TINY_MODELS = {
    # DeepSeek-V3 layout: MLA with q LoRA, YaRN, layer 0 dense, then 16 routed experts in 4
    # groups (2 kept), top-4, one shared expert.
    "tiny-deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _COMMON, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, head_dim=16, v_head_dim=32, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=128, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "mscale": 1.0,
                         "mscale_all_dim": 1.0})),
    # Qwen3-MoE: 16 experts, top-4, every layer sparse.
    "tiny-qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _COMMON, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, norm_topk_prob=True)),
}


def build_tiny_model(kind: str, tokenizer_dir: str) -> str:
    """A seeded random `kind` model with the tokenizer of `tokenizer_dir`, in a temp folder."""
    import torch
    import transformers

    config_name, arch, overrides = TINY_MODELS[kind]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(getattr(transformers, config_name)(**overrides))
    path = tempfile.mkdtemp(prefix=f"{kind}-")
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def workload(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab_size - 10, size=(num_prompts, input_len)).tolist()


def bench_vllm(args, prompts):
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=args.model, max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=args.num_prompts, kv_cache_memory_bytes=args.kv_cache_bytes, seed=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(batch, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)

    run(inputs[:2], 4)  # warm-up: first steps of each shape
    seconds, generated = run(inputs, args.output_len)
    t_one, _ = run(inputs[:1], 1)
    t_full, _ = run(inputs[:1], args.output_len + 1)
    return generated / seconds, (t_full - t_one) / args.output_len * 1e3, seconds


def bench_hf(args, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    def run(batch, max_tokens):
        ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=0)
        return time.perf_counter() - start, (out.shape[1] - ids.shape[1]) * ids.shape[0]

    run(prompts[:2], 4)
    seconds, generated = run(prompts, args.output_len)
    t_one, _ = run(prompts[:1], 1)
    t_full, _ = run(prompts[:1], args.output_len + 1)
    return generated / seconds, (t_full - t_one) / args.output_len * 1e3, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="an HF model folder")
    source.add_argument("--build", choices=sorted(TINY_MODELS),
                        help="benchmark a freshly built tiny model of this kind")
    parser.add_argument("--tokenizer", default=os.path.join(ROOT, "demo_model"),
                        help="tokenizer folder for --build (default: demo_model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.build:
        if not os.path.exists(os.path.join(args.tokenizer, "tokenizer.json")):
            parser.error(f"--build needs a tokenizer: {args.tokenizer}/tokenizer.json is missing "
                         "(`make demo-model` builds demo_model)")
        args.model = build_tiny_model(args.build, args.tokenizer)
    try:
        with open(f"{args.model}/config.json") as f:
            vocab_size = json.load(f)["vocab_size"]
        prompts = workload(vocab_size, args.num_prompts, args.input_len, args.seed)
        rows = [("vllm-mindspore", *bench_vllm(args, prompts))]
        if not args.skip_hf:
            rows.append(("HF transformers generate", *bench_hf(args, prompts)))
    finally:
        if args.build:
            shutil.rmtree(args.model, ignore_errors=True)
    print(f"\nmodel {args.build or args.model}: {args.num_prompts} prompts x {args.input_len} "
          f"tokens in, {args.output_len} out, greedy, ignore_eos")
    print(f"{'engine':<28}{'output tok/s':>14}{'batch-1 ms/step':>18}{'batch wall s':>14}")
    for name, tps, ms, seconds in rows:
        print(f"{name:<28}{tps:>14.1f}{ms:>18.2f}{seconds:>14.2f}")


if __name__ == "__main__":
    main()
