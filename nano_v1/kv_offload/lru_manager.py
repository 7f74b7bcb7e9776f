"""An offloading manager that evicts the least recently used block nobody is reading or writing.

Mirrors vllm/v1/kv_offload/lru_manager.py (chapter 16).

Why it exists: the CPU tier is finite. One ordered dict, hash -> `BlockStatus`, is both
the index and the LRU order (least recent first): `touch` and a new store move blocks to
the end, eviction takes from the front, skipping every block with a transfer in flight
(`ref_cnt != 0`: being stored, -1, or loaded, > 0). If the tier cannot make room without
dropping such a block, `prepare_store` answers None and the connector simply does not
offload (the device cache is unaffected).

What differs from v0.11.0: no offloading events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice

from nano_v1.core.kv_cache_utils import BlockHash
from nano_v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager, PrepareStoreOutput
from nano_v1.kv_offload.backend import Backend, BlockStatus


class LRUOffloadingManager(OffloadingManager):
    """An `OffloadingManager` over any `Backend`, evicting by LRU."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # hash -> its block, least recently used first.
        self.blocks: OrderedDict[BlockHash, BlockStatus] = OrderedDict()

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        hit_count = 0
        for block_hash in block_hashes:
            block = self.blocks.get(block_hash)
            if block is None or not block.is_ready:
                break
            hit_count += 1
        return hit_count

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        block_hashes = list(block_hashes)
        blocks = [self.blocks[block_hash] for block_hash in block_hashes]
        for block in blocks:
            assert block.is_ready, "prepare_load of a block whose store is not complete"
            block.ref_cnt += 1
        return self.backend.get_load_store_spec(block_hashes, blocks)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        # Backwards, so that the first block ends up the most recently used.
        for block_hash in reversed(list(block_hashes)):
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            block = self.blocks[block_hash]
            assert block.ref_cnt > 0, "complete_load without prepare_load"
            block.ref_cnt -= 1

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        block_hashes_to_store = [block_hash for block_hash in block_hashes if block_hash not in self.blocks]
        num_blocks_to_evict = len(block_hashes_to_store) - self.backend.get_num_free_blocks()
        to_evict: list[BlockHash] = []
        if num_blocks_to_evict > 0:
            # The least recently used blocks with no transfer in flight.
            evictable = (block_hash for block_hash, block in self.blocks.items() if block.ref_cnt == 0)
            to_evict = list(islice(evictable, num_blocks_to_evict))
            if len(to_evict) < num_blocks_to_evict:
                return None  # not enough room even after evicting all it may
        for block_hash in to_evict:
            self.backend.free(self.blocks.pop(block_hash))
        blocks = self.backend.allocate_blocks(block_hashes_to_store)
        assert len(blocks) == len(block_hashes_to_store)
        self.blocks.update(zip(block_hashes_to_store, blocks))  # new keys go to the end: most recent
        return PrepareStoreOutput(
            block_hashes_to_store=block_hashes_to_store,
            store_spec=self.backend.get_load_store_spec(block_hashes_to_store, blocks),
            block_hashes_evicted=to_evict,
        )

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        for block_hash in block_hashes:
            block = self.blocks[block_hash]
            if block.is_ready:
                continue  # stored before this store: kept either way
            if success:
                block.ref_cnt = 0
            else:
                self.backend.free(self.blocks.pop(block_hash))
