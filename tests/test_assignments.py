"""Assignment mode: the region parser, student copies, grading, and the integrity check.

The integrity check is the point of this file: for every task region in the source, a
student copy with only that task stubbed must fail every test carrying the task's marker
(and import its own nano_v1, not the installed reference), while the reference tree
passes them all. A task whose tests still pass against a stub is a task nobody can fail.
Each task's planted bugs (helpers/assignment_mutants.py) must be caught too: a copy with one
mutant applied must fail at least one of the task's tests, with a message that says
what is wrong.

The variants (stubs and mutants) run in two copies of the repository, two at a time (CI
has 2 cores), each copy rewritten in place per variant by helpers/variant_runner.py, which
forks every run from one interpreter that has imported torch once.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.assignment_mutants import MUTANTS

from nano_v1.assignments import (
    ASSIGNMENT_FILE,
    NEEDED_BY_EARLIER_CHAPTERS,
    Mutant,
    Task,
    TaskRegionError,
    copy_repository,
    find_tasks,
    later_tasks,
    make_student_copy,
    mutate_source,
    parse_task_regions,
    select_tasks,
    stub_source,
)
from nano_v1.assignments.__main__ import main
from nano_v1.assignments.grading import (
    MAX_FAILURES_SHOWN,
    MAX_MESSAGE_CHARS,
    chapter_tests_selection,
    files_marking_tasks,
    format_table,
    grade,
    score,
    task_tests_selection,
)
from nano_v1.assignments.pytest_plugin import failure_message

pytestmark = pytest.mark.assignments
REPO_ROOT = Path(__file__).resolve().parents[1]

TASKS = find_tasks()
TASKS_BY_ID = {t.task_id: t for t in TASKS}
MUTANT_IDS = [f"{task_id}/{mutant.name}" for task_id, mutants in MUTANTS.items() for mutant in mutants]

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


EARLIER_AND_LATER = textwrap.dedent(
    """\
    def eight():
        # BEGIN TASK ch08_t1: eight
        return 8
        # END TASK

    def ten():
        # BEGIN TASK ch10_t1: ten
        return 10
        # END TASK
    """
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
    exec(compile(stubbed, "m.py", "exec"), namespace)  # noqa: S102  (the stubbed module, which the test wrote)
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
            "nano_v1/other.py": EARLIER_AND_LATER,
            "nano_v1/__pycache__/m.cpython-311.pyc": "junk",
            "tests/test_m.py": "def test(): pass\n",
            "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-q"\n',
            ".venv/lib.py": "",
        },
    )
    tasks = find_tasks(src)
    assert [t.task_id for t in select_tasks(tasks, ["ch09"])] == ["ch09_t1", "ch09_t2"]
    assert [t.task_id for t in later_tasks(tasks, select_tasks(tasks, ["ch08", "ch09_t1"]))] == ["ch10_t1"]
    assert [t.task_id for t in select_tasks(tasks, ["ch09_t2"])] == ["ch09_t2"]
    with pytest.raises(
        ValueError, match="no task or chapter with tasks named 'ch04'; chapters with tasks: ch08, ch09, ch10"
    ):
        select_tasks(tasks, ["ch04"])
    out = tmp_path / "student"
    make_student_copy(["ch09_t1"], out, root=src)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        ASSIGNMENT_FILE, "nano_v1/m.py", "nano_v1/other.py", "pyproject.toml", "tests/test_m.py"
    ]  # fmt: skip
    assert (out / "nano_v1/m.py").read_text() == stub_source(SOURCE, select_tasks(tasks, ["ch09_t1"]))
    # A later chapter's task is stubbed too (its answer is no example to copy); an earlier one's is not.
    other = (out / "nano_v1/other.py").read_text()
    assert other == stub_source(EARLIER_AND_LATER, select_tasks(tasks, ["ch10_t1"]))
    assert "return 8" in other and "return 10" not in other
    assert json.loads((out / ASSIGNMENT_FILE).read_text()) == {
        "tasks": ["ch09_t1"], "later_tasks_stubbed": ["ch10_t1"]
    }  # fmt: skip
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
            cwd=site_packages, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert (result.returncode, result.stderr) == (2, expected), command
    assert not (tmp_path / "copy").exists()


def test_score_gives_partial_credit_per_test():
    tasks = parse_task_regions(SOURCE, "m.py")
    stub = "NotImplementedError: ch09_t2: return 2"
    report = {
        "nano_v1": "x",
        "exitstatus": 1,
        "tests": {
            "a": {"markers": ["ch09", "ch09_t1"], "outcome": "passed", "message": ""},
            "b": {
                "markers": ["ch09", "ch09_t1", "ch09_t2"],
                "outcome": "failed",
                "message": "y must be x + 1",
            },
            "c": {"markers": ["ch09", "ch09_t2", "gpu"], "outcome": "skipped", "message": ""},
            "d": {"markers": ["ch09"], "outcome": "passed", "message": ""},
            "e": {"markers": ["ch09"], "outcome": "not run", "message": ""},
            "f": {"markers": ["ch09", "ch09_t1"], "outcome": "passed", "message": ""},
            "g": {"markers": ["ch09", "ch09_t2"], "outcome": "failed", "message": stub},
        },
    }
    (t1, t2), others = score(tasks, report)
    assert (t1.passed, t1.total, t1.points, t1.all_passed, t1.is_stub) == (2, 3, 2 / 3, False, False)
    assert [(f.test, f.message) for f in t1.failures] == [("b", "y must be x + 1")]
    assert (t2.passed, t2.total, t2.points, t2.is_stub) == (0, 2, 0.0, True)
    assert others == {"ch09": (1, 2)}
    table = format_table([t1, t2], others)
    assert "ch09_t1: 1 of 3 tests fail\n  b: y must be x + 1" in table
    assert "ch09_t2: not implemented yet (NotImplementedError): return 2" in table
    assert "0.67" in table and "0.67/2" in table  # t1's points, then the total
    assert "others" not in table
    assert re.search(r"^others +not run +- +the chapters' other tests: grade --chapter-tests$",
                     format_table([t1, t2], None), re.MULTILINE)  # fmt: skip
    report["tests"]["b"]["outcome"] = "passed"
    (t1, t2), _ = score(tasks, report)
    assert (t1.points, t1.all_passed, t2.all_passed) == (1.0, True, False)
    assert chapter_tests_selection(tasks) == ["-m", "(ch09) and not (ch09_t1 or ch09_t2)"]


GRADED_TESTS = textwrap.dedent(
    """\
    import pytest

    @pytest.mark.ch09
    @pytest.mark.ch09_t1
    @pytest.mark.parametrize("n", range(1, 13))
    def test_t1_fails_loudly(n):
        print("noise\\n" * 500)
        # A long one-line explanation: a long list's would cost minutes of difflib where
        # pytest believes it runs in CI (env CI set), which prints full diffs.
        assert "0" * 900 == str(n) * 900, "x must be " + "long " * 100

    @pytest.mark.ch09
    @pytest.mark.ch09_t2
    def test_t2_passes():
        pass

    @pytest.mark.ch09
    def test_chapter_test_outside_the_tasks():
        pass
    """
)


def test_grade_runs_the_tasks_own_tests_quietly(tmp_path, capfd):
    """The first pass selects exactly the tests marked with a task, and what grade prints for a
    task failing many tests, each with a page of output and a long message, stays short."""
    root = write_tree(
        tmp_path,
        {
            "nano_v1/m.py": SOURCE,
            "tests/test_graded.py": GRADED_TESTS,
            "tests/test_unmarked.py": "def test_elsewhere():\n    pass  # names ch09_t1, marks nothing\n",
            "tests/conftest.py": "import hypothesis\nhypothesis.settings.register_profile('fail_fast')\n",
        },
    )
    tasks = find_tasks(root)
    assert files_marking_tasks(root, ["ch09_t1"]) == ["tests/test_graded.py"]
    assert task_tests_selection(root, tasks) == ["tests/test_graded.py", "-m", "ch09_t1 or ch09_t2"]
    task_scores, others, runs = grade(
        root, tasks, ["-p", "no:cacheprovider"], chapter_tests=False, verbose=False
    )
    assert others is None and [run.name for run in runs] == ["task tests"]
    assert list(runs[0].tests) == [
        f"tests/test_graded.py::test_t1_fails_loudly[{n}]" for n in range(1, 13)
    ] + ["tests/test_graded.py::test_t2_passes"]
    t1, t2 = task_scores
    assert (t1.passed, t1.total, t2.passed, t2.total) == (0, 12, 1, 1)
    assert t1.rerun == "python -m pytest tests/test_graded.py -m ch09_t1"
    table = format_table(task_scores, others, runs)
    assert capfd.readouterr().out.count("noise") == 0, "pytest's output must not reach the terminal"
    lines = table.splitlines()
    assert len(lines) <= 25, table
    assert max(map(len, lines)) <= 300, table
    assert f"  ... and {12 - MAX_FAILURES_SHOWN} more" in lines, table
    assert f"  full output: {t1.rerun}" in lines, table
    assert "noise" not in table and "Traceback" not in table and "assert '000" not in table, table
    # The second pass: the chapter's tests outside the tasks, for no points.
    task_scores, others, runs = grade(
        root, tasks, ["-p", "no:cacheprovider"], chapter_tests=True, verbose=False
    )
    assert others == {"ch09": (1, 1)} and list(runs[1].tests) == [
        "tests/test_graded.py::test_chapter_test_outside_the_tasks"
    ]
    assert [s.total for s in task_scores] == [12, 1]


def test_failure_message_is_the_first_line_an_assertion_gives():
    # pytest's rewritten asserts append the values' diff after the message's lines.
    error = AssertionError("block 1's hash must chain block 0's\n  more\nassert b'a' == b'b'")
    assert failure_message(error) == "block 1's hash must chain block 0's"
    assert failure_message(NotImplementedError("ch03_t1: hint")) == "NotImplementedError: ch03_t1: hint"
    assert failure_message(IndexError("list index out of range")) == "IndexError: list index out of range"
    assert failure_message(AssertionError()) == "AssertionError"
    # Hypothesis reports several distinct failures as a group: the first one speaks.
    group_type = (
        getattr(builtins, "ExceptionGroup", None) or pytest.importorskip("exceptiongroup").ExceptionGroup
    )
    group = group_type("2 distinct failures", [AssertionError("too many blocks"), ValueError("x")])
    assert failure_message(group) == "too many blocks"
    # Triton's interpreter raises a kernel's own error as the cause of an InterpreterError.
    interpreter_error = type("InterpreterError", (Exception,), {})("NotImplementedError('ch06_t1: hint')")
    interpreter_error.__cause__ = NotImplementedError("ch06_t1: hint")
    assert failure_message(interpreter_error) == "NotImplementedError: ch06_t1: hint"


# ----------------------------------------------------------------------------- the integrity check


# Chapters whose tasks exist so far; the course's goal is every chapter 01-10.
CHAPTERS_WITH_TASKS = tuple(f"ch{n:02d}" for n in range(1, 17))  # every chapter but 00


def test_chapters_with_tasks_have_two_each_listed_in_their_chapter_and_the_readme():
    chapters = {t.chapter for t in TASKS}
    assert chapters == set(CHAPTERS_WITH_TASKS), f"chapters with tasks: {sorted(chapters)}"
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    for chapter in CHAPTERS_WITH_TASKS:
        ids = [t.task_id for t in TASKS if t.chapter == chapter]
        assert len(ids) >= 2, f"{chapter} has {len(ids)} task(s); give it at least 2"
        (text_path,) = (REPO_ROOT / "chapters").glob(f"{chapter[2:]}-*.md")
        text = text_path.read_text(encoding="utf-8")
        assert "\n## Your turn\n" in text, f"{text_path.name} has no 'Your turn' section"
        your_turn = text.split("\n## Your turn\n", 1)[1].split("\n## ", 1)[0]
        for task_id in ids:
            assert f"`{task_id}`" in your_turn, f"{text_path.name}'s 'Your turn' does not list {task_id}"
        (row,) = [line for line in readme.splitlines() if line.startswith(f"| {chapter[2:]} |")]
        assert row.split(" | ")[4] == ", ".join(f"`{task_id}`" for task_id in ids), (
            f"README's course table must list {chapter}'s tasks: {row}"
        )


# The course's parts (README's "The course", chapter 00) and the size a part's larger task,
# one that builds a whole piece, must reach at least.
COURSE_PARTS = {
    "Part I": tuple(f"ch{n:02d}" for n in range(1, 6)),
    "Part II": tuple(f"ch{n:02d}" for n in range(6, 9)),
    "Part III": tuple(f"ch{n:02d}" for n in range(9, 17)),
}
LARGER_TASK_LINES = 40


def test_each_part_of_the_course_has_a_larger_task_the_readme_names():
    readme = " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    assert tuple(c for chapters in COURSE_PARTS.values() for c in chapters) == CHAPTERS_WITH_TASKS
    for part, chapters in COURSE_PARTS.items():
        lines = {t.task_id: t.end_line - t.begin_line - 1 for t in TASKS if t.chapter in chapters}
        larger = [task_id for task_id, n in lines.items() if n >= LARGER_TASK_LINES]
        assert larger, (
            f"{part} (chapters {chapters[0][2:]}-{chapters[-1][2:]}) has no task of {LARGER_TASK_LINES} "
            f"lines or more; its largest, {max(lines, key=lines.get)}, has {max(lines.values())}"
        )
        assert any(f"`{task_id}` for {part} (" in readme for task_id in larger), (
            f"README's 'Grading an assignment' must name {part}'s larger task ({', '.join(larger)})"
        )


@dataclass(frozen=True, slots=True)
class Variant:
    """One pytest run on a tree with some files rewritten (none: the tree as it is)."""

    name: str
    files: dict[str, str]  # path relative to the tree: the variant's text of it
    args: list[str]


def run_variants(root: Path, variants: list[Variant], work: Path) -> dict[str, dict]:
    """Run each variant of `root` in turn (helpers/variant_runner.py); the plugin's reports, by name.

    Each report also holds the tail of its run's output, and must come from root's own nano_v1.
    """
    work.mkdir(parents=True, exist_ok=True)
    jobs = []
    for i, variant in enumerate(variants):
        args = [
            *variant.args, "-q", "-p", "no:cacheprovider", "-p", "nano_v1.assignments.pytest_plugin",
            "--task-report", str(work / f"{i}.json"), "--hypothesis-profile=fail_fast",
        ]  # fmt: skip
        log = str(work / f"{i}.log")
        jobs.append({"files": variant.files, "args": args, "log": log, "timeout": 300})
    (work / "jobs.json").write_text(json.dumps({"root": str(root), "jobs": jobs}))
    runner = Path(__file__).parent / "helpers" / "variant_runner.py"
    env = dict(os.environ, PYTHONPATH=str(root))
    result = subprocess.run(
        [sys.executable, str(runner), str(work / "jobs.json")],
        cwd=root, env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = {}
    for i, variant in enumerate(variants):
        output = (work / f"{i}.log").read_text()[-3000:]
        assert (work / f"{i}.json").exists(), f"{variant.name}: no report\n{output}"
        report = json.loads((work / f"{i}.json").read_text())
        report["output"] = output
        assert Path(report["nano_v1"]).resolve().is_relative_to(root.resolve()), report["nano_v1"]
        reports[variant.name] = report
    return reports


@pytest.fixture(scope="module")
def reference_report(tmp_path_factory) -> dict:
    """Every task's tests, run once against the reference tree: what grading's first pass runs
    for every task at once, in two halves side by side (one per core; nothing is rewritten)."""

    def run_half(half: int) -> dict:
        reference = Variant(f"reference{half}", {}, task_tests_selection(REPO_ROOT, TASKS[half::2]))
        return run_variants(REPO_ROOT, [reference], tmp_path_factory.mktemp(reference.name))[reference.name]

    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.map(run_half, range(2))
    return {
        **first,
        "tests": {**first["tests"], **second["tests"]},
        "exitstatus": first["exitstatus"] or second["exitstatus"],
        "output": first["output"] + second["output"],
    }


def task_tests(report: dict, task_id: str) -> dict[str, dict]:
    return {nodeid: test for nodeid, test in report["tests"].items() if task_id in test["markers"]}


@pytest.mark.slow
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


def stub_variant(task_id: str, reference_report: dict) -> Variant:
    """Only `task_id` stubbed; its tests run, and those of the chapter's earlier tasks."""
    task = TASKS_BY_ID[task_id]
    text = stub_source((REPO_ROOT / task.path).read_text(encoding="utf-8"), [task])
    return Variant(
        task_id, {task.path: text}, tasks_tests_args([task_id, *earlier_tasks(task_id)], reference_report)
    )


