"""The scheduler's view of the KV cache: which blocks each request holds, and cache hits.

Mirrors vllm/v1/core/kv_cache_manager.py (chapters 02, 03 and 12).

Why it exists: the scheduler decides *how many* tokens each request computes this
step; this class turns that into blocks, for every KV cache group of the model at once
(one group for most models; sliding-window and full-attention groups for hybrid ones,
chapter 12). `allocate_slots` is all-or-nothing, so the scheduler can try a request and,
on None, preempt someone or stop admitting, with nothing to undo. The per-group work
lives in single_type_kv_cache_manager.py, the agreement between groups in
kv_cache_coordinator.py; the scheduler sees only `KVCacheBlocks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nano_v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from nano_v1.core.kv_cache_utils import KVCacheBlock
from nano_v1.kv_cache_interface import KVCacheConfig
from nano_v1.metrics.stats import PrefixCacheStats
from nano_v1.request import Request, RequestStatus


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks handed between the KV cache manager and the scheduler: `blocks[g][j]` is the
    j-th block of KV cache group g. Groups are the outer dimension, so that groups could
    one day have different block counts."""

    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Both lists of blocks, group by group (a request's hits, then its new blocks)."""
        return KVCacheBlocks(tuple(mine + theirs for mine, theirs in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; with `allow_none`, None when every group's list is empty (the
        common decode step: nothing new to send the runner)."""
        if allow_none and not any(self.blocks):
            return None
        return tuple([block.block_id for block in group] for group in self.blocks)


class KVCacheManager:
    """Per-request blocks of every KV cache group, on one shared `BlockPool`."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool = True
    ) -> None:
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        # Every group has this block size (nano_v1 uses cache_config.block_size for all).
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, enable_caching)
        self.block_pool = self.coordinator.block_pool
        # Every group holds the same number of entries for a request (a sliding window's
        # dropped blocks stay as null entries) and caches the same number, so group 0's
        # counts answer for all groups in the decode fast path of `allocate_slots`.
        self._first_manager = self.coordinator.single_type_managers[0]
        # Returned when nothing was allocated; nobody may append to it.
        self.empty_kv_cache_blocks = self.create_empty_block_list()
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests (0.0 .. 1.0)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the stats gathered since the last call, and start a new interval."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup: its `num_tokens` queried, `num_hit_tokens` hit.

        The scheduler calls this once the request's `allocate_slots` succeeded, not at
        `get_computed_blocks`: a request that fails to allocate stays waiting and looks
        up again next step, and vLLM v0.11.0, which counts in `get_computed_blocks`,
        counts it once per attempt (vllm-project/vllm#43736). A request resumed after
        preemption is admitted, and counted, again, as in v0.11.0: it looks up its
        prompt and its outputs so far. Nothing is counted with caching off (no lookup).
        """
        if not self.enable_caching:
            return
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of cached full blocks matching the request's prefix, in every group.

        Returns (blocks, number of tokens they hold). Changes nothing, not even the
        statistics: the scheduler may still fail to allocate the rest of the request.
        It passes both values to `allocate_slots`, which touches the blocks.

        At most num_tokens - 1 tokens can hit: the model must run on at least the last
        prompt token to produce the logits the first output token is sampled from. The
        hit is whole blocks, so a fully cached prompt recomputes its whole last block.

        A request that wants prompt logprobs gets no hit: they need every prompt
        position's hidden states, which a cached block does not keep.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_kv_cache_blocks, 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        return KVCacheBlocks(computed_blocks), num_new_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for the request's next `num_new_tokens` tokens in every group; all or nothing.

        Token layout of the request after this call:

            | computed | new computed | new           | lookahead |
            |<- request.num_computed_tokens
                       |<- cache hits (new_computed_blocks), only on admission
                                      |<- computed this step
                                                      |<- draft-token slots
            |<------------- slots needed ------------------------>| (<= max_model_len)
            |<-------- committed to the cache ------->| (<= request.num_tokens)

        First, blocks that no query from `request.num_computed_tokens` on can see go back
        to the pool (sliding windows; a no-op for full attention), even if the rest fails:
        they would be dropped anyway, and freeing them first leaves more to allocate from.

        Raises ValueError if `num_new_tokens` < 1: a scheduled request computes at least one
        token, so 0 is the caller's bug.

        Returns None if the free pool cannot cover the new blocks of every group, and then
        changes nothing else. Cache hits that sit in the free queue (ref_cnt 0) count
        against the free pool too: touching them takes them out of it.

        Once everything fits: touch the hits before allocating (a hit still in the free
        queue could otherwise be handed out as a fresh block, to this very request), then
        allocate, then, with prefix caching, commit to the cache every block the final
        tokens fill. Those count this step's hits (`num_new_computed_tokens`) as well as
        the computed and new tokens, never a lookahead slot or a scheduled draft (beyond
        `request.num_tokens`), and are committed even when no new block is needed.

        With `full_sequence_must_fit` (the scheduler's `scheduler_reserve_full_isl`, on
        admission) it also returns None unless the free pool could hold the request's whole
        sequence, not just this chunk; it still allocates only this chunk's blocks. The
        check counts every block of the sequence in every group, as if no window dropped
        any: an upper bound for sliding-window groups.

        With `delay_cache_blocks` (a KV connector loading the tokens asynchronously, chapter
        16) nothing is committed to the cache: the blocks hold no KV until the load ends, and
        a hit on them would read garbage. The scheduler commits them then (`cache_blocks`).

        Otherwise returns only the freshly allocated blocks per group (maybe none). What
        the scheduler sends the runner:
          * a request already running: these new blocks, appended to its block tables;
          * a request being admitted (new or resumed after preemption): its whole
            lists, `get_blocks(request_id)`, which start with the cache hits.
        """
        # BEGIN TASK ch02_t3: a slot for every token in every group, or None and nothing changed (no undo); cache final tokens only
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        request_id = request.request_id
        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        if new_computed_blocks is None:
            # Fast path, most decode steps: the tokens fit in the blocks the request holds
            # and fill none of them, so there is nothing to allocate and nothing to cache.
            # It runs for every running request every step: comparisons, not min(), pick
            # the final tokens and cap the slots (CPython's min() costs several comparisons).
            req_blocks = self._first_manager.req_to_blocks.get(request_id)
            end = request.num_computed_tokens + num_new_tokens
            num_tokens = request.num_tokens
            if (
                req_blocks is not None
                and end + num_lookahead_tokens <= len(req_blocks) * self.block_size
                and (
                    not self.enable_caching
                    or (end if end < num_tokens else num_tokens) // self.block_size
                    <= self._first_manager.num_cached_block[request_id]
                )
            ):
                return self.empty_kv_cache_blocks
            new_computed_block_list = self.empty_kv_cache_blocks.blocks
        else:
            new_computed_block_list = new_computed_blocks.blocks

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:  # lookahead slots stop at the context's end
            num_tokens_need_slot = self.max_model_len
        num_tokens_to_check = num_tokens_need_slot
        if full_sequence_must_fit:
            num_tokens_to_check = max(num_tokens_need_slot, min(request.num_tokens, self.max_model_len))
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_to_check, new_computed_block_list
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        # Committed from here on. Touch the hits first, so that get_new_blocks cannot
        # evict them to make room for this very request.
        if self.enable_caching:
            self.block_pool.touch(new_computed_block_list)
        else:
            assert not any(new_computed_block_list), "cache hits without prefix caching"
        coordinator.save_new_computed_blocks(request_id, new_computed_block_list)
        # Most decode steps fit in the last block: 15 of 16 with block_size 16.
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching and not delay_cache_blocks:
            # Register blocks that this step's tokens fill. Only final tokens count:
            # lookahead slots and scheduled drafts hold tokens that may still be rejected.
            num_final_tokens = num_computed_tokens + num_new_tokens
            if num_final_tokens > request.num_tokens:
                num_final_tokens = request.num_tokens
            coordinator.cache_blocks(request, num_final_tokens)
        return KVCacheBlocks(new_blocks)
        # END TASK

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks that the request's first `num_computed_tokens` (final) tokens fill, if caching."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group (finished, aborted or preempted) and forget it."""
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (and nothing done) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> list[int]:
        """Per group, how many leading blocks every running request shares (cascade attention, chapter 07).

        All zero without prefix caching (`KVCacheCoordinatorNoPrefixCache`): no block is
        shared by design, so cascade attention is never asked for.
        """
        assert request.status == RequestStatus.RUNNING
        return self.coordinator.get_num_common_prefix_blocks(request.request_id, num_running_requests)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's whole block lists, one per group, in token order."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block tables, one per group."""
        return self.get_blocks(request_id).get_block_ids()

    def create_empty_block_list(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))
