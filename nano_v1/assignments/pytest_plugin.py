"""A pytest plugin that records each selected test's outcome and markers as JSON.

Course machinery (the tasks of chapters 01-15); vLLM has no counterpart.

Why it exists: `grade` scores tasks, and a task's score is the outcome of the tests that
carry its marker. Loaded with `-p nano_v1.assignments.pytest_plugin --task-report FILE`,
it writes {"nano_v1": where the package was imported from, "exitstatus": ...,
"tests": {nodeid: {"markers": [...], "outcome": ..., "message": ..., "duration": ...}}}.
A test selected but never run (after `-x` stopped the session) keeps the outcome "not run".

`message` is one line saying what went wrong, for the grade table: an assertion's own
message ("block 1's hash must chain block 0's"), not pytest's diff of the values; for
any other exception, its type and first line ("NotImplementedError: ch03_t1: ...").
`duration` is the test's seconds, setup and teardown included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nano_v1

# The outcome of a test selected but never run; grading reports it as its message.
NOT_RUN = "not run"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--task-report",
        metavar="FILE",
        default=None,
        help="write each test's outcome and markers to FILE as JSON",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--task-report")
    if path:
        config.pluginmanager.register(_TaskReport(Path(path)), "nano_v1_task_report")


def failure_message(error: BaseException) -> str:
    """One line saying what `error` reports: an assertion's message, else 'Type: first line'."""
    # Hypothesis raises an exception group when it finds several distinct failures.
    while getattr(error, "exceptions", None):
        error = error.exceptions[0]
    # A kernel run in Triton's interpreter raises the kernel's own error as the cause of one.
    while type(error).__name__ == "InterpreterError" and error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if isinstance(error, AssertionError):
        return first or "AssertionError"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class _TaskReport:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # session.items is what survived -m/-k deselection.
        for item in session.items:
            markers = sorted({mark.name for mark in item.iter_markers()})
            self.tests[item.nodeid] = {
                "markers": markers,
                "outcome": NOT_RUN,
                "message": "",
                "duration": 0.0,
            }

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
        report = yield
        record = self.tests.get(item.nodeid)
        if record is None:
            return report
        record["duration"] += report.duration
        if record["outcome"] in ("failed", "error"):
            return report
        if report.failed:
            record["outcome"] = "failed" if report.when == "call" else "error"
            record["message"] = (
                failure_message(call.excinfo.value)
                if call.excinfo is not None
                else str(report.longrepr).splitlines()[-1]
            )
        elif report.skipped:
            record["outcome"] = "skipped"
        elif report.when == "call":
            record["outcome"] = "passed"
        return report

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        report = {"nano_v1": nano_v1.__file__, "exitstatus": int(exitstatus), "tests": self.tests}
        self.path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
