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
from helpers.kv_cache import BLOCK_SIZE, HEADS, full_attention_kv_cache_config, make_request, queue_ids
from helpers.scheduler import FakeModelRunner, make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nano_v1.core.block_pool import BlockPool
from nano_v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nano_v1.core.kv_cache_utils import (
    BlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    make_block_hash_with_group_id,
)
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from nano_v1.metrics.stats import PrefixCacheStats
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams


def make_manager(num_gpu_blocks: int, max_model_len: int, enable_caching: bool = True) -> KVCacheManager:
    """A manager of one full-attention KV cache group, the case of chapters 02 and 03."""
    return KVCacheManager(full_attention_kv_cache_config(num_gpu_blocks, BLOCK_SIZE), max_model_len, enable_caching)


def group_blocks(manager: KVCacheManager) -> dict[str, list[KVCacheBlock]]:
    """The one group's {request id: block list}."""
    return manager.coordinator.single_type_managers[0].req_to_blocks


def block_ids(manager: KVCacheManager, request_id: str) -> list[int]:
    (ids,) = manager.get_block_ids(request_id)
    return ids


def ids_of(blocks) -> list[int]:
    """The block ids of a one-group `KVCacheBlocks`."""
    (ids,) = blocks.get_block_ids()
    return ids


# ----------------------------------------------------------------------------- ch02: free queue


def check_links(queue: FreeKVCacheBlockQueue, expected: list[int]) -> None:
    """Forward walk, backward walk and the counter all agree with the model."""
    forward = queue_ids(queue)
    assert forward == expected, f"walking the queue from the head gives blocks {forward}, expected {expected}"
    backward = []
    block = queue.fake_free_list_tail.prev_free_block
    while block is not queue.fake_free_list_head:
        assert block is not None and len(backward) < len(expected), (
            f"walking back from the tail, the prev links after blocks {backward} do not lead to the head: "
            "the block that becomes the front must point back at the head sentinel"
        )
        backward.append(block.block_id)
        block = block.prev_free_block
    assert backward == expected[::-1], (
        f"walking back from the tail gives blocks {backward}, expected {expected[::-1]}: a prev link is wrong"
    )
    assert queue.num_free_blocks == len(expected), (
        f"num_free_blocks is {queue.num_free_blocks} with {len(expected)} blocks in the queue"
    )


def check_membership(blocks: list[KVCacheBlock], queued: list[int]) -> None:
    """A block has links exactly while it is in the queue."""
    for block in blocks:
        in_queue = block.block_id in queued
        links = (block.prev_free_block is not None, block.next_free_block is not None)
        assert links == (in_queue, in_queue), (
            f"block {block.block_id} is {'' if in_queue else 'not '}in the queue, but its (prev, next) links are "
            f"set: {links}; a block in the queue has both, a block taken off it neither"
        )


@pytest.mark.ch02_t1
@pytest.mark.ch02
@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(0, 12), data=st.data())
def test_free_queue_matches_list_model(num_blocks, data):
    """Rule: popleft_n takes «the n least recently used blocks in one pass», «leaving a valid queue behind»
    (links both ways, the count), as a plain list would."""
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
            popped = [b.block_id for b in queue.popleft_n(n)]
            assert popped == model[:n], (
                f"popleft_n({n}) returned blocks {popped}; the front {n} are {model[:n]}"
            )
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
        check_membership(blocks, model)


