"""Shared fixtures: tiny HF models built locally, HF transformers references, and a real
`vllm-mindspore serve` process on a free 127.0.0.1 port that is always stopped."""

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The step token budget the engine tests run with: it bounds the graphs compiled at start-up
# (one a token size up to it; longer prompts are prefilled in chunks). vLLM's default (8192 on
# CPU) would compile ~30 graphs per engine on a 2-core machine.
TOKEN_BUDGET = 64

# Eight prompts of different lengths (1 to ~60 tokens), submitted together in the tests.

def slow(why: str):
    """Skip the test unless VLLM_MS_RUN_SLOW=1: the default suite stays within CI's time."""
    return pytest.mark.skipif(os.environ.get("VLLM_MS_RUN_SLOW") != "1",
                              reason=f"slow: {why}; VLLM_MS_RUN_SLOW=1 runs it")


def needs_mindformers():
    """Skip unless the optional mindformers package is installed (found without importing it)."""
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec("mindformers") is None,
                              reason="mindformers not installed: run make install-mindformers")


PROMPTS = [
    "import",
    "def main():",
    "The quick brown fox jumps over the lazy dog.",
    "class Request:\n    def __init__(self, name, value):\n        self.name = name",
    "for i in range(10):\n    print(i)",
    "Copyright (c) Python Software Foundation. All rights reserved. Licensed under the PSF license "
    "agreement; see the file LICENSE for details and for a DISCLAIMER OF ALL WARRANTIES.",
    "x = 1",
    "# This module provides access to the operating system: files, processes and the environment,"
    " in a portable way",
]


@pytest.fixture
def two_kernel_threads():
    """The CPU kernels split their work over two threads, as in a worker given two cores."""
    from vllm_mindspore.ops import kernels

    kernels.set_num_threads(2)
    yield
    kernels.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained offline on the Python standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
    tok.train(files, trainer)
    tok.save(str(out / "tokenizer.json"))
    chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                     "+ '<|im_end|>\\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096,
        "chat_template": chat_template}))
    return str(out)


def build_tiny_model(path: str, tokenizer_dir: str, arch: str, seed: int = 0,
                     init_scale: float = 0.25, save_dtype: str = "float32",
                     max_shard_size: str | None = None, **overrides) -> str:
    """Save a seeded random HF model of architecture `arch` (Llama/Qwen2/Qwen3/...) to `path`,
    as `save_dtype` safetensors (sharded with an index when `max_shard_size` is given).

    Weights are drawn wider than HF's default so next-token distributions are peaked and exact
    logit ties (which would make greedy comparisons ambiguous) are rare.
    """
    import torch
    import transformers

    config_name = {"GPT2LMHeadModel": "GPT2Config"}.get(arch, arch.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=1024, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    config = config_cls(**base)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, init_scale / param.shape[-1] ** 0.5 * 4)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.1)
    model.to(getattr(torch, save_dtype)).save_pretrained(
        path, safe_serialization=True, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tokenizer_dir):
    cache: dict[tuple, str] = {}

    def make(arch: str, **overrides) -> str:
        key = (arch, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(arch.lower()))
            cache[key] = build_tiny_model(path, tokenizer_dir, arch, **overrides)
        return cache[key]

    return make


# Tiny MoE models mindformers' classes express and compute as HF transformers does (the
# mindformers adapter and serve tests; yaml_configs/small/predict_{qwen3_moe,deepseek_v3}_tiny.yaml
# describe the first two with the factory's defaults).
# Qwen3-MoE: every layer sparse (mindformers' only layout), top-2 of 8 experts.
MF_QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    decoder_sparse_step=1, mlp_only_layers=[])
# DeepSeek-V3: layer 0 dense, layers 1-2 MoE: 8 experts in 4 groups, 2 groups kept, top-4, a
# shared expert. top_k / topk_group = 2 makes mindformers' group score (the sum of each group's
# top top_k // topk_group) HF's top-2 sum; the checkpoint's non-negative expert bias
# (finish_deepseek_checkpoint(non_negative_bias=True)) keeps every biased score positive, where
# mindformers' 0.0 mask of the dropped groups equals HF's -inf.
MF_DEEPSEEK_V3 = dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
    moe_intermediate_size=32, first_k_dense_replace=1)