def tasks_tests_args(task_ids: list[str], reference_report: dict) -> list[str]:
    """pytest arguments running the tests of `task_ids`, from only the test files that hold
    them: collecting the whole suite costs more."""
    paths = {nodeid.split("::")[0] for t in task_ids for nodeid in task_tests(reference_report, t)}
    return [*sorted(paths), "-m", " or ".join(task_ids)]


def later_stubbed_variant(chapter: str, reference_report: dict) -> Variant:
    """A student copy of `chapter` once its tasks are done: the later chapters' tasks stubbed
    (make_student_copy stubs them); the chapter's tasks' tests run."""
    chapter_tasks = [t for t in TASKS if t.chapter == chapter]
    later = later_tasks(TASKS, chapter_tasks)
    files = {
        path: stub_source(
            (REPO_ROOT / path).read_text(encoding="utf-8"), [t for t in later if t.path == path]
        )
        for path in sorted({t.path for t in later})
    }
    return Variant(chapter, files, tasks_tests_args([t.task_id for t in chapter_tasks], reference_report))


def mutant_variant(task_id: str, mutant: Mutant, reference_report: dict) -> Variant:
    """`mutant` planted in `task_id`; the task's tests run, fastest first, until one fails."""
    task = TASKS_BY_ID[task_id]
    tests = task_tests(reference_report, task_id)
    nodeids = sorted(tests, key=lambda nodeid: tests[nodeid]["duration"])
    text = mutate_source((REPO_ROOT / task.path).read_text(encoding="utf-8"), task, mutant)
    return Variant(f"{task_id}/{mutant.name}", {task.path: text}, [*nodeids, "-x"])


