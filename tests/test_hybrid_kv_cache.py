"""Hybrid KV cache groups (chapter 12): specs and grouping, the sliding-window manager, the coordinator.

Oracles:
  * hand arithmetic for page sizes, per-request memory and the grouping of layers (the
    examples in vLLM v0.11.0's own docstrings);
  * brute force for the sliding-window hit rule: the longest hit of j blocks is the
    largest j whose last ceil((w - 1) / block_size) blocks (or all j, if fewer) are cached;
  * a page memory for random workloads through the hybrid coordinator: every block id is
    a page, each allocation "writes" its tokens' prefixes into the pages, and after every
    call each live request's window must still be readable from its own pages, no block
    may be leaked or double-owned, and the null block never handed out.
Planted bugs (test-side monkeypatches with subtly wrong implementations) check that the
checks catch what a student is likely to get wrong.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from helpers.kv_cache import (
    BLOCK_SIZE,
    HEADS,
    expected_hybrid_hit,
    hybrid_kv_cache_config,
    make_request,
    queue_ids,
    sliding_window_hit_length,
)
from helpers.scheduler import make_requests, make_scheduler, next_token, reference_output, run_workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nano_v1.core.block_pool import BlockPool
from nano_v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from nano_v1.core.kv_cache_manager import KVCacheManager
from nano_v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks_per_request,
    hash_block_tokens,
)
from nano_v1.core.single_type_kv_cache_manager import SlidingWindowManager
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from nano_v1.outputs import ModelRunnerOutput
from nano_v1.request import RequestStatus

pytestmark = pytest.mark.ch12

BF16_HEADS = dict(num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def fake_vllm_config(
    max_model_len: int, max_num_batched_tokens: int = 8192, **scheduler
) -> types.SimpleNamespace:
    """The slices of a VllmConfig that the KV cache layout reads."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=types.SimpleNamespace(
            max_num_batched_tokens=max_num_batched_tokens,
            disable_hybrid_kv_cache_manager=scheduler.get("disable_hybrid_kv_cache_manager", False),
        ),
        cache_config=types.SimpleNamespace(num_gpu_blocks_override=scheduler.get("num_gpu_blocks_override")),
    )


# ----------------------------------------------------------------------------- specs and groups


def test_page_size_and_the_most_one_request_holds():
    full = FullAttentionSpec(block_size=16, **BF16_HEADS)
    sliding = SlidingWindowSpec(block_size=16, sliding_window=512, **BF16_HEADS)
    # 2 (K, V) x 16 tokens x 8 heads x 128 x 2 bytes.
    assert full.page_size_bytes == sliding.page_size_bytes == 65_536
    config = fake_vllm_config(max_model_len=32_768, max_num_batched_tokens=8192)
    assert full.max_memory_usage_bytes(config) == 2048 * 65_536  # every token of the context
    # 511 older keys + 8192 new tokens = 8703 tokens = 544 blocks, + 1 for a window off the block grid.
    assert sliding.max_memory_usage_bytes(config) == 545 * 65_536
    short = fake_vllm_config(max_model_len=300, max_num_batched_tokens=8192)
    assert sliding.max_memory_usage_bytes(short) == (19 + 1) * 65_536  # never more than max_model_len


def layer_specs(pattern: str, window: int = 512) -> dict:
    """Layer name -> spec for a pattern like "ssfssf" (s: sliding window, f: full attention)."""
    specs = {}
    for i, kind in enumerate(pattern):
        if kind == "s":
            specs[f"layers.{i}"] = SlidingWindowSpec(block_size=16, sliding_window=window, **BF16_HEADS)
        else:
            specs[f"layers.{i}"] = FullAttentionSpec(block_size=16, **BF16_HEADS)
    return specs


def test_layers_group_by_spec_in_groups_of_the_rarest_count():
    # vLLM's docstring example: 2 full + 3 sliding -> (full.0, full.1), (sw.0, sw.2), (sw.1, padding).
    specs = layer_specs("sfssf")  # layers 0, 2, 3 sliding; 1, 4 full
    groups = get_kv_cache_groups(fake_vllm_config(4096), specs)
    assert [g.layer_names for g in groups] == [
        ["layers.0", "layers.3"], ["layers.2"], ["layers.1", "layers.4"]
    ]  # fmt: skip
    assert [type(g.kv_cache_spec) for g in groups] == [
        SlidingWindowSpec,
        SlidingWindowSpec,
        FullAttentionSpec,
    ]
    # Two tensors (the largest group has two layers), tensor i shared by layer i of every group.
    (config,) = get_kv_cache_configs(fake_vllm_config(4096), [specs], [100 * 2 * 65_536])
    assert config.num_blocks == 100
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [
        (100 * 65_536, ["layers.0", "layers.2", "layers.1"]),
        (100 * 65_536, ["layers.3", "layers.4"]),
    ]


