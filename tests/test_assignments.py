"""Assignment mode: the region parser, student copies, grading, and the integrity check.

The integrity check is the point of this file: for every task region in the source, a
student copy with only that task stubbed must fail every test carrying the task's marker
(and import its own nano_v1, not the installed reference), while the reference tree
passes them all. A task whose tests still pass against a stub is a task nobody can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nano_v1.assignments import (
    ASSIGNMENT_FILE,
    REPO_ROOT,
    TaskRegionError,
    find_tasks,
    make_student_copy,
    parse_task_regions,
    select_tasks,
    stub_source,
)
from nano_v1.assignments.__main__ import main
from nano_v1.assignments.grading import marker_expression, score

pytestmark = pytest.mark.assignments

TASKS = find_tasks()

SOURCE = textwrap.dedent(
    '''\
    def f(x):
        """Doc."""
        y = 1
        # BEGIN TASK ch09_t1: add "one" to x
        y = x + 1
        if y:
            y += 0
        # END TASK
        return y

    class C:
        def g(self):
            # BEGIN TASK ch09_t2: return 2
            return 2
            # END TASK
    '''
)


# ----------------------------------------------------------------------------- the parser


def test_parse_regions_hints_lines_and_indentation():
    t1, t2 = parse_task_regions(SOURCE, "m.py")
    assert (t1.task_id, t1.chapter, t1.hint, t1.begin_line, t1.end_line, t1.indent) == (
        "ch09_t1", "ch09", 'add "one" to x', 4, 8, "    "
    )  # fmt: skip
    assert (t2.task_id, t2.begin_line, t2.end_line, t2.indent) == ("ch09_t2", 13, 15, "        ")


def test_stub_keeps_markers_and_valid_python():
    tasks = parse_task_regions(SOURCE, "m.py")
    stubbed = stub_source(SOURCE, tasks)
    namespace: dict = {}
    exec(compile(stubbed, "m.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match='^ch09_t1: add "one" to x$'):
        namespace["f"](1)
    with pytest.raises(NotImplementedError, match="^ch09_t2: return 2$"):
        namespace["C"]().g()
    # The markers survive, so the copy can be listed, graded and stubbed again (idempotent).
    again = parse_task_regions(stubbed, "m.py")
    assert [(t.task_id, t.hint, t.end_line - t.begin_line) for t in again] == [
        ("ch09_t1", 'add "one" to x', 2), ("ch09_t2", "return 2", 2)
    ]  # fmt: skip
    assert stub_source(stubbed, again) == stubbed
    # Only the chosen task is stubbed.
    only_second = stub_source(SOURCE, tasks[1:])
    assert "y = x + 1" in only_second and "        return 2\n" not in only_second


@pytest.mark.parametrize(
    "source, message",
    [
        ("# BEGIN TASK ch01_t1: a\nx = 1\n", "m.py:1: task ch01_t1 has no '# END TASK'"),
        ("x = 1\n# END TASK\n", "m.py:2: '# END TASK' without"),
        (
            "# BEGIN TASK ch01_t1: a\n# BEGIN TASK ch01_t2: b\nx\n# END TASK\n",
            "m.py:2: task ch01_t2 begins inside",
        ),
        ("# BEGIN TASK ch01_t1: a\n# END TASK\n", "m.py:2: task ch01_t1 has no statements"),
        ("# BEGIN TASK ch1_t1: a\nx\n# END TASK\n", "m.py:1: expected '# BEGIN TASK chNN_tK: <hint>'"),
        ("# BEGIN TASK ch01_t1:\nx\n# END TASK\n", "m.py:1: expected"),
        ("# BEGIN TASK ch01_t1: a\nx\n# END TASK here\n", "m.py:3: expected a bare '# END TASK'"),
        ("if a:\n    # BEGIN TASK ch01_t1: a\n    x\ny\n    # END TASK\n", "m.py:4: line is indented less"),
        ("if a:\n    # BEGIN TASK ch01_t1: a\n    x\n# END TASK\n", "m.py:4: '# END TASK' must be indented"),
    ],
)
def test_malformed_regions_name_file_and_line(source, message):
    with pytest.raises(TaskRegionError) as error:
        parse_task_regions(source, "m.py")
    assert str(error.value).startswith(message)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_duplicate_task_ids_across_files(tmp_path):
    region = "# BEGIN TASK ch02_t1: h\nx = 1\n# END TASK\n"
    write_tree(tmp_path, {"nano_v1/a.py": region, "nano_v1/sub/b.py": "\n" + region})
    with pytest.raises(
        TaskRegionError, match=r"nano_v1/sub/b.py:2: duplicate task id ch02_t1 \(first at nano_v1/a.py:1\)"
    ):
        find_tasks(tmp_path)


def test_select_and_make_copy(tmp_path):
    src = write_tree(
        tmp_path / "src",
        {
            "nano_v1/m.py": SOURCE,
            "nano_v1/__pycache__/m.cpython-311.pyc": "junk",
            "tests/test_m.py": "def test(): pass\n",
            "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-q"\n',
            ".venv/lib.py": "",
        },
    )
    tasks = find_tasks(src)
    assert [t.task_id for t in select_tasks(tasks, ["ch09"])] == ["ch09_t1", "ch09_t2"]
    assert [t.task_id for t in select_tasks(tasks, ["ch09_t2"])] == ["ch09_t2"]
    with pytest.raises(
        ValueError, match="no task or chapter with tasks named 'ch04'; chapters with tasks: ch09"
    ):
        select_tasks(tasks, ["ch04"])
    out = tmp_path / "student"
    make_student_copy(["ch09_t1"], out, root=src)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        ASSIGNMENT_FILE, "nano_v1/m.py", "pyproject.toml", "tests/test_m.py"
    ]  # fmt: skip
    assert (out / "nano_v1/m.py").read_text() == stub_source(SOURCE, tasks[:1])
    assert json.loads((out / ASSIGNMENT_FILE).read_text()) == {"tasks": ["ch09_t1"]}
    # A plain `pytest` in the copy must import the copy's package, not an installed one.
    pyproject = (out / "pyproject.toml").read_text()
    assert pyproject == '[tool.pytest.ini_options]\npythonpath = ["."]\naddopts = "-q"\n'
    with pytest.raises(ValueError, match="exists and is not empty"):
        make_student_copy(["ch09"], out, root=src)
    with pytest.raises(ValueError, match="inside the repository"):
        make_student_copy(["ch09"], src / "student", root=src)


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["make", "ch99", "--out", str(tmp_path / "x")]) == 2
    assert "error: no task or chapter with tasks named 'ch99'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["list"]) == 0
    assert capsys.readouterr().out.count("\n") == len(TASKS)


def test_cli_from_an_installed_package_asks_for_a_source_checkout(tmp_path):
    """Installed from a wheel, nano_v1 sits in site-packages with no tests/ beside it."""
    site_packages = tmp_path / "site-packages"
    ignore = shutil.ignore_patterns("__pycache__", "checkpoint")  # no model is loaded
    shutil.copytree(REPO_ROOT / "nano_v1", site_packages / "nano_v1", ignore=ignore)
    env = {**os.environ, "PYTHONPATH": str(site_packages)}
    expected = (
        "error: the assignments need a source checkout of nano_v1 (git clone the repository, then "
        f"pip install -e . in it): {site_packages} has no tests/ directory\n"
    )
    for command in (["list"], ["make", "ch04", "--out", str(tmp_path / "copy")], ["grade"]):
        result = subprocess.run(
            [sys.executable, "-m", "nano_v1.assignments", *command],
            cwd=site_packages, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (result.returncode, result.stderr) == (2, expected), command
    assert not (tmp_path / "copy").exists()


def test_score_is_all_or_nothing_per_task():
    tasks = parse_task_regions(SOURCE, "m.py")
    report = {
        "nano_v1": "x",
        "exitstatus": 1,
        "tests": {
            "a": {"markers": ["ch09", "ch09_t1"], "outcome": "passed", "message": ""},
            "b": {"markers": ["ch09", "ch09_t1", "ch09_t2"], "outcome": "failed", "message": "boom"},
            "c": {"markers": ["ch09", "ch09_t2", "gpu"], "outcome": "skipped", "message": ""},
            "d": {"markers": ["ch09"], "outcome": "passed", "message": ""},
            "e": {"markers": ["ch09"], "outcome": "not run", "message": ""},
        },
    }
    (t1, t2), others = score(tasks, report)
    assert (t1.passed, t1.total, t1.points, t1.failures) == (1, 2, 0, ["b: boom"])
    assert (t2.passed, t2.total, t2.points) == (0, 1, 0)
    assert others == {"ch09": (1, 2)}
    report["tests"]["b"]["outcome"] = "passed"
    (t1, t2), _ = score(tasks, report)
    assert (t1.points, t2.points) == (1, 1)
    assert marker_expression(tasks) == "ch09 or ch09_t1 or ch09_t2"


# ----------------------------------------------------------------------------- the integrity check


def test_chapters_02_to_05_have_at_least_two_tasks_each():
    for chapter in ("ch02", "ch03", "ch04", "ch05"):
        assert len([t for t in TASKS if t.chapter == chapter]) >= 2, chapter


def run_tests(root: Path, report_path: Path, marker: str, paths: list[str] = ()) -> dict:
    """pytest -m marker in `root`, in a fresh interpreter that imports root's own nano_v1."""
    command = [
        sys.executable, "-m", "pytest", *paths, "-m", marker, "-q", "-p", "no:cacheprovider",
        "-p", "nano_v1.assignments.pytest_plugin", "--task-report", str(report_path),
        "--hypothesis-profile=fail_fast",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(root))
    result = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert report_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    report["output"] = result.stdout[-3000:]
    assert Path(report["nano_v1"]).resolve().is_relative_to(root.resolve()), report["nano_v1"]
    return report


