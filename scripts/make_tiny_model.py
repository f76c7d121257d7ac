#!/usr/bin/env python3
"""Build a tiny random Hugging Face model whose shape a MindFormers predict YAML describes, to
rehearse a deployment on CPU (the docs' scaled-down DeepSeek-R1 runs use it). Offline: the
tokenizer is trained on the Python standard library's sources; nothing is downloaded.

    python scripts/make_tiny_model.py yaml_configs/small/predict_deepseek_r1_tiny.yaml tiny_deepseek
    python scripts/make_tiny_model.py yaml_configs/small/predict_qwen2_demo.yaml demo_shaped --arch Qwen2ForCausalLM

The YAML's `model.model_config` (and `moe_config`) fields become config.json fields through the
plugin's own mapping (vllm_mindspore.config), so the model passes the MindFormers backend's
cross-check. The weights are random (seeded): the text it writes means nothing, but the tokens are
deterministic, which is what comparing parallel layouts needs. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def build_tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
    tok.train(files, trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096,
                   "chat_template": CHAT_TEMPLATE}, f)


def hf_config_fields(yaml_path: str) -> tuple[str, dict]:
    from vllm_mindspore.config import load_mindformers_config, model_config_overrides

    cfg = load_mindformers_config(yaml_path)
    arch = ((cfg.get("model") or {}).get("arch") or {}).get("type")
    return arch, dict(model_config_overrides(cfg))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("yaml", help="MindFormers predict YAML (e.g. yaml_configs/small/...)")
    parser.add_argument("out_dir", help="folder to write the model into")
    parser.add_argument("--arch", help="HF architecture (default: the YAML's model.arch.type)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers

    yaml_arch, fields = hf_config_fields(args.yaml)
    arch = args.arch or yaml_arch
    if not arch or not hasattr(transformers, arch):
        print(f"unknown architecture {arch!r}: pass --arch (e.g. Qwen2ForCausalLM)", file=sys.stderr)
        return 2
    fields.setdefault("tie_word_embeddings", False)
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])  # MHA unless the YAML says
    vocab = fields["vocab_size"]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        bos_token_id=0, eos_token_id=2, pad_token_id=0, **fields)
    torch.manual_seed(args.seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    with torch.no_grad():  # wider than HF's init: peaked next-token distributions, few ties
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.1)
    os.makedirs(args.out_dir, exist_ok=True)
    model.save_pretrained(args.out_dir, safe_serialization=True)
    build_tokenizer(args.out_dir, min(vocab, 4096))
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {arch} ({params / 1e6:.2f}M parameters, shape of {args.yaml}) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
