"""What each attention layer needs from the KV cache, and how the cache is laid out for all of them.

Mirrors vllm/v1/kv_cache_interface.py (chapter 12).

Why it exists: not every layer needs every token. A full-attention layer attends to the
whole context, so it keeps the keys and values of every token; a sliding-window layer
with window w attends to its last w tokens only, so it can drop everything older. A
`KVCacheSpec` says which of the two a layer is, how big one block of it is
(`page_size_bytes`) and the most one request can ever hold in it
(`max_memory_usage_bytes`). The engine groups layers of the same spec into KV cache
groups (`KVCacheGroupSpec`), each with its own block table; all groups draw their blocks
from one block pool, and `KVCacheConfig` records the number of blocks and which layers
share which tensor. Layers are never told about blocks: the group is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The KV cache format of one layer. Frozen: equal specs group together (they are dict keys)."""

    # Tokens per block.
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """The most bytes one request can hold in this layer at any moment."""
        raise NotImplementedError

    @classmethod
    def merge(cls, specs: list[KVCacheSpec]) -> KVCacheSpec:
        """One spec for a group of layers; ValueError if the layers cannot share a block table."""
        if any(spec != specs[0] for spec in specs[1:]):
            raise ValueError(f"all layers of one KV cache group must have the same spec, got {set(specs)}")
        return specs[0]  # frozen: shared, never copied


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        # Keys and values: 2 x block_size x num_kv_heads x head_size elements.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that keeps every token: blocks for the whole context.

    `sliding_window` is set only when the hybrid allocator is off
    (`disable_hybrid_kv_cache_manager`): a sliding-window layer is then managed like full
    attention (blocks for every token), while the kernel still attends to its window, and
    the runner must know that (cascade attention handles no window).
    """

    sliding_window: int | None = None

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        return -(-vllm_config.model_config.max_model_len // self.block_size) * self.page_size_bytes  # ceil

    @classmethod
    def merge_window_sizes(cls, window_sizes: set[int]) -> int | None:
        if len(window_sizes) > 1:
            raise ValueError(
                f"all layers of one KV cache group must have the same window, got {window_sizes}"
            )
        return next(iter(window_sizes), None)

    @classmethod
    def merge(cls, specs: list[KVCacheSpec]) -> FullAttentionSpec:
        """Full-attention layers, some perhaps with a window (the unified case), as one spec."""
        if not all(isinstance(spec, FullAttentionSpec) for spec in specs):
            raise ValueError("all layers of a full-attention KV cache group must be FullAttentionSpec")
        first = specs[0]
        merged = cls(
            block_size=first.block_size,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=first.dtype,
            sliding_window=cls.merge_window_sizes(
                {spec.sliding_window for spec in specs if spec.sliding_window is not None}
            ),
        )
        for spec in specs:
            if (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype) != (
                merged.block_size, merged.num_kv_heads, merged.head_size, merged.dtype
            ):  # fmt: skip
                raise ValueError("all layers of one KV cache group must have the same page layout")
        return merged


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer whose queries see only their last `sliding_window` keys (the query's own included)."""

    sliding_window: int

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """Blocks for the window before this step plus the step's tokens, plus one for alignment.

        Within a step a request holds its last `sliding_window - 1` computed tokens (the
        oldest key its first new query sees) and the step's new tokens, at most
        `max_num_batched_tokens`; never more than `max_model_len`. A window rarely starts
        at a block boundary: block size 4 and a 4-token window over tokens C..F of
        [A B C D][E F] needs two blocks, hence the + 1.
        """
        num_tokens = min(
            self.sliding_window - 1 + vllm_config.scheduler_config.max_num_batched_tokens,
            vllm_config.model_config.max_model_len,
        )
        return (-(-num_tokens // self.block_size) + 1) * self.page_size_bytes


@dataclass(slots=True)
class KVCacheTensor:
    """One KV cache allocation of `size` bytes, and the layers that share it (one per group)."""

    size: int
    shared_by: list[str]


@dataclass(slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table: the KV cache manager sees them as one layer."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass(slots=True)
class KVCacheConfig:
    """The whole KV cache: how many blocks, which tensors hold them, and the groups.

    A block id names the same-sized page in every tensor. Each tensor is shared by at most
    one layer of each group, and the block pool hands each block to exactly one group, so
    layers sharing a tensor never touch the same page.
    """

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
