"""A pytest plugin that records each selected test's outcome and markers as JSON.

Course machinery (chapters 02-05); vLLM has no counterpart.

Why it exists: `grade` scores tasks, and a task's score is the outcome of the tests that
carry its marker. Loaded with `-p nano_v1.assignments.pytest_plugin --task-report FILE`,
it writes {"nano_v1": where the package was imported from, "exitstatus": ...,
"tests": {nodeid: {"markers": [...], "outcome": ..., "message": ...}}}. A test selected
but never run (after `-x` stopped the session) keeps the outcome "not run".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nano_v1


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


class _TaskReport:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # session.items is what survived -m/-k deselection.
        for item in session.items:
            markers = sorted({mark.name for mark in item.iter_markers()})
            self.tests[item.nodeid] = {"markers": markers, "outcome": "not run", "message": ""}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = self.tests.get(report.nodeid)
        if record is None or record["outcome"] in ("failed", "error"):
            return
        if report.failed:
            record["outcome"] = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            record["message"] = crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
        elif report.skipped:
            record["outcome"] = "skipped"
        elif report.when == "call":
            record["outcome"] = "passed"

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        report = {"nano_v1": nano_v1.__file__, "exitstatus": int(exitstatus), "tests": self.tests}
        self.path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
