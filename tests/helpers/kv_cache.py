"""KV cache builders and oracles for tests that drive the KV cache manager or the scheduler without a model.

- KV cache configs (`full_attention_kv_cache_config`, `hybrid_kv_cache_config`): the
  scheduler side reads only the groups' specs and the block count; layer names and
  tensors matter to the model runner alone, so each group gets placeholder names.
- Requests (`make_request`) and the free queue's order (`queue_ids`), chapters 02 and 03.
- The sliding-window hit rule by brute force (`sliding_window_hit_length`) and the hybrid
  coordinator's expected hit (`expected_hybrid_hit`), chapter 12.
"""

from __future__ import annotations

import torch

from nano_v1.core.kv_cache_manager import KVCacheManager
from nano_v1.core.kv_cache_utils import FreeKVCacheBlockQueue, get_request_block_hasher
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from nano_v1.request import Request
from nano_v1.sampling_params import SamplingParams

# One layer's head layout: the scheduler never looks at it.
HEADS = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)

BLOCK_SIZE = 4


def full_attention_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """One group of full attention: every model before chapter 12."""
    spec = FullAttentionSpec(block_size=block_size, **HEADS)
    return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["full.0"], spec)])


def hybrid_kv_cache_config(
    num_blocks: int, block_size: int, sliding_window: int, num_sliding_groups: int = 2
) -> KVCacheConfig:
    """Sliding-window groups first, then one full-attention group, as Gemma 3's layers group."""
    sliding = SlidingWindowSpec(block_size=block_size, sliding_window=sliding_window, **HEADS)
    groups = [KVCacheGroupSpec([f"sw.{i}"], sliding) for i in range(num_sliding_groups)]
    groups.append(KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size=block_size, **HEADS)))
    return KVCacheConfig(num_blocks, [], groups)



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


def sliding_window_hit_length(
    cached: list[bool], window: int, max_length: int, block_size: int = BLOCK_SIZE
) -> int:
    """Brute force, in blocks: the most blocks j whose last ceil((w - 1) / block_size) blocks (all j, if
    fewer) are cached.

    A hit of j blocks means the next token computed is at j * block_size; its window needs
    keys back to j * block_size - (w - 1), and nothing older.
    """
    needed = -(-(window - 1) // block_size)
    max_blocks = max_length // block_size
    return max(j for j in range(max_blocks + 1) if all(cached[max(0, j - needed) : j]))


def expected_hybrid_hit(manager: KVCacheManager, request) -> int:
    """The hybrid rule from the pool's index: full attention's leading run (never the last token),
    then the sliding-window rule within it, a block counting only if every sliding group has it."""
    coordinator, pool, block_size = manager.coordinator, manager.block_pool, manager.block_size
    max_blocks = (request.num_tokens - 1) // block_size
    hashes = request.block_hashes
    full_run = 0
    while full_run < max_blocks and pool.get_cached_block(
        hashes[full_run], coordinator.full_attention_group_ids
    ):
        full_run += 1
    in_all = [pool.get_cached_block(h, coordinator.other_group_ids) is not None for h in hashes[:full_run]]
    window = coordinator.other_spec.sliding_window
    return block_size * sliding_window_hit_length(in_all, window, full_run * block_size, block_size)

