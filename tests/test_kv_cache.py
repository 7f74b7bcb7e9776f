"""Paged KV cache (ch02) and prefix caching (ch03) against brute-force models.

The oracles are deliberately naive: a Python list for the free queue (O(n) removal),
and for the manager a model that names every cached block by the *token tuple* it
holds (the whole prefix) instead of a hash, and tracks the eviction order in a list.
Hypothesis drives random sequences of scheduler-like calls and checks every
invariant after every call.
"""

from __future__ import annotations

import functools

import pytest
from conftest import make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import FakeModelRunner

from nano_v1.core.block_pool import BlockPool
from nano_v1.core.kv_cache_manager import KVCacheManager
from nano_v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
)
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.metrics.stats import PrefixCacheStats
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(
    request_id: str, prompt: list[int], block_size: int = BLOCK_SIZE, max_tokens: int = 1000
) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        block_hasher=get_request_block_hasher(block_size),
    )


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue.get_all_free_blocks()]


# ----------------------------------------------------------------------------- ch02: free queue


def check_links(queue: FreeKVCacheBlockQueue, expected: list[int]) -> None:
    """Forward walk, backward walk and the counter all agree with the model."""
    assert queue_ids(queue) == expected
    backward = []
    block = queue.fake_free_list_tail.prev_free_block
    while block is not queue.fake_free_list_head:
        backward.append(block.block_id)
        block = block.prev_free_block
    assert backward == expected[::-1]
    assert queue.num_free_blocks == len(expected)


@pytest.mark.ch02_t1
@pytest.mark.ch02
@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(0, 12), data=st.data())
def test_free_queue_matches_list_model(num_blocks, data):
    blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    queue = FreeKVCacheBlockQueue(blocks)
    model = list(range(num_blocks))  # front = next to be evicted
    for _ in range(data.draw(st.integers(0, 40))):
        outside = [i for i in range(num_blocks) if i not in model]
        op = data.draw(st.sampled_from(["popleft", "popleft_n", "remove", "append", "append_n"]))
        if op == "popleft":
            if model:
                assert queue.popleft().block_id == model.pop(0)
            else:
                with pytest.raises(ValueError):
                    queue.popleft()
        elif op == "popleft_n":
            n = data.draw(st.integers(0, len(model)))
            assert [b.block_id for b in queue.popleft_n(n)] == model[:n]
            del model[:n]
        elif op == "remove" and model:
            victim = data.draw(st.sampled_from(model))
            queue.remove(blocks[victim])
            model.remove(victim)
        elif op == "append" and outside:
            block_id = data.draw(st.sampled_from(outside))
            queue.append(blocks[block_id])
            model.append(block_id)
        elif op == "append_n":
            ids = data.draw(st.permutations(outside)) if outside else []
            ids = ids[: data.draw(st.integers(0, len(ids)))]
            queue.append_n([blocks[i] for i in ids])
            model.extend(ids)
        check_links(queue, model)
        for i in range(num_blocks):
            in_queue = blocks[i].prev_free_block is not None
            assert in_queue == (i in model), f"block {i} links disagree with membership"


# ----------------------------------------------------------------------------- ch02: pool basics


@pytest.mark.ch02_t1
@pytest.mark.ch02
def test_null_block_is_never_handed_out():
    pool = BlockPool(num_gpu_blocks=5, enable_caching=False)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0 and queue_ids(pool.free_block_queue) == [1, 2, 3, 4]


@pytest.mark.ch02_t2
@pytest.mark.ch02
def test_allocate_slots_rounds_up_and_caps_at_max_model_len():
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=20, max_model_len=10, enable_caching=False)
    request = make_request("r", list(range(5)))
    new_blocks = manager.allocate_slots(request, 5)
    assert len(new_blocks) == 2  # ceil(5 / 4)
    request.num_computed_tokens = 5
    # 5 + 1 + 7 lookahead = 13 slots (4 blocks), but no position past max_model_len = 10
    # exists: 3 blocks.
    assert len(manager.allocate_slots(request, 1, num_lookahead_tokens=7)) == 1
    assert len(manager.get_block_ids("r")) == 3
    with pytest.raises(ValueError):
        manager.allocate_slots(request, 0)


@pytest.mark.ch02_t2
@pytest.mark.ch02
def test_allocate_slots_is_all_or_nothing():
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=4, max_model_len=100, enable_caching=False)
    big = make_request("big", list(range(8)))
    assert manager.allocate_slots(big, 8) is not None  # 2 of the 3 usable blocks
    greedy = make_request("greedy", list(range(8)))
    assert manager.allocate_slots(greedy, 8) is None  # needs 2, 1 is free
    assert manager.get_block_ids("greedy") == [] and "greedy" not in manager.req_to_blocks
    assert manager.block_pool.get_num_free_blocks() == 1
    manager.free(big)
    assert manager.allocate_slots(greedy, 8) is not None


