"""One KV cache group's blocks: what each request holds, what it still needs, what it can drop.

Mirrors vllm/v1/core/single_type_kv_cache_manager.py (chapters 02, 03 and 12).

Why it exists: the bookkeeping of chapter 02 (block lists, counting what a request still
needs) and chapter 03 (registering full blocks, finding hits) is the same for every
kind of attention, but two decisions are not. Which blocks may a request drop while it
runs? Full attention: none, every token stays visible. A sliding window of w tokens:
every block that lies wholly before the oldest key the next query can see, handed back
to the pool (`SlidingWindowManager.remove_skipped_blocks`). And which cached blocks make
a prefix-cache hit? Full attention: an unbroken run from the first block
(`FullAttentionManager.find_longest_cache_hit`). A sliding window: only the blocks the
next query's window covers must be there, so the search runs from the right
(`SlidingWindowManager.find_longest_cache_hit`). One manager per KV cache group; the
coordinator (kv_cache_coordinator.py) makes them agree.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

from nano_v1.core.block_pool import BlockPool
from nano_v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from nano_v1.request import Request


class SingleTypeKVCacheManager(ABC):
    """Per-request block lists of one KV cache group, on a block pool shared with the other groups.

    Invariants, between calls:
      * `req_to_blocks[r]` holds ceil(tokens with a slot / block_size) entries, in token
        order; an entry may be the null block (a block a sliding window dropped, or a
        hit that needs no KV). Each real block's ref_cnt counts the requests listing it.
      * `num_cached_block[r]`: the first that many entries of r are registered in the
        prefix cache (or were hits); the rest are not, yet.
      * A request is in both dicts or in neither: an allocation that fails leaves no trace.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free blocks the request needs to give `num_tokens` tokens (all it has) a slot.

        New blocks beyond those it holds and the hits, plus the hits that sit in the free
        queue (ref_cnt 0): touching them takes them out of it, exactly as a fresh block is.
        """
        num_held = len(self.req_to_blocks.get(request_id, ()))
        # BEGIN TASK ch02_t2: blocks for num_tokens slots, minus those held and the hits (never negative)
        num_required_blocks = -(-num_tokens // self.block_size)  # ceil division
        num_new_blocks = max(0, num_required_blocks - num_held - len(new_computed_blocks))
        # END TASK
        if not new_computed_blocks:
            return num_new_blocks  # a running request: hits are only taken on admission
        num_evictable_computed_blocks = sum(
            block.ref_cnt == 0 and not block.is_null for block in new_computed_blocks
        )
        return num_new_blocks + num_evictable_computed_blocks

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Start the block list of a request being admitted with its hits (maybe none)."""
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "cache hits are only taken on admission"
            return
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append fresh blocks until `num_tokens` tokens have a slot; return the fresh ones."""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that the first `num_tokens` (final) tokens fill."""
        request_id = request.request_id
        num_full_blocks = num_tokens // self.block_size
        num_cached_blocks = self.num_cached_block[request_id]
        if num_full_blocks > num_cached_blocks:
            self.block_pool.cache_full_blocks(
                request,
                self.req_to_blocks[request_id],
                num_cached_blocks,
                num_full_blocks,
                self.block_size,
                self.kv_cache_group_id,
            )
            self.num_cached_block[request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Give back the request's blocks, last first, and forget it.

        A sequence's tail joins the free queue ahead of its head, so the tail is evicted
        first: a later block is only ever a hit together with the blocks before it.
        """
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    @abstractmethod
    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks every running request shares (cascade attention, chapter 07)."""

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest prefix of at most `max_length` tokens (whole blocks) that hits in every
        group of `kv_cache_group_ids`; one block list per group, skipped blocks as the null block.

        A classmethod: the coordinator asks before any manager holds the request.
        """

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no query from `num_computed_tokens` on can see; the null block takes their place."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token stays visible: blocks are only given back when the request ends."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Full attention: the cached blocks of `block_hashes` from the first block up to the
        first miss (a miss ends the hit: every later hash names a prefix that includes it),
        at most `max_num_blocks` whole blocks; each block found in every group."""
        assert isinstance(kv_cache_spec, FullAttentionSpec)
        computed_blocks: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_num_blocks = max_length // kv_cache_spec.block_size
        # BEGIN TASK ch03_t2: hits from the first block up to the first miss, at most max_num_blocks
        # Chain hashes: block i's hash names tokens [0, (i+1) * block_size), so the
        # first miss ends the hit; nothing after it can match.
        for block_hash in itertools.islice(block_hashes, max_num_blocks):
            cached_blocks = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached_blocks is None:
                break
            for computed, cached in zip(computed_blocks, cached_blocks):
                computed.append(cached)
        # END TASK
        return computed_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return  # every block stays visible

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """A block shared by all `num_running_requests` has exactly that ref_cnt; any running
        request's list works for the scan. Running requests not scheduled this step still
        count, so the answer can be 0 even when the scheduled ones share a prefix."""
        num_common_blocks = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            num_common_blocks += 1
        return num_common_blocks


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query at position p sees keys p - sliding_window + 1 .. p: older blocks go back to the pool."""

    def __init__(
        self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Search from the right for a run of cached blocks that covers the next query's window.

        A hit of L tokens means the next token computed is at position L; its window needs
        keys L - w + 1 .. L - 1 (w - 1 of them: the token itself is computed), i.e. the last
        ceil((w - 1) / block_size) blocks before L, and nothing older. So the hit ends at
        the rightmost such run; blocks left of the run come back as the null block. A run
        that reaches block 0 is a hit even if shorter: no key before it exists. The hit is
        at most `max_length` tokens (whole blocks): the coordinator passes the full-attention
        hit there, which bounds this one.
        E.g. block size 4, w = 8, max_length 24: cached [_, 3, 8, _, 9, _] -> hit
        [null, 3, 8] of 12 tokens.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        sliding_window_contiguous_blocks = -(-(kv_cache_spec.sliding_window - 1) // kv_cache_spec.block_size)
        max_num_blocks = max_length // kv_cache_spec.block_size
        null_block = block_pool.null_block
        computed_blocks = tuple([null_block] * max_num_blocks for _ in kv_cache_group_ids)
        # BEGIN TASK ch12_t2: from the right, find the window's run of cached blocks; end the hit after it
        num_contiguous_blocks = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached_blocks = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached_blocks is None:
                num_contiguous_blocks = 0
                continue
            for computed, cached in zip(computed_blocks, cached_blocks):
                computed[i] = cached
            num_contiguous_blocks += 1
            if num_contiguous_blocks >= sliding_window_contiguous_blocks:
                # The run is blocks i .. i + num_contiguous_blocks - 1: the hit ends there.
                for computed in computed_blocks:
                    del computed[i + num_contiguous_blocks :]
                match_found = True
                break
        if not match_found:
            # The loop ended at block 0: only a run that starts there (maybe empty) is a hit.
            for computed in computed_blocks:
                del computed[num_contiguous_blocks:]
        # END TASK
        return computed_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free every block wholly before the oldest key the next query (at `num_computed_tokens`) sees.

        Blocks are replaced, not removed: a block table's j-th entry must stay the block of
        tokens j * block_size .. (j + 1) * block_size - 1. The scan stops at the first null
        block from the right, since everything before it was dropped by an earlier call; a
        decode step so drops at most one block.
        """
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return  # being admitted: it holds nothing yet
        # BEGIN TASK ch12_t1: null out and free the blocks before the block of key num_computed_tokens - w + 1
        first_useful_token = num_computed_tokens - self.sliding_window + 1
        first_useful_block = first_useful_token // self.block_size
        removed_blocks = []
        for i in range(first_useful_block - 1, -1, -1):
            if blocks[i] is self._null_block:
                break
            removed_blocks.append(blocks[i])
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed_blocks)
        # END TASK

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """0: a sliding window's leading entries are null blocks, and cascade attention has no window."""
        return 0


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    return spec_manager_map[type(kv_cache_spec)](kv_cache_spec, block_pool, kv_cache_group_id)