def selected_variants(session: pytest.Session) -> set[str]:
    """The stub, mutant and later-stubbed variants that the session's selected tests read
    (`-k ch11` runs ch11's only)."""
    names = set()
    for item in session.items:
        params = getattr(item, "callspec", None)
        if params is not None and "variant_reports" in item.fixturenames:
            keys = ("task_id", "mutant_id", "chapter")
            names.update(str(params.params[key]) for key in keys if key in params.params)
    return names


@pytest.fixture(scope="module")
def variant_reports(request, reference_report, tmp_path_factory) -> dict[str, dict]:
    """Reports of the stub variants (by task id), mutant variants ("task_id/name") and
    later-stubbed variants (by chapter) that the selected tests need."""
    wanted = selected_variants(request.session)
    variants = [
        stub_variant(t.task_id, reference_report)
        for t in TASKS
        if t.task_id in wanted and task_tests(reference_report, t.task_id)
    ]
    variants += [
        mutant_variant(task_id, mutant, reference_report)
        for task_id, mutants in MUTANTS.items()
        if task_tests(reference_report, task_id)
        for mutant in mutants
        if f"{task_id}/{mutant.name}" in wanted
    ]
    variants += [
        later_stubbed_variant(chapter, reference_report)
        for chapter in CHAPTERS_WITH_LATER_TASKS
        if chapter in wanted
    ]

    def run_share(worker: int) -> dict[str, dict]:
        tmp = tmp_path_factory.mktemp(f"worker{worker}")
        copy_repository(REPO_ROOT, tmp / "copy")
        return run_variants(tmp / "copy", variants[worker::2], tmp / "runs")

    with ThreadPoolExecutor(max_workers=2) as pool:
        return {name: report for share in pool.map(run_share, range(2)) for name, report in share.items()}


