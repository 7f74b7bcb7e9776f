"""The package has no import cycle: the modules of nano_v1 import each other as a tree, never back.

A cycle makes a module's meaning depend on which of the two was imported first (one of
them runs against the other half-initialised), and it hides a layering a reader should be
able to follow. The graph is read with `ast`, without importing anything: an edge is an
import that runs when its module is imported. Imports inside functions run later and
imports under `if TYPE_CHECKING:` never run, so neither counts; imports in class bodies,
`try` and other module-level blocks do. Importing `a.b.c` also runs the packages `a` and
`a.b`, so those are edges too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.ch00

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "nano_v1"


def module_name(path: Path, root: Path) -> str:
    """`root/a/b.py` -> `a.b` and `root/a/__init__.py` -> `a`, with `root`'s own name first."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_time_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when a module with this body is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # runs when called
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            yield from import_time_imports(node.orelse)
        else:
            for block in nested_bodies(node):
                yield from import_time_imports(block)


def nested_bodies(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists inside a compound statement (class, if, for, while, with, try, match)."""
    bodies = [getattr(node, field) for field in ("body", "orelse", "finalbody") if hasattr(node, field)]
    bodies += [handler.body for handler in getattr(node, "handlers", [])]
    bodies += [case.body for case in getattr(node, "cases", [])]
    return bodies


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> set[str]:
    """Every module this statement runs: the named ones, `from pkg import submodule`, and the packages above.

    The packages above the importer itself are left out: they are already being imported
    (a package runs before its modules), so reaching them again runs nothing. Naming one
    (`from pkg import name` inside `pkg`) still counts.
    """
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = importer.split(".") if is_package else importer.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        named = [base] + [f"{base}.{alias.name}" for alias in node.names]
    own_packages = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    above = {".".join(name.split(".")[:i]) for name in named for i in range(1, name.count(".") + 1)}
    return set(named) | (above - own_packages)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports when it is imported."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = {
            target
            for node in import_time_imports(tree.body)
            for target in imported_modules(node, name, path.name == "__init__.py")
        }
        graph[name] = {target for target in edges if target in paths and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_nano_v1_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR)
    assert "nano_v1.engine.llm_engine" in graph["nano_v1.entrypoints.llm"]  # the edges were read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_config_loads_the_model_registry_lazily():
    """Importing `nano_v1.config` imports no model code: `ModelConfig.registry` loads it on first use."""
    script = (
        "import sys, nano_v1.config\n"
        "print(sorted(m for m in sys.modules if m.startswith('nano_v1.model_executor')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", f"importing nano_v1.config imported {result.stdout.strip()}"


def test_the_checker_finds_a_cycle_and_ignores_what_runs_later(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                "def f():\n    import pkg.a\n",
        "sub/__init__.py": "",
        "sub/c.py": "try:\n    from ..sub import d\nexcept ImportError:\n    pass\n",
        "sub/d.py": "class D:\n    from pkg.sub.c import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.b"] == set()
    assert find_cycle(graph) == ["pkg.sub.c", "pkg.sub.d", "pkg.sub.c"]
    (pkg / "sub/d.py").write_text("def later():\n    from pkg.sub.c import x\n")
    assert find_cycle(import_graph(pkg)) is None
