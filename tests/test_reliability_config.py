"""Reliability matrix, bad configuration (docs/reliability.md): broken checkpoints, a missing
tokenizer, bad environment variables, features the plugin does not implement, remote code.

Each broken checkpoint is loaded in-process by the real loader into the real MindSpore model
(seconds, no engine), and its error must name the file or tensor. Representative cases also
run `vllm-mindspore serve` end to end: one clear error, a non-zero exit, no process or port
left."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_reliability_helpers import leftover_processes, port_listening, wait_until_gone

ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-bytes",
        str(8 << 20), "--max-num-batched-tokens", "32")
CLI = os.path.join(os.path.dirname(sys.executable), "vllm-mindspore")


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("LlamaForCausalLM")


@pytest.fixture(scope="module")
def sharded(tiny_model_factory):
    return tiny_model_factory("LlamaForCausalLM", max_shard_size="200KB")


def load_into_native_model(model_dir: str) -> None:
    """What a worker does with the folder: build the MindSpore model from config.json, read the
    safetensors into it (raises WeightLoadError on a bad checkpoint)."""
    import mindspore as ms
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config

    from model_backends import NATIVE, resolve_model_class
    from model_backends.native.layers import ParallelLayout, building_with_layout
    from model_backends.native.weights import load_checkpoint

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model_cls = resolve_model_class(config.architectures, NATIVE)
    with set_current_vllm_config(VllmConfig()), building_with_layout(ParallelLayout()):
        model = model_cls(config, 16, ms.float32)
        load_checkpoint(model, model_dir, model.checkpoint_name_to_param)


def _rewrite_tensors(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _last_shard(folder: str) -> str:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[-1]


def _corrupt(folder):
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"\x00not a safetensors file\x00" * 64)


def _truncate(folder):
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)


def _edit_config(folder, **fields):
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(fields)
    json.dump(config, open(path, "w"))


def _transpose(tensors):
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].t().contiguous()


def _to_int8(tensors):
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = (tensors[name] * 100).to(__import__("torch").int8)


# (case, sharded?, how to break the copy, expected message: {dir} and {shard} are filled in)
BROKEN = [
    ("corrupt-file", False, _corrupt,
     "Cannot read safetensors file '{dir}/model.safetensors' (SafetensorError"),
    ("truncated-file", False, _truncate,
     "Cannot read safetensors file '{dir}/model.safetensors' (SafetensorError: Error while "
     "deserializing header: incomplete metadata, file not fully covered): the file is corrupt "
     "or truncated"),
    ("empty-file", False, lambda d: open(os.path.join(d, "model.safetensors"), "wb").close(),
     "Cannot read safetensors file '{dir}/model.safetensors'"),
    ("shard-missing", True, lambda d: os.remove(os.path.join(d, _last_shard(d))),
     "Shard(s) ['{shard}'] named by '{dir}/model.safetensors.index.json' are missing"),
    ("corrupt-index", True,
     lambda d: open(os.path.join(d, "model.safetensors.index.json"), "w").write("{not json"),
     "Cannot read the checkpoint index '{dir}/model.safetensors.index.json' (JSONDecodeError"),
    ("shape-mismatch", False,
     lambda d: _rewrite_tensors(os.path.join(d, "model.safetensors"), _transpose),
     "Checkpoint tensor 'model.layers.0.mlp.down_proj.weight' has shape (128, 64), too small for "
     "rows 0:128 along dim 1 of the model built from config.json: config.json and the weights "
     "in '{dir}' do not belong together."),
    ("weights-larger-than-config", False, lambda d: _edit_config(d, intermediate_size=64),
     "Checkpoint tensor 'model.layers.0.mlp.down_proj.weight' has shape (64, 128) but the model "
     "built from config.json expects 64 along dim 1"),
    ("dtype-mismatch", False,
     lambda d: _rewrite_tensors(os.path.join(d, "model.safetensors"), _to_int8),
     "Checkpoint tensor 'model.layers.1.self_attn.o_proj.weight' in '{dir}' has dtype int8"),
    ("tensor-missing", False,
     lambda d: _rewrite_tensors(os.path.join(d, "model.safetensors"),
                                lambda t: t.pop("model.norm.weight")),
     "missing ['model.norm.weight'] (1 in all)"),
    ("tensor-unexpected", False,
     lambda d: _rewrite_tensors(os.path.join(d, "model.safetensors"), lambda t: t.update({
         "model.layers.7.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].clone()})),
     "unexpected ['model.layers.7.mlp.up_proj.weight'] (1 in all)"),
]


@pytest.mark.parametrize("case, use_shards, breaks, expected", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_checkpoint_error_names_the_file_or_tensor(llama, sharded, tmp_path, case,
                                                          use_shards, breaks, expected):
    from model_backends.native.weights import WeightLoadError

    folder = str(tmp_path / case)
    shutil.copytree(sharded if use_shards else llama, folder)
    load_into_native_model(folder)  # intact: loads
    shard = _last_shard(folder)
    breaks(folder)
    with pytest.raises(WeightLoadError) as error:
        load_into_native_model(folder)
    assert expected.format(dir=folder, shard=shard) in str(error.value), str(error.value)


def _remove_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(folder, name))


# (case, how to break a copy of the model, extra serve flags, the error expected in the log,
#  whether the error comes before any engine process starts)
END_TO_END = [
    ("truncated-checkpoint", _truncate, (),
     "Cannot read safetensors file '{dir}/model.safetensors' (SafetensorError", False),
    ("missing-tokenizer", _remove_tokenizer, (), "No tokenizer in '{dir}'", True),
    ("missing-weights", lambda folder: os.remove(os.path.join(folder, "model.safetensors")), (),
     "No *.safetensors weights in '{dir}'", True),
    # An architecture vLLM knows but this plugin does not implement.
    ("unknown-architecture", lambda folder: _edit_config(folder, architectures=[
        "MistralForCausalLM"]), (), "not supported by the Native backend of vllm-mindspore", True),
    ("lora-requested", lambda folder: None, ("--enable-lora",),
     "vllm-mindspore does not support LoRA adapters (--enable-lora)", True),
]


def test_bad_configuration_stops_the_server_end_to_end(serve, llama, tmp_path):
    """`vllm-mindspore serve` on a truncated checkpoint (fails in the worker, while loading), a
    folder without tokenizer or without weights, an architecture the plugin does not implement
    and --enable-lora (all four refused before any engine process): each exits non-zero with
    its error in the log, and leaves no process or listening port. They start together (their
    start-ups overlap)."""
    started = time.time()
    servers = []
    for case, breaks, args, expected, before_engine in END_TO_END:
        folder = str(tmp_path / case)
        shutil.copytree(llama, folder)
        breaks(folder)
        servers.append((case, serve(folder, *ARGS, *args, wait=False), folder,
                        expected.format(dir=folder), before_engine))
    for case, server, folder, expected, before_engine in servers:
        server.proc.wait(timeout=240)
        log = server.log_tail(100000)
        assert server.proc.returncode != 0, case
        assert expected in log, (case, log[-3000:])
        assert log.count(expected) <= 3, (case, log.count(expected))  # reported, not repeated
        if before_engine:
            assert "EngineCore" not in log, case
        wait_until_gone(server, folder, 15)
        assert not leftover_processes(server, folder), case
        assert not port_listening(server.port), case
        print(f"{case}: exit {server.proc.returncode} within {time.time() - started:.1f} s")


# ---- environment variables -----------------------------------------------------------------------
BAD_ENV = [
    ("VLLM_MS_DEVICE", "gpu", "is not one of auto, Ascend, CPU"),
    ("VLLM_MS_CPU_KVCACHE_SPACE", "-1", "is not a number > 0"),
    ("VLLM_MS_COMM_TIMEOUT", "soon", "is not a number > 0"),
    ("VLLM_MS_LOG_STEPS", "maybe", "is not a boolean"),
    ("VLLM_MS_DISABLE_PLATFORM", "perhaps", "is not a boolean"),
    ("vLLM_MODEL_BACKEND", "Torch", "valid values: Native, MindFormers"),
]


@pytest.mark.parametrize("name, value, message", BAD_ENV, ids=[b[0] for b in BAD_ENV])
def test_bad_plugin_variable_stops_serve_with_one_line_naming_it(llama, name, value, message):
    start = time.time()
    process = subprocess.Popen([CLI, "serve", llama], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, name: value})
    try:
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:  # it went on to serve: stop it and everything it started
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and not stdout, stderr + stdout
    assert lines[0].startswith(f"vllm-mindspore: error: {name}={value!r}") and message in lines[0]
    assert time.time() - start < 30


def test_validate_environ_checks_the_plugin_variables(monkeypatch):
    """The check vLLM itself runs in create_engine_config (plain `vllm serve` too; hard_fail is
    --fail-on-environ-validation): the plugin's variables are known, their values checked,
    unknown VLLM_* still refused. (Server A of test_reliability_serving.py serves with
    --fail-on-environ-validation and VLLM_MS_* variables set.)"""
    from vllm_mindspore.platform import MindSporePlatform

    monkeypatch.setenv("VLLM_MS_LOG_STEPS", "1")
    monkeypatch.setenv("VLLM_MS_COMM_TIMEOUT", "30")
    monkeypatch.setenv("VLLM_MS_MODEL_BACKEND", "native")
    monkeypatch.setenv("VLLM_MS_YAML_CLI_DEFAULTS_APPLIED", "1")  # set by the plugin itself
    MindSporePlatform.validate_environ(hard_fail=True)
    monkeypatch.setenv("VLLM_MS_COMM_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="VLLM_MS_COMM_TIMEOUT='abc' is not a number > 0"):
        MindSporePlatform.validate_environ(hard_fail=False)
    monkeypatch.setenv("VLLM_MS_COMM_TIMEOUT", "30")
    monkeypatch.setenv("VLLM_MS_TYPO", "1")
    MindSporePlatform.validate_environ(hard_fail=False)  # a warning
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: "
                                         "VLLM_MS_TYPO"):
        MindSporePlatform.validate_environ(hard_fail=True)


# ---- features the plugin does not implement: refused at start-up ---------------------------------
UNSUPPORTED = [
    ("lora", dict(enable_lora=True), "LoRA adapters (--enable-lora)"),
    ("speculative", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_max": 3}),
     "speculative decoding (--speculative-config)"),
    ("pooling-runner", dict(runner="pooling"), "the 'pooling' runner"),
    ("embedding-convert", dict(convert="embed"), "the 'pooling' runner"),
    ("prompt-embeds", dict(enable_prompt_embeds=True), "prompt embeddings"),
    ("fp8-kv-cache", dict(kv_cache_dtype="fp8"), "--kv-cache-dtype fp8"),
    ("quantization", dict(quantization="fp8", dtype="float16"), "quantization 'fp8'"),
]


@pytest.mark.parametrize("case, args, message", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_feature_is_refused_by_the_engine_config(llama, case, args, message):
    """vLLM's own config path (what `serve` and `LLM(...)` run before any process starts)."""
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(NotImplementedError, match="vllm-mindspore does not support") as error:
        EngineArgs(model=llama, max_model_len=256, kv_cache_memory_bytes=8 << 20,
                   **args).create_engine_config()
    assert message in str(error.value)


