"""The `nano-v1` command in a process of its own, as a user runs it (chapters 01 and 09)."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nano_v1.entrypoints.cli", *args], capture_output=True, text=True, timeout=300
    )