@pytest.mark.ch02_t1
@pytest.mark.ch02
def test_popleft_n_takes_the_front_and_leaves_a_valid_queue():
    """Rule: «Remove and return the first `n` blocks, front first» (none for n = 0), «leaving a valid queue
    behind»."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    popped = [b.block_id for b in queue.popleft_n(2)]
    assert popped == [0, 1], f"popleft_n(2) on blocks [0, 1, 2, 3, 4] returned {popped}, not the front two"
    check_links(queue, [2, 3, 4])
    check_membership(blocks, [2, 3, 4])
    assert queue.popleft_n(0) == [], "popleft_n(0) takes nothing"
    check_links(queue, [2, 3, 4])
    popped = [b.block_id for b in queue.popleft_n(3)]
    assert popped == [2, 3, 4], f"popleft_n(3) on blocks [2, 3, 4] returned {popped}, not all three"
    check_links(queue, [])
    check_membership(blocks, [])


# ----------------------------------------------------------------------------- ch02: pool basics


@pytest.mark.ch02_t1
@pytest.mark.ch02
def test_null_block_is_never_handed_out():
    """Rule: the pool hands out blocks through popleft_n, «front first»; the null block is never in the queue."""
    pool = BlockPool(num_gpu_blocks=5, enable_caching=False)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null, "block 0 is the null block"
    assert pool.get_num_free_blocks() == 4, "of 5 blocks, all but the null block start free"
    blocks = [b.block_id for b in pool.get_new_blocks(4)]
    assert blocks == [1, 2, 3, 4], (
        f"get_new_blocks(4) on a fresh pool handed out {blocks}, not blocks 1-4 in order"
    )
    assert pool.get_num_free_blocks() == 0, (
        f"{pool.get_num_free_blocks()} blocks still count as free after all were taken"
    )
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(pool.blocks[1:])
    assert queue_ids(pool.free_block_queue) == [1, 2, 3, 4], "freed blocks go back to the queue in order"
    assert pool.get_usage() == 0.0


class PrefixNameHasher:
    """A stand-in block hasher for chapter 02's tests: a full block's "hash" spells its whole
    prefix. With it ch02's tests need none of chapter 03's code (the real hasher is ch03_t1)."""

    block_size = BLOCK_SIZE

    def __call__(self, request: Request) -> list[BlockHash]:
        first_end = (len(request.block_hashes) + 1) * BLOCK_SIZE
        return [
            BlockHash(repr(request.all_token_ids[:end]).encode())
            for end in range(first_end, request.num_tokens + 1, BLOCK_SIZE)
        ]


def make_ch02_request(request_id: str, prompt: list[int]) -> Request:
    hasher = PrefixNameHasher()
    return Request(request_id, list(prompt), SamplingParams(max_tokens=1000), None, block_hasher=hasher)


# ----------------------------------------------------------------------------- ch02_t2: counting blocks


def single_type_manager() -> SingleTypeKVCacheManager:
    """The one group's manager, on a pool of 19 free blocks. ch02_t2's tests call it directly:
    `allocate_slots`, which calls it, is ch02_t3."""
    manager = make_manager(num_gpu_blocks=20, max_model_len=100, enable_caching=False)
    return manager.coordinator.single_type_managers[0]


def hold_blocks(single: SingleTypeKVCacheManager, request_id: str, num_blocks: int) -> list[KVCacheBlock]:
    """Give `request_id` `num_blocks` fresh blocks (ref_cnt 1, out of the free queue)."""
    single.save_new_computed_blocks(request_id, [])
    return single.allocate_new_blocks(request_id, num_blocks * BLOCK_SIZE)


@pytest.mark.ch02_t2
@pytest.mark.ch02
@pytest.mark.parametrize(
    "num_held, num_hits, num_tokens, num_blocks, why",
    [
        pytest.param(
            0, 0, 5, 2, "5 slots in blocks of 4 take 2 blocks: a partly filled block is still a whole block",
            id="round_up",
        ),
        pytest.param(0, 0, 8, 2, "8 slots fill exactly 2 blocks of 4: no spare block", id="exactly_full"),
        pytest.param(
            1, 0, 9, 2, "9 slots take 3 blocks and the request already holds 1: it needs 2 more",
            id="minus_held",
        ),
        pytest.param(
            0, 2, 9, 1, "9 slots take 3 blocks and its 2 cache hits are 2 of them: it needs 1 more",
            id="minus_hits",
        ),
        pytest.param(
            3, 0, 5, 0,
            "5 slots take 2 blocks and the request holds 3 (reserved for last step's lookahead slots): it "
            "needs none, never a negative count",
            id="never_negative",
        ),
    ],
)  # fmt: skip
def test_get_num_blocks_to_allocate_counts_the_blocks_a_request_needs(
    num_held, num_hits, num_tokens, num_blocks, why
):
    """Rule: «blocks for num_tokens slots, minus those held and the hits (never negative)», «plus the hits
    that sit in the free queue»."""
    single = single_type_manager()
    # Hits held by another request too (ref_cnt 1): touching them takes nothing from the free queue.
    hits = hold_blocks(single, "other", num_hits)
    if num_held:
        hold_blocks(single, "r", num_held)
    counted = single.get_num_blocks_to_allocate("r", num_tokens, hits)
    assert counted == num_blocks, f"{why}; get_num_blocks_to_allocate says {counted}"


@pytest.mark.ch02_t2
@pytest.mark.ch02
@settings(max_examples=100, deadline=None)
@given(num_held=st.integers(0, 4), num_hits=st.integers(0, 3), num_tokens=st.integers(1, 30))
def test_get_num_blocks_to_allocate_against_a_slot_by_slot_count(num_held, num_hits, num_tokens):
    """Rule: «New blocks beyond those it holds and the hits», a partly filled block counting whole, against a
    slot-by-slot count."""
    single = single_type_manager()
    hits = hold_blocks(single, "other", num_hits)
    if num_held:
        hold_blocks(single, "r", num_held)
    # Brute force: walk the slots in order; a slot past the blocks so far opens one more.
    num_blocks, num_new = num_held + num_hits, 0
    for slot in range(num_tokens):
        if slot // BLOCK_SIZE == num_blocks:
            num_blocks += 1
            num_new += 1
    counted = single.get_num_blocks_to_allocate("r", num_tokens, hits)
    assert counted == num_new, (
        f"{num_tokens} slots in blocks of {BLOCK_SIZE}, {num_held} blocks held and {num_hits} cache hits: "
        f"the slots beyond them open {num_new} new blocks, but get_num_blocks_to_allocate says {counted}"
    )


# ----------------------------------------------------------------------------- ch02_t3: allocate_slots


@pytest.mark.ch02_t3
@pytest.mark.ch02
@pytest.mark.parametrize(
    "num_computed, num_new, num_lookahead, num_blocks, why",
    [
        pytest.param(
            0, 5, 0, 2, "5 tokens in blocks of 4 take 2 blocks: a partly filled block is still a whole block",
            id="round_up",
        ),
        pytest.param(0, 8, 0, 2, "8 tokens fill exactly 2 blocks of 4", id="exactly_full"),
        pytest.param(
            4, 5, 0, 3, "4 computed + 5 new tokens = 9 slots, 3 blocks: slots are for every token, not just the new ones",
            id="computed_and_new",
        ),
        pytest.param(4, 1, 3, 2, "4 computed + 1 new + 3 lookahead = 8 slots fit in 2 blocks", id="lookahead_fits"),
        pytest.param(
            4, 1, 4, 3, "4 computed + 1 new + 4 lookahead = 9 slots: the lookahead (draft) slots need a 3rd block",
            id="lookahead_needs_a_block",
        ),
        pytest.param(
            5, 1, 3, 3,
            "5 computed + 1 new + 3 lookahead = 9 slots: the new token fits in the 2 blocks held, its lookahead "
            "slots do not, so the step needs a 3rd block",
            id="lookahead_past_the_held_blocks",
        ),
        pytest.param(
            4, 1, 8, 3,
            "4 + 1 + 8 lookahead = 13 slots, but no position at or past max_model_len = 10 needs one: 3 blocks",
            id="max_model_len",
        ),
    ],
)  # fmt: skip
def test_allocate_slots_counts_the_blocks_a_request_needs(
    num_computed, num_new, num_lookahead, num_blocks, why
):
    """Rule: «a slot for every token in every group»: computed, new and lookahead tokens, but no slot at or
    past max_model_len «(<= max_model_len)»."""
    manager = make_manager(num_gpu_blocks=20, max_model_len=10, enable_caching=False)
    request = make_ch02_request("r", list(range(9)))
    if num_computed:
        manager.allocate_slots(request, num_computed)
        request.num_computed_tokens = num_computed
    manager.allocate_slots(request, num_new, num_lookahead_tokens=num_lookahead)
    held = len(block_ids(manager, "r"))
    assert held == num_blocks, f"{why}; the request holds {held}"


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_allocate_slots_refuses_zero_tokens():
    """Rule: «Raises ValueError if `num_new_tokens` < 1»."""
    manager = make_manager(num_gpu_blocks=20, max_model_len=10, enable_caching=False)
    try:
        manager.allocate_slots(make_ch02_request("r", list(range(5))), 0)
    except ValueError:
        return
    raise AssertionError(
        "allocate_slots(request, 0) must raise ValueError: a scheduled request computes at least 1 token, "
        "so 0 tokens is the caller's bug"
    )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_allocate_slots_admits_exactly_what_fits():
    """Rule: «Returns None if the free pool cannot cover the new blocks of every group»; a request that fits
    exactly is admitted."""
    manager = make_manager(num_gpu_blocks=3, max_model_len=100, enable_caching=False)  # 2 free: block 0 is null
    full = make_ch02_request("full", list(range(8)))
    assert manager.allocate_slots(full, 8) is not None, (
        "8 tokens in blocks of 4 need exactly 2 blocks, and 2 are free: the request fits and must be admitted"
    )
    manager.free(full)
    over = make_ch02_request("over", list(range(9)))
    assert manager.allocate_slots(over, 9) is None, (
        "9 tokens need 3 blocks of 4 (a partly filled block is still a whole block) and only 2 are free: refuse"
    )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_allocate_slots_is_all_or_nothing():
    """Rule: «or None and nothing changed»: a refused request holds and takes no block."""
    manager = make_manager(num_gpu_blocks=4, max_model_len=100, enable_caching=False)
    big = make_ch02_request("big", list(range(8)))
    assert manager.allocate_slots(big, 8) is not None, "8 tokens need 2 of the 3 free blocks"
    greedy = make_ch02_request("greedy", list(range(8)))
    assert manager.allocate_slots(greedy, 8) is None, "8 tokens need 2 blocks and only 1 is free: None"
    assert block_ids(manager, "greedy") == [] and "greedy" not in group_blocks(manager), (
        "a refused request must hold nothing"
    )
    assert manager.block_pool.get_num_free_blocks() == 1, "a refused request must take no block"
    manager.free(big)
    assert manager.allocate_slots(greedy, 8) is not None, "with 3 blocks free, 8 tokens fit"


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_allocate_slots_first_drops_the_blocks_no_query_sees(monkeypatch):
    # Full attention drops nothing; a sliding window (chapter 12) does, through this call.
    """Rule: «First, blocks that no query from `request.num_computed_tokens` on can see go back to the pool»,
    «even if the rest fails»."""
    manager = make_manager(num_gpu_blocks=4, max_model_len=100, enable_caching=False)  # 3 free
    coordinator = manager.coordinator
    calls = []
    drop = coordinator.remove_skipped_blocks
    monkeypatch.setattr(coordinator, "remove_skipped_blocks", lambda *args: (calls.append(args), drop(*args)))
    request = make_ch02_request("r", list(range(16)))
    manager.allocate_slots(request, 8)
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 8) is None, "16 slots need 4 blocks; the pool has 3"
    assert calls == [("r", 0), ("r", 8)], (
        f"allocate_slots called remove_skipped_blocks with {calls}: each call must first hand back the blocks "
        "no query from request.num_computed_tokens on can see (0, then 8), even one that is then refused"
    )


def admit_and_free_a_prefix(manager: KVCacheManager) -> list[KVCacheBlock]:
    """Request "a" computes tokens 0-8 (blocks 1, 2, 3) and finishes: blocks 1 and 2, full, stay
    cached in the free queue, the cache hits of a request that starts with tokens 0-7."""
    a = make_ch02_request("a", list(range(9)))
    manager.allocate_slots(a, 9)
    hits = group_blocks(manager)["a"][:2]
    manager.free(a)
    assert all(block.block_hash is not None for block in hits), (
        "a request that computed tokens 0-8 must cache its 2 full blocks"
    )
    return hits


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_admission_touches_its_hits_and_counts_their_tokens():
    """Rule: the hits hold slots too, and admitting touches them: «touching them takes them out of it» (the
    free queue), ref_cnt 1."""
    manager = make_manager(num_gpu_blocks=10, max_model_len=100)
    hits = admit_and_free_a_prefix(manager)  # the free queue: 4-9, then a's 3, 2, 1
    b = make_ch02_request("b", list(range(8)) + [50, 51, 52])
    fresh = manager.allocate_slots(b, 3, 8, KVCacheBlocks((hits,)))
    handed_out = None if fresh is None else ids_of(fresh)
    assert handed_out == [4], (
        f"b's 2 cache hits hold tokens 0-7 and it computes tokens 8-10: 11 slots need 3 blocks, the 2 hits and "
        f"1 fresh one (block 4, the front of the free queue); allocate_slots handed out {handed_out}"
    )
    assert block_ids(manager, "b") == [1, 2, 4], "b's block list is its 2 hits, then its fresh block"
    free_queue = queue_ids(manager.block_pool.free_block_queue)
    for block in hits:
        assert block.ref_cnt == 1 and block.block_id not in free_queue, (
            f"hit block {block.block_id} has ref_cnt {block.ref_cnt} and is "
            f"{'' if block.block_id in free_queue else 'not '}in the free queue: admitting b must touch its hits "
            "(ref_cnt 1, out of the queue), or the pool hands them out while b reads them"
        )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_a_refused_admission_leaves_its_hits_in_the_free_queue():
    """Rule: «Cache hits that sit in the free queue (ref_cnt 0) count against the free pool too», and a
    refusal «changes nothing else»: the hits stay in the queue."""
    manager = make_manager(num_gpu_blocks=5, max_model_len=100)  # 4 free
    hits = admit_and_free_a_prefix(manager)  # the free queue: 4, then a's 3, 2, 1
    b = make_ch02_request("b", list(range(8)) + list(range(50, 60)))
    before = snapshot(manager)
    fresh = manager.allocate_slots(b, 10, 8, KVCacheBlocks((hits,)))
    assert fresh is None, (
        "b's 18 slots need 5 blocks, its 2 hits and 3 fresh ones, and the pool has 4 free blocks, the hits among "
        "them: refuse"
    )
    assert snapshot(manager) == before, (
        "a refused admission must change nothing: b's hits stay in the free queue with ref_cnt 0 (touch them only "
        "once everything fits)"
    )
    c = make_ch02_request("c", list(range(8)) + list(range(50, 55)))
    assert manager.allocate_slots(c, 5, 8, KVCacheBlocks((hits,))) is not None, (
        "c's 13 slots need 4 blocks, its 2 hits and 2 fresh ones: with the hits still in the free queue, the "
        "pool's 4 free blocks are exactly enough"
    )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_only_final_tokens_are_cached():
    """Rule: «cache final tokens only»: «never a lookahead slot or a scheduled draft»."""
    manager = make_manager(num_gpu_blocks=10, max_model_len=100)
    chunked = make_ch02_request("chunked", list(range(12)))
    manager.allocate_slots(chunked, 3, num_lookahead_tokens=1)
    (block,) = group_blocks(manager)["chunked"]
    assert block.block_hash is None, (
        "a chunk of 3 prompt tokens and 1 lookahead slot fills block 0, but with 3 final tokens: the 4th slot "
        "holds a draft, not prompt token 3, so block 0 must not be cached yet"
    )
    decoding = make_ch02_request("decoding", list(range(8)))
    manager.allocate_slots(decoding, 8)
    decoding.num_computed_tokens = 8
    decoding.append_output_token_ids(60)
    try:
        manager.allocate_slots(decoding, 1 + 3)  # the sampled token and 3 draft tokens to verify
    except AssertionError as error:
        raise AssertionError(
            f"allocate_slots failed a check ({error}) in the step that verifies 3 draft tokens, which complete "
            "block 2: drafts are not final tokens (request.num_tokens does not count them), so no block they "
            "fill may be cached"
        ) from error
    hashed = [b.block_hash is not None for b in group_blocks(manager)["decoding"]]
    assert hashed == [True, True, False], (
        f"the blocks with hashes are {hashed}: block 2 holds token 8 and 3 draft tokens that may be rejected, "
        "so only blocks 0 and 1 may be cached"
    )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_a_decode_step_that_fills_a_block_caches_it():
    """Rule: every block the final tokens fill is committed «even when no new block is needed»."""
    manager = make_manager(num_gpu_blocks=10, max_model_len=100)
    request = make_ch02_request("r", list(range(6)))
    manager.allocate_slots(request, 6)  # 2 blocks; block 0 full and cached
    for token in (60, 61):  # decode tokens 6 and 7
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(token)
        fresh = manager.allocate_slots(request, 1)
        assert fresh is not None and ids_of(fresh) == [], (
            f"token {request.num_computed_tokens} fits in block 1, which the request holds: no new block"
        )
    hashed = [b.block_hash is not None for b in group_blocks(manager)["r"]]
    assert hashed == [True, True], (
        f"the blocks with hashes are {hashed}: the step that computes token 7 fills block 1; it needs no new "
        "block, but it must cache block 1 so that later requests can hit it"
    )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_hits_at_the_front_of_the_free_queue_are_touched_before_allocating():
    """Rule: «touch the hits before allocating» the fresh blocks: a hit still in the free queue could
    otherwise be handed out again, to this very request."""
    manager = make_manager(num_gpu_blocks=6, max_model_len=100)  # 5 free
    hits = admit_and_free_a_prefix(manager)  # a held blocks 1, 2, 3; the free queue: 4, 5, then 3, 2, 1
    x = make_ch02_request("x", list(range(100, 108)))
    manager.allocate_slots(x, 8)  # blocks 4 and 5
    manager.free(x)  # the free queue: 3, 2, 1, 5, 4 (the hits 2 and 1 near its front)
    b = make_ch02_request("b", list(range(8)) + list(range(50, 58)))
    fresh = manager.allocate_slots(b, 8, 8, KVCacheBlocks((hits,)))
    handed_out = None if fresh is None else ids_of(fresh)
    assert handed_out == [3, 5], (
        f"b's 16 slots need its 2 hits (blocks 1, 2) and 2 fresh blocks; allocate_slots handed out {handed_out}: "
        "with the hits touched first, the fresh ones are the front of what is left of the queue, 3 and 5 "
        "(touch the hits before allocating, or the pool hands a hit out again)"
    )
    assert block_ids(manager, "b") == [1, 2, 3, 5], "b's block list is its 2 hits, then its 2 fresh blocks"


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_every_group_must_fit():
    """Rule: count the blocks «every group» needs against the free pool: a chunk that fits in one group's
    blocks but not in all of them is refused, and nothing changes."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, **HEADS)
    config = KVCacheConfig(6, [], [KVCacheGroupSpec(["a.0"], spec), KVCacheGroupSpec(["b.0"], spec)])
    manager = KVCacheManager(config, max_model_len=100, enable_caching=False)  # 5 free
    request = make_ch02_request("r", list(range(12)))
    try:
        fresh = manager.allocate_slots(request, 12)
    except ValueError as error:
        raise AssertionError(
            f"allocate_slots raised {error!r}: 12 tokens need 3 blocks in each of the 2 groups, 6 in all, and "
            "5 are free; count every group's blocks and return None"
        ) from error
    assert fresh is None, (
        "12 tokens need 3 blocks in each of the 2 groups, 6 in all, and 5 are free: refuse (return None)"
    )
    assert manager.block_pool.get_num_free_blocks() == 5 and manager.get_block_ids("r") == ([], []), (
        "a refused request must take no block in any group"
    )
    assert manager.allocate_slots(make_ch02_request("s", list(range(8))), 8) is not None, (
        "8 tokens need 2 blocks in each group, 4 in all, and 5 are free: admit"
    )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_an_admission_caches_what_its_hits_and_new_tokens_fill():
    """Rule: the tokens to cache «count this step's hits»: after an admission, the request's hits and new
    tokens are all final, and every block they fill is cached."""
    manager = make_manager(num_gpu_blocks=10, max_model_len=100)
    hits = admit_and_free_a_prefix(manager)
    b = make_ch02_request("b", list(range(8)) + [50, 51, 52, 53])
    manager.allocate_slots(b, 4, 8, KVCacheBlocks((hits,)))
    hashed = [block.block_hash is not None for block in group_blocks(manager)["b"]]
    assert hashed == [True, True, True], (
        f"the blocks with hashes are {hashed}: b's 2 hits hold tokens 0-7 and this step computes tokens 8-11, "
        "which fill block 2, so block 2 must be cached too (count the hits' 8 tokens, not just "
        "request.num_computed_tokens = 0)"
    )


