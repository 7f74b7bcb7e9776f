"""How the model is spread over devices, and how the workers that hold it are run.

Mirrors vllm/config/parallel.py (`ParallelConfig`) (chapter 13).

Why it exists: tensor parallelism cuts every layer into `tensor_parallel_size` shards,
one per rank (chapter 13), and the executor needs to know how to run those ranks. vLLM's
pipeline, data and expert parallelism are left out, so the world is one tensor-parallel
group and `world_size == tensor_parallel_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nano_v1.config.utils import check_positive_int

# vLLM's names (vllm/config/parallel.py::DistributedExecutorBackend), without "ray".
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many ranks share each layer, and how they are run."""

    tensor_parallel_size: int = 1
    """Ranks (devices) each layer's weights, attention heads and KV cache are split over (chapter 13)."""
    distributed_executor_backend: str | None = None
    """How the ranks run: uni (one worker in the engine core's process), mp (a worker process per rank)
    or external_launcher (each rank, started by torchrun, runs its own engine); default: uni for one rank,
    else mp."""
    world_size: int = field(init=False)
    """All ranks; here the tensor-parallel ranks (vLLM: tensor x pipeline parallel size)."""

    def __post_init__(self) -> None:
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        self.world_size = self.tensor_parallel_size
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {list(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}."
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size is "
                f"{self.tensor_parallel_size}: use 'mp' (a process per rank) or 'external_launcher' (torchrun)."
            )
