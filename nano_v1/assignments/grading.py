"""Grade a student copy: run the chapters' tests and score each task.

Course machinery (the tasks of chapters 01-14); vLLM has no counterpart.

Why it exists: `pytest -m ch04` says which tests fail, not which task is done or what is
wrong with it. A task with n tests earns passed/n points, and `all_passed` says when it
is done. Each failing test is reported by the one line its assertion message gives
("block 1's hash must chain block 0's"), and a task still raising its stub's
NotImplementedError is reported once, with its hint. The chapter's other tests are
reported beside the tasks (a broken neighbour shows up there) but carry no points.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nano_v1.assignments import Task


@dataclass(slots=True)
class Failure:
    """One test of a task that did not pass, and the one line saying why."""

    test: str
    message: str


@dataclass(slots=True)
class TaskScore:
    task_id: str
    hint: str
    path: str
    passed: int = 0
    total: int = 0
    failures: list[Failure] = field(default_factory=list)

    @property
    def points(self) -> float:
        """Partial credit: the fraction of the task's tests that passed."""
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def is_stub(self) -> bool:
        """True while a test still hits this task's own NotImplementedError."""
        stub = f"NotImplementedError: {self.task_id}:"
        return any(failure.message.startswith(stub) for failure in self.failures)


def marker_expression(tasks: list[Task]) -> str:
    """`-m` expression selecting the tasks' chapters and the tasks themselves."""
    chapters = sorted({t.chapter for t in tasks})
    return " or ".join(chapters + [t.task_id for t in tasks])


def run_pytest(root: Path, tasks: list[Task], extra_args: list[str]) -> dict:
    """Run `pytest -m <chapters and tasks>` in `root` in a fresh interpreter; return the plugin's report."""
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pytest",
            "-p", "nano_v1.assignments.pytest_plugin", "--task-report", str(report_path),
            "-m", marker_expression(tasks), *extra_args,
        ]  # fmt: skip
        # The copy's own package must be the one imported, not an installed reference.
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        )
        returncode = subprocess.run(command, cwd=root, env=env, check=False).returncode
        if not report_path.exists():
            return {"nano_v1": None, "exitstatus": returncode, "tests": {}}
        return json.loads(report_path.read_text(encoding="utf-8"))


def score(tasks: list[Task], report: dict) -> tuple[list[TaskScore], dict[str, tuple[int, int]]]:
    """Per-task scores, and (passed, total) of each chapter's tests that belong to no task.

    Skipped tests (e.g. GPU-only ones) count in neither passed nor total.
    """
    scores = {t.task_id: TaskScore(t.task_id, t.hint, t.path) for t in tasks}
    chapters = {t.chapter for t in tasks}
    others = {chapter: [0, 0] for chapter in sorted(chapters)}
    for nodeid, test in report["tests"].items():
        if test["outcome"] == "skipped":
            continue
        passed = test["outcome"] == "passed"
        task_ids = [name for name in test["markers"] if name in scores]
        for task_id in task_ids:
            task_score = scores[task_id]
            task_score.total += 1
            task_score.passed += passed
            if not passed:
                task_score.failures.append(Failure(nodeid, test["message"] or test["outcome"]))
        if not task_ids:
            for chapter in chapters.intersection(test["markers"]):
                others[chapter][0] += passed
                others[chapter][1] += 1
    return list(scores.values()), {chapter: (p, t) for chapter, (p, t) in others.items()}


def _status(task_score: TaskScore) -> str:
    if task_score.all_passed:
        return "done"
    if task_score.is_stub:
        return "to do"
    return f"{len(task_score.failures)} failing" if task_score.total else "no tests ran"


def format_table(task_scores: list[TaskScore], others: dict[str, tuple[int, int]]) -> str:
    """The score table, then what is wrong with each task that is not done."""
    rows = [("task", "tests passed", "points", "status", "hint")]
    rows += [(s.task_id, f"{s.passed}/{s.total}", f"{s.points:.2f}", _status(s), s.hint) for s in task_scores]
    rows += [
        (f"{chapter} other", f"{p}/{t}", "-", "", "the chapter's tests outside any task")
        for chapter, (p, t) in others.items()
    ]
    total = sum(s.points for s in task_scores)
    rows.append(("total", "", f"{total:.2f}/{len(task_scores)}", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4] for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    for s in task_scores:
        lines += _explain(s)
    return "\n".join(line.rstrip() for line in lines)


def _explain(task_score: TaskScore) -> list[str]:
    """What is wrong with a task that is not done: its hint while it is a stub, else
    each failing test with its message."""
    if task_score.all_passed or not task_score.failures:
        return []
    if task_score.is_stub:
        return ["", f"{task_score.task_id}: not implemented yet (NotImplementedError): {task_score.hint}"]
    lines = ["", f"{task_score.task_id}: {len(task_score.failures)} of {task_score.total} tests fail"]
    return lines + [f"  {failure.test}: {failure.message}" for failure in task_score.failures]


def to_json(task_scores: list[TaskScore], others: dict[str, tuple[int, int]], report: dict) -> dict:
    return {
        "tasks": [
            dict(asdict(s), points=s.points, max_points=1, all_passed=s.all_passed, is_stub=s.is_stub)
            for s in task_scores
        ],
        "other_tests": {chapter: {"passed": p, "total": t} for chapter, (p, t) in others.items()},
        "score": sum(s.points for s in task_scores),
        "max_score": len(task_scores),
        "all_passed": all(s.all_passed for s in task_scores),
        "pytest_exit_status": report["exitstatus"],
        "nano_v1": report["nano_v1"],
    }