@pytest.mark.slow
@pytest.mark.parametrize("task_id", [t.task_id for t in TASKS])
def test_stubbed_task_fails_all_its_tests(task_id, reference_report, variant_reports):
    expected = task_tests(reference_report, task_id)
    assert expected, f"{task_id} has no tests"
    report = variant_reports[task_id]
    assert report["exitstatus"] == 1, report["output"]
    own = task_tests(report, task_id)
    assert own.keys() == expected.keys()
    for nodeid, test in own.items():
        assert test["outcome"] in ("failed", "error"), f"{nodeid} passes with {task_id} stubbed"
    messages = [test["message"] for test in own.values()]
    assert any(f"NotImplementedError: {task_id}:" in message for message in messages), report["output"]


@pytest.mark.slow
@pytest.mark.parametrize("task_id", [t.task_id for t in TASKS if earlier_tasks(t.task_id)])
def test_earlier_tasks_pass_without_later_ones(task_id, variant_reports):
    """Tasks are done in order, and each earns its point as soon as it works: with task
    t<k> stubbed, the tests of the chapter's tasks before it still pass."""
    report = variant_reports[task_id]
    earlier = {nodeid: test for nodeid, test in report["tests"].items() if task_id not in test["markers"]}
    assert earlier, f"no tests of {earlier_tasks(task_id)} ran"
    for nodeid, test in earlier.items():
        assert test["outcome"] == "passed", (
            f"{nodeid}, a test of an earlier task, fails with {task_id} stubbed"
        )