@pytest.fixture(scope="module")
def reference_report(tmp_path_factory) -> dict:
    """Every task's tests, run once against the reference tree."""
    report_path = tmp_path_factory.mktemp("reference") / "report.json"
    return run_tests(REPO_ROOT, report_path, " or ".join(t.task_id for t in TASKS))


def task_tests(report: dict, task_id: str) -> dict[str, dict]:
    return {nodeid: test for nodeid, test in report["tests"].items() if task_id in test["markers"]}


def test_reference_passes_every_task(reference_report):
    assert reference_report["exitstatus"] == 0, reference_report["output"]
    for task in TASKS:
        tests = task_tests(reference_report, task.task_id)
        assert tests, f"{task.task_id} has no tests: mark some with @pytest.mark.{task.task_id}"
        for nodeid, test in tests.items():
            assert test["outcome"] == "passed", (nodeid, test)
            # `pytest -m chNN` (what grading runs) must include the task's tests.
            assert task.chapter in test["markers"], f"{nodeid} lacks the chapter marker {task.chapter}"


def earlier_tasks(task_id: str) -> list[str]:
    """The tasks of the same chapter that come before `task_id` (a student does them first)."""
    chapter, number = task_id.split("_t")
    return [t.task_id for t in TASKS if t.chapter == chapter and int(t.task_id.split("_t")[1]) < int(number)]


