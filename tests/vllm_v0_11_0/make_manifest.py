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

The same script records a later release's files alone, for the chapters' "In vLLM today"
sections, which name where things live now (tests/vllm_v0_33_0/manifest.json):

    pip download --no-deps --no-binary :all: --no-clean vllm==0.33.0 -d /tmp/sdist
    python tests/vllm_v0_11_0/make_manifest.py --version 0.33.0 --paths-only /tmp/pip-download-*/vllm_*/
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

VERSION = "0.11.0"
TESTS = Path(__file__).resolve().parents[1]


def manifest_path(version: str) -> Path:
    """tests/vllm_v0_11_0/manifest.json for 0.11.0, and so on."""
    return TESTS / f"vllm_v{version.replace('.', '_')}" / "manifest.json"


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


def main(tree: Path, version: str = VERSION, paths_only: bool = False) -> None:
    found = read_version(tree)
    if found != version:
        raise SystemExit(f"{tree} is vLLM {found}; expected {version}")
    files = sorted(
        path.relative_to(tree).as_posix()
        for path in (tree / "vllm").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )
    # One file per line, so that a regenerated manifest diffs by file.
    lines = [f'{{"vllm_version": {json.dumps(version)},', '"files": [']
    lines += [json.dumps(path) + ("," if i < len(files) - 1 else "") for i, path in enumerate(files)]
    if paths_only:
        lines.append("]}")
        symbols = {}
    else:
        symbols = {
            path: module_symbols((tree / path).read_text(encoding="utf-8"))
            for path in files
            if path.endswith(".py")
        }
        lines += ["],", '"symbols": {']
        items = list(symbols.items())
        lines += [
            f"{json.dumps(path)}: {json.dumps(names)}" + ("," if i < len(items) - 1 else "")
            for i, (path, names) in enumerate(items)
        ]
        lines.append("}}")
    out = manifest_path(version)
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(files)} files, {sum(map(len, symbols.values()))} symbols")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="the unpacked source archive (holding PKG-INFO and vllm/)")
    parser.add_argument(
        "--version", default=VERSION, help=f"the release the tree must be (default {VERSION})"
    )
    parser.add_argument("--paths-only", action="store_true", help="record the files, not their symbols")
    args = parser.parse_args()
    main(args.tree, args.version, args.paths_only)
