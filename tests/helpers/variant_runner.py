"""Run pytest on variants of one tree, each in a fork of one warm interpreter.

    python tests/helpers/variant_runner.py JOBS.json

The assignment integrity check (test_assignments.py) runs a task's tests on dozens of
variants of a student copy: one task stubbed, or one planted bug. A fresh
`python -m pytest` per variant spends most of its time importing torch. Here the heavy
third-party modules are imported once; each variant then runs in a forked child, which
imports the tree's own nano_v1 and tests from scratch (so nothing of nano_v1 may be
imported before the fork).

JOBS.json holds {"root": the tree, "jobs": [{"files": {a file relative to root: the
variant's text of it}, "args": pytest's arguments, "log": where the child's output goes,
"timeout": seconds}]}. A job's files are rewritten before its run and restored after it,
so the jobs run one after another.

Bytecode: the children compile each module once and cache it in a "pycache" directory
beside JOBS.json (`sys.pycache_prefix`, whatever PYTHONDONTWRITEBYTECODE says; nothing is
written into the tree or site-packages). A job's files lose their cached bytecode before
the run: Python checks a .pyc against its source's size and mtime in whole seconds, so a
variant written in the same second as the one before, at the same size, would otherwise
run that one's code.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import hypothesis  # noqa: F401  (imported here once, for every child)
import numpy  # noqa: F401
import pytest
import torch  # noqa: F401
import transformers  # noqa: F401

# pytest's plugins from installed packages too: a child would import (and assertion-rewrite) them.
for _plugin in importlib.metadata.entry_points(group="pytest11"):
    _plugin.load()
# What is loaded now lives on in every child: keep the garbage collector from walking it
# each time pytest collects garbage there (about half a second per full collection).
gc.freeze()


def run_job(root: Path, job: dict) -> int:
    """Write the job's variant, run pytest on it in a child, restore the files; the exit code."""
    originals = {path: (root / path).read_text(encoding="utf-8") for path in job["files"]}
    for path, text in job["files"].items():
        (root / path).write_text(text, encoding="utf-8")
        Path(importlib.util.cache_from_source(str(root / path))).unlink(missing_ok=True)
    try:
        pid = os.fork()
        if pid == 0:
            _run_child(root, job)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        for path, text in originals.items():
            (root / path).write_text(text, encoding="utf-8")


def _run_child(root: Path, job: dict) -> None:
    """In the forked child: run pytest in `root` and exit with its status; never returns."""
    code = 3
    try:
        with open(job["log"], "w", encoding="utf-8") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        os.chdir(root)
        # sys.path[0] is this script's directory, the reference's tests/helpers/: the tree's root
        # takes its place, so that the tree's own nano_v1 is imported.
        sys.path[0] = str(root)
        signal.alarm(job["timeout"])  # a variant that loops forever is killed (SIGALRM)
        code = int(pytest.main(job["args"]))
    except BaseException:  # noqa: BLE001  (say why, whatever it is; the child must reach os._exit)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(jobs_path: str) -> int:
    spec = json.loads(Path(jobs_path).read_text(encoding="utf-8"))
    root = Path(spec["root"])
    sys.pycache_prefix = str(Path(jobs_path).parent / "pycache")
    sys.dont_write_bytecode = False
    for job in spec["jobs"]:
        print(f"exit status {run_job(root, job)}: {job['log']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