@pytest.fixture(scope="module")
def stubbed_reports(reference_report, tmp_path_factory) -> dict[str, dict]:
    """For each task, a student copy with only that task stubbed runs the task's tests and
    those of the chapter's earlier tasks.

    The runs are independent subprocesses, so they go two at a time (CI has 2 cores).
    """

    def run_stubbed(task_id: str) -> dict:
        tmp = tmp_path_factory.mktemp(task_id)
        make_student_copy([task_id], tmp / "student")
        selected = [task_id, *earlier_tasks(task_id)]
        # Only the test files that hold these tests: collecting the whole suite costs more.
        paths = {nodeid.split("::")[0] for t in selected for nodeid in task_tests(reference_report, t)}
        return run_tests(tmp / "student", tmp / "report.json", " or ".join(selected), sorted(paths))

    task_ids = [t.task_id for t in TASKS if task_tests(reference_report, t.task_id)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(task_ids, pool.map(run_stubbed, task_ids)))


@pytest.mark.parametrize("task_id", [t.task_id for t in TASKS])
def test_stubbed_task_fails_all_its_tests(task_id, reference_report, stubbed_reports):
    expected = task_tests(reference_report, task_id)
    assert expected, f"{task_id} has no tests"
    report = stubbed_reports[task_id]
    assert report["exitstatus"] == 1, report["output"]
    own = task_tests(report, task_id)
    assert own.keys() == expected.keys()
    for nodeid, test in own.items():
        assert test["outcome"] in ("failed", "error"), f"{nodeid} passes with {task_id} stubbed"
    messages = [test["message"] for test in own.values()]
    assert any(f"NotImplementedError: {task_id}:" in message for message in messages), report["output"]


@pytest.mark.parametrize("task_id", [t.task_id for t in TASKS if earlier_tasks(t.task_id)])
def test_earlier_tasks_pass_without_later_ones(task_id, stubbed_reports):
    """Tasks are done in order, and each earns its point as soon as it works: with task
    t<k> stubbed, the tests of the chapter's tasks before it still pass."""
    report = stubbed_reports[task_id]
    earlier = {nodeid: test for nodeid, test in report["tests"].items() if task_id not in test["markers"]}
    assert earlier, f"no tests of {earlier_tasks(task_id)} ran"
    for nodeid, test in earlier.items():
        assert test["outcome"] == "passed", (
            f"{nodeid}, a test of an earlier task, fails with {task_id} stubbed"
        )


def test_grade_scores_a_student_copy(reference_report, tmp_path):
    """The whole student loop for one task: make a copy, then grade it from inside."""
    task = TASKS[0]
    copy = tmp_path / "student"
    make_student_copy([task.task_id], copy)
    score_path = tmp_path / "score.json"
    # Grading collects the whole suite; the task's own test files are enough here.
    paths = sorted({nodeid.split("::")[0] for nodeid in task_tests(reference_report, task.task_id)})
    command = [sys.executable, "-m", "nano_v1.assignments", "grade", "--json", str(score_path),
               "--", "-p", "no:cacheprovider", "--hypothesis-profile=fail_fast", *paths]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(copy))
    result = subprocess.run(
        command, cwd=copy, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    scores = json.loads(score_path.read_text())
    assert Path(scores["nano_v1"]).resolve().is_relative_to(copy.resolve())
    assert [(t["task_id"], t["points"], t["passed"]) for t in scores["tasks"]] == [(task.task_id, 0, 0)]
    assert scores["tasks"][0]["total"] == len(task_tests(reference_report, task.task_id))
    assert (scores["score"], scores["max_score"]) == (0, 1)
    assert f"{task.task_id}  " in result.stdout and "total" in result.stdout
