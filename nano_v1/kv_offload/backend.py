"""A tier's block allocator, as the LRU manager sees it: allocate, free, and say where a block is.

Mirrors vllm/v1/kv_offload/backend.py (chapter 16).

Why it exists: eviction policy (nano_v1/kv_offload/lru_manager.py) and storage (CPU memory
here, a disk or a remote store elsewhere) are separate choices; the manager asks a
`Backend` for room and for the `LoadStoreSpec` of the blocks it allocated.

What differs from v0.11.0: `BlockStatus` is a plain dataclass (v0.11.0 packs it in a
`ctypes.Structure` to keep millions of them small).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from nano_v1.core.kv_cache_utils import BlockHash
from nano_v1.kv_offload.abstract import LoadStoreSpec


@dataclass(slots=True)
class BlockStatus:
    """One offloaded block: `ref_cnt` transfers read it now; -1 while its store is in flight."""

    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        """Whether its data is written, so it may be looked up and loaded."""
        return self.ref_cnt >= 0


class Backend(ABC):
    """Allocates blocks of `block_size` tokens in one medium."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium

    @abstractmethod
    def get_num_free_blocks(self) -> int:
        """Blocks `allocate_blocks` can hand out now."""

    @abstractmethod
    def allocate_blocks(self, block_hashes: list[BlockHash]) -> list[BlockStatus]:
        """One new block (not ready: ref_cnt -1) per hash; the caller checked `get_num_free_blocks`."""

    @abstractmethod
    def free(self, block: BlockStatus) -> None:
        """Give back a block `allocate_blocks` returned, once."""

    @abstractmethod
    def get_load_store_spec(self, block_hashes: Iterable[BlockHash], blocks: Iterable[BlockStatus]) -> LoadStoreSpec:
        """Where a worker reads or writes these blocks."""
