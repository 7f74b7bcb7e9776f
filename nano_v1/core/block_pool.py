"""The pool of KV cache blocks: allocation, reference counts, and the prefix-cache index.

Mirrors vllm/v1/core/block_pool.py (chapters 02, 03 and 12).

Why it exists: every request's KV lives in fixed-size blocks drawn from one pool, so
memory is handed out in small units and nothing is reserved for tokens not yet
generated. With prefix caching the same pool is also the cache: a freed block keeps
its contents and its hash until the block is handed out again, so "free" and "cached"
are not separate memory, and eviction costs nothing until the space is needed. With
several KV cache groups (chapter 12) the pool is shared: any block can go to any group,
and the cache index keys a block by its hash *and* its group.
"""

from __future__ import annotations

from collections.abc import Iterable

from nano_v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from nano_v1.request import Request


class BlockPool:
    """All KV cache blocks, the free queue, and the hash -> cached block index.

    A block is in exactly one of three states:
      * in use: ref_cnt > 0, held by that many running requests (maybe with a hash);
      * free and cached: ref_cnt == 0, in the free queue, still has its hash, so a
        new request can hit it (`touch`) until it is evicted;
      * free and empty: ref_cnt == 0, in the free queue, no hash.
    Eviction is lazy: a cached block loses its hash only when `get_new_blocks` hands
    it out for other tokens.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        assert num_gpu_blocks >= 1, "the pool needs at least the null block"
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # {(block hash, group): {block_id: block}}. Usually one block per key; two requests
        # that computed the same prefix in the same step each cache their own copy (blocks
        # are never swapped for a cached twin: block tables are append-only).
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        # Block 0 is a placeholder the runner can point at (e.g. padded block-table
        # entries; skipped sliding-window blocks, chapter 12). Nobody owns it: it is
        # taken out of the free queue here, and its ref_cnt is never maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """For each group, a block holding exactly this prefix; None if any group misses.

        Does not change any state.
        """
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            blocks = self.cached_block_hash_to_block.get(make_block_hash_with_group_id(block_hash, group_id))
            if not blocks:
                return None
            cached_blocks.append(next(iter(blocks.values())))
        return cached_blocks

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]`, newly full, in the cache.

        `blocks` is the request's whole block list in group `kv_cache_group_id`; the first
        `num_cached_blocks` are already registered (or were cache hits). Hashes come from
        `request.block_hashes`, computed as the tokens arrived, so caching costs a dict
        insert per block.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"{request.request_id}: {num_full_blocks} full blocks of {block_size} tokens but only "
            f"{len(request.block_hashes)} hashes; was the Request built with a block_hasher?"
        )
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks],
            request.block_hashes[num_cached_blocks:num_full_blocks],
        ):
            key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
            block.block_hash = key  # asserts the block had no hash
            self.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the front of the free queue (ref_cnt 0 -> 1).

        A handed-out block that was still cached is evicted now: its old contents are
        about to be overwritten. Does not look for cache hits.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} are free")
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in new_blocks:
            assert block.ref_cnt == 0
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return new_blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop `block` from the cache index if it is there; True if it was."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        same_hash = self.cached_block_hash_to_block[block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True

    def touch(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        """Take a reference on cache-hit blocks (one list per group); a hit on a free block
        rescues it from eviction. A hit may list the null block (a sliding window's skipped
        blocks): it is never in the queue, and its count means nothing."""
        for blocks_per_group in blocks:
            for block in blocks_per_group:
                if block.ref_cnt == 0 and not block.is_null:
                    self.free_block_queue.remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's back.

        `ordered_blocks` is in eviction order: the first block to reach 0 will be the
        first of them evicted.
        """
        now_free = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0 or block.is_null, f"{block} freed more often than allocated"
            if block.ref_cnt == 0 and not block.is_null:
                now_free.append(block)
        self.free_block_queue.append_n(now_free)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update); only when no block is in use.

        Returns False, changing nothing, while any request still holds blocks: a
        running request's blocks would otherwise lose their hashes mid-flight.
        """
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:  # the null block is never free
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks `get_new_blocks` could hand out now, cached-but-free ones included."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        num_usable = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / num_usable if num_usable else 0.0