# ----------------------------------------------------------------------------- the reference model


class ReferenceCache:
    """Brute-force model of the pool + manager: blocks named by the tokens they hold."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        self.enable_caching = enable_caching
        self.free_order = list(range(1, num_gpu_blocks))  # front = evicted first
        self.ref = [0] * num_gpu_blocks
        # Block id -> the full token prefix it caches, or None.
        self.content: list[tuple[int, ...] | None] = [None] * num_gpu_blocks
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def longest_hit(self, tokens: list[int]) -> int:
        """Blocks of `tokens` servable from cache: every prefix must be cached, last token excluded."""
        if not self.enable_caching:
            return 0
        cached = {c for c in self.content if c is not None}
        num_blocks = 0
        while (num_blocks + 1) * BLOCK_SIZE <= len(tokens) - 1:
            if tuple(tokens[: (num_blocks + 1) * BLOCK_SIZE]) not in cached:
                break
            num_blocks += 1
        return num_blocks

    def allocate(self, rid, tokens, num_computed, num_new, hits, num_lookahead, max_model_len):
        """Returns the block ids that must be handed out fresh, or None if they do not fit."""
        held = self.req_blocks.get(rid, [])
        need = -(
            -min(num_computed + len(hits) * BLOCK_SIZE + num_new + num_lookahead, max_model_len) // BLOCK_SIZE
        )
        num_fresh = max(0, need - len(held) - len(hits))
        if num_fresh + sum(self.ref[b] == 0 for b in hits) > len(self.free_order):
            return None
        for b in hits:
            if self.ref[b] == 0:
                self.free_order.remove(b)
            self.ref[b] += 1
        fresh = self.free_order[:num_fresh]  # LRU: the front goes first
        del self.free_order[:num_fresh]
        for b in fresh:
            self.content[b] = None  # evicted
            self.ref[b] = 1
        if rid not in self.req_blocks:
            self.req_blocks[rid] = []
            self.num_cached[rid] = len(hits)
        self.req_blocks[rid] += hits + fresh
        if self.enable_caching:
            num_final = min(num_computed + len(hits) * BLOCK_SIZE + num_new, len(tokens))
            for i in range(self.num_cached[rid], num_final // BLOCK_SIZE):
                b = self.req_blocks[rid][i]
                assert self.content[b] is None
                self.content[b] = tuple(tokens[: (i + 1) * BLOCK_SIZE])
            self.num_cached[rid] = max(self.num_cached[rid], num_final // BLOCK_SIZE)
        return fresh

    def free(self, rid):
        for b in reversed(self.req_blocks.pop(rid, [])):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_order.append(b)
        self.num_cached.pop(rid, None)


def snapshot(manager: KVCacheManager):
    pool = manager.block_pool
    return (
        queue_ids(pool.free_block_queue),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: manager.get_block_ids(rid) for rid in manager.req_to_blocks},
        dict(manager.num_cached_block),
        {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
    )


def check_invariants(manager: KVCacheManager, model: ReferenceCache, live: dict[str, Request]) -> None:
    pool = manager.block_pool
    assert queue_ids(pool.free_block_queue) == model.free_order
    assert {rid: manager.get_block_ids(rid) for rid in live} == model.req_blocks
    holders: dict[int, list[tuple[str, int]]] = {}
    for rid, ids in model.req_blocks.items():
        for pos, b in enumerate(ids):
            holders.setdefault(b, []).append((rid, pos))
    for block in pool.blocks[1:]:
        owners = holders.get(block.block_id, [])
        assert block.ref_cnt == len(owners), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, owners {owners}"
        )
        assert (block.ref_cnt == 0) == (block.prev_free_block is not None), "free queue != blocks with ref 0"
        if len(owners) > 1:
            # Sharing is only legal for a cached full block at the same position of
            # requests that agree on every token up to its end.
            assert block.block_hash is not None
            prefixes = {tuple(live[rid].all_token_ids[: (pos + 1) * BLOCK_SIZE]) for rid, pos in owners}
            assert len(prefixes) == 1 and len({pos for _, pos in owners}) == 1
        assert (block.block_hash is not None) == (model.content[block.block_id] is not None)
        if block.block_hash is not None:
            assert block.block_hash == expected_hash(model.content[block.block_id])
            assert pool.cached_block_hash_to_block[block.block_hash][block.block_id] is block
    assert sum(len(d) for d in pool.cached_block_hash_to_block.values()) == sum(
        c is not None for c in model.content
    )
    num_used = sum(r > 0 for r in model.ref[1:])
    assert manager.usage == pytest.approx(num_used / (len(pool.blocks) - 1))


@functools.cache
def expected_hash(prefix: tuple[int, ...]):
    """The chain hash of a whole prefix, built block by block from the start."""
    parent = expected_hash(prefix[:-BLOCK_SIZE]) if len(prefix) > BLOCK_SIZE else None
    return hash_block_tokens(parent, prefix[-BLOCK_SIZE:])


# Prompts share a few stems, so requests hit each other's blocks; tokens come from a
# tiny vocabulary, so unrelated prompts also collide on content now and then.
STEMS = [[7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]


def draw_prompt(data) -> list[int]:
    stem = data.draw(st.sampled_from(STEMS + [[]]))
    stem = stem[: data.draw(st.integers(0, len(stem)))]
    return stem + data.draw(st.lists(st.integers(0, 3), min_size=0 if stem else 1, max_size=14))


def run_random_workload(data, enable_caching: bool, num_gpu_blocks: int, max_model_len: int = 40) -> None:
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks, max_model_len, enable_caching)
    model = ReferenceCache(num_gpu_blocks, enable_caching)
    live: dict[str, Request] = {}
    next_id = 0
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["admit", "admit", "step", "step", "step", "free", "reset", "common"]))
        if op == "admit":
            request = make_request(f"r{next_id}", draw_prompt(data))
            next_id += 1
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            num_hit_blocks = model.longest_hit(request.all_token_ids)
            assert num_hit_tokens == num_hit_blocks * BLOCK_SIZE == len(hits) * BLOCK_SIZE
            assert num_hit_tokens < request.num_tokens  # the last token is always recomputed
            for i, block in enumerate(hits):
                assert model.content[block.block_id] == tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])
            remaining = request.num_tokens - num_hit_tokens
            num_new = data.draw(st.integers(1, remaining))  # a chunked prefill
            num_lookahead = data.draw(st.integers(0, 2))
            before = snapshot(manager)
            fresh = manager.allocate_slots(request, num_new, num_hit_tokens, hits, num_lookahead)
            expected = model.allocate(
                request.request_id,
                request.all_token_ids,
                0,
                num_new,
                [b.block_id for b in hits],
                num_lookahead,
                max_model_len,
            )
            if expected is None:
                assert fresh is None and snapshot(manager) == before
                continue
            assert [b.block_id for b in fresh] == expected
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens + num_new
            live[request.request_id] = request
        elif op == "step" and live:
            request = live[data.draw(st.sampled_from(sorted(live)))]
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids(data.draw(st.integers(0, 3)))  # "sampled" last step
            num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
            if request.num_computed_tokens + num_new > max_model_len:
                continue
            num_lookahead = data.draw(st.integers(0, 2))
            before = snapshot(manager)
            fresh = manager.allocate_slots(request, num_new, num_lookahead_tokens=num_lookahead)
            expected = model.allocate(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                num_new,
                [],
                num_lookahead,
                max_model_len,
            )
            if expected is None:
                assert fresh is None and snapshot(manager) == before
                # What the scheduler does next: preempt (free) the request.
                manager.free(request)
                model.free(request.request_id)
                del live[request.request_id]
            else:
                assert [b.block_id for b in fresh] == expected
                request.num_computed_tokens += num_new
        elif op == "free" and live:
            request = live.pop(data.draw(st.sampled_from(sorted(live))))
            manager.free(request)
            model.free(request.request_id)
        elif op == "reset":
            assert manager.reset_prefix_cache() == (not live)
            if not live:
                model.content = [None] * num_gpu_blocks
        elif op == "common" and live:
            request = live[data.draw(st.sampled_from(sorted(live)))]
            held_by_all = set.intersection(*(set(ids) for ids in model.req_blocks.values()))
            expected_common = 0
            while enable_caching and expected_common < len(model.req_blocks[request.request_id]) and (
                model.req_blocks[request.request_id][expected_common] in held_by_all
            ):
                expected_common += 1  # without caching nothing is shared by design: 0 (vLLM v0.11.0)
            assert manager.get_num_common_prefix_blocks(request, len(live)) == expected_common
        check_invariants(manager, model, live)

    for request in live.values():
        manager.free(request)
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:]) and not manager.req_to_blocks
    assert manager.reset_prefix_cache() and not pool.cached_block_hash_to_block


@pytest.mark.ch02_t2
@pytest.mark.ch02
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_gpu_blocks=st.integers(2, 24))
def test_allocator_against_reference(data, num_gpu_blocks):
    run_random_workload(data, enable_caching=False, num_gpu_blocks=num_gpu_blocks)


@pytest.mark.ch03
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_gpu_blocks=st.integers(2, 24))
def test_prefix_cache_against_reference(data, num_gpu_blocks):
    run_random_workload(data, enable_caching=True, num_gpu_blocks=num_gpu_blocks)


# ----------------------------------------------------------------------------- ch03: directed cases


@pytest.mark.ch03_t1
@pytest.mark.ch03
def test_block_hashes_are_chained_and_only_for_full_blocks():
    request = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(request.block_hashes) == 2  # the 9th token's block is not full
    assert request.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4])
    assert request.block_hashes[1] == hash_block_tokens(request.block_hashes[0], [5, 6, 7, 8])
    # Same tokens, different history: a different hash.
    assert request.block_hashes[1] != hash_block_tokens(None, [5, 6, 7, 8])
    for token in [10, 11, 12]:
        request.append_output_token_ids(token)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [9, 10, 11, 12])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 1)) != hash_block_tokens(None, [1, 2, 3, 4])


@pytest.mark.ch03_t2
@pytest.mark.ch03
def test_fully_cached_prompt_recomputes_its_last_block():
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, max_model_len=100)
    first = make_request("a", list(range(8)))
    assert manager.get_computed_blocks(first) == ([], 0)
    manager.allocate_slots(first, 8)
    manager.free(first)
    again = make_request("b", list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 4 and [b.block_id for b in hits] == [1]
    longer = make_request("c", list(range(9)))
    assert manager.get_computed_blocks(longer)[1] == 8
    # Lookups change nothing, statistics included: the scheduler counts admissions.
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()


@pytest.mark.ch03_t2
@pytest.mark.ch03
def test_hits_sitting_in_the_free_queue_count_against_free_space():
    # 3 usable blocks. A caches all 3 and finishes; B hits all 3 (still free, ref 0)
    # and needs a 4th. Counting only the 4th as "new" would say yes, then touching
    # the hits would leave nothing to allocate it from.
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=4, max_model_len=100)
    a = make_request("a", list(range(12)))
    manager.allocate_slots(a, 12)
    manager.free(a)
    b = make_request("b", list(range(16)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 12 and all(block.ref_cnt == 0 for block in hits)
    before = snapshot(manager)
    assert manager.allocate_slots(b, 4, num_hit_tokens, hits) is None
    assert snapshot(manager) == before


@pytest.mark.ch03_t2
@pytest.mark.ch03
def test_eviction_is_lru_and_tail_first():
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=7, max_model_len=100)
    pool = manager.block_pool
    a = make_request("a", [1] * 8 + [0])  # blocks 1, 2 full; block 3 partial
    b = make_request("b", [2] * 8 + [0])  # blocks 4, 5 full; block 6 partial
    manager.allocate_slots(a, 9)
    manager.allocate_slots(b, 9)
    manager.free(a)  # a first: its blocks are older
    manager.free(b)
    # Reverse order within a request: tail first.
    assert queue_ids(pool.free_block_queue) == [3, 2, 1, 6, 5, 4]
    filler = make_request("f", [3] * 5)
    manager.allocate_slots(filler, 5)  # takes blocks 3 and 2: a's partial and a's tail
    assert manager.get_block_ids("f") == [3, 2]
    assert manager.get_computed_blocks(make_request("a2", [1] * 8 + [0]))[1] == 4  # head survives
    assert manager.get_computed_blocks(make_request("b2", [2] * 8 + [0]))[1] == 8  # b untouched
    # A hit rescues a free block from eviction: touch moves it out of the queue.
    b3 = make_request("b3", [2] * 8 + [5])
    hits, num_hit_tokens = manager.get_computed_blocks(b3)
    manager.allocate_slots(b3, 1, num_hit_tokens, hits)
    assert [blk.block_id for blk in hits] == [4, 5] and 4 not in queue_ids(pool.free_block_queue)


@pytest.mark.ch03
def test_caching_disabled_never_hits_or_hashes():
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, max_model_len=100, enable_caching=False)
    a = make_request("a", list(range(9)))
    manager.allocate_slots(a, 9)
    manager.free(a)
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert not manager.block_pool.cached_block_hash_to_block
    assert all(block.block_hash is None for block in manager.block_pool.blocks)


@pytest.mark.ch03_t1
@pytest.mark.ch03
def test_lookahead_slots_are_not_cached():
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, max_model_len=100)
    a = make_request("a", list(range(6)))
    manager.allocate_slots(a, 6, num_lookahead_tokens=6)  # 12 slots -> 3 blocks
    assert len(manager.get_block_ids("a")) == 3
    assert manager.num_cached_block["a"] == 1  # only tokens 0..3 form a full, final block
    assert [b.block_hash is not None for b in manager.req_to_blocks["a"]] == [True, False, False]


@pytest.mark.ch03
def test_duplicate_blocks_are_all_indexed_and_evicted_one_by_one():
    # A prefills in two chunks; B, with the same prompt, arrives in between, hits A's
    # first block and computes blocks 1 and 2 itself. A then computes its own copies:
    # two blocks per hash, both in the index, and block tables stay append-only.
    manager = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=6, max_model_len=100)
    pool = manager.block_pool
    prompt = list(range(12))
    a, b = make_request("a", prompt), make_request("b", prompt)
    manager.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 4
    manager.allocate_slots(b, 8, num_hit_tokens, hits)
    manager.allocate_slots(a, 8)
    assert manager.get_block_ids("a") == [1, 4, 5] and manager.get_block_ids("b") == [1, 2, 3]
    assert {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()} == {
        a.block_hashes[0]: [1],
        a.block_hashes[1]: [2, 4],
        a.block_hashes[2]: [3, 5],
    }
    manager.free(b)
    manager.free(a)
    assert queue_ids(pool.free_block_queue) == [3, 2, 5, 4, 1]
    longer = make_request("c", prompt + [99])
    assert manager.get_computed_blocks(longer)[1] == 12
    manager.allocate_slots(make_request("filler", [50] * 8), 8)  # evicts B's copies, 3 and 2
    hits, num_hit_tokens = manager.get_computed_blocks(longer)
    assert num_hit_tokens == 12 and [block.block_id for block in hits] == [1, 4, 5]


# ----------------------------------------------------------------------------- ch03: statistics


def run_to_completion(sched: Scheduler) -> list[PrefixCacheStats | None]:
    """Step the scheduler (with the fake runner) until it is idle; each step's prefix-cache stats."""
    runner = FakeModelRunner(sched.block_size)
    per_step = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        stats = sched.update_from_output(so, runner.execute_model(so)).scheduler_stats
        per_step.append(None if stats is None else stats.prefix_cache_stats)
    return per_step