@pytest.mark.ch02_t3
@pytest.mark.ch02
def test_full_sequence_must_fit_checks_the_whole_prompt_but_allocates_the_chunk():
    """Rule: with `full_sequence_must_fit`, None «unless the free pool could hold the request's whole
    sequence»; «it still allocates only this chunk's blocks»."""
    manager = make_manager(num_gpu_blocks=5, max_model_len=100, enable_caching=False)  # 4 free
    too_long = make_ch02_request("too_long", list(range(20)))
    assert manager.allocate_slots(too_long, 4, full_sequence_must_fit=True) is None, (
        "the prompt's 20 tokens need 5 blocks and 4 are free: with full_sequence_must_fit even its first "
        "chunk of 4 is refused"
    )
    fits = make_ch02_request("fits", list(range(16)))
    fresh = manager.allocate_slots(fits, 4, full_sequence_must_fit=True)
    handed_out = None if fresh is None else ids_of(fresh)
    assert handed_out == [1], (
        f"the prompt's 16 tokens fit in the 4 free blocks and its first chunk of 4 takes 1 of them, but "
        f"allocate_slots handed out {handed_out}: full_sequence_must_fit checks the whole prompt and allocates "
        "only this chunk"
    )


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
        {rid: block_ids(manager, rid) for rid in group_blocks(manager)},
        dict(manager.coordinator.single_type_managers[0].num_cached_block),
        {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
    )


