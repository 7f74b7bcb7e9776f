"""Executors: how the engine core reaches its workers (chapter 13).

Mirrors vllm/v1/executor/: `abstract.py` (`Executor`, `UniProcExecutor`,
`ExecutorWithExternalLauncher`) and `multiproc_executor.py` (`MultiprocExecutor`).
"""

from nano_v1.executor.abstract import Executor

__all__ = ["Executor"]