CHAPTERS_WITH_LATER_TASKS = [chapter for chapter in CHAPTERS_WITH_TASKS if chapter < CHAPTERS_WITH_TASKS[-1]]


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS_WITH_LATER_TASKS)
def test_a_chapters_tasks_pass_with_later_chapters_stubbed(chapter, variant_reports):
    """A student copy stubs the later chapters' tasks too (all but NEEDED_BY_EARLIER_CHAPTERS):
    those stubs must not fail a test of the chapter's own tasks."""
    report = variant_reports[chapter]
    assert report["tests"], f"no tests of {chapter}'s tasks ran"
    for nodeid, test in report["tests"].items():
        assert test["outcome"] == "passed", (
            f"{nodeid}, a test of {chapter}'s tasks, fails with the later chapters' tasks stubbed: "
            f"{test['message']}"
        )


def test_a_copy_hides_the_answers_of_later_chapters(tmp_path):
    """A copy of chapter 02 holds no reference body of a later chapter's task, though ch03_t2,
    ch12_t1 and ch12_t2 sit in a file it hands out; ch01's stay (the student did them), and so
    do the later tasks that earlier chapters' tests need."""
    assert set(NEEDED_BY_EARLIER_CHAPTERS) <= set(TASKS_BY_ID)
    copy = tmp_path / "copy"
    make_student_copy(["ch02"], copy)
    copied = {task.task_id: task for task in find_tasks(copy)}
    for task in TASKS:
        stubbed = task.chapter >= "ch02" and task.task_id not in NEEDED_BY_EARLIER_CHAPTERS
        expected = task.stub_line if stubbed else region_body(REPO_ROOT, task)
        assert region_body(copy, copied[task.task_id]) == expected, (
            f"{task.task_id}: a ch02 copy must hold {'its stub' if stubbed else 'its answer'}"
        )
    assert {"ch03_t2", "ch12_t1", "ch12_t2"} <= set(
        json.loads((copy / ASSIGNMENT_FILE).read_text())["later_tasks_stubbed"]
    )