def check_invariants(manager: KVCacheManager, model: ReferenceCache, live: dict[str, Request]) -> None:
    pool = manager.block_pool
    free_queue = queue_ids(pool.free_block_queue)
    assert free_queue == model.free_order, (
        f"the free queue is {free_queue}; the reference model's is {model.free_order}"
    )
    block_tables = {rid: block_ids(manager, rid) for rid in live}
    assert block_tables == model.req_blocks, (
        f"the block tables are {block_tables}; the reference model's are {model.req_blocks}"
    )
    holders: dict[int, list[tuple[str, int]]] = {}
    for rid, ids in model.req_blocks.items():
        for pos, b in enumerate(ids):
            holders.setdefault(b, []).append((rid, pos))
    for block in pool.blocks[1:]:
        owners = holders.get(block.block_id, [])
        assert block.ref_cnt == len(owners), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, owners {owners}"
        )
        assert (block.ref_cnt == 0) == (block.prev_free_block is not None), (
            f"block {block.block_id} has ref_cnt {block.ref_cnt} and is "
            f"{'' if block.prev_free_block is not None else 'not '}linked into the free queue: "
            "a block is in the free queue exactly when nobody holds it"
        )
        if len(owners) > 1:
            # Sharing is only legal for a cached full block at the same position of
            # requests that agree on every token up to its end.
            prefixes = {tuple(live[rid].all_token_ids[: (pos + 1) * BLOCK_SIZE]) for rid, pos in owners}
            shareable = (
                block.block_hash is not None and len(prefixes) == 1 and len({p for _, p in owners}) == 1
            )
            assert shareable, (
                f"block {block.block_id} is shared by {owners}, but only a cached full block of one prefix may be"
            )
        cached = model.content[block.block_id]
        assert (block.block_hash is not None) == (cached is not None), (
            f"block {block.block_id} {'has' if block.block_hash is not None else 'lacks'} a hash; the reference "
            f"model says it {'caches the prefix ' + str(cached) if cached is not None else 'caches nothing'}"
        )
        if block.block_hash is not None:
            assert block.block_hash == make_block_hash_with_group_id(expected_hash(cached), 0), (
                f"block {block.block_id}'s hash is not the chain hash of the prefix it caches, {cached}"
            )
            assert pool.cached_block_hash_to_block[block.block_hash][block.block_id] is block, (
                f"block {block.block_id} has a hash but is not in the cache index under it"
            )
    num_indexed = sum(len(d) for d in pool.cached_block_hash_to_block.values())
    num_cached = sum(c is not None for c in model.content)
    assert num_indexed == num_cached, f"the cache index holds {num_indexed} blocks; {num_cached} are cached"
    num_used = sum(r > 0 for r in model.ref[1:])
    assert manager.usage == pytest.approx(num_used / (len(pool.blocks) - 1)), (
        "usage is the fraction of blocks held"
    )


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
    manager = make_manager(num_gpu_blocks, max_model_len, enable_caching)
    model = ReferenceCache(num_gpu_blocks, enable_caching)
    # Blocks cached for real (chapter 03) need the real hasher; without caching, ch02's will do.
    new_request = make_request if enable_caching else make_ch02_request
    live: dict[str, Request] = {}
    next_id = 0
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["admit", "admit", "step", "step", "step", "free", "reset", "common"]))
        if op == "admit":
            request = new_request(f"r{next_id}", draw_prompt(data))
            next_id += 1
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            num_hit_blocks = model.longest_hit(request.all_token_ids)
            assert num_hit_tokens == num_hit_blocks * BLOCK_SIZE == len(ids_of(hits)) * BLOCK_SIZE, (
                f"a prompt of {request.num_tokens} tokens hit {len(ids_of(hits))} blocks and {num_hit_tokens} tokens; its "
                f"longest cached prefix that leaves the last token to compute is {num_hit_blocks} blocks of {BLOCK_SIZE}"
            )
            assert num_hit_tokens < request.num_tokens, "the last prompt token must be computed, never hit"
            for i, block in enumerate(hits.blocks[0]):
                prefix = tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])
                assert model.content[block.block_id] == prefix, (
                    f"hit {i} is block {block.block_id}, which caches other tokens than the prompt's block {i}"
                )
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
                ids_of(hits),
                num_lookahead,
                max_model_len,
            )
            if expected is None:
                check_refused(manager, fresh, before)
                continue
            check_fresh(fresh, expected)
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
                check_refused(manager, fresh, before)
                # What the scheduler does next: preempt (free) the request.
                manager.free(request)
                model.free(request.request_id)
                del live[request.request_id]
            else:
                check_fresh(fresh, expected)
                request.num_computed_tokens += num_new
        elif op == "free" and live:
            request = live.pop(data.draw(st.sampled_from(sorted(live))))
            manager.free(request)
            model.free(request.request_id)
        elif op == "reset":
            assert manager.reset_prefix_cache() == (not live), (
                "reset_prefix_cache works exactly when no block is held"
            )
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
            (common,) = manager.get_num_common_prefix_blocks(request, len(live))
            assert common == expected_common, (
                f"{common} common prefix blocks; every request holds {expected_common}"
            )
        check_invariants(manager, model, live)

    for request in live.values():
        manager.free(request)
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == num_gpu_blocks - 1, "with every request freed, every block is free"
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:]) and not group_blocks(manager), (
        "freed requests hold nothing"
    )
    assert manager.reset_prefix_cache() and not pool.cached_block_hash_to_block, (
        "an idle cache resets to empty"
    )


