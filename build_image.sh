#!/usr/bin/env bash
# Build the vllm-mindspore container image (Dockerfile next to this script) and tag it
# vllm_ms_<YYYYMMDD>:latest, as the deployment guide does:
#
#   bash build_image.sh                 # plain CPU base (python:3.11-slim-bookworm)
#   bash build_image.sh --ascend        # Ascend base with CANN; pick its tag with --base
#   bash build_image.sh --dry-run       # print the exact commands, run nothing
#
# Options:
#   --cpu | --ascend        base image family (default --cpu)
#   --base IMAGE            base image (default: see CPU_BASE / ASCEND_BASE below)
#   --tag NAME:TAG          image name (default vllm_ms_<today>:latest)
#   --torch-index URL       extra pip index torch comes from (default PyTorch's CPU index; "" for PyPI)
#   --engine CMD            container engine command (default docker)
#   --dry-run               print the commands instead of running them
#   -- ARGS...              passed to `<engine> build` unchanged (e.g. -- --network=host --platform linux/arm64)
#
# Proxy variables set in the environment (http_proxy, https_proxy, no_proxy, upper case too) are
# passed into the build by name. The versions installed are those of scripts/versions.env, through
# scripts/install.sh: the same stack as `make install`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/versions.env
. "$ROOT/scripts/versions.env"

CPU_BASE="python:3.11-slim-bookworm"
# CANN's own image (Ubuntu 22.04, Python 3.11). Use the CANN version MindSpore ${MINDSPORE_VERSION}'s
# installation guide pairs with, and the same one on every node.
ASCEND_BASE="quay.io/ascend/cann:9.0.0-910b-ubuntu22.04-py3.11"

device=cpu
base=""
tag="vllm_ms_$(date +%Y%m%d):latest"
torch_index="https://download.pytorch.org/whl/cpu"
engine="docker"
dry_run=0
extra=()

die() { printf 'build_image.sh: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) device=cpu ;;
        --ascend) device=ascend ;;
        --base) [ $# -ge 2 ] || die "--base needs an image"; base="$2"; shift ;;
        --tag) [ $# -ge 2 ] || die "--tag needs NAME:TAG"; tag="$2"; shift ;;
        --torch-index) [ $# -ge 2 ] || die "--torch-index needs a URL"; torch_index="$2"; shift ;;
        --engine) [ $# -ge 2 ] || die "--engine needs a command"; engine="$2"; shift ;;
        --dry-run) dry_run=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        --) shift; extra=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done
if [ -z "$base" ]; then
    if [ "$device" = ascend ]; then base="$ASCEND_BASE"; else base="$CPU_BASE"; fi
fi

build=("$engine" build --file "$ROOT/Dockerfile" --tag "$tag"
       --build-arg "BASE_IMAGE=$base" --build-arg "TORCH_INDEX_URL=$torch_index")
for name in http_proxy https_proxy no_proxy ftp_proxy all_proxy \
            HTTP_PROXY HTTPS_PROXY NO_PROXY FTP_PROXY ALL_PROXY; do
    # By name only: the engine reads the value from this environment (no credentials printed).
    if [ -n "${!name:-}" ]; then build+=(--build-arg "$name"); fi
done
build+=("${extra[@]}" "$ROOT")
inspect=("$engine" image inspect --format '{{.Id}}' "$tag")

summary() {
    echo "vllm-mindspore image $tag ($device base $base): torch $TORCH_VERSION (CPU build)," \
         "vLLM $VLLM_VERSION (sdist, VLLM_TARGET_DEVICE=empty), MindSpore $MINDSPORE_VERSION, numpy<2, Ray" \
         "(scripts/versions.env)"
}
show() {  # one shell-quoted command line
    local out=() arg
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./:=@,+-]+$ ]]; then out+=("$arg"); else out+=("'${arg//\'/\'\\\'\'}'"); fi
    done
    echo "${out[*]}"
}

if [ "$dry_run" = 1 ]; then
    summary
    show "${build[@]}"
    show "${inspect[@]}"
    exit 0
fi

command -v "$engine" >/dev/null 2>&1 \
    || die "no container engine: \`$engine\` is not installed. Install Docker (or pass --engine podman), or see the commands with --dry-run."
if ! reason="$("$engine" info 2>&1 >/dev/null)"; then
    reason="$(printf '%s\n' "$reason" | grep -v '^\s*$' | tail -n 1)"
    die "no reachable container engine: \`$engine info\` failed (${reason:-no output}). Start the daemon (or point DOCKER_HOST at one), or see the commands with --dry-run."
fi

summary
"${build[@]}"
id="$("${inspect[@]}")"
id="${id#sha256:}"
echo "Successfully built ${id:0:12}"
echo "Successfully tagged $tag"
