"""The error every caller gets once the engine core is gone.

Mirrors vllm/v1/engine/exceptions.py (chapter 09).

Why it exists: the frontend (`LLM`, `AsyncLLM`, the API server, the CLI) and the executor
all raise or catch it, so it lives in a module of its own that imports nothing.

What differs from v0.11.0: only `EngineDeadError`; v0.11.0's `EngineGenerateError`
(a failed `AsyncLLM.generate` that the engine survives) has no use here. Ours takes an
optional detail (the exit code, the dead rank) and puts it in the message.
"""

from __future__ import annotations


class EngineDeadError(Exception):
    """The engine core is gone; nothing more can be served."""

    def __init__(self, detail: str = "") -> None:
        message = "the engine core process died or stopped responding"
        super().__init__(f"{message}: {detail}" if detail else f"{message}; see its log above for the cause.")