def check_fresh(fresh: KVCacheBlocks | None, expected: list[int]) -> None:
    handed_out = None if fresh is None else ids_of(fresh)
    assert handed_out == expected, (
        f"allocate_slots handed out {handed_out}; the reference model, counting the blocks the request needs "
        f"beyond those it holds, hands out {expected} from the front of the free queue"
    )


def check_refused(manager: KVCacheManager, fresh: KVCacheBlocks | None, before) -> None:
    assert fresh is None, (
        f"allocate_slots handed out {ids_of(fresh)}, but the free blocks cannot cover what the "
        "request needs (the reference model refuses): it must return None"
    )
    assert snapshot(manager) == before, "a refused allocate_slots must change nothing"


@pytest.mark.ch02_t3
@pytest.mark.ch02
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_gpu_blocks=st.integers(2, 24))
def test_allocator_against_reference(data, num_gpu_blocks):
    """Rule: «a slot for every token in every group, or None and nothing changed», over random workloads,
    against a brute-force model of the pool."""
    run_random_workload(data, enable_caching=False, num_gpu_blocks=num_gpu_blocks)


@pytest.mark.ch03
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_gpu_blocks=st.integers(2, 24))
def test_prefix_cache_against_reference(data, num_gpu_blocks):
    run_random_workload(data, enable_caching=True, num_gpu_blocks=num_gpu_blocks)