def region_body(root: Path, task: Task) -> str:
    """The statements between the task's BEGIN and END lines in the tree at `root`."""
    lines = (root / task.path).read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(lines[task.begin_line : task.end_line - 1])


# Markdown code: fenced blocks, and inline spans (which may wrap across lines).
_CHAPTER_CODE_RE = re.compile(r"```.*?```|`[^`]+`", re.DOTALL)
# A statement that computes something (arithmetic, a comparison, indexing), long enough that quoting
# it gives a step of the answer away; a call or an attribute read alone does not.
_ANSWER_STATEMENT_RE = re.compile(r"[-+*/%<>\[]")
MIN_ANSWER_STATEMENT_CHARS = 16
# `name = value`: the value alone is the answer, whatever a chapter calls the name.
_ASSIGNMENT_RE = re.compile(r"^[\w.\[\]]+=(?!=)")


def answer_statements(task: Task) -> list[str]:
    """The task's statements that a chapter must not quote, without whitespace (and a
    trailing colon), each with its value alone when it is an assignment."""
    found = []
    for line in region_body(REPO_ROOT, task).splitlines():
        code = re.sub(r"\s+", "", line.split("  #")[0]).rstrip(":")
        if code.startswith("#"):
            continue
        value = code[_ASSIGNMENT_RE.match(code).end() :] if _ASSIGNMENT_RE.match(code) else None
        found += [
            part for part in (code, value)
            if part and len(part) >= MIN_ANSWER_STATEMENT_CHARS and _ANSWER_STATEMENT_RE.search(part)
        ]  # fmt: skip
    return found


