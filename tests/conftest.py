"""Fixtures and pytest hooks; the builders and fakes the tests share are in tests/helpers/.

Before any test module is imported: engines run in-process, and without a GPU Triton's
kernels run in its interpreter (nano_v1/triton_utils.py repairs it where a version needs it).
Fixtures: tiny checkpoints of every supported architecture (`tiny_checkpoint_any`) and
of Qwen3 (`tiny_qwen3`), one per session. Hooks: the assignment tasks' markers, skipping
`gpu` tests without CUDA, and the `fail_fast` Hypothesis profile.
"""

from __future__ import annotations

import os

import hypothesis
import pytest
import torch

# Engines under test run in-process unless a test asks for the engine-core process itself
# (chapter 09); spawning one per test would cost seconds each.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). Read when a
# kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.checkpoints import make_tiny_checkpoint  # noqa: E402  (after the environment above)


@pytest.fixture(scope="session", params=["qwen3", "qwen2", "llama"])
def tiny_checkpoint_any(request, tmp_path_factory) -> str:
    """A tiny checkpoint of each supported architecture."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def pytest_configure(config) -> None:
    """Register one marker per assignment task region in the source (`ch04_t1`, ...).

    Derived from the `# BEGIN TASK` lines, so a new task needs no edit here, and
    `--strict-markers` still rejects a task marker that names no region.
    """
    from nano_v1.assignments import find_tasks, pytest_marker_lines

    for line in pytest_marker_lines(find_tasks()):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config, items) -> None:
    """Skip `gpu`-marked tests where CUDA is absent (CI and laptops)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# `--hypothesis-profile=fail_fast`: report the first failing example as found, without
# shrinking or explaining it, and keep no example database. The assignment integrity
# check (test_assignments.py) only needs to know that a stubbed or planted-bug task
# fails; shrinking a failure that every example hits costs tens of seconds per test, and
# a database would replay one variant's failing examples against the next.
hypothesis.settings.register_profile(
    "fail_fast",
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    database=None,
)
