"""docs/environment-variables.md lists exactly the plugin's env registry (vllm_mindspore/envs.py):
regenerate it with `python scripts/gen_env_docs.py` when a variable changes."""

import os
import subprocess
import sys

from conftest import ROOT


def test_env_reference_matches_the_registry():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_env_docs.py"),
                             "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_variable_and_alias_is_listed():
    from vllm_mindspore import envs

    with open(os.path.join(ROOT, "docs", "environment-variables.md"), encoding="utf-8") as f:
        doc = f.read()
    for name in list(envs.ENVIRONMENT_VARIABLES) + list(envs.ALIASES):
        assert f"`{name}`" in doc, name