def test_no_chapter_quotes_the_answer_of_its_own_or_a_later_task():
    """A chapter may show what a task must achieve, never its statements: no code in chapter NN
    (blocks or inline) holds a statement of a task of chapter NN or later, spacing aside.
    Earlier chapters' answers are fair game: the student wrote them already."""
    for path in sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]-*.md")):
        chapter = f"ch{path.name[:2]}"
        code = [
            re.sub(r"\s+", "", m.group().strip("`"))
            for m in _CHAPTER_CODE_RE.finditer(path.read_text("utf-8"))
        ]
        for task in TASKS:
            if task.chapter < chapter:
                continue
            for statement in answer_statements(task):
                assert not any(statement in quoted for quoted in code), (
                    f"{path.name} quotes {task.task_id}'s answer ({task.path}): {statement}; "
                    "say what the code must do instead"
                )


def test_every_task_has_at_least_three_mutants():
    assert set(MUTANTS) <= set(TASKS_BY_ID), f"mutants of unknown tasks: {set(MUTANTS) - set(TASKS_BY_ID)}"
    for task in TASKS:
        names = [mutant.name for mutant in MUTANTS.get(task.task_id, [])]
        assert len(names) >= 3, (
            f"{task.task_id} has {len(names)} mutants; plant at least 3 in tests/helpers/assignment_mutants.py"
        )
        assert len(set(names)) == len(names), f"{task.task_id}: mutant names repeat"


@pytest.mark.parametrize("mutant_id", MUTANT_IDS)
def test_mutant_applies_and_compiles(mutant_id):
    """Cheap, and before any run: the snippet is still in the region, the result is Python."""
    task_id, name = mutant_id.split("/")
    task = TASKS_BY_ID[task_id]
    (mutant,) = [m for m in MUTANTS[task_id] if m.name == name]
    text = (REPO_ROOT / task.path).read_text(encoding="utf-8")
    mutated = mutate_source(text, task, mutant)
    assert mutated != text
    compile(mutated, task.path, "exec")


def test_a_rotten_mutant_fails_loudly():
    (task,) = [t for t in parse_task_regions(SOURCE, "m.py") if t.task_id == "ch09_t1"]
    with pytest.raises(ValueError, match=r"mutant ch09_t1/gone: .* occurs 0 times in the region at m.py:4"):
        mutate_source(SOURCE, task, Mutant("gone", "", "y = x + 2", "y = x"))
    # Text outside the region (here the `return y` after END) is not the region's.
    with pytest.raises(ValueError, match="occurs 0 times"):
        mutate_source(SOURCE, task, Mutant("outside", "", "return y", "return 0"))
    assert mutate_source(SOURCE, task, Mutant("minus", "", "x + 1", "x - 1")) == SOURCE.replace(
        "y = x + 1", "y = x - 1"
    )