# ----------------------------------------------------------------------------- ch03: directed cases


@pytest.mark.ch03_t1
@pytest.mark.ch03
def test_only_full_blocks_get_hashes():
    """Rule: «a partial last block gets no hash until it fills»."""
    request = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    num_hashes = len(request.block_hashes)
    assert num_hashes == 2, (
        f"9 tokens fill 2 blocks of 4 and start a third, which gets no hash yet; got {num_hashes} hashes"
    )
    for token in [10, 11]:
        request.append_output_token_ids(token)
    num_hashes = len(request.block_hashes)
    assert num_hashes == 2, f"block 2 holds 3 of its 4 tokens: still 2 hashes, got {num_hashes}"
    request.append_output_token_ids(12)
    num_hashes = len(request.block_hashes)
    assert num_hashes == 3, (
        f"the 12th token fills block 2, which gets its hash now: 3 hashes, got {num_hashes}"
    )
    num_hashes = len(make_request("s", list(range(8))).block_hashes)
    assert num_hashes == 2, f"8 tokens fill exactly 2 blocks of 4: 2 hashes, got {num_hashes}"


@pytest.mark.ch03_t1
@pytest.mark.ch03
def test_block_hashes_chain_from_the_previous_block():
    """Rule: «the parent is block i - 1's hash (None for block 0)»: «so a hash names its whole prefix»."""
    request = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert request.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4]), (
        "block 0 has no parent: its hash is hash_block_tokens(None, its tokens)"
    )
    assert request.block_hashes[1] == hash_block_tokens(request.block_hashes[0], [5, 6, 7, 8]), (
        "block 1's hash must chain block 0's hash: hash_block_tokens(block_hashes[0], block 1's tokens)"
    )
    for token in [10, 11, 12]:
        request.append_output_token_ids(token)
    assert len(request.block_hashes) == 3, (
        f"12 tokens fill 3 blocks of 4, but {len(request.block_hashes)} have hashes"
    )
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [9, 10, 11, 12]), (
        "block 2, filled by output tokens, must chain the hash the request already had for block 1"
    )


