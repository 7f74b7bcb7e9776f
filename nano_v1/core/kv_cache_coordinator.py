"""The KV cache groups of one model, kept in step: one block pool, one manager per group.

Mirrors vllm/v1/core/kv_cache_coordinator.py (chapter 12).

Why it exists: a request's tokens live in every group at once (each group is a set of
layers with its own block table), so every decision about a request is taken for all
groups together. Allocation is all-or-nothing across groups: the blocks every group
needs are counted before any is taken. A prefix-cache hit must be a hit in every group:
the request computes from the same position in all layers. Without prefix caching
(`KVCacheCoordinatorNoPrefixCache`) there is no hit to agree on; with one group
(`UnitaryKVCacheCoordinator`) that is chapter 03's search; with full-attention and
sliding-window groups (`HybridKVCacheCoordinator`) the full-attention hit bounds the
sliding-window search, whose hit is then the answer for both.

What differs from v0.11.0: two shortcuts for the calls the scheduler makes for every
running request every step. `UnitaryKVCacheCoordinator` passes them straight to its one
manager instead of looping over a tuple of one; and `remove_skipped_blocks` asks only the
managers that can drop a block (not full attention's, whose answer is always "none").
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from nano_v1.core.block_pool import BlockPool
from nano_v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from nano_v1.core.single_type_kv_cache_manager import FullAttentionManager, get_manager_for_kv_cache_spec
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nano_v1.request import Request


class KVCacheCoordinator(ABC):
    """One `SingleTypeKVCacheManager` per KV cache group, over one shared `BlockPool`.

    Block lists travel as tuples with one list per group, in group order.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, kv_cache_group_id)
            for kv_cache_group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        # Full attention never drops a block while a request runs, so
        # `remove_skipped_blocks`, called for every running request every step, asks only
        # the other managers (none, for most models).
        self.managers_that_skip_blocks = tuple(
            manager for manager in self.single_type_managers if not isinstance(manager, FullAttentionManager)
        )

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: tuple[list[KVCacheBlock], ...]
    ) -> int:
        """Free blocks that all groups together need for `num_tokens` slots (hits included)."""
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, blocks)
            for manager, blocks in zip(self.single_type_managers, new_computed_blocks)
        )

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[list[KVCacheBlock], ...]
    ) -> None:
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks):
            manager.save_new_computed_blocks(request_id, blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Fresh blocks for every group, group 0 first (it takes the front of the free queue)."""
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens) for manager in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        return [
            manager.get_num_common_prefix_blocks(request_id, num_running_requests)
            for manager in self.single_type_managers
        ]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers_that_skip_blocks:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(manager.req_to_blocks.get(request_id, []) for manager in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """(the hit's blocks, one list per group; its length in tokens), valid for every group."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups, no hit ever, no block shared by design."""

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(kv_cache_config, enable_caching=False)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        return [0] * len(self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group: every layer full attention, or every layer the same window."""

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool) -> None:
        super().__init__(kv_cache_config, enable_caching)
        assert len(kv_cache_config.kv_cache_groups) == 1
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size
        (self.manager,) = self.single_type_managers

    # The scheduler calls these for every running request every step: with one group each
    # goes straight to its manager, with no loop over groups and no generator.
    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: tuple[list[KVCacheBlock], ...]
    ) -> int:
        return self.manager.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[0])

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[list[KVCacheBlock], ...]
    ) -> None:
        self.manager.save_new_computed_blocks(request_id, new_computed_blocks[0])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        return (self.manager.allocate_new_blocks(request_id, num_tokens),)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks = self.manager.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Full-attention groups plus groups of one other kind (one window size), as vLLM v0.11.0 allows."""

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool) -> None:
        super().__init__(kv_cache_config, enable_caching)
        self.verify_and_split_kv_cache_groups()

    def verify_and_split_kv_cache_groups(self) -> None:
        """Split the group ids into full attention and the other kind; check there are exactly two specs.

        Both kinds must have one block size here (the hit search needs the other kind's
        block size to be a multiple of full attention's; nano_v1 uses one block size).
        The two kinds' ids must not interleave, so that merging their hits in id order is
        a concatenation.
        """
        groups = self.kv_cache_config.kv_cache_groups
        self.full_attention_group_ids = [
            i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)
        ]
        self.other_group_ids = [i for i in range(len(groups)) if i not in self.full_attention_group_ids]
        full_specs = {groups[i].kv_cache_spec for i in self.full_attention_group_ids}
        other_specs = {groups[i].kv_cache_spec for i in self.other_group_ids}
        if len(full_specs) != 1 or len(other_specs) != 1:
            raise ValueError(
                "HybridKVCacheCoordinator needs exactly one full-attention spec and one other spec, "
                f"got {full_specs} and {other_specs}."
            )
        (self.full_attention_spec,) = full_specs
        (self.other_spec,) = other_specs
        if self.full_attention_spec.block_size != self.other_spec.block_size:
            raise ValueError("every KV cache group must have the same block size.")
        self.block_size = self.full_attention_spec.block_size
        self.other_attention_cls = type(self.single_type_managers[self.other_group_ids[0]])
        if max(self.full_attention_group_ids) < min(self.other_group_ids):
            self.full_attn_first = True
        elif max(self.other_group_ids) < min(self.full_attention_group_ids):
            self.full_attn_first = False
        else:
            raise ValueError("full-attention and other KV cache group ids must not interleave.")

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The full-attention hit first, then the other kind's hit within it; both cut to the shorter.

        Full attention needs every block from the start, the sliding window only the
        blocks of its last window: a full-attention hit of L tokens bounds the sliding
        search to L, and whatever that search finds (never more than L) is a hit for both,
        since a full-attention hit is also a hit of every shorter length.
        """
        hit_blocks_full_attn = FullAttentionManager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            self.full_attention_group_ids,
            self.block_pool,
            self.full_attention_spec,
        )
        hit_length = len(hit_blocks_full_attn[0]) * self.block_size
        hit_blocks_other_attn = self.other_attention_cls.find_longest_cache_hit(
            block_hashes, hit_length, self.other_group_ids, self.block_pool, self.other_spec
        )
        hit_length = len(hit_blocks_other_attn[0]) * self.block_size
        for group_hit_blocks in hit_blocks_full_attn:
            del group_hit_blocks[hit_length // self.block_size :]
        if self.full_attn_first:
            return hit_blocks_full_attn + hit_blocks_other_attn, hit_length
        return hit_blocks_other_attn + hit_blocks_full_attn, hit_length


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, enable_caching: bool) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, enable_caching)
    return HybridKVCacheCoordinator(kv_cache_config, enable_caching)
