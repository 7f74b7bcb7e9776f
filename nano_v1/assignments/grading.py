"""Grade a student copy: run the chapters' tests and score each task.

Course machinery (chapters 02-05); vLLM has no counterpart.

Why it exists: `pytest -m ch04` says which tests fail, not which task is done. A task
earns its point when every test carrying its marker ran and passed; a partly working
task earns nothing, because its tests are one specification. The chapter's other tests
are reported beside the tasks (a broken neighbour shows up there) but carry no points.
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
class TaskScore:
    task_id: str
    hint: str
    path: str
    passed: int = 0
    total: int = 0
    # "nodeid: message" of each test that did not pass.
    failures: list[str] = field(default_factory=list)

    @property
    def points(self) -> int:
        return int(self.total > 0 and self.passed == self.total)


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
                task_score.failures.append(f"{nodeid}: {test['message'] or test['outcome']}")
        if not task_ids:
            for chapter in chapters.intersection(test["markers"]):
                others[chapter][0] += passed
                others[chapter][1] += 1
    return list(scores.values()), {chapter: (p, t) for chapter, (p, t) in others.items()}


def format_table(task_scores: list[TaskScore], others: dict[str, tuple[int, int]]) -> str:
    rows = [("task", "tests passed", "points", "hint")]
    rows += [(s.task_id, f"{s.passed}/{s.total}", f"{s.points}/1", s.hint) for s in task_scores]
    rows += [
        (f"{chapter} other", f"{p}/{t}", "-", "the chapter's tests outside any task")
        for chapter, (p, t) in others.items()
    ]
    total = sum(s.points for s in task_scores)
    rows.append(("total", "", f"{total}/{len(task_scores)}", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3] for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    for s in task_scores:
        lines += [f"  {s.task_id} FAILED {failure}" for failure in s.failures[:3]]
    return "\n".join(line.rstrip() for line in lines)


def to_json(task_scores: list[TaskScore], others: dict[str, tuple[int, int]], report: dict) -> dict:
    return {
        "tasks": [dict(asdict(s), points=s.points, max_points=1) for s in task_scores],
        "other_tests": {chapter: {"passed": p, "total": t} for chapter, (p, t) in others.items()},
        "score": sum(s.points for s in task_scores),
        "max_score": len(task_scores),
        "pytest_exit_status": report["exitstatus"],
        "nano_v1": report["nano_v1"],
    }
