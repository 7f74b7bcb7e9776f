"""The CPU tier's allocator: block ids into the CPU tensors the worker's handler holds.

Mirrors vllm/v1/kv_offload/backends/cpu.py (chapter 16).

Why it exists: the scheduler must know which CPU block a hash lives in, without touching
the worker's memory; ids are handed out fresh (0, 1, 2, ...) until the tier is full, then
reused from the freed ones, the most recently freed first (v0.11.0's order).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nano_v1.core.kv_cache_utils import BlockHash
from nano_v1.kv_offload.backend import Backend, BlockStatus
from nano_v1.kv_offload.mediums import CPULoadStoreSpec


@dataclass(slots=True)
class CPUBlockStatus(BlockStatus):
    block_id: int = 0  # its block in the CPU tier's tensors


class CPUBackend(Backend):
    """`num_blocks` blocks of `block_size` tokens in CPU memory."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        super().__init__(block_size=block_size, medium=CPULoadStoreSpec.medium())
        self.num_blocks = num_blocks
        self.num_allocated_blocks = 0  # ids below it have been handed out at least once
        self.allocated_blocks_free_list: list[int] = []

    def get_num_free_blocks(self) -> int:
        return len(self.allocated_blocks_free_list) + self.num_blocks - self.num_allocated_blocks

    def allocate_blocks(self, block_hashes: list[BlockHash]) -> list[BlockStatus]:
        num_fresh_blocks = min(len(block_hashes), self.num_blocks - self.num_allocated_blocks)
        num_reused_blocks = len(block_hashes) - num_fresh_blocks
        assert len(self.allocated_blocks_free_list) >= num_reused_blocks, "allocate_blocks past the free blocks"
        blocks: list[BlockStatus] = [
            CPUBlockStatus(block_id=self.num_allocated_blocks + i) for i in range(num_fresh_blocks)
        ]
        self.num_allocated_blocks += num_fresh_blocks
        blocks += [CPUBlockStatus(block_id=self.allocated_blocks_free_list.pop()) for _ in range(num_reused_blocks)]
        return blocks

    def free(self, block: BlockStatus) -> None:
        assert isinstance(block, CPUBlockStatus)
        self.allocated_blocks_free_list.append(block.block_id)

    def get_load_store_spec(
        self, block_hashes: Iterable[BlockHash], blocks: Iterable[BlockStatus]
    ) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([block.block_id for block in blocks])  # type: ignore[attr-defined]