@pytest.mark.ch03
def test_block_hash_names_its_history_and_extra_keys():
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]
    )
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 1)) != hash_block_tokens(None, [1, 2, 3, 4])


@pytest.mark.ch03_t2
@pytest.mark.ch03
def test_fully_cached_prompt_recomputes_its_last_block():
    """Rule: the hit is «at most `max_num_blocks` whole blocks» of max_length tokens: a fully cached prompt
    recomputes its last block."""
    manager = make_manager(num_gpu_blocks=10, max_model_len=100)
    first = make_request("a", list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(first)
    assert ids_of(hits) == [] and num_hit_tokens == 0, "an empty cache has no hits"
    manager.allocate_slots(first, 8)
    manager.free(first)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit_tokens == 4 and ids_of(hits) == [1], (
        f"the same 8-token prompt again hit {num_hit_tokens} tokens in blocks {ids_of(hits)}; it must "
        "hit only block 1 (4 tokens): the last token is always computed, so its whole block is"
    )
    num_hit_tokens = manager.get_computed_blocks(make_request("c", list(range(9))))[1]
    assert num_hit_tokens == 8, (
        f"a 9-token prompt starting with the cached 8 hit {num_hit_tokens} tokens; both cached blocks (8 tokens) "
        "hit, as the 9th token is left to compute"
    )
    # Lookups change nothing, statistics included: the scheduler counts admissions.
    assert manager.make_prefix_cache_stats() == PrefixCacheStats(), "a lookup must not count statistics"


@pytest.mark.ch03_t2
@pytest.mark.ch03
def test_the_first_miss_ends_the_hit():
    """Rule: «hits from the first block up to the first miss»: a cached block after a miss is not a hit."""
    manager = make_manager(num_gpu_blocks=10, max_model_len=100)
    a = make_request("a", list(range(13)))  # 3 full blocks, then 1 token
    manager.allocate_slots(a, 13)
    manager.free(a)
    cached, _ = manager.get_computed_blocks(make_request("b", list(range(13))))
    (cached_blocks,) = cached.blocks
    manager.block_pool._maybe_evict_cached_block(cached_blocks[1])  # the prompt's block 1 is gone; 0 and 2 stay
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("c", list(range(13))))
    assert num_hit_tokens == 4 and ids_of(hits) == [cached_blocks[0].block_id], (
        f"with the prompt's block 1 evicted, the lookup hit {num_hit_tokens} tokens in blocks "
        f"{ids_of(hits)}; a hit is a prefix, so it ends at the first miss: block 0 only"
    )


