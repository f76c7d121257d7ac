"""The docs' shell commands, extracted from the Markdown, and the rules that keep them honest.

Every ```bash / ```sh / ```shell / ```console block in docs/ (docs/benchmarks.md excepted, which has
its own owner) is preceded by a marker line:

    <!-- run: ID -->                 run on CPU by the test module RUN_BY[ID] names
    <!-- no-run: why not -->         cannot run here (needs NPUs, a container engine, the network)

This module checks the markers (every block has one, IDs are unique and each is claimed by a test that
mentions it, the Chinese pages' blocks are the English ones verbatim) and the docs' relative links.
The helpers at the bottom run blocks (from a scratch folder laid out like a checkout), for the modules
that run them: test_docs_commands.py, test_deploy_ray.py, test_deploy_data_parallel.py.
"""

import contextlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from conftest import ROOT, Server, free_port

DOCS = os.path.join(ROOT, "docs")
NOT_OURS = {os.path.join(DOCS, "benchmarks.md")}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"<!--\s*(run|no-run):\s*(.*?)\s*-->")

# Which test module runs each block (the module must mention the ID in quotes).
RUN_BY = {
    "install": "test_docs_commands",
    "activate": "test_docs_commands",
    "models": "test_docs_commands",
    "demo-model": "test_docs_commands",
    "backend-models": "test_docs_commands",
    "build-dry-run": "test_docs_commands",
    "quantize": "test_docs_commands",
    "serve": "test_deploy_ray",
    "curl-completions": "test_deploy_ray",
    "curl-chat": "test_deploy_ray",
    "ray-env-file": "test_deploy_ray",
    "ray-head": "test_deploy_ray",
    "ray-status": "test_deploy_ray",
    "ray-serve": "test_deploy_ray",
    "ray-curl": "test_deploy_ray",
    "ray-stop": "test_deploy_ray",
    "dp-model": "test_deploy_data_parallel",
    "dp-head": "test_deploy_data_parallel",
    "dp-secondary": "test_deploy_data_parallel",
    "dp-curl": "test_deploy_data_parallel",
}


@dataclass
class Block:
    path: str
    line: int
    lang: str
    kind: str | None  # "run", "no-run" or None (unmarked)
    label: str  # the ID (run) or the reason (no-run)
    text: str

    @property
    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def doc_files() -> list[str]:
    found = []
    for folder, _, files in os.walk(DOCS):
        found += [os.path.join(folder, f) for f in files if f.endswith(".md")]
    return sorted(f for f in found if f not in NOT_OURS)


def parse_blocks(path: str) -> list[Block]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        lang, start = fence.group(1).lower(), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.search(lines[start - 1]) if start > 0 else None
        blocks.append(Block(path, start + 1, lang, marker.group(1) if marker else None,
                            marker.group(2) if marker else "", "\n".join(lines[start + 1:end])))
        i = end + 1
    return blocks


def shell_blocks() -> list[Block]:
    return [b for path in doc_files() for b in parse_blocks(path) if b.lang in SHELL_LANGS]


def is_chinese(block: Block) -> bool:
    return os.path.relpath(block.path, DOCS).startswith("zh" + os.sep)


def doc_block(block_id: str) -> str:
    """The text of the English block marked `<!-- run: block_id -->`."""
    found = [b for b in shell_blocks() if b.kind == "run" and b.label == block_id
             and not is_chinese(b)]
    assert len(found) == 1, f"expected one English block {block_id!r}, found {len(found)}"
    return found[0].text


# ------------------------------------------------------------------------------------------
# the rules


def test_every_shell_block_is_marked():
    unmarked = [b.where for b in shell_blocks() if b.kind is None]
    assert not unmarked, ("shell blocks without a <!-- run: ID --> or <!-- no-run: reason --> "
                          f"marker on the line above: {unmarked}")
    assert all(b.label for b in shell_blocks()), "a marker without an ID or reason"


def test_run_ids_are_unique_and_each_is_run_by_a_test():
    english = [b for b in shell_blocks() if b.kind == "run" and not is_chinese(b)]
    ids = [b.label for b in english]
    assert len(ids) == len(set(ids)), f"duplicate run IDs: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert set(ids) == set(RUN_BY), (f"not claimed by a test: {sorted(set(ids) - set(RUN_BY))}; "
                                     f"claimed but not in the docs: {sorted(set(RUN_BY) - set(ids))}")
    for block_id, module in RUN_BY.items():
        with open(os.path.join(ROOT, "tests", module + ".py"), encoding="utf-8") as f:
            assert f'"{block_id}"' in f.read(), f"{module}.py does not run block {block_id!r}"