@pytest.mark.slow
@pytest.mark.parametrize("mutant_id", MUTANT_IDS)
def test_mutant_is_caught(mutant_id, reference_report, variant_reports):
    """The task's tests fail with the planted bug, and the first failure teaches."""
    task_id, name = mutant_id.split("/")
    (mutant,) = [m for m in MUTANTS[task_id] if m.name == name]
    report = variant_reports[mutant_id]
    own = task_tests(report, task_id)
    assert own.keys() == task_tests(reference_report, task_id).keys(), report["output"]
    failed = {nodeid: test for nodeid, test in own.items() if test["outcome"] in ("failed", "error")}
    assert failed, (
        f"mutant {mutant_id} ({mutant.description}) survived: all {len(own)} tests of {task_id} pass "
        f"with it; strengthen the tests marked {task_id}"
    )
    for nodeid, test in failed.items():
        assert not test["message"].startswith("assert "), (
            f"{nodeid} catches {mutant_id} with a bare assert; give the assertion a message that says "
            f"what is wrong: {test['message']}"
        )


# What grade may print for one failing task (its row, the table around it and the failures).
MAX_GRADE_LINES = 40


@pytest.mark.slow
def test_grade_teaches_with_partial_credit(reference_report, tmp_path):
    """The whole student loop: make a copy of ch04, implement ch04_t1 with a planted bug,
    leave ch04_t2 a stub, and grade it from inside the copy: only the tasks' own tests run,
    and the report is short."""
    copy = tmp_path / "student"
    make_student_copy(["ch04"], copy)
    done, stub = TASKS_BY_ID["ch04_t1"], TASKS_BY_ID["ch04_t2"]
    (bug,) = [m for m in MUTANTS[done.task_id] if m.name == "eos_despite_ignore_eos"]
    (copy / done.path).write_text(mutate_source((REPO_ROOT / done.path).read_text(), done, bug))
    score_path = tmp_path / "score.json"
    command = [sys.executable, "-m", "nano_v1.assignments", "grade", "--json", str(score_path),
               "--", "-p", "no:cacheprovider"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(copy))
    result = subprocess.run(
        command, cwd=copy, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout
    assert len(table.splitlines()) <= MAX_GRADE_LINES, table
    assert "AssertionError" not in table and "Traceback" not in table, table
    scores = json.loads(score_path.read_text())
    assert Path(scores["nano_v1"]).resolve().is_relative_to(copy.resolve())
    (run,) = scores["runs"]
    own = {*task_tests(reference_report, done.task_id), *task_tests(reference_report, stub.task_id)}
    assert (run["pass"], run["selected"]) == ("task tests", len(own)), (
        "the first pass runs the tasks' own tests"
    )
    assert scores["other_tests"] is None
    t1, t2 = scores["tasks"]
    assert (t1["task_id"], t1["all_passed"], t1["is_stub"]) == (done.task_id, False, False)
    assert t1["total"] == len(task_tests(reference_report, done.task_id)), "all of ch04_t1's tests count"
    assert 0 < t1["passed"] < t1["total"] and t1["points"] == t1["passed"] / t1["total"]
    assert (t2["task_id"], t2["passed"], t2["points"], t2["is_stub"]) == (stub.task_id, 0, 0.0, True)
    assert (scores["score"], scores["max_score"], scores["all_passed"]) == (t1["points"], 2, False)
    t1_row = (
        rf"^{done.task_id} +{t1['passed']}/{t1['total']} +{t1['points']:.2f} +{len(t1['failures'])} failing "
    )
    assert re.search(t1_row, table, re.MULTILINE), table
    assert re.search(rf"^{stub.task_id} +0/{t2['total']} +0.00 +to do ", table, re.MULTILINE), table
    assert re.search(rf"^total +{t1['points']:.2f}/2$", table, re.MULTILINE), table
    assert f"\n{done.task_id}: {len(t1['failures'])} of {t1['total']} tests fail\n" in table
    for failure in t1["failures"][:MAX_FAILURES_SHOWN]:
        assert f"\n  {failure['test']}: {failure['message'][: MAX_MESSAGE_CHARS - 3]}" in table, table
        assert "ignore_eos" in failure["message"], failure
    assert f"\n  full output: {t1['rerun']}\n" in table, table
    assert f"\n{stub.task_id}: not implemented yet (NotImplementedError): {stub.hint}" in table
