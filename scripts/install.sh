#!/usr/bin/env bash
# Create (or reuse) the project's Python environment with the exact stack from PLATFORM_FACTS.md.
# Idempotent: when everything is present it only checks versions and the editable install (seconds).
#
#   VLLM_MS_VENV   where the environment lives (default: ~/.cache/vllm-mindspore/venv, shared by checkouts)
#   PYTHON         interpreter used to create it (default: python3.11, else python3)
#
#   --with-mindformers   also install the optional MindSpore Transformers package (make install-mindformers)
set -euo pipefail

WITH_MINDFORMERS=0
for arg in "$@"; do
    case "$arg" in
        --with-mindformers) WITH_MINDFORMERS=1 ;;
        *) echo "usage: scripts/install.sh [--with-mindformers]" >&2; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_MS_VENV:-$HOME/.cache/vllm-mindspore/venv}"
PY_BOOT="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# TORCH_VERSION, VLLM_VERSION, MINDSPORE_VERSION (and the optional MINDFORMERS_VERSION): one source
# of truth, shared with the Dockerfile.
. "$ROOT/scripts/versions.env"

log() { printf '[install] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PY_BOOT"
    mkdir -p "$(dirname "$VENV")"
    "$PY_BOOT" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check)

have() {  # have DIST VERSION -> exit 0 when DIST==VERSION (ignoring local labels) is installed
    "$PY" - "$1" "$2" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    v = version(sys.argv[1]).split("+")[0]
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v == sys.argv[2] else 1)
PYEOF
}

# 1. torch CPU from the local wheel (an unpinned torch would pull a CUDA build).
if ! have torch "$TORCH_VERSION"; then
    log "installing torch $TORCH_VERSION (CPU)"
    "${PIP[@]}" "torch==$TORCH_VERSION"
fi

# 2. vLLM from its sdist without device kernels, as hardware plugins install it.
if ! have vllm "$VLLM_VERSION"; then
    log "building vllm $VLLM_VERSION from sdist (VLLM_TARGET_DEVICE=empty)"
    "${PIP[@]}" "cmake>=3.26.1" ninja "packaging>=24.2" "setuptools>=77.0.3,<81" \
        "setuptools-scm>=8" "setuptools-rust>=1.9" wheel jinja2 "torch==$TORCH_VERSION"
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="$VLLM_VERSION" \
        "${PIP[@]}" --no-build-isolation --no-binary vllm "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi

# 3. MindSpore with numpy<2 in the same call (MindSpore 2.10 breaks on numpy 2), Ray, test/runtime tools.
if ! have mindspore "$MINDSPORE_VERSION" || ! "$PY" -c 'import numpy, sys; sys.exit(numpy.__version__ >= "2")' \
        || ! "$PY" -c 'import ray, yaml, safetensors, pytest, openai, transformers' 2>/dev/null; then
    log "installing mindspore $MINDSPORE_VERSION, numpy<2, ray, test tools"
    "${PIP[@]}" "mindspore==$MINDSPORE_VERSION" "ray[default]" pyyaml safetensors pytest pytest-timeout \
        openai tokenizers "torch==$TORCH_VERSION" "numpy<2"
fi

# 4. This package, editable, pointing at this checkout (the venv may be shared by several checkouts).
if ! "$PY" - "$ROOT" <<'PYEOF' 2>/dev/null
import json, sys
from importlib.metadata import distribution
d = distribution("vllm-mindspore")
url = json.loads(d.read_text("direct_url.json") or "{}").get("url", "")
sys.exit(0 if url == "file://" + sys.argv[1] else 1)
PYEOF
then
    log "installing vllm-mindspore (editable) from $ROOT"
    "${PIP[@]}" -q --no-deps --no-build-isolation -e "$ROOT"
fi
# 5. Optional: mindformers, without its declared dependencies: it pins transformers 4.x (vLLM needs
# 5.x; mindformers' inference path does not import it) and training-only packages, whose imports
# are stubbed (vllm_mindspore/patches/mindformers.py). `deprecated` is imported for real.
if [ "$WITH_MINDFORMERS" = 1 ]; then
    if ! have mindformers "$MINDFORMERS_VERSION"; then
        log "installing mindformers $MINDFORMERS_VERSION (--no-deps)"
        "${PIP[@]}" --no-deps "mindformers==$MINDFORMERS_VERSION"
    fi
    if ! "$PY" -c 'import deprecated' 2>/dev/null; then
        "${PIP[@]}" "deprecated>=1.2.0"
    fi
fi
log "environment ready: $VENV"