def test_chinese_blocks_are_the_english_commands():
    english = {b.label: b.text for b in shell_blocks() if b.kind == "run" and not is_chinese(b)}
    chinese = [b for b in shell_blocks() if b.kind == "run" and is_chinese(b)]
    assert chinese, "docs/zh has no runnable block"
    for block in chinese:
        assert block.label in english, f"{block.where}: run ID {block.label!r} is not in the English docs"
        assert block.text == english[block.label], (
            f"{block.where}: block {block.label!r} differs from the English one (commands must be "
            "identical; translate the prose around them)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- \u4e00-\u9fff]", "", text)
    return text.replace(" ", "-")


def test_relative_links_resolve():
    broken = []
    pages = doc_files() + [os.path.join(ROOT, "README.md")]
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
            elif anchor and path.endswith(".md"):
                with open(path, encoding="utf-8") as f:
                    headings = re.findall(r"^#+\s+(.*)$", f.read(), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, broken


def _committed(paths: list[str]) -> list[str]:
    """`paths` that git tracks (all of them outside a git checkout): a page someone is still
    writing need not be linked yet."""
    result = subprocess.run(["git", "ls-files", "--", "docs"], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode != 0:
        return paths
    tracked = {os.path.join(ROOT, line) for line in result.stdout.split()}
    return [p for p in paths if p in tracked]


def test_readme_links_every_doc():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    missing = [os.path.relpath(p, ROOT) for p in _committed(doc_files() + sorted(NOT_OURS))
               if os.path.relpath(p, ROOT) not in readme]
    assert not missing, f"README.md does not link {missing} (its Documentation section)"


# ------------------------------------------------------------------------------------------
# running blocks


def block_env(extra: dict | None = None) -> dict:
    """The environment blocks run in: this interpreter's venv first on PATH, as after
    `source .../activate`."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "VIRTUAL_ENV": os.path.dirname(bin_dir)}
    return {**env, **(extra or {})}


def run_block(text: str, cwd: str, env: dict | None = None, timeout: float = 300,
              expect_rc: int | None = 0) -> subprocess.CompletedProcess:
    """Run a block with bash -e (a failing command fails the block); -> the completed process."""
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=cwd,
                            env=env or block_env(), capture_output=True, text=True, timeout=timeout)
    if expect_rc is not None:
        assert result.returncode == expect_rc, (
            f"block exited {result.returncode}, expected {expect_rc}:\n{text}\n--- stdout\n"
            f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
    return result


def replace_checked(text: str, old: str, new: str) -> str:
    assert old in text, f"{old!r} is no longer in the block:\n{text}"
    return text.replace(old, new)


def joined_lines(text: str) -> str:
    """Backslash-continued lines joined (so a command is one line)."""
    return re.sub(r"\\\n\s*", "", text)


def with_serve_args(text: str, *args: str) -> str:
    """Append `args` to every `vllm-mindspore serve` command of the block."""
    lines = joined_lines(text).split("\n")
    serving = [i for i, line in enumerate(lines) if "vllm-mindspore serve" in line]
    assert serving, f"no vllm-mindspore serve in the block:\n{text}"
    for i in serving:
        lines[i] += " " + " ".join(args)
    return "\n".join(lines)


class BlockServer(Server):
    """A doc block that starts `vllm-mindspore serve`, run by bash in its own session on a free
    port; Server's readiness, logs and teardown (the whole process group) apply."""

    def __init__(self, text: str, model: str, cwd: str, log_path: str, env: dict,
                 extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.model = model
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = with_serve_args(text, "--host", "127.0.0.1", "--port", str(self.port),
                                       *extra_args)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(["bash", "-e", "-c", self.command], cwd=cwd, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def curl(self, text: str, cwd: str) -> str:
        """Run a curl block of the docs against this server -> its output."""
        block = replace_checked(text, "localhost:8000", f"127.0.0.1:{self.port}")
        return run_block(block, cwd, timeout=120).stdout


def make_workdir(path: str) -> str:
    """A scratch folder laid out like the top of a checkout (scripts/ and yaml_configs/ linked),
    so the docs' relative paths work and the blocks' files land outside the repository. Never
    run scripts/install.sh from it: it would repoint the shared editable install here."""
    os.makedirs(path, exist_ok=True)
    for name in ("scripts", "yaml_configs"):
        with contextlib.suppress(FileExistsError):
            os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    return path
