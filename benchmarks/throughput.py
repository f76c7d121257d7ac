"""Offline throughput and batch-1 decode latency of vllm-mindspore, side by side with HF
transformers `generate` on the same model and workload, in the same run.

Workload (defaults): 64 prompts of 128 random token ids, 128 output tokens each, greedy,
ignore_eos. Batch-1 decode: one prompt, ms per decode step = (t(1 + N tokens) - t(1 token)) / N.

    python benchmarks/throughput.py --model demo_model [--num-prompts 64 --input-len 128 ...]
"""

import argparse
import json
import time

import numpy as np


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
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    with open(f"{args.model}/config.json") as f:
        vocab_size = json.load(f)["vocab_size"]
    prompts = workload(vocab_size, args.num_prompts, args.input_len, args.seed)
    rows = [("vllm-mindspore", *bench_vllm(args, prompts))]
    if not args.skip_hf:
        rows.append(("HF transformers generate", *bench_hf(args, prompts)))
    print(f"\nmodel {args.model}: {args.num_prompts} prompts x {args.input_len} tokens in, "
          f"{args.output_len} out, greedy, ignore_eos")
    print(f"{'engine':<28}{'output tok/s':>14}{'batch-1 ms/step':>18}{'batch wall s':>14}")
    for name, tps, ms, seconds in rows:
        print(f"{name:<28}{tps:>14.1f}{ms:>18.2f}{seconds:>14.2f}")


if __name__ == "__main__":
    main()