def test_gemma3_1b_pattern_groups_and_saves_memory():
    # gemma-3-1b: 26 layers, every 6th global: 22 sliding, 4 full -> 4 layers per group,
    # 6 sliding groups (2 padding slots) + 1 full group, 4 tensors.
    pattern = "".join("f" if (i + 1) % 6 == 0 else "s" for i in range(26))
    vllm_config = fake_vllm_config(max_model_len=32_768, max_num_batched_tokens=2048)
    (config,) = get_kv_cache_configs(vllm_config, [layer_specs(pattern)], [4 * 65_536 * 10_001])
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [4, 4, 4, 4, 3, 3, 4]
    assert len(config.kv_cache_tensors) == 4 and config.num_blocks == 10_001
    # One 32k request: 2048 blocks of full attention + 6 x (ceil((511 + 2048) / 16) + 1) = 6 x 161.
    assert get_num_blocks_per_request(vllm_config, config) == 2048 + 6 * 161
    assert get_max_concurrency_for_kv_cache_config(vllm_config, config) == pytest.approx(10_000 / 3014)


def test_one_spec_is_one_group_and_disabling_hybrid_unifies():
    (config,) = get_kv_cache_configs(fake_vllm_config(4096), [layer_specs("fff")], [30 * 65_536])
    assert [g.layer_names for g in config.kv_cache_groups] == [["layers.0", "layers.1", "layers.2"]]
    assert config.num_blocks == 10 and len(config.kv_cache_tensors) == 3
    vllm_config = fake_vllm_config(4096, disable_hybrid_kv_cache_manager=True)
    (config,) = get_kv_cache_configs(vllm_config, [layer_specs("ssf", window=64)], [30 * 65_536])
    ((group),) = config.kv_cache_groups
    assert group.layer_names == ["layers.0", "layers.1", "layers.2"] and config.num_blocks == 10
    # The window is remembered: the runner must not cascade these layers.
    assert group.kv_cache_spec == FullAttentionSpec(block_size=16, sliding_window=64, **BF16_HEADS)


def test_override_and_unsupported_layouts():
    vllm_config = fake_vllm_config(4096, num_gpu_blocks_override=7)
    (config,) = get_kv_cache_configs(vllm_config, [layer_specs("sf")], [0])
    assert config.num_blocks == 7
    mixed = {
        "a": FullAttentionSpec(block_size=16, **BF16_HEADS),
        "b": FullAttentionSpec(16, 4, 128, torch.bfloat16),
    }
    with pytest.raises(ValueError, match="page sizes"):
        get_kv_cache_groups(fake_vllm_config(4096), mixed)
    two_windows = KVCacheConfig(
        10,
        [],
        [
            KVCacheGroupSpec(["a"], SlidingWindowSpec(block_size=4, sliding_window=8, **HEADS)),
            KVCacheGroupSpec(["b"], SlidingWindowSpec(block_size=4, sliding_window=16, **HEADS)),
            KVCacheGroupSpec(["c"], FullAttentionSpec(block_size=4, **HEADS)),
        ],
    )
    with pytest.raises(ValueError, match="exactly one full-attention spec and one other"):
        HybridKVCacheCoordinator(two_windows, enable_caching=True)


# ----------------------------------------------------------------------------- ch12_t1: dropping blocks


def make_hybrid_manager(
    num_blocks: int,
    window: int,
    max_model_len: int = 200,
    enable_caching: bool = True,
    num_sliding_groups: int = 1,
) -> KVCacheManager:
    config = hybrid_kv_cache_config(num_blocks, BLOCK_SIZE, window, num_sliding_groups)
    return KVCacheManager(config, max_model_len, enable_caching)