# DeepSeek-V3's YaRN (mscale == mscale_all_dim, as mindformers' MLA softmax scale needs).
MF_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                    "mscale": 1.0, "mscale_all_dim": 1.0}


def finish_deepseek_checkpoint(model_dir: str, non_negative_bias: bool = False) -> None:
    """What the factory's random init leaves out of a real DeepSeek-V3 checkpoint: a non-zero
    e_score_correction_bias (HF keeps it a zero buffer; `non_negative_bias` keeps every biased
    score positive), and a multi-token-prediction layer (index num_hidden_layers) in its own
    shard, which HF ignores and the server must skip."""
    import torch
    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(model_dir, "mtp.safetensors")):
        return
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            bias = torch.randn(tensor.shape, generator=generator) * 0.5
            tensors[name] = bias.abs() if non_negative_bias else bias
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.load(open(os.path.join(model_dir, "config.json")))
    mtp, hidden = f"model.layers.{config['num_hidden_layers']}", config["hidden_size"]
    save_file({f"{mtp}.enorm.weight": torch.ones(hidden), f"{mtp}.hnorm.weight": torch.ones(hidden),
               f"{mtp}.eh_proj.weight": torch.zeros(hidden, 2 * hidden),
               f"{mtp}.shared_head.norm.weight": torch.ones(hidden),
               f"{mtp}.mlp.experts.0.gate_proj.weight": tensors[
                   "model.layers.1.mlp.experts.0.gate_proj.weight"]},
              os.path.join(model_dir, "mtp.safetensors"), metadata={"format": "pt"})


def real_tiny_checkpoint(tiny_model_factory, arch: str, overrides: dict,
                         non_negative_bias: bool = False) -> str:
    """The factory's tiny model of `arch`, a DeepSeek-V3 one finished as a real checkpoint is
    (finish_deepseek_checkpoint)."""
    model_dir = tiny_model_factory(arch, **overrides)
    if arch == "DeepseekV3ForCausalLM":
        finish_deepseek_checkpoint(model_dir, non_negative_bias)
    return model_dir


class HFReference:
    """Greedy generation with HF transformers on the same folder, in float32. With
    `rounding="bfloat16"` it rounds what vllm-mindspore's --dtype bfloat16 rounds on CPU with
    vdpbf16ps, float32 everywhere else: every linear layer's input, and the keys and values
    attention reads (the bfloat16 KV cache); with "bfloat16-cache" only the latter (the bfloat16
    weights widened to float32, VLLM_MS_CPU_BF16_WIDEN=1); with "bfloat16-tiles" the former and,
    as attention rounds them where AMX is there, the scaled queries and softmax numerators."""

    def __init__(self, model_dir: str, rounding: str = "float32"):
        import torch
        from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.rounding = rounding
        if rounding in ("bfloat16", "bfloat16-cache", "bfloat16-tiles"):
            def bfloat16_cache_attention(module, query, key, value, *args, **kwargs):
                key, value = key.bfloat16().float(), value.bfloat16().float()
                if rounding == "bfloat16-tiles":
                    return self._tile_attention(module, query, key, value)
                return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

            AttentionInterface.register("bfloat16_cache", bfloat16_cache_attention)
            self.model.set_attn_implementation("bfloat16_cache")

    def _tile_attention(self, module, query, key, value):
        """Causal attention of query [1, H, q, D] (the last q positions) over key/value
        [1, KVH, S, D] as the tiles compute it -> ([1, q, H, Dv], None)."""
        torch = self.torch
        group = module.num_key_value_groups
        key, value = (x.repeat_interleave(group, dim=1) for x in (key, value))
        query = (query * module.scaling).bfloat16().float()
        scores = query @ key.transpose(-1, -2)
        q_len, keys = scores.shape[-2:]
        visible = torch.arange(keys)[None, :] <= torch.arange(keys - q_len, keys)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        numerators = torch.exp(scores - scores.amax(-1, keepdim=True))
        out = (numerators.bfloat16().float() @ value) / numerators.sum(-1, keepdim=True)
        return out.transpose(1, 2).contiguous(), None

    @contextlib.contextmanager
    def _rounding_linear_inputs(self):
        functional = self.torch.nn.functional
        linear = functional.linear
        if self.rounding in ("bfloat16", "bfloat16-tiles"):
            bfloat16 = self.torch.bfloat16
            functional.linear = lambda x, *args: linear(x.to(bfloat16).float(), *args)
        try:
            yield
        finally:
            functional.linear = linear

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[list[float]]]:
        """-> (token ids, per-step full-vocabulary logprobs)."""
        torch = self.torch
        with torch.no_grad(), self._rounding_linear_inputs():
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True,
                                      pad_token_id=0)
        steps = [torch.log_softmax(l[0].double(), -1) for l in out.logits]
        return out.sequences[0][len(prompt_ids):].tolist(), steps

    def prompt_logprobs(self, prompt_ids: list[int]):
        torch = self.torch
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt_ids])).logits[0]
        return torch.log_softmax(logits.double(), -1)


