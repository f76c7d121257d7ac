"""The DP / EP rehearsal of docs/multi-node.md (section 9), run from the docs' blocks: build the tiny
DeepSeek-R1-shaped model from the small YAML, start the head and the `--headless` secondary with the
MindFormers backend and expert parallel, ask the head with the docs' curl. Both engines form one
expert-parallel world and both run steps. (The tokens of this layout against expert parallel off are
tests/test_expert_parallel.py's business.)"""

import json

from conftest import TOKEN_BUDGET, free_port
from test_docs_blocks import BlockServer, block_env, doc_block, make_workdir, replace_checked, run_block

# Bounds for a shared 2-core machine, added to the docs' commands: a small KV cache, fewer graph
# sizes to compile (TOKEN_BUDGET: 7 decoder graphs instead of 12), and on the head one API
# server (vLLM starts one per data-parallel engine by default).
SERVE_EXTRA = ("--kv-cache-memory-bytes", str(8 << 20), "--max-num-seqs", "4",
               "--max-num-batched-tokens", str(TOKEN_BUDGET))
HEAD_EXTRA = ("--api-server-count", "1")


def test_dp2_ep_headless_rehearsal(tmp_path):
    work = make_workdir(str(tmp_path / "work"))
    run_block(doc_block("dp-model"), work, timeout=300)
    env = block_env({"VLLM_MS_LOG_STEPS": "1"})
    rpc_port = str(free_port())
    head_block = replace_checked(doc_block("dp-head"), "12370", rpc_port)
    secondary_block = replace_checked(doc_block("dp-secondary"), "12370", rpc_port)
    head = BlockServer(head_block, "tiny_deepseek", work, str(tmp_path / "head.log"), env,
                       SERVE_EXTRA + HEAD_EXTRA)
    secondary = BlockServer(secondary_block, "tiny_deepseek", work, str(tmp_path / "secondary.log"),
                            env, SERVE_EXTRA)
    try:
        head.wait_ready(timeout=400)  # two engines compiling on 2 cores
        answer = json.loads(head.curl(doc_block("dp-curl"), work))
        assert answer["model"] == "tiny_deepseek" and answer["usage"]["completion_tokens"] > 0
        assert secondary.proc.poll() is None, secondary.log_tail()
    finally:
        head.stop()
        secondary.stop()
    for server in (head, secondary):
        log = server.log_tail(100000)
        assert "Model backend: MindFormers" in log
        assert "MindSpore communication up: rank" in log and "of 2" in log, log[-3000:]
    # The request was served by one of the two engines.
    assert "step:" in head.log_tail(100000) + secondary.log_tail(100000)