def check_sliding_window_decode(window: int, prompt_len: int, num_decodes: int) -> None:
    """Prefill, then decode one token at a time, checking the sliding group after every step.

    After an allocation for a request with c computed tokens, exactly the blocks wholly
    before key c - window + 1 are null, each dropped block went back to the pool (last
    dropped first in the free queue), and the full-attention group still holds every block.
    """
    manager = make_hybrid_manager(num_blocks=64, window=window, enable_caching=False)
    pool = manager.block_pool
    request = make_request("r", list(range(prompt_len)))
    assert manager.allocate_slots(request, prompt_len) is not None
    request.num_computed_tokens = prompt_len
    sliding, full = manager.coordinator.single_type_managers
    held_before = list(sliding.req_to_blocks["r"])
    for _ in range(num_decodes):
        request.append_output_token_ids(1)
        computed = request.num_computed_tokens
        assert manager.allocate_slots(request, 1) is not None
        blocks = sliding.req_to_blocks["r"]
        first_useful_block = max(computed - window + 1, 0) // BLOCK_SIZE
        assert all(b.is_null for b in blocks[:first_useful_block]), (computed, [b.block_id for b in blocks])
        assert not any(b.is_null for b in blocks[first_useful_block:]), (
            computed,
            [b.block_id for b in blocks],
        )
        dropped = [was for b, was in zip(blocks, held_before) if b.is_null and not was.is_null]
        assert all(b.ref_cnt == 0 for b in dropped), "a dropped block is still counted as held"
        if dropped:  # back of the free queue, the one nearest the window first
            assert queue_ids(pool.free_block_queue)[-len(dropped) :] == [
                b.block_id for b in reversed(dropped)
            ]
        assert not any(b.is_null for b in full.req_to_blocks["r"])
        assert len(full.req_to_blocks["r"]) == len(blocks) == -(-(computed + 1) // BLOCK_SIZE)
        held = sum(not b.is_null for b in blocks) + len(full.req_to_blocks["r"])
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - held, "a block leaked"
        held_before = list(blocks)
        request.num_computed_tokens += 1
    manager.free(request)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


@pytest.mark.ch12_t1
@pytest.mark.parametrize("window, prompt_len", [(6, 20), (4, 9), (9, 3), (16, 40), (2, 13)])
def test_remove_skipped_blocks_frees_exactly_the_blocks_before_the_window(window, prompt_len):
    """Rule: «Free every block wholly before the oldest key the next query (at `num_computed_tokens`) sees»,
    and no other; «Blocks are replaced, not removed»."""
    check_sliding_window_decode(window, prompt_len, num_decodes=17)


@pytest.mark.ch12_t1
def test_remove_skipped_blocks_in_a_long_chunk_frees_several_at_once():
    """Rule: «Free every block wholly before the oldest key the next query (at `num_computed_tokens`) sees»:
    after a long chunk, several at once."""
    manager = make_hybrid_manager(num_blocks=40, window=6, enable_caching=False)
    sliding = manager.coordinator.single_type_managers[0]
    request = make_request("r", list(range(40)))
    manager.allocate_slots(request, 24)  # blocks 0..5 of each group
    ids = [b.block_id for b in sliding.req_to_blocks["r"]]
    request.num_computed_tokens = 24
    free_before = manager.block_pool.get_num_free_blocks()
    manager.allocate_slots(request, 16)  # the next query is at 24: keys 19.. -> block 4 on
    nulls = [b.is_null for b in sliding.req_to_blocks["r"]]
    assert nulls == [True] * 4 + [False] * 6, (
        f"with window 6 and the next query at 24, keys 19.. stay visible: blocks 0-3 (keys 0-15) must be "
        f"the null block and blocks 4.. kept; which are null: {nulls}"
    )
    # Four dropped, then four new blocks for each of the two groups.
    num_free = manager.block_pool.get_num_free_blocks()
    assert num_free == free_before + 4 - 8, (
        f"the 4 blocks that fell out of the window must go back to the pool: {num_free} free blocks, "
        f"expected {free_before + 4 - 8}"
    )
    # The dropped blocks joined the back of the free queue, the one nearest the window first.
    tail = queue_ids(manager.block_pool.free_block_queue)[-4:]
    assert tail == ids[3::-1], f"the dropped blocks {ids[3::-1]} must end the free queue, newest first; it ends {tail}"
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 39, "a freed request must give back every block once"


def drop_blocks_before(self, request_id: str, first_useful_block: int, free=True, null=True) -> None:
    """What a (buggy) `remove_skipped_blocks` does once it has decided where the window starts."""
    blocks = self.req_to_blocks.get(request_id, [])
    dropped = [b for b in blocks[: max(first_useful_block, 0)] if not b.is_null]
    if null:
        blocks[: max(first_useful_block, 0)] = [self._null_block] * min(
            max(first_useful_block, 0), len(blocks)
        )
    if free:
        self.block_pool.free_blocks(dropped)


def free_one_block_too_many(self, request_id: str, num_computed_tokens: int) -> None:
    drop_blocks_before(
        self, request_id, (num_computed_tokens - self.sliding_window + 1) // self.block_size + 1
    )


def window_off_by_one(self, request_id: str, num_computed_tokens: int) -> None:
    """Takes the key at c - w + 1 for outside the window: can drop its block too early."""
    drop_blocks_before(self, request_id, (num_computed_tokens - self.sliding_window + 2) // self.block_size)


def nulls_without_freeing(self, request_id: str, num_computed_tokens: int) -> None:
    first_useful_block = (num_computed_tokens - self.sliding_window + 1) // self.block_size
    drop_blocks_before(self, request_id, first_useful_block, free=False)


def frees_without_nulling(self, request_id: str, num_computed_tokens: int) -> None:
    first_useful_block = (num_computed_tokens - self.sliding_window + 1) // self.block_size
    drop_blocks_before(self, request_id, first_useful_block, null=False)


@pytest.mark.parametrize(
    "bug", [free_one_block_too_many, window_off_by_one, nulls_without_freeing, frees_without_nulling]
)
def test_planted_bugs_in_remove_skipped_blocks_are_caught(bug, monkeypatch):
    monkeypatch.setattr(SlidingWindowManager, "remove_skipped_blocks", bug)
    with pytest.raises(AssertionError):
        for window, prompt_len in [(6, 20), (4, 9), (16, 40)]:
            check_sliding_window_decode(window, prompt_len, num_decodes=17)


# ----------------------------------------------------------------------------- ch12_t2: hits from the right


def pool_with_cached_blocks(cached: list[list[bool]]) -> tuple[BlockPool, list, list[list]]:
    """A pool in which block j of one request's prefix is cached in group g iff `cached[g][j]`.

    Returns the pool, the request's block hashes, and per group the block cached for each j (or None).
    """
    num_blocks = len(cached[0])
    pool = BlockPool(num_gpu_blocks=1 + len(cached) * num_blocks, enable_caching=True)
    hashes, parent = [], None
    for j in range(num_blocks):
        parent = hash_block_tokens(parent, [j] * BLOCK_SIZE)
        hashes.append(parent)
    request = types.SimpleNamespace(request_id="cached", block_hashes=hashes)
    per_group = []
    for group_id, flags in enumerate(cached):
        placed = [pool.get_new_blocks(1)[0] if flag else None for flag in flags]
        for j, block in enumerate(placed):
            if block is not None:
                pool.cache_full_blocks(request, placed, j, j + 1, BLOCK_SIZE, group_id)
        per_group.append(placed)
    return pool, hashes, per_group


def check_sliding_window_hits(find_longest_cache_hit, num_cases: int = 300) -> None:
    """`find_longest_cache_hit` (SlidingWindowManager's signature) against the brute-force rule.

    Random cached/missing patterns over one or two groups (a block counts only if cached in
    every group), windows from 2 tokens to 4 blocks, and lengths that cut blocks off the end.
    The hit must have the rule's length, the null block before the window's blocks, and
    exactly the cached blocks inside it.
    """
    rng = random.Random(12)
    for _ in range(num_cases):
        num_groups, num_blocks = rng.randint(1, 2), rng.randint(0, 10)
        cached = [[rng.random() < 0.75 for _ in range(num_blocks)] for _ in range(num_groups)]
        window = rng.randint(2, 4 * BLOCK_SIZE + 1)
        max_length = rng.randint(0, num_blocks * BLOCK_SIZE)
        spec = SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=window, **HEADS)
        pool, hashes, placed = pool_with_cached_blocks(cached)
        hit = find_longest_cache_hit(hashes, max_length, list(range(num_groups)), pool, spec)
        in_all = [all(flags[j] for flags in cached) for j in range(num_blocks)]
        expected = sliding_window_hit_length(in_all, window, max_length)
        case = (cached, window, max_length)
        assert [len(blocks) for blocks in hit] == [expected] * num_groups, case
        first_needed = max(0, expected - -(-(window - 1) // BLOCK_SIZE))
        for blocks, group_placed in zip(hit, placed):
            assert all(b is pool.null_block for b in blocks[:first_needed]), case
            assert blocks[first_needed:] == group_placed[first_needed:expected], case


@pytest.mark.ch12_t2
def test_sliding_window_hit_is_found_from_the_right():
    # The docstring's case: block size 4, window 8 (2 blocks needed), blocks 1, 2 and 4 cached.
    """Rule: «Search from the right for a run of cached blocks that covers the next query's window»; «blocks
    left of the run come back as the null block»."""
    pool, hashes, (placed,) = pool_with_cached_blocks([[False, True, True, False, True, False]])
    spec = SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=8, **HEADS)
    (hit,) = SlidingWindowManager.find_longest_cache_hit(hashes, 24, [0], pool, spec)
    assert hit == [pool.null_block, placed[1], placed[2]], (
        f"cached blocks 1, 2, 4 with a window of 2 blocks: the rightmost run of 2 is blocks 1-2, so the hit is "
        f"[null, 1, 2]; got {[b.block_id for b in hit]}"
    )
    # Only the window's blocks are needed: a missing block 0 does not stop the hit.
    pool, hashes, (placed,) = pool_with_cached_blocks([[False, False, True, True, True]])
    (hit,) = SlidingWindowManager.find_longest_cache_hit(hashes, 20, [0], pool, spec)
    assert hit == [pool.null_block] * 3 + placed[3:5], (
        f"only the window's blocks must be cached: blocks 3-4 end a hit of 5 blocks whose first 3 are null; "
        f"got {[b.block_id for b in hit]}"
    )
    # A run from block 0 is a hit even when shorter than the window.
    spec = SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=17, **HEADS)
    pool, hashes, (placed,) = pool_with_cached_blocks([[True, True, False, True, True, True]])
    (hit,) = SlidingWindowManager.find_longest_cache_hit(hashes, 24, [0], pool, spec)
    assert hit == placed[:2], (
        f"a run that starts at block 0 is a hit even when shorter than the window (no older key exists): "
        f"blocks 0-1; got {[b.block_id for b in hit]}"
    )


@pytest.mark.ch12_t2
def test_sliding_window_hit_matches_brute_force():
    """Rule: «So the hit ends at the rightmost such run»; «A run that reaches block 0 is a hit even if
    shorter», against brute force."""
    check_sliding_window_hits(SlidingWindowManager.find_longest_cache_hit)


def hit_by_a_wrong_rule(block_hashes, max_length, group_ids, pool, spec, needed: int, trim: bool, keep_short):
    """A hit of j blocks by a rule with knobs: `needed` blocks in a row before j, the blocks after
    the run kept unless `trim`, a run shorter than `needed` from block 0 kept only if `keep_short`."""
    found = [pool.get_cached_block(h, group_ids) for h in block_hashes[: max_length // spec.block_size]]
    runs = [j for j in range(len(found), needed - 1, -1) if needed and all(found[j - needed : j])]
    leading = next((k for k, blocks in enumerate(found) if blocks is None), len(found)) if keep_short else 0
    end = runs[0] if runs else leading
    length = len(found) if runs and not trim else end
    return tuple(
        [
            found[k][g] if k >= end - needed and found[k] is not None else pool.null_block
            for k in range(length)
        ]
        for g in range(len(group_ids))
    )


def search_from_the_left(cls, block_hashes, max_length, group_ids, pool, spec):
    """Full attention's rule: the hit ends at the first miss, so a window after a dropped block is lost."""
    return hit_by_a_wrong_rule(block_hashes, max_length, group_ids, pool, spec, 0, True, True)


def one_block_too_many_needed(cls, block_hashes, max_length, group_ids, pool, spec):
    """Counts the query's own token into the window: needs ceil(w / block_size) blocks."""
    needed = -(-spec.sliding_window // spec.block_size)
    return hit_by_a_wrong_rule(block_hashes, max_length, group_ids, pool, spec, needed, True, True)


def keeps_blocks_after_the_run(cls, block_hashes, max_length, group_ids, pool, spec):
    needed = -(-(spec.sliding_window - 1) // spec.block_size)
    return hit_by_a_wrong_rule(block_hashes, max_length, group_ids, pool, spec, needed, False, True)


def drops_a_short_run_at_the_start(cls, block_hashes, max_length, group_ids, pool, spec):
    needed = -(-(spec.sliding_window - 1) // spec.block_size)
    return hit_by_a_wrong_rule(block_hashes, max_length, group_ids, pool, spec, needed, True, False)


def hit_in_the_first_group_is_enough(cls, block_hashes, max_length, group_ids, pool, spec):
    """The right rule, asked of one group only: a block missing from another group slips through."""
    needed = -(-(spec.sliding_window - 1) // spec.block_size)
    first = hit_by_a_wrong_rule(block_hashes, max_length, group_ids[:1], pool, spec, needed, True, True)
    return first * len(group_ids)


@pytest.mark.parametrize(
    "bug",
    [
        search_from_the_left,
        one_block_too_many_needed,
        keeps_blocks_after_the_run,
        drops_a_short_run_at_the_start,
        hit_in_the_first_group_is_enough,
    ],
)
def test_planted_bugs_in_the_hit_search_are_caught(bug):
    with pytest.raises(AssertionError):
        check_sliding_window_hits(types.MethodType(bug, SlidingWindowManager))


# ----------------------------------------------------------------------------- the coordinator's hits


def run_to_completion(manager: KVCacheManager, request, num_decodes: int) -> None:
    """Prefill in one step, decode `num_decodes` tokens (the sliding groups drop blocks), free."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    for _ in range(num_decodes):
        request.append_output_token_ids(7)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    manager.free(request)


@pytest.mark.ch12_t2
def test_repeated_prompt_hits_in_every_group_and_survives_eviction_outside_the_window():
    """Rule: the window needs «the last ceil((w - 1) / block_size) blocks before L, and nothing older»: a
    repeated prompt hits in every group, even after blocks outside the window are evicted."""
    manager = make_hybrid_manager(num_blocks=40, window=8, num_sliding_groups=2)
    prompt = list(range(30))
    run_to_completion(manager, make_request("first", prompt), num_decodes=10)
    again = make_request("again", prompt)
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    # 29 tokens may hit: 7 blocks. Full attention has all 7; each window needs the last 2.
    assert num_hit_tokens == 28 == expected_hybrid_hit(manager, again), (
        f"a repeated 30-token prompt hits {num_hit_tokens} tokens; its 7 full blocks (28 tokens) should hit"
    )
    sliding_a, sliding_b, full = hits.blocks
    for window in (sliding_a, sliding_b):
        assert [b.is_null for b in window] == [True] * 5 + [False] * 2, (
            f"a window of 8 needs the last 2 of the 7 hit blocks and nothing older; null blocks: "
            f"{[b.is_null for b in window]}"
        )
    assert not any(b.is_null for b in full) and len(full) == 7, "full attention must hit all 7 blocks"
    # A filler takes the free queue's front: the sliding groups' oldest blocks, dropped first.
    # They are outside the repeated prompt's window, so the hit does not shrink.
    filler = make_request("filler", [99] * 16)
    manager.allocate_slots(filler, 16)  # 4 blocks in each of 3 groups
    hit_after_filler = manager.get_computed_blocks(make_request("again2", prompt))[1]
    assert hit_after_filler == 28, (
        f"evicting blocks outside the window must not shrink the hit: {hit_after_filler} tokens, not 28"
    )
    manager.free(filler)
    # Evict much more: now the rule, not the whole prefix, decides how much is left.
    big = make_request("big", [98] * 60)
    manager.allocate_slots(big, 44)
    third = make_request("third", prompt)
    hit, expected = manager.get_computed_blocks(third)[1], expected_hybrid_hit(manager, third)
    assert hit == expected < 28, f"after a larger eviction the hit is {hit} tokens; the rule gives {expected} (< 28)"


@pytest.mark.ch12_t2
def test_the_full_attention_hit_bounds_the_window_hit():
    # Evict a full-attention block in the middle: the windows' blocks after it are useless.
    """Rule: «The hit is at most `max_length` tokens (whole blocks)»: «the full-attention hit», which «bounds
    this one»."""
    manager = make_hybrid_manager(num_blocks=40, window=8)
    prompt = list(range(30))
    run_to_completion(manager, make_request("first", prompt), num_decodes=0)
    full = manager.coordinator.single_type_managers[1]
    cached_full = manager.block_pool.get_cached_block(make_request("x", prompt).block_hashes[3], [1])
    manager.block_pool._maybe_evict_cached_block(cached_full[0])  # as if reused by another request
    again = make_request("again", prompt)
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 12 == expected_hybrid_hit(manager, again)  # blocks 0..2 only
    assert [len(blocks) for blocks in hits.blocks] == [3, 3] and not full.req_to_blocks


# ----------------------------------------------------------------------------- random workloads


class PageMemory:
    """What every KV cache page holds: page (block id, offset) -> (group, token prefix).

    A block id is a page in every tensor, and a block belongs to one group at a time, so a
    page written by one group and read by another is a bug the memory can see.
    """

    def __init__(self) -> None:
        self.pages: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}

    def write(self, manager: KVCacheManager, request, start: int, end: int) -> None:
        """The step computes positions start..end-1 of `request` in every group."""
        tokens = request.all_token_ids
        for group_id, blocks in enumerate(manager.get_blocks(request.request_id).blocks):
            for pos in range(start, end):
                block = blocks[pos // BLOCK_SIZE]
                assert not block.is_null, f"{request.request_id}: a token is written to the null block"
                self.pages[block.block_id, pos % BLOCK_SIZE] = (group_id, tuple(tokens[: pos + 1]))

    def check_window(
        self, manager: KVCacheManager, request, blocks_per_group, num_computed: int, held: bool = True
    ) -> None:
        """The keys the next query (at position `num_computed`) reads are in `blocks_per_group`, and
        (if `held`: the request owns them) none of their blocks is free."""
        tokens = request.all_token_ids
        managers = manager.coordinator.single_type_managers
        for group_id, (blocks, manager_g) in enumerate(zip(blocks_per_group, managers)):
            window = getattr(manager_g, "sliding_window", None)
            first = 0 if window is None else max(0, num_computed - window + 1)
            for pos in range(first, num_computed):
                block = blocks[pos // BLOCK_SIZE]
                where = f"{request.request_id} group {group_id} position {pos} in block {block.block_id}"
                assert not block.is_null and (block.ref_cnt > 0 or not held), f"{where}: freed in the window"
                page = self.pages.get((block.block_id, pos % BLOCK_SIZE))
                assert page == (group_id, tuple(tokens[: pos + 1])), f"{where}: holds someone else's KV"


def check_hybrid_invariants(
    manager: KVCacheManager, live: dict, memory: PageMemory, last_computed: dict
) -> None:
    pool = manager.block_pool
    managers = manager.coordinator.single_type_managers
    owners: dict[int, int] = {}
    for rid, request in live.items():
        lists = [m.req_to_blocks[rid] for m in managers]
        num_cached = {m.num_cached_block[rid] for m in managers}
        assert len({len(blocks) for blocks in lists}) == 1 and len(num_cached) == 1, f"{rid}: groups disagree"
        memory.check_window(manager, request, lists, request.num_computed_tokens)
        for m, blocks in zip(managers, lists):
            window = getattr(m, "sliding_window", None)
            if window is not None:  # dropped at the last allocation: everything before its window
                first_useful_block = max(last_computed[rid] - window + 1, 0) // BLOCK_SIZE
                assert all(b.is_null for b in blocks[:first_useful_block]), f"{rid}: a skipped block kept"
            for block in blocks:
                if not block.is_null:
                    owners[block.block_id] = owners.get(block.block_id, 0) + 1
    assert pool.null_block.prev_free_block is None, "the null block is in the free queue"
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners.get(block.block_id, 0), f"block {block.block_id} leaked or double-held"
        assert (block.ref_cnt == 0) == (block.prev_free_block is not None)
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "only cached full blocks may be shared"
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - len(owners)


def blocks_needed(manager: KVCacheManager, rid: str, num_tokens: int, hits) -> int:
    """Free blocks an allocation of `num_tokens` slots takes, counted plainly."""
    managers = manager.coordinator.single_type_managers
    hit_lists = hits.blocks if hits is not None else ([],) * len(managers)
    total = 0
    for m, hit in zip(managers, hit_lists):
        held = len(m.req_to_blocks.get(rid, []))
        total += max(0, -(-num_tokens // BLOCK_SIZE) - held - len(hit))
        total += sum(b.ref_cnt == 0 and not b.is_null for b in hit)
    return total


def snapshot(manager: KVCacheManager):
    pool = manager.block_pool
    return (
        queue_ids(pool.free_block_queue),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks[1:]],
        [{rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
         for m in manager.coordinator.single_type_managers],
    )  # fmt: skip


STEMS = [list(range(1, 23)), [5] * 17, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def run_hybrid_workload(data, num_blocks: int, window: int, enable_caching: bool) -> None:
    max_model_len = 48
    manager = make_hybrid_manager(num_blocks, window, max_model_len, enable_caching, num_sliding_groups=2)
    memory, live, last_computed, next_id = PageMemory(), {}, {}, 0

    def allocate(request, num_new, num_hit_tokens=0, hits=None, num_lookahead=0):
        rid = request.request_id
        # Dropping skipped blocks happens even when the allocation fails; do it first so that a
        # failure can be checked to change nothing else.
        manager.coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        before = snapshot(manager)
        num_slots = min(request.num_computed_tokens + num_hit_tokens + num_new + num_lookahead, max_model_len)
        need = blocks_needed(manager, rid, num_slots, hits)
        new = manager.allocate_slots(request, num_new, num_hit_tokens, hits, num_lookahead)
        if new is None:
            assert need > manager.block_pool.get_num_free_blocks() and snapshot(manager) == before
            return False
        assert sum(len(blocks) for blocks in new.blocks) <= need, "allocated more than the request needs"
        assert not any(b.is_null for blocks in new.blocks for b in blocks), "the null block was handed out"
        last_computed[rid] = request.num_computed_tokens
        return True

    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["admit", "admit", "step", "step", "step", "abort", "abort_unknown"]))
        if op == "admit":
            stem = data.draw(st.sampled_from(STEMS))
            prompt = stem[: data.draw(st.integers(1, len(stem)))]
            prompt += data.draw(st.lists(st.integers(0, 3), max_size=8))
            request = make_request(f"r{next_id}", prompt)
            next_id += 1
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            if enable_caching:
                assert num_hit_tokens == expected_hybrid_hit(manager, request)
            # The hit (not yet touched: maybe free) holds this prompt's KV where the first query looks.
            memory.check_window(manager, request, hits.blocks, num_hit_tokens, held=False)
            num_new = data.draw(st.integers(1, request.num_tokens - num_hit_tokens))
            if allocate(request, num_new, num_hit_tokens, hits, data.draw(st.integers(0, 2))):
                request.status = RequestStatus.RUNNING
                memory.write(manager, request, num_hit_tokens, num_hit_tokens + num_new)
                request.num_computed_tokens = num_hit_tokens + num_new
                live[request.request_id] = request
        elif op == "step" and live:
            request = live[data.draw(st.sampled_from(sorted(live)))]
            if request.num_computed_tokens == request.num_tokens:
                if request.num_tokens >= max_model_len:
                    continue
                request.append_output_token_ids(data.draw(st.integers(0, 3)))  # "sampled" last step
            num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
            start = request.num_computed_tokens
            if allocate(request, num_new, num_lookahead=data.draw(st.integers(0, 2))):
                memory.write(manager, request, start, start + num_new)
                request.num_computed_tokens += num_new
            else:  # what the scheduler does next: preempt it
                manager.free(live.pop(request.request_id))
        elif op == "abort" and live:
            manager.free(live.pop(data.draw(st.sampled_from(sorted(live)))))
        elif op == "abort_unknown":  # aborted while waiting: never held a block
            manager.free(make_request("never-scheduled", [1]))
        check_hybrid_invariants(manager, live, memory, last_computed)

    for request in live.values():
        manager.free(request)
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == num_blocks - 1 and all(b.ref_cnt == 0 for b in pool.blocks[1:])


@pytest.mark.ch12_t1
@pytest.mark.ch12_t2
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(4, 40), window=st.integers(2, 13), enable_caching=st.booleans())
def test_hybrid_coordinator_random_workloads(data, num_blocks, window, enable_caching):
    """Rule: «null out and free the blocks before the block of key num_computed_tokens - w + 1», and «from the
    right, find the window's run of cached blocks; end the hit after it»: over random workloads the
    hybrid coordinator keeps its invariants."""
    run_hybrid_workload(data, num_blocks, window, enable_caching)


# ----------------------------------------------------------------------------- through the scheduler


class WindowedFakeModelRunner:
    """test_scheduler.py's fake runner for several KV cache groups.

    It keeps every page's content, (block id, offset) -> (group, token), and checks, for
    every scheduled request, that each group's blocks hold the request's keys as far back
    as that group's window reaches (all of them for full attention). Its model is the same
    deterministic function of the token history, so outputs must equal a direct computation
    however requests were chunked, preempted, aborted or served from the prefix cache.
    """

    def __init__(self, block_size: int, windows: list[int | None]) -> None:
        self.block_size = block_size
        self.windows = windows
        self.pages: dict[tuple[int, int], tuple[int, int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[list[int]]] = {}
        self.num_computed: dict[str, int] = {}

    def page(self, req_id: str, group_id: int, pos: int) -> tuple[int, int]:
        return self.block_ids[req_id][group_id][pos // self.block_size], pos % self.block_size

    def execute_model(self, so):
        for rid in so.finished_req_ids:
            for state in (self.tokens, self.block_ids, self.num_computed):
                state.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.block_ids[new.req_id] = [list(ids) for ids in new.block_ids]
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, resumed, new_blocks, computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
        ):
            if resumed:
                self.block_ids[rid] = [list(ids) for ids in new_blocks]
            elif new_blocks is not None:
                for ids, new_ids in zip(self.block_ids[rid], new_blocks):
                    ids.extend(new_ids)
            self.num_computed[rid] = computed
        sampled = []
        for rid in so.num_scheduled_tokens:
            start, n, tokens = self.num_computed[rid], so.num_scheduled_tokens[rid], self.tokens[rid]
            for group_id, window in enumerate(self.windows):
                first = 0 if window is None else max(0, start - window + 1)
                for pos in range(first, start):
                    assert self.pages.get(self.page(rid, group_id, pos)) == (group_id, tokens[pos]), (
                        f"{rid}: group {group_id} lost position {pos} of its window"
                    )
                for pos in range(start, start + n):
                    self.pages[self.page(rid, group_id, pos)] = (group_id, tokens[pos])
            self.num_computed[rid] = start + n
            if start + n < len(tokens):
                sampled.append([])  # a prefill chunk short of the last prompt token
            else:
                tokens.append(next_token(tokens))
                sampled.append([tokens[-1]])
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    def take_draft_token_ids(self) -> None:
        return None  # no speculative decoding here


@pytest.mark.ch12_t1
@pytest.mark.ch12_t2
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.integers(2, 40),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    abort_prob=st.sampled_from([0.0, 0.1]),
)
def test_scheduler_with_hybrid_groups_keeps_every_window(
    seed, block_size, window, budget, max_seqs, caching, abort_prob
):
    """Rule: «null out and free the blocks before the block of key num_computed_tokens - w + 1», and «from the
    right, find the window's run of cached blocks»: through the scheduler, every query's window stays
    in its blocks."""
    rng = random.Random(seed)
    max_prompt, max_out = 40, 12
    max_model_len = 3 * 16 + max_prompt + max_out + 1
    # Between "one request at a time" and "plenty": small pools force preemption.
    window_blocks = -(-min(window - 1 + budget, max_model_len) // block_size) + 1
    one_request = -(-max_model_len // block_size) + 2 * window_blocks
    num_blocks = rng.randint(one_request + 1, 3 * one_request)
    kv_cache_config = hybrid_kv_cache_config(num_blocks, block_size, window, num_sliding_groups=2)
    sched = make_scheduler(
        num_blocks, block_size, budget, max_seqs, max_model_len, caching, kv_cache_config=kv_cache_config
    )
    runner = WindowedFakeModelRunner(block_size, [window, window, None])
    requests = make_requests(rng, rng.randint(1, 12), block_size, max_prompt, max_out, shared=True)
    # run_workload (test_scheduler.py) also checks every block's count after every step, and
    # that every block is free at the end.
    outputs, aborted = run_workload(sched, requests, abort_prob, rng, runner=runner)
    for r in requests:
        if r.request_id not in aborted:
            assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens)


# ----------------------------------------------------------------------------- cascade attention per group


def test_cascade_is_refused_for_windowed_groups(tiny_qwen3):
    """The runner asks vLLM's rule per group, saying honestly whether the group has a window:
    a batch that cascades for full attention does not for a sliding window, or for full
    attention that remembers a window (the hybrid allocator off)."""
    from nano_v1.engine.arg_utils import EngineArgs
    from nano_v1.worker.gpu_model_runner import GPUModelRunner

    config = EngineArgs(model=tiny_qwen3, block_size=16, max_model_len=1024).create_engine_config()
    runner = GPUModelRunner(config, torch.device("cpu"))  # the builder, heads and SMs it reads
    runner.input_batch.num_computed_tokens_cpu[:8] = 1000
    query_lens = np.full(8, 2, dtype=np.int32)  # not pure decodes: the rule says cascade
    heads = dict(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    cases = {
        FullAttentionSpec(**heads): 992,
        SlidingWindowSpec(**heads, sliding_window=64): 0,
        FullAttentionSpec(**heads, sliding_window=64): 0,
    }
    for spec, expected in cases.items():
        got = runner._compute_cascade_attn_prefix_len(query_lens, 62, spec)
        assert got == expected, spec
