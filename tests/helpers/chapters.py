"""Reading what the chapters and docstrings write: paths with brace groups (`a/{b,c}.py`)."""

from __future__ import annotations

import itertools
import re


def expand_braces(path: str) -> list[str]:
    """`a/{b,c}.py` -> [`a/b.py`, `a/c.py`] (one level, any number of groups)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]

