"""Every rule a task's tests enforce is stated where the student reads it.

A student has the stub, not the tests: the docstring of the function that holds the task
region and the region's hint. Each test that carries a task's marker says in its docstring
which rule it holds, in a paragraph that starts `Rule:` (or `Rules:`), and quotes the rule's
key phrase in «...» (or a name in `...`); every phrase quoted there must appear verbatim,
whitespace aside, in the task's docstring or hint. A test that holds the student to a rule
the stub never states fails here, naming the phrase.

Read with `ast`, like tests/test_layout.py: no test module is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nano_v1.assignments import Task, find_tasks

pytestmark = pytest.mark.ch00

REPO_ROOT = Path(__file__).resolve().parents[1]
TASKS = {task.task_id: task for task in find_tasks()}
TASK_MARK = re.compile(r"^ch\d\d_t\d+$")
RULE_LINE = re.compile(r"^Rules?:", re.MULTILINE)
QUOTED = re.compile(r"«([^»]+)»|`([^`]+)`")


def task_marks(node: ast.AST) -> set[str]:
    """The task ids that `node` names as `pytest.mark.chNN_tK` (decorators, `marks=`, `pytestmark`)."""
    return {
        sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute) and TASK_MARK.match(sub.attr)
    }


def task_tests() -> list[tuple[str, str, set[str], str]]:
    """(file, test name, task ids, docstring) of every test function that carries a task's marker."""
    found = []
    for path in sorted((REPO_ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # Module-level names that hold task marks (`pytestmark`, or a list of `pytest.param`s).
        named = {
            target.id: task_marks(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks = set(named.get("pytestmark", set()))
                for decorator in node.decorator_list:
                    marks |= task_marks(decorator)
                    for name in ast.walk(decorator):
                        if isinstance(name, ast.Name):
                            marks |= named.get(name.id, set())
                if marks:
                    found.append((path.name, node.name, marks, ast.get_docstring(node) or ""))
    return found


def stated(task: Task) -> str:
    """What the stub shows of `task`: the hint and the docstring of the function around the region."""
    tree = ast.parse((REPO_ROOT / task.path).read_text(encoding="utf-8"))
    around = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.lineno < task.begin_line
        and task.begin_line < (node.end_lineno or 0)
    ]
    innermost = max(around, key=lambda node: node.lineno)
    return " ".join(f"{task.hint} {ast.get_docstring(innermost) or ''}".split())


TESTS = task_tests()


def test_every_task_has_tests_found_here():
    """The check below sees every task's tests: one that found none would pass vacuously."""
    found = set().union(*(marks for _, _, marks, _ in TESTS))
    assert found == set(TASKS), f"tasks whose tests this check cannot find: {sorted(set(TASKS) - found)}"


@pytest.mark.parametrize(
    "marks, doc", [(m, d) for _, _, m, d in TESTS], ids=[f"{f}::{n}" for f, n, _, _ in TESTS]
)
def test_each_task_test_states_a_rule_its_stub_states(marks, doc, request):
    where = request.node.callspec.id
    rule = RULE_LINE.search(doc)
    assert rule, (
        f"{where} tests {', '.join(sorted(marks))}: its docstring needs a line 'Rule: ...' naming its rule"
    )
    paragraph = doc[rule.start() :].split("\n\n")[0]
    phrases = [" ".join((a or b).split()) for a, b in QUOTED.findall(paragraph)]
    assert phrases, f"{where}: its Rule line must quote the rule's key phrase in «...» (or a name in `...`)"
    texts = {task_id: stated(TASKS[task_id]) for task_id in sorted(marks)}
    for phrase in phrases:
        assert any(phrase in text for text in texts.values()), (
            f"{where} holds {'/'.join(texts)} to «{phrase}», which no hint or docstring of the function around "
            f"the region states ({', '.join(TASKS[t].path for t in texts)})"
        )
