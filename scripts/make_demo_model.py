"""Build a small Qwen2-architecture demo model in Hugging Face format, fully offline.

The model is meant for smoke-testing the serving stack end to end without network access:
it is tiny, loads in a second, and after a short CPU training run its greedy output is
recognisably English-like (it will not be *useful*; it is a demo).

Steps:
  1. Collect a few MB of English text already on this machine (license texts, package
     documentation, and as a fallback Python standard-library docstrings).
  2. Train a byte-level BPE tokenizer on it with ChatML special tokens.
  3. Build a seeded ``Qwen2ForCausalLM`` and train it as a causal LM for a fixed time budget.
  4. Save everything into a temporary folder, load it back with transformers and greedily
     generate a sample as a self-check, then move the folder into place atomically.

Usage:
  python scripts/make_demo_model.py OUT_DIR [--force] [--train-steps N] [--seed S]

Nothing is ever downloaded: ``HF_HUB_OFFLINE`` is forced on and every load is local-only.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # must be set before transformers is imported

import argparse
import ast
import gzip
import json
import shutil
import sys
import sysconfig
import tempfile
import time
from statistics import mean
from pathlib import Path
from typing import Iterator

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Qwen2's pre-tokenizer split. transformers loads this folder as a Qwen2Tokenizer (because of the
# config's model_type), which imposes this normalizer and pre-tokenizer on tokenizer.json; training
# with the same pipeline keeps the ids the model learned identical to the ids it is served with.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

CORPUS_MAX_BYTES = 3_000_000
VOCAB_SIZE = 3072
SEQUENCE_LENGTH = 128
BATCH_SIZE = 16
PEAK_LEARNING_RATE = 4e-3
WARMUP_STEPS = 20
LOG_EVERY_STEPS = 10
SELF_CHECK_PROMPT = "The license"
SELF_CHECK_NEW_TOKENS = 20


# --------------------------------------------------------------------------- corpus


def english_paragraphs(text: str) -> Iterator[str]:
    """Yield the paragraphs of ``text`` that look like English prose rather than code or data."""
    for block in text.split("\n\n"):
        paragraph = " ".join(block.split())
        if len(paragraph) < 40:
            continue
        ascii_share = sum(char.isascii() for char in paragraph) / len(paragraph)
        letter_share = sum(char.isalpha() or char == " " for char in paragraph) / len(paragraph)
        if ascii_share > 0.98 and letter_share > 0.85:
            yield paragraph


def read_text_file(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            return handle.read(1_000_000)
    except (OSError, EOFError):
        return ""


def license_files() -> list[Path]:
    root = Path("/usr/share/common-licenses")
    return sorted(path for path in root.glob("*") if path.is_file())


def package_doc_files() -> list[Path]:
    """READMEs and copyright notices of installed Debian packages."""
    root = Path("/usr/share/doc")
    if not root.is_dir():
        return []
    readmes = [path for path in root.rglob("README*") if path.is_file()]
    notices = [path for path in root.rglob("copyright") if path.is_file()]
    return sorted(readmes) + sorted(notices)


def stdlib_docstrings() -> Iterator[str]:
    """Docstrings of the Python standard library, used when little other text exists."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(read_text_file(path))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    yield docstring


def collect_corpus(max_bytes: int = CORPUS_MAX_BYTES) -> list[str]:
    """Return deduplicated English documents from local files, at most ``max_bytes`` in total."""
    def raw_documents() -> Iterator[str]:
        for path in license_files() + package_doc_files():
            yield read_text_file(path)
        yield from stdlib_docstrings()

    seen_paragraphs: set[str] = set()
    documents: list[str] = []
    total_bytes = 0
    for raw in raw_documents():
        fresh = [p for p in english_paragraphs(raw) if p not in seen_paragraphs]
        if not fresh:
            continue
        seen_paragraphs.update(fresh)
        document = "\n\n".join(fresh)
        documents.append(document)
        total_bytes += len(document)
        if total_bytes >= max_bytes:
            break
    if not documents:
        sys.exit("error: found no local English text to train on")
    return documents


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(documents: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    special_tokens_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
    }
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    write_json(folder / "special_tokens_map.json", special_tokens_map)


# --------------------------------------------------------------------------- model


def build_model(tokenizer: Tokenizer) -> Qwen2ForCausalLM:
    end_of_text_id = tokenizer.token_to_id(END_OF_TEXT)
    config = Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        max_window_layers=4,
        use_sliding_window=False,
        bos_token_id=end_of_text_id,
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=end_of_text_id,
        architectures=["Qwen2ForCausalLM"],
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=end_of_text_id,
        eos_token_id=[tokenizer.token_to_id(IM_END), end_of_text_id],
        pad_token_id=end_of_text_id,
    )
    return model


