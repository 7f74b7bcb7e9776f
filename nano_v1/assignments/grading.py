"""Grade a student copy: run each task's own tests, score each task, say briefly what is wrong.

Course machinery (the tasks of chapters 01-15); vLLM has no counterpart.

Why it exists: `pytest -m ch04` says which tests fail, not which task is done or what is
wrong with it, and it prints pages of tracebacks. Grading runs in two passes, each a quiet
pytest in a fresh interpreter whose output is kept, not printed:

1. the task tests: only the tests marked with a chosen task's id (`-m ch04_t1 or ch04_t2`),
   collected from the test files that name one (collecting the whole suite costs more than
   most tasks' tests). A task with n tests earns passed/n points; `all_passed` says when it
   is done. Each failing test is reported by the one line its assertion gives ("block 1's
   hash must chain block 0's"), at most MAX_FAILURES_SHOWN of them per task, then the pytest
   command that shows the full output; a task still raising its stub's NotImplementedError
   is reported once, with its hint.
2. optional, the chapter tests: the chosen chapters' other tests (`-m "ch04 and not (...)"`),
   reported beside the tasks (a broken neighbour shows up there) but carrying no points.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nano_v1.assignments import Task
from nano_v1.assignments.pytest_plugin import NOT_RUN

# A failing task lists this many failing tests, then says how many more there are.
MAX_FAILURES_SHOWN = 8
# A failure's message is cut to this many characters (a tensor's repr can fill a screen).
MAX_MESSAGE_CHARS = 240
# pytest's output when it is kept, not shown: only its last lines matter (OUTPUT_TAIL_LINES).
QUIET_ARGS = ("-q", "--tb=short")
# When pytest stops before scoring (a syntax error, a bad argument), this many of its last lines are shown.
OUTPUT_TAIL_LINES = 15
# Hypothesis reports the first failing example it finds instead of shrinking it (tens of seconds
# per test); the full-output command that grading prints leaves the shrinking on.
FAST_FAILURE_ARGS = ("--hypothesis-profile=fail_fast",)


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
    # The pytest command that runs this task's tests with pytest's full output.
    rerun: str = ""

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


@dataclass(slots=True)
class PytestRun:
    """One pass of grading: the pytest arguments that select its tests, and what came of it."""

    name: str
    selection: list[str]
    exit_status: int
    seconds: float
    tests: dict[str, dict]
    nano_v1: str | None
    output_tail: list[str]

    @property
    def stopped_early(self) -> bool:
        """pytest neither ran every test nor found some failing (exit status 2-5: interrupted,
        internal error, usage error, nothing collected)."""
        return self.exit_status not in (0, 1)


def files_marking_tasks(root: Path, task_ids: list[str]) -> list[str]:
    """The test files under root/tests that hold `mark.<task id>` for one of `task_ids`.

    Only they can mark a test with a task (tests spell a task's marker `pytest.mark.ch04_t1`),
    and collecting just them is much cheaper than collecting the whole suite.
    """
    marks = re.compile(r"\bmark\.(?:" + "|".join(map(re.escape, task_ids)) + r")\b")
    return [
        path.relative_to(root).as_posix()
        for path in sorted((root / "tests").glob("test_*.py"))
        if marks.search(path.read_text(encoding="utf-8"))
    ]


def task_tests_selection(root: Path, tasks: list[Task]) -> list[str]:
    """pytest arguments selecting exactly the tests marked with one of `tasks`' ids."""
    task_ids = [t.task_id for t in tasks]
    return [*files_marking_tasks(root, task_ids), "-m", " or ".join(task_ids)]


def chapter_tests_selection(tasks: list[Task]) -> list[str]:
    """pytest arguments selecting the tasks' chapters' tests that carry none of the tasks' markers."""
    chapters = " or ".join(sorted({t.chapter for t in tasks}))
    return ["-m", f"({chapters}) and not ({' or '.join(t.task_id for t in tasks)})"]


def rerun_command(selection: list[str]) -> str:
    """The shell command that runs `selection` with pytest's full output, from the copy's root."""
    return shlex.join(["python", "-m", "pytest", *selection])


def run_pytest(
    root: Path, name: str, selection: list[str], extra_args: list[str], verbose: bool
) -> PytestRun:
    """Run pytest on `selection` in `root`, in a fresh interpreter, with the task-report plugin.

    pytest's output is kept (its last lines) unless `verbose`, when it goes to the terminal.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pytest", *(() if verbose else QUIET_ARGS),
            "-p", "nano_v1.assignments.pytest_plugin", "--task-report", str(report_path),
            *FAST_FAILURE_ARGS, *selection, *extra_args,
        ]  # fmt: skip
        # The copy's own package must be the one imported, not an installed reference.
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        )
        start = time.perf_counter()
        result = subprocess.run(
            command, cwd=root, env=env, check=False, text=True,
            stdout=None if verbose else subprocess.PIPE, stderr=None if verbose else subprocess.STDOUT,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        tail = [] if verbose else result.stdout.splitlines()[-OUTPUT_TAIL_LINES:]
        report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else None
    return PytestRun(
        name,
        selection,
        result.returncode,
        seconds,
        report["tests"] if report else {},
        report["nano_v1"] if report else None,
        tail,
    )


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


def grade(
    root: Path, tasks: list[Task], extra_args: list[str], chapter_tests: bool, verbose: bool
) -> tuple[list[TaskScore], dict[str, tuple[int, int]] | None, list[PytestRun]]:
    """Run the task tests (and, if `chapter_tests`, the chapters' other tests) and score them.

    The chapters' other tests come back as None when that pass did not run.
    """
    runs = [run_pytest(root, "task tests", task_tests_selection(root, tasks), extra_args, verbose)]
    if chapter_tests:
        runs.append(run_pytest(root, "chapter tests", chapter_tests_selection(tasks), extra_args, verbose))
    task_scores, others = score(tasks, {"tests": {k: v for run in runs for k, v in run.tests.items()}})
    for task_score in task_scores:
        own = [t for t in tasks if t.task_id == task_score.task_id]
        task_score.rerun = rerun_command(task_tests_selection(root, own))
    return task_scores, others if chapter_tests else None, runs


def _status(task_score: TaskScore) -> str:
    if task_score.all_passed:
        return "done"
    if task_score.is_stub:
        return "to do"
    return f"{len(task_score.failures)} failing" if task_score.total else "no tests ran"


def format_table(
    task_scores: list[TaskScore], others: dict[str, tuple[int, int]] | None, runs: Sequence[PytestRun] = ()
) -> str:
    """The score table, what is wrong with each task that is not done, and how each pass went.

    `others` None: the chapters' other tests did not run (`grade --chapter-tests` runs them).
    """
    rows = [("task", "tests passed", "points", "status", "hint")]
    rows += [(s.task_id, f"{s.passed}/{s.total}", f"{s.points:.2f}", _status(s), s.hint) for s in task_scores]
    if others is None:
        rows.append(("others", "not run", "-", "", "the chapters' other tests: grade --chapter-tests"))
    else:
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
    for run in runs:
        lines += _explain_run(run)
    return "\n".join(line.rstrip() for line in lines)


def _shorten(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 3] + "..."


def _explain(task_score: TaskScore) -> list[str]:
    """What is wrong with a task that is not done: its hint while it is a stub, else its
    failing tests, each with its message, and the command that shows pytest's full output."""
    if task_score.all_passed or not task_score.failures:
        return []
    if task_score.is_stub:
        return ["", f"{task_score.task_id}: not implemented yet (NotImplementedError): {task_score.hint}"]
    failures = [failure for failure in task_score.failures if failure.message != NOT_RUN]
    not_run = len(task_score.failures) - len(failures)
    lines = ["", f"{task_score.task_id}: {len(task_score.failures)} of {task_score.total} tests fail"]
    lines += [f"  {failure.test}: {_shorten(failure.message)}" for failure in failures[:MAX_FAILURES_SHOWN]]
    if len(failures) > MAX_FAILURES_SHOWN:
        lines.append(f"  ... and {len(failures) - MAX_FAILURES_SHOWN} more")
    if not_run:
        lines.append(f"  {not_run} did not run: pytest stopped before them")
    if task_score.rerun:
        lines.append(f"  full output: {task_score.rerun}")
    return lines


def _explain_run(run: PytestRun) -> list[str]:
    """A pass's line: how many tests in how long; if pytest stopped early, its last lines."""
    lines = [
        "",
        f"{run.name}: {len(run.tests)} selected, pytest exit status {run.exit_status}, {run.seconds:.1f} s",
    ]
    if run.stopped_early:
        lines.append(
            f"  pytest stopped early; the end of its output ({rerun_command(run.selection)} shows all):"
        )
        lines += [f"  | {line}" for line in run.output_tail]
    return lines


def to_json(
    task_scores: list[TaskScore], others: dict[str, tuple[int, int]] | None, runs: list[PytestRun]
) -> dict:
    """The scores and both passes; `other_tests` is null when the chapter tests did not run."""
    return {
        "tasks": [
            dict(asdict(s), points=s.points, max_points=1, all_passed=s.all_passed, is_stub=s.is_stub)
            for s in task_scores
        ],
        "other_tests": None
        if others is None
        else {chapter: {"passed": p, "total": t} for chapter, (p, t) in others.items()},
        "score": sum(s.points for s in task_scores),
        "max_score": len(task_scores),
        "all_passed": all(s.all_passed for s in task_scores),
        "runs": [
            {
                "pass": run.name,
                "command": rerun_command(run.selection),
                "selected": len(run.tests),
                "exit_status": run.exit_status,
                "seconds": round(run.seconds, 2),
            }
            for run in runs
        ],
        "nano_v1": runs[0].nano_v1,
    }
