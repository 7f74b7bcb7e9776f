"""The scheduler's view of the KV cache: which blocks each request holds, and cache hits.

Mirrors vllm/v1/core/kv_cache_manager.py (chapters 02 and 03), with vLLM's
KVCacheCoordinator and FullAttentionManager (vllm/v1/core/kv_cache_coordinator.py,
single_type_kv_cache_manager.py) folded in: we keep one KV cache group of full
attention (hybrid groups arrive in chapter 12), so blocks are plain lists, not
vLLM's per-group `KVCacheBlocks` tuples.

Why it exists: the scheduler decides *how many* tokens each request computes this
step; this class turns that into blocks. `allocate_slots` is all-or-nothing, so the
scheduler can try a request and, on None, preempt someone or stop admitting, with
nothing to undo.
"""

from __future__ import annotations

from nano_v1.core.block_pool import BlockPool
from nano_v1.core.kv_cache_utils import KVCacheBlock
from nano_v1.metrics.stats import PrefixCacheStats
from nano_v1.request import Request, RequestStatus


class KVCacheManager:
    """Per-request block lists on top of a `BlockPool`.

    Invariants, between calls:
      * `req_to_blocks[r]` holds ceil(tokens with a slot / block_size) blocks of r, in
        token order; each block's ref_cnt is the number of requests listing it.
      * `num_cached_block[r]`: the first that many blocks of r are registered in the
        prefix cache (or were hits); the rest are not, yet.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks matching the request's prefix.

        Returns (blocks, number of tokens they hold). Changes nothing, not even the
        statistics: the scheduler may still fail to allocate the rest of the request.
        It passes both values to `allocate_slots`, which touches the blocks.

        At most num_tokens - 1 tokens can hit: the model must run on at least the last
        prompt token to produce the logits the first output token is sampled from. The
        hit is whole blocks, so a fully cached prompt recomputes its whole last block.
        """
        if not self.enable_caching:
            return [], 0
        # BEGIN TASK ch03_t2: hits up to the first miss (last token never hits); set num_computed_tokens
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks = []
        # Chain hashes: block i's hash names tokens [0, (i+1) * block_size), so the
        # first miss ends the hit; nothing after it can match.
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        num_computed_tokens = len(computed_blocks) * self.block_size
        # END TASK
        return computed_blocks, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for the request's next `num_new_tokens` tokens; all or nothing.

        Token layout of the request after this call:

            | computed | new computed | new           | lookahead |
            |<- request.num_computed_tokens
                       |<- cache hits (new_computed_blocks), only on admission
                                      |<- computed this step
                                                      |<- draft-token slots
            |<------------- slots needed ------------------------>| (<= max_model_len)
            |<-------- committed to the cache ------->| (<= request.num_tokens)

        Returns None if the free pool cannot cover the new blocks, and then changes
        nothing. Cache hits that sit in the free queue (ref_cnt 0) count against the
        free pool too: touching them takes them out of it.

        With `full_sequence_must_fit` (the scheduler's `scheduler_reserve_full_isl`, on
        admission) it also returns None unless the free pool could hold the request's whole
        sequence, not just this chunk; it still allocates only this chunk's blocks.

        Otherwise returns only the freshly allocated blocks (possibly []). What the
        scheduler sends the runner:
          * a request already running: these new blocks, appended to its block table;
          * a request being admitted (new or resumed after preemption): its whole
            list, `get_block_ids(request_id)`, which starts with the cache hits.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is not None and not new_computed_blocks:
            # Fast path, most decode steps: the tokens fit in the blocks the request holds
            # and fill none of them, so there is nothing to allocate and nothing to cache.
            end = request.num_computed_tokens + num_new_tokens
            if end + num_lookahead_tokens <= len(req_blocks) * self.block_size and (
                not self.enable_caching
                or min(end, request.num_tokens) // self.block_size <= self.num_cached_block[request_id]
            ):
                return []
        else:
            req_blocks = req_blocks if req_blocks is not None else []
        new_computed_blocks = new_computed_blocks or []
        assert not (new_computed_blocks and req_blocks), "cache hits are only taken on admission"

        # BEGIN TASK ch02_t2: set num_computed_tokens and num_new_blocks (slots capped at max_model_len)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_required_blocks = -(-num_tokens_need_slot // self.block_size)  # ceil division
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(new_computed_blocks))
        # END TASK
        # A hit still in the free queue (ref_cnt 0) leaves it when touched, exactly like
        # a fresh block does, so it must be paid for out of the free blocks too.
        num_evictable_computed_blocks = (
            sum(block.ref_cnt == 0 for block in new_computed_blocks) if new_computed_blocks else 0
        )
        num_blocks_to_check = num_new_blocks
        if full_sequence_must_fit:
            num_full_sequence_blocks = -(-min(request.num_tokens, self.max_model_len) // self.block_size)
            num_blocks_to_check = max(
                num_new_blocks, num_full_sequence_blocks - len(req_blocks) - len(new_computed_blocks)
            )
        if num_blocks_to_check + num_evictable_computed_blocks > self.block_pool.get_num_free_blocks():
            return None

        # Committed from here on. Touch the hits first, so that get_new_blocks cannot
        # evict them to make room for this very request.
        if new_computed_blocks:
            assert self.enable_caching, "cache hits without prefix caching"
            self.block_pool.touch(new_computed_blocks)
        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = req_blocks
            self.num_cached_block[request_id] = len(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        # Most decode steps fit in the last block: 15 of 16 with block_size 16.
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Register blocks that this step's tokens fill. Only final tokens count:
            # lookahead slots hold draft tokens that may still be rejected.
            num_full_blocks = min(num_computed_tokens + num_new_tokens, request.num_tokens) // self.block_size
            num_cached_blocks = self.num_cached_block[request_id]
            if num_full_blocks > num_cached_blocks:
                self.block_pool.cache_full_blocks(
                    request, req_blocks, num_cached_blocks, num_full_blocks, self.block_size
                )
                self.num_cached_block[request_id] = num_full_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted) and forget it.

        Blocks go back last first: a sequence's tail joins the free queue ahead of
        its head, so the tail is evicted first. The tail is the part least likely to
        be shared (a later block hit needs every earlier block to hit too), and
        keeping the head keeps the longest reusable prefix.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (and nothing done) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        """How many leading blocks every running request shares (for cascade attention, chapter 07).

        A block shared by all `num_running_requests` running requests has exactly that
        ref_cnt; any running request's list works for the scan. Running requests that
        are not scheduled this step still count, so the answer can be 0 even when the
        scheduled ones share a prefix.
        """
        assert request.status == RequestStatus.RUNNING
        if not self.enable_caching:
            # As vLLM v0.11.0 (KVCacheCoordinatorNoPrefixCache): without prefix caching no
            # block is shared by design, so cascade attention is never asked for.
            return 0
        num_common_blocks = 0
        for block in self.req_to_blocks.get(request.request_id, []):
            if block.ref_cnt != num_running_requests:
                break
            num_common_blocks += 1
        return num_common_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's whole block table, in token order."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]
