"""Write manifest.json: every file of vLLM v0.11.0's `vllm/` package, and what each .py defines.

Why it exists: nano_v1 cites vLLM by path and symbol ("Mirrors vllm/v1/core/block_pool.py",
`vllm/_custom_ops.py::reshape_and_cache_flash`). tests/test_vllm_manifest.py checks every
such citation against this manifest, so a citation of a file that v0.11.0 does not have
(one renamed later, say) fails in CI without vLLM installed.

Run it on the unpacked v0.11.0 source archive (the PyPI sdist, whose root holds PKG-INFO
and `vllm/`). pip unpacks it and then fails to build it, which is all we need:

    pip download --no-deps --no-binary :all: --no-clean vllm==0.11.0 -d /tmp/sdist
    python tests/vllm_v0_11_0/make_manifest.py /tmp/pip-download-*/vllm_*/

It imports nothing from the tree: symbols come from `ast`. For every .py file the manifest
lists the names its module body defines (functions, classes, assigned names, including
those under a top-level `if` or `try`) and, for each class, `Class.member` for the
functions and assigned names of the class body. Imported names are not listed: a citation
names the file that defines a symbol, not one that re-exports it.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

VERSION = "0.11.0"
OUT = Path(__file__).with_name("manifest.json")


def assigned_names(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]


def body_statements(body: list[ast.stmt]):
    """The statements of a body, looking through `if`/`try` blocks (version and import guards)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from body_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from body_statements(
                node.body
                + [s for handler in node.handlers for s in handler.body]
                + node.orelse
                + node.finalbody
            )
        else:
            yield node


def defined_names(body: list[ast.stmt]) -> list[str]:
    names = []
    for node in body_statements(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.extend(assigned_names(node))
    return names


def module_symbols(source: str) -> list[str]:
    tree = ast.parse(source)
    symbols = set(defined_names(tree.body))
    for node in body_statements(tree.body):
        if isinstance(node, ast.ClassDef):
            symbols.update(f"{node.name}.{member}" for member in defined_names(node.body))
    return sorted(symbols)


def read_version(tree: Path) -> str:
    for line in (tree / "PKG-INFO").read_text().splitlines():
        if line.startswith("Version: "):
            return line.removeprefix("Version: ").strip()
    raise SystemExit(f"{tree}/PKG-INFO names no version")


def main(tree: Path) -> None:
    version = read_version(tree)
    if version != VERSION:
        raise SystemExit(f"{tree} is vLLM {version}; the manifest pins {VERSION}")
    files = sorted(
        path.relative_to(tree).as_posix()
        for path in (tree / "vllm").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )
    symbols = {
        path: module_symbols((tree / path).read_text(encoding="utf-8"))
        for path in files
        if path.endswith(".py")
    }
    # One file per line, so that a regenerated manifest diffs by file.
    lines = [f'{{"vllm_version": {json.dumps(version)},', '"files": [']
    lines += [json.dumps(path) + ("," if i < len(files) - 1 else "") for i, path in enumerate(files)]
    lines += ["],", '"symbols": {']
    items = list(symbols.items())
    lines += [
        f"{json.dumps(path)}: {json.dumps(names)}" + ("," if i < len(items) - 1 else "")
        for i, (path, names) in enumerate(items)
    ]
    lines.append("}}")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"{OUT}: {len(files)} files, {sum(map(len, symbols.values()))} symbols")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} PATH_TO_VLLM_{VERSION.replace('.', '_')}_SOURCE_TREE")
    main(Path(sys.argv[1]))
