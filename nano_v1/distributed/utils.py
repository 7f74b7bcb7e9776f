"""Arithmetic of splitting a dimension over ranks.

Mirrors vllm/distributed/utils.py (`divide`) (chapter 13).
"""

from __future__ import annotations


def divide(numerator: int, denominator: int) -> int:
    """`numerator / denominator`, which must be exact: a dimension is split into equal shards."""
    if numerator % denominator:
        raise ValueError(
            f"{numerator} is not divisible by {denominator}: it cannot be split into equal shards."
        )
    return numerator // denominator
