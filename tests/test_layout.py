"""The tests' own layout: what they share is in tests/helpers/, and no test module imports another.

A test module that imports another runs that module's import-time code (its fixtures,
its `pytestmark`, its skips) and hides where a shared fake lives. Read with `ast`,
imports inside functions included: those run too, only later.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.ch00

TESTS_DIR = Path(__file__).resolve().parent
TEST_MODULES = sorted(TESTS_DIR.glob("test_*.py"))
HELPER_MODULES = sorted((TESTS_DIR / "helpers").glob("*.py"))


def imported_roots(tree: ast.AST) -> set[str]:
    """The first component of every module an import statement anywhere in `tree` names."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_test_modules_and_conftest_sit_at_the_top():
    loose = [
        path.name
        for path in TESTS_DIR.glob("*.py")
        if path.name != "conftest.py" and not path.name.startswith("test_")
    ]
    assert not loose, f"{loose}: shared code and scripts belong in tests/helpers/"


@pytest.mark.parametrize(
    "path", TEST_MODULES + HELPER_MODULES, ids=lambda p: p.relative_to(TESTS_DIR).as_posix()
)
def test_no_module_imports_a_test_module_or_conftest(path):
    forbidden = {p.stem for p in TEST_MODULES} | {"conftest"}
    imported = imported_roots(ast.parse(path.read_text(encoding="utf-8"))) & forbidden
    assert not imported, (
        f"{path.name} imports {sorted(imported)}: move what it needs into tests/helpers/, import it from there"
    )


def test_imported_roots_sees_imports_inside_functions():
    tree = ast.parse("import a.b\nfrom c import d\nfrom . import e\ndef f():\n    from test_x import y\n")
    assert imported_roots(tree) == {"a", "c", "test_x"}
