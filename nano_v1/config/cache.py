"""How the paged KV cache is laid out and sized.

Mirrors vllm/config/cache.py (`CacheConfig`) (chapters 02 and 03).
"""

from __future__ import annotations

from dataclasses import dataclass

from nano_v1.config.utils import check_positive_int


@dataclass
class CacheConfig:
    """The KV cache: block size, how much memory it gets, prefix caching."""

    block_size: int = 16
    """Tokens per KV cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights, activations and the KV cache)."""
    num_gpu_blocks_override: int | None = None
    """Use exactly this many KV cache blocks instead of sizing the cache from memory."""
    kv_cache_memory_bytes: int = 1 << 30
    """On the CPU, where there is nothing to profile against, the KV cache gets this many bytes."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before (chapter 03)."""
    num_gpu_blocks: int | None = None
    """Set by the engine core once the cache is sized; not an argument."""

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}."
            )
        if self.num_gpu_blocks_override is not None:
            check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)
        check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
