"""Assignment mode: task regions in the reference code, student copies, and grading.

Course machinery (the tasks of chapters 01-15); vLLM has no counterpart.

Why it exists: the best way to learn an engine is to rebuild its key pieces and have the
real test suite judge them. The reference code marks each piece a student writes with a
region of whole statements:

    <indent># BEGIN TASK ch04_t2: <one-line hint>
    <indent>...reference statements...
    <indent># END TASK

`make_student_copy` copies the repository and replaces the statements of the chosen
tasks with `raise NotImplementedError("ch04_t2: <hint>")`, keeping both marker lines so
that the copy can be listed, graded and stubbed again. The tasks of later chapters are
stubbed too (their answers would sit in plain sight a few lines away), all but those that
earlier chapters' tests run through (NEEDED_BY_EARLIER_CHAPTERS). Tests that exercise a task carry
its marker (`@pytest.mark.ch04_t2`) next to the chapter marker, and `grade` runs
`pytest -m "ch04_t1 or ch04_t2"` with a small plugin that scores each task (see `grading`).

A `Mutant` is a planted bug in one task's region (the catalog is
tests/helpers/assignment_mutants.py): `mutate_source` applies it to the reference text, and the
integrity check (tests/test_assignments.py) proves that the task's tests catch it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import nano_v1

_BEGIN_RE = re.compile(r"(?P<indent>[ \t]*)# BEGIN TASK (?P<task_id>ch\d\d_t\d+): (?P<hint>\S.*?)\s*")
_END_RE = re.compile(r"(?P<indent>[ \t]*)# END TASK\s*")

# What a student copy contains: the package, its tests, what they import beside it (benchmarks/,
# tools/, examples/) and the course text. Not .git, virtual environments or build output.
COPIED_PATHS = (
    "nano_v1", "tests", "benchmarks", "tools", "examples", "chapters", "notebooks", "figures",
    "pyproject.toml", "README.md",
)  # fmt: skip
_IGNORED = shutil.ignore_patterns(
    "__pycache__", "*.pyc", ".pytest_cache", ".hypothesis", "*.egg-info", ".ipynb_checkpoints"
)
# Written into a student copy: the tasks it was made for, so `grade` knows what to run.
ASSIGNMENT_FILE = "ASSIGNMENT.json"


# Later tasks that a copy of an earlier chapter keeps as written, each with the reason: the
# tests of earlier chapters' tasks run through them. The integrity check (tests/test_assignments.py)
# proves that stubbing every other later task fails no test of a copy's own chapter.
NEEDED_BY_EARLIER_CHAPTERS = {
    "ch09_t3": "the LLM front door turns every step's tokens into text through it",
}


class TaskRegionError(ValueError):
    """A malformed task region; the message names file:line."""


@dataclass(slots=True, frozen=True)
class Task:
    """One task region: `path` is relative to the repository root, lines are 1-based."""

    task_id: str
    hint: str
    path: str
    begin_line: int
    end_line: int
    indent: str

    @property
    def chapter(self) -> str:
        return self.task_id.split("_")[0]

    @property
    def stub_line(self) -> str:
        """The statement that replaces the region in a student copy."""
        message = json.dumps(f"{self.task_id}: {self.hint}", ensure_ascii=False)
        return f"{self.indent}raise NotImplementedError({message})\n"


def parse_task_regions(text: str, path: str) -> list[Task]:
    """Find the task regions of one source file; raise TaskRegionError on a malformed one.

    A region's body must be non-empty and sit at or below the BEGIN line's indentation,
    and END must be indented like BEGIN: then replacing the body with one statement at
    that indentation keeps the file valid Python.
    """
    tasks: list[Task] = []
    open_begin: re.Match[str] | None = None
    begin_line = 0
    body_lines = 0
    for line_no, line in enumerate(text.splitlines(), start=1):
        where = f"{path}:{line_no}"
        if "# BEGIN TASK" in line:
            begin = _BEGIN_RE.fullmatch(line)
            if begin is None:
                raise TaskRegionError(
                    f"{where}: expected '# BEGIN TASK chNN_tK: <hint>', got {line.strip()!r}"
                )
            if open_begin is not None:
                raise TaskRegionError(
                    f"{where}: task {begin['task_id']} begins inside task {open_begin['task_id']} "
                    f"(opened at line {begin_line}); regions cannot nest"
                )
            open_begin, begin_line, body_lines = begin, line_no, 0
        elif "# END TASK" in line:
            end = _END_RE.fullmatch(line)
            if end is None:
                raise TaskRegionError(f"{where}: expected a bare '# END TASK', got {line.strip()!r}")
            if open_begin is None:
                raise TaskRegionError(f"{where}: '# END TASK' without a matching '# BEGIN TASK'")
            if end["indent"] != open_begin["indent"]:
                raise TaskRegionError(
                    f"{where}: '# END TASK' must be indented like its BEGIN line {begin_line}"
                )
            if body_lines == 0:
                raise TaskRegionError(f"{where}: task {open_begin['task_id']} has no statements")
            tasks.append(
                Task(
                    open_begin["task_id"], open_begin["hint"], path, begin_line, line_no, open_begin["indent"]
                )
            )
            open_begin = None
        elif open_begin is not None and line.strip():
            if not line.startswith(open_begin["indent"]):
                raise TaskRegionError(
                    f"{where}: line is indented less than its task's BEGIN line {begin_line}; "
                    "a region must hold whole statements at one level"
                )
            body_lines += 1
    if open_begin is not None:
        raise TaskRegionError(f"{path}:{begin_line}: task {open_begin['task_id']} has no '# END TASK'")
    return tasks


def check_source_checkout(root: Path) -> None:
    """Raise ValueError unless `root` holds the tests that assignments copy and run."""
    if not (root / "tests").is_dir():
        raise ValueError(
            "the assignments need a source checkout of nano_v1 (git clone the repository, then "
            f"pip install -e . in it): {root} has no tests/ directory"
        )


def source_checkout() -> Path:
    """The source checkout of the imported nano_v1: the directory that holds the package, checked to be one.

    Assignments copy the repository's tests and run them, so they work in a clone only
    (installed with `pip install -e .` or put on the path). Installed from a wheel, the
    directory that holds the package is site-packages, and this raises ValueError saying so.
    """
    (package_dir,) = nano_v1.__path__
    root = Path(package_dir).resolve().parent
    check_source_checkout(root)
    return root


def find_tasks(root: Path | None = None) -> list[Task]:
    """Every task region under root/nano_v1, sorted by task id; task ids must be unique.

    `root` defaults to `source_checkout()`.
    """
    root = source_checkout() if root is None else root
    tasks: dict[str, Task] = {}
    package_dir = root / "nano_v1"
    for source in sorted(package_dir.rglob("*.py")):
        rel_path = source.relative_to(root).as_posix()
        if rel_path.startswith("nano_v1/assignments/"):
            continue  # this package's docstrings show the markers; they are not regions
        for task in parse_task_regions(source.read_text(encoding="utf-8"), rel_path):
            if task.task_id in tasks:
                first = tasks[task.task_id]
                raise TaskRegionError(
                    f"{rel_path}:{task.begin_line}: duplicate task id {task.task_id} "
                    f"(first at {first.path}:{first.begin_line})"
                )
            tasks[task.task_id] = task
    return sorted(tasks.values(), key=lambda t: (t.chapter, int(t.task_id.split("_t")[1])))


def select_tasks(tasks: list[Task], selectors: list[str]) -> list[Task]:
    """Tasks named by chapters (`ch04`) or task ids (`ch04_t1`); a ValueError names unknown ones."""
    known_chapters = sorted({t.chapter for t in tasks})
    by_id = {t.task_id: t for t in tasks}
    chosen: dict[str, Task] = {}
    for selector in selectors:
        if selector in by_id:
            chosen[selector] = by_id[selector]
        elif selector in known_chapters:
            chosen.update((t.task_id, t) for t in tasks if t.chapter == selector)
        else:
            raise ValueError(
                f"no task or chapter with tasks named {selector!r}; "
                f"chapters with tasks: {', '.join(known_chapters) or 'none'}; "
                f"tasks: {', '.join(by_id) or 'none'}"
            )
    return [t for t in tasks if t.task_id in chosen]


def later_tasks(tasks: list[Task], chosen: list[Task]) -> list[Task]:
    """The tasks of chapters after the last chapter of `chosen` that a student copy stubs too:
    all but NEEDED_BY_EARLIER_CHAPTERS."""
    last = max(t.chapter for t in chosen)
    return [t for t in tasks if t.chapter > last and t.task_id not in NEEDED_BY_EARLIER_CHAPTERS]


def stub_source(text: str, tasks: list[Task]) -> str:
    """`text` with the body of each of `tasks` (all regions of this file) replaced by its stub."""
    lines = text.splitlines(keepends=True)
    # Bottom up, so earlier line numbers stay valid.
    for task in sorted(tasks, key=lambda t: t.begin_line, reverse=True):
        lines[task.begin_line : task.end_line - 1] = [task.stub_line]
    return "".join(lines)


@dataclass(slots=True, frozen=True)
class Mutant:
    """A planted bug in one task: the mistake `description` names, as a textual edit.

    `old` must occur exactly once in the body of the task's region (between its BEGIN
    and END lines) and becomes `new`; write both with the file's own indentation.
    """

    name: str
    description: str
    old: str
    new: str


def mutate_source(text: str, task: Task, mutant: Mutant) -> str:
    """`text` (the file holding `task`) with `mutant` applied inside the task's region.

    Raises ValueError, naming the mutant, unless `old` occurs exactly once there: a
    mutant whose snippet the reference no longer holds must fail loudly, not go untested.
    """
    lines = text.splitlines(keepends=True)
    body = "".join(lines[task.begin_line : task.end_line - 1])
    count = body.count(mutant.old)
    if count != 1:
        raise ValueError(
            f"mutant {task.task_id}/{mutant.name}: its old snippet {mutant.old!r} occurs {count} times "
            f"in the region at {task.path}:{task.begin_line}, not once; update the mutant"
        )
    lines[task.begin_line : task.end_line - 1] = [body.replace(mutant.old, mutant.new)]
    return "".join(lines)


def copy_repository(root: Path, out: Path) -> None:
    """Copy what a student copy holds (COPIED_PATHS) from `root` into the new directory `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED_PATHS:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, out / name, ignore=_IGNORED)
        elif source.is_file():
            shutil.copy2(source, out / name)
    _make_pytest_import_the_copy(out / "pyproject.toml")


def make_student_copy(selectors: list[str], out: Path, root: Path | None = None) -> list[Task]:
    """Copy the repository at `root` to `out` with the selected tasks stubbed; return them.

    Every task of a later chapter (`later_tasks`) is stubbed as well; ASSIGNMENT_FILE records
    both lists. `root` defaults to `source_checkout()`.

    `out` must not exist yet (or be an empty directory) and must lie outside `root`.
    """
    root, out = (source_checkout() if root is None else root).resolve(), out.resolve()
    all_tasks = find_tasks(root)
    tasks = select_tasks(all_tasks, selectors)
    if not tasks:
        raise ValueError("choose at least one chapter or task")
    if out == root or root in out.parents:
        raise ValueError(f"--out {out} is inside the repository {root}; choose a directory outside it")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty")
    later = later_tasks(all_tasks, tasks)
    stubbed = tasks + later
    copy_repository(root, out)
    for path in sorted({t.path for t in stubbed}):
        target = out / path
        target.write_text(
            stub_source(target.read_text(encoding="utf-8"), [t for t in stubbed if t.path == path]),
            encoding="utf-8",
        )
    assignment = {"tasks": [t.task_id for t in tasks], "later_tasks_stubbed": [t.task_id for t in later]}
    (out / ASSIGNMENT_FILE).write_text(json.dumps(assignment, indent=2) + "\n")
    return tasks


def _make_pytest_import_the_copy(pyproject: Path) -> None:
    """Put the copy's root on pytest's sys.path, so that a plain `pytest` run in the copy
    tests the copy's nano_v1 and not the reference installed in editable mode."""
    section = "[tool.pytest.ini_options]\n"
    text = pyproject.read_text(encoding="utf-8") if pyproject.is_file() else ""
    if section in text and "\npythonpath" not in text:
        pyproject.write_text(text.replace(section, section + 'pythonpath = ["."]\n', 1), encoding="utf-8")


def pytest_marker_lines(tasks: list[Task]) -> list[str]:
    """`markers` ini lines registering one pytest marker per task."""
    return [f"{t.task_id}: assignment task ({t.path}): {t.hint}" for t in tasks]