def token_stream(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents tokenized and joined, each followed by ``<|endoftext|>``."""
    end_of_text_id = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids.extend(encoding.ids)
        ids.append(end_of_text_id)
    return torch.tensor(ids, dtype=torch.long)


def train(model: Qwen2ForCausalLM, tokens: torch.Tensor, steps: int, seed: int) -> float:
    """Train on random windows of ``tokens`` for ``steps``; return the mean loss of the last steps.

    The learning rate warms up linearly, then decays linearly over the steps. Given the seed,
    the result does not depend on how busy the machine is (only how long it takes).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LEARNING_RATE, weight_decay=0.1)
    batch_sampler = torch.Generator().manual_seed(seed)
    window = SEQUENCE_LENGTH + 1
    model.train()
    started = time.monotonic()
    recent_losses: list[float] = []
    for step in range(steps):
        elapsed = time.monotonic() - started
        warmup = min(1.0, (step + 1) / WARMUP_STEPS)
        decay = max(0.05, 1.0 - step / steps)
        for group in optimizer.param_groups:
            group["lr"] = PEAK_LEARNING_RATE * warmup * decay

        starts = torch.randint(0, len(tokens) - window, (BATCH_SIZE,), generator=batch_sampler)
        batch = torch.stack([tokens[start : start + window] for start in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        recent_losses = recent_losses[-(LOG_EVERY_STEPS - 1) :] + [loss.item()]
        if (step + 1) % LOG_EVERY_STEPS == 0:
            print(f"  step {step + 1:4d}  loss {mean(recent_losses):.3f}  ({elapsed:.0f}s)", flush=True)
    model.eval()
    final_loss = mean(recent_losses) if recent_losses else float("nan")
    print(f"trained {steps} steps, final loss {final_loss:.3f} (mean of the last {len(recent_losses)} steps)")
    return final_loss


def save_model(model: Qwen2ForCausalLM, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)
    # Newer transformers writes only "dtype"; older readers look for "torch_dtype".
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = config["torch_dtype"] = "float32"
    write_json(config_path, config)


def self_check(folder: Path) -> None:
    """Load the folder back with transformers and greedily continue a fixed prompt."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    inputs = tokenizer(SELF_CHECK_PROMPT, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=SELF_CHECK_NEW_TOKENS, do_sample=False)
    print(f"self-check generation: {tokenizer.decode(output[0], skip_special_tokens=True)!r}")


# --------------------------------------------------------------------------- folder handling


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def is_complete_model(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def move_into_place(built: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` with ``built`` so that readers never see a half-written folder."""
    built.chmod(0o755)  # mkdtemp and transformers' atomic writes leave owner-only permissions
    for path in built.iterdir():
        path.chmod(0o644)
    if out_dir.exists():
        discarded = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        out_dir.rename(discarded / out_dir.name)
        built.rename(out_dir)
        shutil.rmtree(discarded)
    else:
        built.rename(out_dir)


def folder_size_mb(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.iterdir()) / 1e6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder to write the model into")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR holds a model")
    parser.add_argument("--train-steps", type=int, default=300,
                        help="optimizer steps (about 90 s on 2 idle cores)")
    parser.add_argument("--seed", type=int, default=0, help="seed for initialisation and batches")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out_dir: Path = args.out_dir.resolve()
    if is_complete_model(out_dir) and not args.force:
        print(f"{out_dir} already holds a complete model; use --force to rebuild it")
        return
    if out_dir.exists() and any(out_dir.iterdir()) and not args.force:
        sys.exit(f"error: {out_dir} is not empty and holds no complete model; use --force to replace it")

    started = time.monotonic()
    torch.manual_seed(args.seed)
    torch.set_num_threads(len(os.sched_getaffinity(0)))

    documents = collect_corpus()
    print(f"corpus: {len(documents)} documents, {sum(map(len, documents)) / 1e6:.2f} MB")
    tokenizer = train_tokenizer(documents)
    tokens = token_stream(tokenizer, documents)
    print(f"tokenizer: vocab {tokenizer.get_vocab_size()}, corpus is {len(tokens)} tokens")

    model = build_model(tokenizer)
    parameter_count = sum(parameter.numel() for parameter in model.parameters())
    print(f"model: {parameter_count / 1e6:.2f}M parameters; training for {args.train_steps} steps")
    train(model, tokens, args.train_steps, args.seed)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        save_tokenizer(tokenizer, building)
        save_model(model, building)
        self_check(building)
        move_into_place(building, out_dir)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    print(f"wrote {out_dir} ({folder_size_mb(out_dir):.1f} MB) in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
