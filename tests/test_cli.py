"""The `nano-v1` command: the quick start's main job, and clear errors for bad flags.

The quick start's command runs as the reader runs it, in a process of its own; the flag
checks call the same `main` in this process.
"""

from __future__ import annotations

import pytest
from helpers.cli import run_cli

from nano_v1.entrypoints.cli import main

pytestmark = pytest.mark.ch01


def test_generate_with_the_bundled_model():
    result = run_cli("generate", "def fibonacci(n):", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fibonacci(n):")
    assert len(result.stdout.splitlines()[0]) > len("def fibonacci(n):") or len(result.stdout.splitlines()) > 2


def test_generate_rejects_bad_sampling_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "x = 1", "--max-tokens", "0"])
    assert exit_info.value.code == 2
    assert "max_tokens" in capsys.readouterr().err


def test_engine_flags_come_from_engine_args(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--max-num-seqs", "--block-size", "--enable-prefix-caching", "--max-num-batched-tokens"):
        assert flag in help_text
