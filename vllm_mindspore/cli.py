"""`vllm-mindspore`: vLLM's own command line (serve, chat, complete, bench, ...) with this
plugin's environment defaults applied first."""

import os
import sys


def set_env_defaults() -> None:
    # MindSpore hangs in a child forked after it ran an op; MindSpore's glog is noisy at WARNING.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("GLOG_v", "3")


def main() -> None:
    set_env_defaults()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm-mindspore"
    vllm_main()


if __name__ == "__main__":
    main()
