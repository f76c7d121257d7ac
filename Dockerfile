# vllm-mindspore container image: the stack scripts/install.sh installs (versions: scripts/versions.env)
# on a plain CPU base or on an Ascend base that brings CANN. Build it with `bash build_image.sh`
# (`--ascend` for the Ascend base); docs/docker.md explains the container run.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# PyPI's x86_64 torch is a multi-GB CUDA build: torch comes from this CPU-only index (extra index,
# so the pinned version resolves to its +cpu build). Empty: PyPI only (fine on aarch64).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# g++ builds the plugin's CPU kernels on first use; curl for requests; procps for ps/kill.
# Debian/Ubuntu bases use apt-get, openEuler/CentOS-style Ascend bases dnf or yum. The system
# packages follow the base image (not pinned); DL3032/DL3040: hadolint misses the clean inside if/elif.
# hadolint ignore=DL3008,DL3033,DL3041,DL3032,DL3040
RUN if command -v apt-get >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ curl procps ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    elif command -v dnf >/dev/null; then \
        dnf install -y gcc-c++ curl procps-ng && dnf clean all; \
    elif command -v yum >/dev/null; then \
        yum install -y gcc-c++ curl procps-ng && yum clean all; \
    fi

ENV VLLM_MS_VENV=/opt/vllm-mindspore/venv \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ENV PATH=${VLLM_MS_VENV}/bin:${PATH}

WORKDIR /opt/vllm-mindspore
COPY setup.py README.md Makefile ./
COPY scripts/ scripts/
COPY vllm_mindspore/ vllm_mindspore/
COPY model_backends/ model_backends/
COPY yaml_configs/ yaml_configs/
COPY docs/ docs/

# Exactly what `make install` does on a machine: the same script, the same pins.
RUN if [ -n "${TORCH_INDEX_URL}" ]; then export PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}"; fi \
    && PYTHON="$(command -v python3.11 || command -v python3)" bash scripts/install.sh \
    && python scripts/check_stack.py

CMD ["bash"]