# ---- remote code ---------------------------------------------------------------------------------
def test_remote_code_model_is_refused_without_trust_remote_code(llama, tmp_path):
    """A folder whose config needs its own code: refused unless --trust-remote-code, and the
    code never runs (it would write the marker)."""
    from vllm.engine.arg_utils import EngineArgs

    folder = str(tmp_path / "model")
    shutil.copytree(llama, folder)
    marker = str(tmp_path / "REMOTE_CODE_RAN")
    with open(os.path.join(folder, "configuration_bait.py"), "w") as f:
        f.write(f"open({marker!r}, 'w').write('ran')\n"
                "from transformers import LlamaConfig\n"
                "class BaitConfig(LlamaConfig):\n    model_type = 'bait'\n")
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(model_type="bait", auto_map={"AutoConfig": "configuration_bait.BaitConfig"})
    json.dump(config, open(path, "w"))
    with pytest.raises(Exception, match="trust_remote_code|trust-remote-code"):
        EngineArgs(model=folder, max_model_len=256).create_engine_config()
    assert not os.path.exists(marker)


# ---- the matrix in the docs -------------------------------------------------------------------
def test_docs_matrix_names_every_reliability_test_and_only_those():
    """docs/reliability.md records each case of tests/test_reliability_*.py: every test is named
    there, and every test it names exists."""
    import ast
    import glob
    import re

    here = os.path.dirname(os.path.abspath(__file__))
    tests = set()
    for path in glob.glob(os.path.join(here, "test_reliability_*.py")):
        tree = ast.parse(open(path).read())
        tests |= {node.name for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    with open(os.path.join(os.path.dirname(here), "docs", "reliability.md")) as f:
        named = set(re.findall(r"`(?:\w+ )?(test_\w+)", f.read()))
    assert tests - named == set(), "tests missing from docs/reliability.md"
    assert named - tests == set(), "docs/reliability.md names tests that do not exist"
