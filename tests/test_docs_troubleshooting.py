"""docs/troubleshooting.md covers each error the plugin raises, and quotes none it no longer has.

An error is any call of an `...Error`/`...Exception` class or `sys.exit` with a message in
vllm_mindspore/ or model_backends/; its key is the longest literal part of the message. The page must
quote the key, or at least QUOTE characters of it in a row (whitespace-insensitive). Each `#### \\`quote\\`` heading of the page's plugin section
must still be literal text of the plugin's sources."""

import ast
import os
import re

from conftest import ROOT

PAGE = os.path.join(ROOT, "docs", "troubleshooting.md")
SOURCES = ("vllm_mindspore", "model_backends")
# Programming errors, not something a user can meet or fix.
INTERNAL = {
    "has no attribute",  # envs.__getattr__: Python's attribute protocol
    "The fused silu(gate) * up projection has no bias.",
}


def _fragments(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _fragments(node.left) + _fragments(node.right)
    return []


def _is_error_call(node) -> bool:
    func = node.func
    name = getattr(func, "id", None) or getattr(func, "attr", "")
    if name == "exit" and getattr(getattr(func, "value", None), "id", None) == "sys":
        return True
    return name.endswith(("Error", "Exception"))


def _sources():
    for top in SOURCES:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        yield path, ast.parse(f.read())


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _key(fragment: str) -> str:
    return _norm(fragment).lstrip(" :;,.)'\"").rstrip(" :;,('\"").strip()


def error_keys() -> list[tuple[str, str]]:
    """(file:line, key) of every error message in the plugin."""
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _is_error_call(node):
                keys = [_key(f) for f in _fragments(node.args[0])]
                keys = [k for k in keys if len(k) >= 6]
                if keys:
                    found.append((f"{os.path.relpath(path, ROOT)}:{node.lineno}", max(keys, key=len)))
    return found


QUOTE = 30


def quoted(key: str, page: str) -> bool:
    if len(key) <= QUOTE:
        return key in page
    return any(key[i:i + QUOTE] in page for i in range(len(key) - QUOTE + 1))


def _page() -> str:
    with open(PAGE, encoding="utf-8") as f:
        return f.read()


def test_every_error_the_plugin_raises_is_documented():
    page = _norm(_page())
    missing = [f"{where}: {key!r}" for where, key in error_keys()
               if key not in INTERNAL and not quoted(key, page)]
    assert not missing, ("errors without an entry in docs/troubleshooting.md (quote the text in "
                         "an entry with its cause and fix):\n" + "\n".join(missing))
    assert len(error_keys()) > 30  # the scan finds the plugin's errors


def test_documented_errors_still_exist():
    literals = []
    for _, tree in _sources():
        for node in ast.walk(tree):
            literals += [_norm(f) for f in _fragments(node)] if isinstance(
                node, (ast.Constant, ast.JoinedStr)) else []
    plugin_section = _page().split("## Errors raised by vllm-mindspore", 1)[1].split("\n## ", 1)[0]
    stale = [quote for quote in re.findall(r"^#### `(.+)`\s*$", plugin_section, flags=re.M)
             if not any(_key(quote) in literal for literal in literals)]
    assert not stale, f"entries quoting messages the plugin no longer has: {stale}"
