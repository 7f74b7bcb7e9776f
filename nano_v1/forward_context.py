"""The forward context: per-step data that attention layers read without it being threaded
through every module's `forward` signature.

Mirrors vllm/forward_context.py (chapter 06).

Why it exists: a model's `forward(input_ids, positions)` stays the same as in Hugging
Face; the attention metadata for the step is set here by the model runner around the
forward call, and each `Attention` layer picks it up. This is the one piece of global
mutable state in nano_v1, owned by this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    # The backend's metadata for this step (e.g. FlashAttentionMetadata); None during
    # a profiling or warm-up run that has no KV cache to read or write.
    attn_metadata: Any


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "an attention layer ran outside set_forward_context()"
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata)
    try:
        yield
    finally:
        _forward_context = previous
