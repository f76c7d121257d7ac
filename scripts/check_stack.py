#!/usr/bin/env python3
"""Check that this interpreter's environment holds the stack scripts/install.sh installs, at the
versions of scripts/versions.env: torch, vLLM (built without device kernels), MindSpore, numpy<2,
Ray, and this package with its vLLM platform entry point. Reads package metadata only (no imports
of the packages themselves), so it takes well under a second.

    python scripts/check_stack.py      # prints the stack; exit 1 and what differs otherwise

The Dockerfile runs it as the image's last build step; tests/test_deploy_image.py runs it too.
"""

import os
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points

VERSIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "versions.env")


def pinned_versions(path: str = VERSIONS_FILE) -> dict[str, str]:
    """NAME=VALUE lines of versions.env (comments and blank lines skipped)."""
    versions = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                versions[name.strip()] = value.strip().strip('"')
    return versions


def installed(dist: str) -> str | None:
    try:
        return distribution(dist).version
    except PackageNotFoundError:
        return None


def check() -> tuple[list[str], list[str]]:
    """-> (lines describing the stack, problems)."""
    pins = pinned_versions()
    lines, problems = [], []
    for dist, key in (("torch", "TORCH_VERSION"), ("vllm", "VLLM_VERSION"),
                      ("mindspore", "MINDSPORE_VERSION")):
        have, want = installed(dist), pins[key]
        lines.append(f"{dist:<15} {have or '(missing)':<14} pinned {want} ({key})")
        if have is None or have.split("+")[0] != want:
            problems.append(f"{dist} {have or 'is not installed'}, scripts/versions.env pins {want}")
    numpy = installed("numpy")
    lines.append(f"{'numpy':<15} {numpy or '(missing)':<14} pinned <2 (MindSpore breaks on numpy 2)")
    if numpy is None or int(numpy.split(".")[0]) >= 2:
        problems.append(f"numpy {numpy or 'is not installed'}, MindSpore needs numpy<2")
    for dist in ("ray", "vllm-mindspore"):
        have = installed(dist)
        lines.append(f"{dist:<15} {have or '(missing)'}")
        if have is None:
            problems.append(f"{dist} is not installed")
    plugins = [ep.value for ep in entry_points(group="vllm.platform_plugins")
               if ep.value.startswith("vllm_mindspore")]
    if not plugins:
        problems.append("no vllm.platform_plugins entry point of vllm_mindspore: reinstall this "
                        "package (pip install -e .)")
    return lines, problems


def main() -> int:
    lines, problems = check()
    print("\n".join(lines))
    for problem in problems:
        print(f"MISMATCH: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