NEAR_TIE = 1e-3
LOGPROB_TOL = 1e-3


def assert_matches_hf(ours: list[int], our_logprobs: list[float] | None, ref_tokens: list[int],
                      ref_steps, context: str = "") -> None:
    """Greedy tokens identical to HF's; a divergence is accepted only at a step where HF's top
    two logprobs are within NEAR_TIE (then the rest is not compared). Logprobs of the chosen
    tokens within LOGPROB_TOL."""
    for step, (mine, ref) in enumerate(zip(ours, ref_tokens)):
        if our_logprobs is not None:
            expected = float(ref_steps[step][mine])
            assert abs(our_logprobs[step] - expected) < LOGPROB_TOL, (
                f"{context} step {step}: logprob {our_logprobs[step]} vs HF {expected}")
        if mine != ref:
            top2 = ref_steps[step].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE and float(ref_steps[step][mine]) >= float(top2[1]) - 1e-9, (
                f"{context} step {step}: token {mine} != HF {ref} (HF top-2 gap {gap:.2e}); "
                f"ours {ours} vs HF {ref_tokens}")
            return
    assert len(ours) == len(ref_tokens), f"{context}: {len(ours)} tokens vs HF {len(ref_tokens)}"


def assert_serves_hf_tokens(model: str, prompts: list[str], tokens: list[list[int]],
                            context: str = "") -> None:
    """Each prompt's served greedy tokens are HF's on the same folder (`assert_matches_hf`;
    a prompt repeated, say for a prefix-cache hit, is run through HF once)."""
    reference = HFReference(model)
    expected = {}
    for prompt, ours in zip(prompts, tokens, strict=True):
        if prompt not in expected:
            expected[prompt] = reference.greedy(reference.tokenizer(prompt)["input_ids"],
                                                len(ours))
        assert_matches_hf(ours, None, *expected[prompt], f"{context} {prompt[:20]!r}")


class Server:
    """`vllm-mindspore serve` in its own process group, logs in a file."""

    def __init__(self, model: str, args: list[str], log_path: str, env: dict | None = None):
        self.port = free_port()
        self.model = model
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [os.path.join(os.path.dirname(sys.executable), "vllm-mindspore"), "serve", model,
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float = 240) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=120,
                             max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # any child left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.close()


def greedy_tokens(server: Server, model: str, prompts: list[str], max_tokens: int = 8):
    """Greedy completions of `prompts` submitted together (so vLLM batches them): token ids."""
    from concurrent.futures import ThreadPoolExecutor

    client = server.client()

    def one(prompt):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.fixture
def serve(tmp_path):
    """serve(model, *args) -> a ready Server; every server is stopped at teardown."""
    servers: list[Server] = []

    def start(model: str, *args: str, env: dict | None = None, wait: bool = True) -> Server:
        server = Server(model, list(args), str(tmp_path / f"server{len(servers)}.log"), env)
        servers.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in servers:
        server.stop()
