"""Command line of assignment mode: list tasks, make a student copy, grade it.

Course machinery (the tasks of chapters 01-15); vLLM has no counterpart.

    python -m nano_v1.assignments list
    python -m nano_v1.assignments make ch04 [ch05_t1 ...] --out ../nano_v1-ch04
    cd ../nano_v1-ch04
    python -m nano_v1.assignments grade [--chapter-tests] [--verbose] [--json score.json] [-- -x]

`grade` runs the tasks' own tests and prints a table (tests passed, partial-credit points,
status per task) and then, for each task not done, its hint while it is still a stub, else
each failing test with the one line its assertion gives and the pytest command that shows
the full output; `--chapter-tests` also runs the chapters' other tests, `--verbose` shows
pytest's own output, `--json` writes the scores and both passes (see `grading`).

Why it exists: one entry point per step of the student's loop; `grade` always tests the
tree this module was imported from, so it refuses to run from anywhere but that tree's
root (from elsewhere, an installed reference copy could be graded by mistake).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nano_v1.assignments import (
    ASSIGNMENT_FILE,
    TaskRegionError,
    find_tasks,
    make_student_copy,
    select_tasks,
    source_checkout,
)
from nano_v1.assignments.grading import format_table, grade, to_json


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after "--" goes to pytest untouched.
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv

    parser = argparse.ArgumentParser(prog="python -m nano_v1.assignments", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="print every task with its file and hint")
    make = commands.add_parser("make", help="write a student copy with the chosen tasks stubbed")
    make.add_argument("selectors", nargs="+", metavar="CHAPTER_OR_TASK", help="e.g. ch04 or ch04_t1")
    make.add_argument("--out", required=True, type=Path, help="new directory for the copy")
    grade = commands.add_parser("grade", help="run the tasks' tests here and print a score per task")
    grade.add_argument(
        "selectors", nargs="*", metavar="CHAPTER_OR_TASK",
        help=f"default: the tasks recorded in {ASSIGNMENT_FILE}, else every task",
    )  # fmt: skip
    grade.add_argument(
        "--chapter-tests", action="store_true",
        help="then also run the chapters' tests outside the tasks (a second pass, no points)",
    )  # fmt: skip
    grade.add_argument("--verbose", action="store_true", help="show pytest's own output")
    grade.add_argument("--json", type=Path, help="also write the scores to this file")
    args = parser.parse_args(argv)

    try:
        root = source_checkout()
        tasks = find_tasks(root)
        if args.command == "list":
            width = max((len(f"{t.path}:{t.begin_line}") for t in tasks), default=0)
            for task in tasks:
                print(f"{task.task_id:9} {f'{task.path}:{task.begin_line}':{width}}  {task.hint}")
            return 0
        if args.command == "make":
            chosen = make_student_copy(args.selectors, args.out, root)
            print(
                f"wrote {args.out} with {len(chosen)} task(s) to do: {', '.join(t.task_id for t in chosen)}"
            )
            print(f"grade it with: cd {args.out} && python -m nano_v1.assignments grade")
            return 0
        return _grade(root, tasks, args, pytest_args)
    except (TaskRegionError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _grade(root: Path, tasks, args: argparse.Namespace, pytest_args: list[str]) -> int:
    if Path.cwd().resolve() != root:
        raise ValueError(
            f"nano_v1 was imported from {root}, but the current directory is {Path.cwd()}; "
            "run grade from the root of the copy you want graded"
        )
    assignment = root / ASSIGNMENT_FILE
    selectors = args.selectors
    if not selectors and assignment.exists():
        selectors = json.loads(assignment.read_text())["tasks"]
    chosen = select_tasks(tasks, selectors) if selectors else tasks
    task_scores, others, runs = grade(root, chosen, pytest_args, args.chapter_tests, args.verbose)
    print(format_table(task_scores, others, runs))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(task_scores, others, runs), indent=2) + "\n")
    return 0 if all(s.all_passed for s in task_scores) else 1


if __name__ == "__main__":
    sys.exit(main())
