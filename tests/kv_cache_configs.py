"""KV cache configs for tests that drive the KV cache manager or the scheduler without a model.

The scheduler side reads only the groups' specs and the block count; layer names and
tensors matter to the model runner alone, so each group gets placeholder names.
"""

from __future__ import annotations

import torch

from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

# One layer's head layout: the scheduler never looks at it.
HEADS = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)


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