@pytest.mark.ch03
def test_prefix_cache_stats_count_an_admission_not_each_failed_attempt():
    # 4 usable blocks. A (12 tokens, 3 blocks) is admitted and decodes into the 4th block.
    # B shares A's first 2 blocks and needs 2 more: it cannot be admitted until A is done,
    # and looks the cache up at every step in between.
    sched = make_scheduler(5, BLOCK_SIZE, budget=64, max_seqs=4, max_model_len=40, caching=True)
    prompt_a = list(range(1, 13))
    prompt_b = prompt_a[:8] + list(range(30, 38))
    sched.add_request(make_request("a", prompt_a, max_tokens=3))
    sched.add_request(make_request("b", prompt_b, max_tokens=1))
    assert run_to_completion(sched) == [
        PrefixCacheStats(requests=1, queries=12, hits=0),  # A admitted, B's first try fails
        None,
        None,
        PrefixCacheStats(requests=1, queries=16, hits=8),  # B admitted: A's first 2 blocks hit
    ]


@pytest.mark.ch03
def test_prefix_cache_stats_count_a_resumed_request_again():
    # As vLLM v0.11.0: a request resumed after preemption looks its prompt and outputs up
    # again, and that lookup counts. 6 usable blocks: a and b take 3 each; a's first
    # decode needs a 7th, so b is preempted, its blocks freed tail first, and a's new
    # block is b's last one. b comes back with 13 tokens and finds its first 2 blocks.
    sched = make_scheduler(7, BLOCK_SIZE, budget=64, max_seqs=4, max_model_len=20, caching=True)
    for rid, token in (("a", 1), ("b", 2)):
        sched.add_request(make_request(rid, [token] * 12, max_tokens=4))
    b = sched.requests["b"]
    admissions = [stats for stats in run_to_completion(sched) if stats is not None]
    assert b.num_preemptions == 1
    assert admissions == [
        PrefixCacheStats(requests=2, queries=24, hits=0),
        PrefixCacheStats(requests=1, queries=13, hits=8),
    ]


@pytest.mark.ch03
def test_prefix_cache_stats_are_empty_with_caching_off():
    sched = make_scheduler(64, BLOCK_SIZE, budget=64, max_seqs=4, max_model_len=40, caching=False)
    for rid in "ab":
        sched.add_request(make_request(rid, list(range(1, 13)), max_tokens=2))
    assert set(run_to_completion(sched)) == {None}