@pytest.mark.ch03_t2
@pytest.mark.ch03
def test_hits_sitting_in_the_free_queue_count_against_free_space():
    # 3 usable blocks. A caches all 3 and finishes; B hits all 3 (still free, ref 0)
    # and needs a 4th. Counting only the 4th as "new" would say yes, then touching
    # the hits would leave nothing to allocate it from.
    """Rule: «hits from the first block up to the first miss», free-queue blocks included (they are found,
    then count against the free space)."""
    manager = make_manager(num_gpu_blocks=4, max_model_len=100)
    a = make_request("a", list(range(12)))
    manager.allocate_slots(a, 12)
    manager.free(a)
    b = make_request("b", list(range(16)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 12 and all(block.ref_cnt == 0 for block in hits.blocks[0]), (
        f"a 16-token prompt whose first 12 tokens are cached in 3 free blocks hit {num_hit_tokens} tokens, not 12"
    )
    before = snapshot(manager)
    assert manager.allocate_slots(b, 4, num_hit_tokens, hits) is None, (
        "the 3 hits are free blocks and a 4th is needed: the pool of 3 cannot cover it"
    )
    assert snapshot(manager) == before, "a refused allocate_slots must change nothing"


@pytest.mark.ch03_t2
@pytest.mark.ch03
def test_eviction_is_lru_and_tail_first():
    """Rule: «hits from the first block up to the first miss»: a block evicted from the middle of a prefix
    ends the hit there."""
    manager = make_manager(num_gpu_blocks=7, max_model_len=100)
    pool = manager.block_pool
    a = make_request("a", [1] * 8 + [0])  # blocks 1, 2 full; block 3 partial
    b = make_request("b", [2] * 8 + [0])  # blocks 4, 5 full; block 6 partial
    manager.allocate_slots(a, 9)
    manager.allocate_slots(b, 9)
    manager.free(a)  # a first: its blocks are older
    manager.free(b)
    # Reverse order within a request: tail first.
    assert queue_ids(pool.free_block_queue) == [3, 2, 1, 6, 5, 4], (
        "freed requests queue their blocks tail first"
    )
    filler = make_request("f", [3] * 5)
    manager.allocate_slots(filler, 5)  # takes blocks 3 and 2: a's partial and a's tail
    assert block_ids(manager, "f") == [3, 2], "new blocks come from the front of the free queue"
    num_hit_tokens = manager.get_computed_blocks(make_request("a2", [1] * 8 + [0]))[1]
    assert num_hit_tokens == 4, (
        f"a's block 2 was evicted, its block 1 was not: 4 tokens hit, not {num_hit_tokens}"
    )
    num_hit_tokens = manager.get_computed_blocks(make_request("b2", [2] * 8 + [0]))[1]
    assert num_hit_tokens == 8, f"b's blocks were not evicted: 8 tokens hit, not {num_hit_tokens}"
    # A hit rescues a free block from eviction: touch moves it out of the queue.
    b3 = make_request("b3", [2] * 8 + [5])
    hits, num_hit_tokens = manager.get_computed_blocks(b3)
    manager.allocate_slots(b3, 1, num_hit_tokens, hits)
    assert ids_of(hits) == [4, 5] and 4 not in queue_ids(pool.free_block_queue), (
        "a hit on free blocks 4 and 5 takes them out of the free queue"
    )


@pytest.mark.ch03
def test_caching_disabled_never_hits_or_hashes():
    manager = make_manager(num_gpu_blocks=10, max_model_len=100, enable_caching=False)
    a = make_request("a", list(range(9)))
    manager.allocate_slots(a, 9)
    manager.free(a)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(9))))
    assert ids_of(hits) == [] and num_hit_tokens == 0
    assert not manager.block_pool.cached_block_hash_to_block
    assert all(block.block_hash is None for block in manager.block_pool.blocks)


@pytest.mark.ch03_t1
@pytest.mark.ch03
def test_lookahead_slots_are_not_cached():
    """Rule: «hash each newly full block»: a block filled only by lookahead slots is not full of tokens and
    gets no hash."""
    manager = make_manager(num_gpu_blocks=10, max_model_len=100)
    a = make_request("a", list(range(6)))
    manager.allocate_slots(a, 6, num_lookahead_tokens=6)  # 12 slots -> 3 blocks
    assert len(block_ids(manager, "a")) == 3, "6 tokens and 6 lookahead slots take 3 blocks"
    hashed = [b.block_hash is not None for b in group_blocks(manager)["a"]]
    assert manager.coordinator.single_type_managers[0].num_cached_block["a"] == 1 and hashed == [True, False, False], (
        f"of 6 tokens and 6 lookahead slots only tokens 0-3 fill a block of final tokens: block 0 alone is "
        f"cached, but the blocks with hashes are {hashed}"
    )


@pytest.mark.ch03
def test_duplicate_blocks_are_all_indexed_and_evicted_one_by_one():
    # A prefills in two chunks; B, with the same prompt, arrives in between, hits A's
    # first block and computes blocks 1 and 2 itself. A then computes its own copies:
    # two blocks per hash, both in the index, and block tables stay append-only.
    manager = make_manager(num_gpu_blocks=6, max_model_len=100)
    pool = manager.block_pool
    prompt = list(range(12))
    a, b = make_request("a", prompt), make_request("b", prompt)
    manager.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 4
    manager.allocate_slots(b, 8, num_hit_tokens, hits)
    manager.allocate_slots(a, 8)
    assert block_ids(manager, "a") == [1, 4, 5] and block_ids(manager, "b") == [1, 2, 3]
    assert {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()} == {
        make_block_hash_with_group_id(a.block_hashes[0], 0): [1],
        make_block_hash_with_group_id(a.block_hashes[1], 0): [2, 4],
        make_block_hash_with_group_id(a.block_hashes[2], 0): [3, 5],
    }
    manager.free(b)
    manager.free(a)
    assert queue_ids(pool.free_block_queue) == [3, 2, 5, 4, 1]
    longer = make_request("c", prompt + [99])
    assert manager.get_computed_blocks(longer)[1] == 12
    manager.allocate_slots(make_request("filler", [50] * 8), 8)  # evicts B's copies, 3 and 2
    hits, num_hit_tokens = manager.get_computed_blocks(longer)
    assert num_hit_tokens == 12 and ids_of(hits) == [1, 4, 5]


# ----------------------------------------------------------------------------- ch03: statistics


def run_to_completion(sched: Scheduler) -> list[PrefixCacheStats | None]:
    """Step the scheduler (with the fake runner) until it is idle; each step's prefix-cache stats
    (None for a step that admitted nothing)."""
    runner = FakeModelRunner(sched.block_size)
    per_step = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        stats = sched.update_from_output(so, runner.execute_model(so)).scheduler_stats.prefix_cache_stats
        per_step.append(stats if stats.requests else None)
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
