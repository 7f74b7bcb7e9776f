"""How the model is spread over devices.

Mirrors vllm/config/parallel.py (`ParallelConfig`) (chapter 13).

Empty for now: nano_v1 runs one worker on one device. Tensor parallelism (chapter 13)
fills it with vLLM's `tensor_parallel_size` and `distributed_executor_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """One worker, one device (the only layout so far)."""
