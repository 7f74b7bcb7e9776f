"""KV cache building blocks: the block record, the O(1) free queue, block hashing, and the cache's layout.

Mirrors vllm/v1/core/kv_cache_utils.py (chapters 02, 03, 11 and 12).

Why it exists: the paged KV cache is a pool of fixed-size blocks. The pool needs a
record per block (`KVCacheBlock`), an ordering of the free blocks that doubles as the
prefix cache's LRU eviction order (`FreeKVCacheBlockQueue`), and a content address for
every full block (`hash_block_tokens`) so that a new request can find blocks another
request already computed. A block whose positions hold part of an image carries the
image's content hash in its extra keys (`generate_block_hash_extra_keys`, chapter 11):
the KV there depends on the image, which the placeholder token ids do not show.
Chapter 12 adds the layout: which layers form a KV cache group (one block table each),
how many blocks the memory holds, and which layers share which tensor
(`get_kv_cache_configs`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from array import array
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from nano_v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig
    from nano_v1.request import Request

logger = logging.getLogger(__name__)

# The content address of one full block *and everything before it* (a chain hash):
# a 32-byte SHA-256 digest. A distinct type so raw bytes are not passed by mistake.
BlockHash = NewType("BlockHash", bytes)

# A block hash and the KV cache group the block belongs to, as the prefix cache's key:
# the same tokens have one block per group (a full-attention layer's KV and a
# sliding-window layer's KV are different tensors), and each must be found on its own.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The hash's 32 bytes followed by the group id in 4 bytes, big-endian (bytes, not a tuple: cheaper keys)."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


# The parent of every sequence's first block. Fixed, so hashes are reproducible
# across runs and processes (vLLM seeds it from PYTHONHASHSEED or at random; with a
# cryptographic hash a secret seed buys nothing against collisions).
NONE_HASH = BlockHash(hashlib.sha256(b"nano_v1: the empty prefix").digest())


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV cache block; the tensors live in the model runner.

    `eq=False`: blocks compare by identity. A field-wise `==` would walk the free-list
    pointers, and two blocks are never "equal" anyway.
    """

    # Index into the KV cache tensors, 0 .. num_gpu_blocks - 1.
    block_id: int
    # How many live requests hold this block. 0 means it sits in the free queue.
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache (its hash and its KV
    # cache group); cleared when the block is evicted (reused for other tokens). Read
    # through the `block_hash` property.
    _block_hash: BlockHashWithGroupId | None = None
    # Links of the free queue's doubly linked list; only FreeKVCacheBlockQueue touches them.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder block 0: never allocated, never cached, never freed.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash: the block is being evicted from the prefix cache."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Ids only: printing the neighbours themselves would recurse down the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self._block_hash.hex()[:8] if self._block_hash else None}, "
            f"prev_free_block={prev_id}, next_free_block={next_id})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list threaded through the blocks themselves.

    Front = evicted first. Blocks start in block-id order; a freed block is appended at
    the back, so the front is always the least recently freed block (LRU). A prefix-cache
    hit on a free block takes it out of the middle, which is why this is a linked list
    and not a `collections.deque` (whose `remove` is O(n)). No Python objects are
    allocated per operation: only the blocks' `prev_free_block`/`next_free_block` change.

    Two sentinel blocks (`fake_free_list_head`, `fake_free_list_tail`, id -1) bracket the
    list, so every real block in it has both neighbours and no operation needs an
    "is this the first/last block" branch. A block is in the queue exactly when its
    links are not None.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in itertools.pairwise(chain):
            left.next_free_block = right
            right.prev_free_block = left

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front (least recently used) block."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, front first, in one pass."""
        assert 0 <= n <= self.num_free_blocks, f"cannot pop {n} of {self.num_free_blocks} free blocks"
        # BEGIN TASK ch02_t1: take the n least recently used blocks in one pass, leaving a valid queue behind
        popped = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            popped.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        # Reconnect the head to whatever follows the popped run (maybe the tail).
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return popped
        # END TASK

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is in the queue, in O(1)."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None, f"{block} is not in the free queue"
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the back: it becomes the last to be evicted."""
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the back, keeping their order (blocks[0] is evicted first)."""
        last = self.fake_free_list_tail.prev_free_block
        for block in blocks:
            assert block.prev_free_block is None and block.next_free_block is None, (
                f"{block} is already in the free queue"
            )
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue front to back; O(n), for tests and debugging."""
        blocks = []
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Chain hash of one full block: SHA-256(parent hash, token count, tokens, extra keys).

    Folding in the parent's hash makes the hash name the whole prefix up to and
    including this block, so equal hashes mean equal KV (attention at position i
    depends on every token before i). `extra_keys` carries anything else the KV
    depends on besides token ids (a LoRA id, an image hash, a cache salt).

    The encoding is compact and unambiguous: 32 bytes of parent, 4 bytes of token
    count, 8 bytes per token, then the extra keys' repr. SHA-256 rather than Python's
    `hash()`: a 64-bit hash of integers is cheap to collide on purpose (a collision
    silently serves one user's KV to another's prompt), and even by accident a server
    that hashes billions of blocks approaches the 2**32 birthday bound. The price,
    about 1.3 µs per 16-token block versus 0.4 µs for `hash(tuple)` on a 2-core CPU,
    is paid once per block per request (chapter 03 has the arithmetic).
    """
    data = b"".join(
        (
            parent_block_hash or NONE_HASH,
            len(curr_block_token_ids).to_bytes(4, "little"),
            array("q", curr_block_token_ids).tobytes(),  # int64 per token
            b"" if extra_keys is None else repr(extra_keys).encode(),
        )
    )
    return BlockHash(hashlib.sha256(data).digest())


def _gen_mm_extra_hash_keys(request: Request, start_token_idx: int, end_token_idx: int) -> list[str]:
    """The mm_hash of every image with a position in the block `[start_token_idx, end_token_idx)`.

    An image of 10 positions at offset 6 with 4-token blocks is in blocks 1, 2, 3 and 4
    (positions 4-7, ..., 16-19), not in block 0 (0-3) nor block 5 (20-23). The request's
    `mm_features` are in prompt order, so no image after one that starts past the block
    can be in it.
    """
    # BEGIN TASK ch11_t2: identifiers of the images whose positions overlap the block, in prompt order
    extra_keys = []
    for mm_feature in request.mm_features:
        offset = mm_feature.mm_position.offset
        if offset >= end_token_idx:
            break
        if offset + mm_feature.mm_position.length > start_token_idx:
            extra_keys.append(mm_feature.identifier)
    return extra_keys
    # END TASK


def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int
) -> tuple[Any, ...] | None:
    """The extra keys of one block: the hashes of the images in it; None if there are none.

    vLLM also folds in a LoRA adapter's id and a cache salt, which nano_v1 does not have,
    and carries an image index from block to block to skip images already passed.
    """
    if not request.mm_features:
        return None
    mm_extra_keys = _gen_mm_extra_hash_keys(request, start_token_idx, end_token_idx)
    return tuple(mm_extra_keys) if mm_extra_keys else None


class RequestBlockHasher:
    """Hashes the blocks a request's new tokens have filled; a `Request` calls it.

    `block_size` is public so that a `Request` can skip the call while its newest block
    is still partial (the common case: 15 of every 16 decode steps with 16-token blocks).
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        """Hashes of blocks `len(request.block_hashes)`, ... that are now full (a partial
        last block gets no hash until it fills).

        Block i's hash is `hash_block_tokens(parent, its tokens, its extra keys)`, where the
        parent is block i - 1's hash (None for block 0): so a hash names its whole prefix."""
        # BEGIN TASK ch03_t1: hash each newly full block and its extra keys so a hash names its whole prefix
        block_size = self.block_size
        start = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        token_ids = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes = []
        for block_start in range(start, num_tokens - block_size + 1, block_size):
            block_end = block_start + block_size
            extra_keys = generate_block_hash_extra_keys(request, block_start, block_end)
            parent = hash_block_tokens(parent, token_ids[block_start:block_end], extra_keys)
            new_hashes.append(parent)
        return new_hashes
        # END TASK


def get_request_block_hasher(block_size: int) -> RequestBlockHasher:
    """The hasher a `Request` uses for its full blocks (vLLM's name for the factory)."""
    return RequestBlockHasher(block_size)


# ----------------------------------------------------------------------------- the cache's layout (chapter 12)


def max_memory_usage_bytes(vllm_config: VllmConfig, kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    """The most bytes one request can hold at once in layers (or groups) of these specs."""
    return sum(spec.max_memory_usage_bytes(vllm_config) for spec in kv_cache_specs)


def create_kv_cache_group_specs(
    kv_cache_spec: dict[str, KVCacheSpec], grouped_layer_names: list[list[str]]
) -> list[KVCacheGroupSpec]:
    """One `KVCacheGroupSpec` per list of layer names, its spec merged from its layers'."""
    groups = []
    for layer_names in grouped_layer_names:
        layer_specs = [kv_cache_spec[name] for name in layer_names]
        groups.append(KVCacheGroupSpec(layer_names, layer_specs[0].merge(layer_specs)))
    return groups


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """Whether every layer can share one block table (full attention with and without a window counts as one)."""
    specs = list(kv_cache_spec.values())
    try:
        specs[0].merge(specs)
    except ValueError:
        return False
    return True


def is_kv_cache_page_size_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """Whether one block of any layer takes the same bytes (so one pool of pages can serve every group)."""
    return len({spec.page_size_bytes for spec in kv_cache_spec.values()}) == 1


def get_uniform_page_size(kv_cache_spec: dict[str, KVCacheSpec]) -> int:
    (page_size,) = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    return page_size


def _get_kv_cache_groups_uniform_spec(kv_cache_spec: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Every layer has the same spec (most models): one group of all layers."""
    return create_kv_cache_group_specs(kv_cache_spec, [list(kv_cache_spec)])


def _get_kv_cache_groups_uniform_page_size(kv_cache_spec: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Groups of one spec each and equally many layers, for a model that mixes specs of equal page size.

    Hybrid models repeat a pattern: Gemma 3 is (5 sliding, 1 full) x n. The group size is
    the count of the rarest spec (the "1" of an n:1 pattern), and each spec's layers are
    dealt into groups of that size: 2 full + 3 sliding layers give (full.0, full.1),
    (sw.0, sw.2), (sw.1, padding). Equal group sizes make every group's block the same
    bytes (block_size x layers per group), which is what lets one pool serve them all; a
    short last group pads, wasting that share of its tensor. Layers go to groups by
    stride (`layers[i::num_groups]`), not in runs, as vLLM does so that each pipeline stage
    gets layers from every group.
    """
    same_type_layers: dict[KVCacheSpec, list[str]] = defaultdict(list)
    for layer_name, layer_spec in kv_cache_spec.items():
        same_type_layers[layer_spec].append(layer_name)
    group_size = min(len(layers) for layers in same_type_layers.values())
    grouped_layers = []
    for layers in same_type_layers.values():
        num_padding_layers = -len(layers) % group_size
        if num_padding_layers:
            logger.warning(
                "%d padding layer(s) in a KV cache group: up to %.1f%% of the KV cache memory is idle",
                num_padding_layers,
                num_padding_layers / len(layers) * 100,
            )
        num_groups = -(-len(layers) // group_size)
        grouped_layers.extend(layers[i::num_groups] for i in range(num_groups))
    return create_kv_cache_group_specs(kv_cache_spec, grouped_layers)


def unify_hybrid_kv_cache_specs(kv_cache_spec: dict[str, KVCacheSpec]) -> None:
    """Turn sliding-window layers into full-attention ones that remember their window, in place.

    With the hybrid allocator off, every layer keeps every token: one group, as for a model
    without windows; the kernel still attends to the window only.
    """
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return
    logger.warning(
        "the hybrid KV cache manager is disabled for a hybrid model: sliding-window layers keep every "
        "token's KV (their compute is still windowed)."
    )
    for layer_name, spec in kv_cache_spec.items():
        if isinstance(spec, SlidingWindowSpec):
            kv_cache_spec[layer_name] = FullAttentionSpec(
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
                sliding_window=spec.sliding_window,
            )
    if not is_kv_cache_spec_uniform(kv_cache_spec):
        raise ValueError(
            "the hybrid KV cache manager is disabled, but the layers' KV cache specs do not unify."
        )


def get_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Split the model's layers into KV cache groups of one spec each."""
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        unify_hybrid_kv_cache_specs(kv_cache_spec)
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return _get_kv_cache_groups_uniform_spec(kv_cache_spec)
    if is_kv_cache_page_size_uniform(kv_cache_spec):
        return _get_kv_cache_groups_uniform_page_size(kv_cache_spec)
    raise ValueError(
        "the model's attention layers have KV cache specs of different page sizes; nano_v1 (like vLLM "
        "v0.11.0 for attention layers) needs one page size for all of them."
    )


def may_override_num_blocks(vllm_config: VllmConfig, num_blocks: int) -> int:
    """`num_gpu_blocks_override`, if set, instead of the number that fits in memory."""
    override = vllm_config.cache_config.num_gpu_blocks_override
    return num_blocks if override is None else override


def get_num_blocks(vllm_config: VllmConfig, num_layers: int, available_memory: int, page_size: int) -> int:
    """Blocks that fit: each block id is a page in each of the `num_layers` tensors."""
    num_blocks = max(available_memory // page_size // num_layers, 0)
    return may_override_num_blocks(vllm_config, num_blocks)


def get_kv_cache_config_from_groups(
    vllm_config: VllmConfig,
    kv_cache_groups: list[KVCacheGroupSpec],
    kv_cache_specs: dict[str, KVCacheSpec],
    available_memory: int,
) -> KVCacheConfig:
    """The number of blocks and the tensors for these groups in `available_memory` bytes.

    As many tensors as the largest group has layers; tensor i is shared by layer i of every
    group. Groups (full.0, full.1), (sw.0, sw.2), (sw.1, padding) give two tensors: one
    shared by full.0, sw.0, sw.1, one by full.1 and sw.2. Block b is page b of every
    tensor, and belongs to one group at a time, so sharers never write the same page.
    """
    group_size = max(len(group.layer_names) for group in kv_cache_groups)
    page_size = get_uniform_page_size(kv_cache_specs)
    num_blocks = get_num_blocks(vllm_config, group_size, available_memory, page_size)
    kv_cache_tensors = [
        KVCacheTensor(
            size=page_size * num_blocks,
            shared_by=[group.layer_names[i] for group in kv_cache_groups if i < len(group.layer_names)],
        )
        for i in range(group_size)
    ]
    kv_cache_config = KVCacheConfig(num_blocks, kv_cache_tensors, kv_cache_groups)
    block_size = kv_cache_groups[0].kv_cache_spec.block_size
    logger.info(
        "KV cache: %d blocks, %s tokens per group; at most %.2f requests of max_model_len=%d at once",
        num_blocks,
        f"{num_blocks // len(kv_cache_groups) * block_size:,}",
        get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config),
        vllm_config.model_config.max_model_len,
    )
    return kv_cache_config


def get_num_blocks_per_request(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Blocks that one request of `max_model_len` tokens holds at its largest, over all groups."""
    return sum(
        -(-group.kv_cache_spec.max_memory_usage_bytes(vllm_config) // group.kv_cache_spec.page_size_bytes)
        for group in kv_cache_config.kv_cache_groups
    )


def get_max_concurrency_for_kv_cache_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> float:
    """How many requests of `max_model_len` tokens the cache holds at once.

    The null block is left out (vLLM counts it): it is never handed to a request.
    """
    return (kv_cache_config.num_blocks - 1) / get_num_blocks_per_request(vllm_config, kv_cache_config)


def get_kv_cache_configs(
    vllm_config: VllmConfig, kv_cache_specs: list[dict[str, KVCacheSpec]], available_memory: list[int]
) -> list[KVCacheConfig]:
    """One `KVCacheConfig` per worker, from each worker's layer specs and free memory.

    The groups are decided once for the whole model (the union of the workers' layers),
    each worker gets those groups restricted to its own layers, and every worker keeps the
    smallest worker's block count: the scheduler hands out one set of block ids for all.
    """
    merged_kv_cache_specs: dict[str, KVCacheSpec] = {}
    for kv_cache_spec_one_worker in kv_cache_specs:
        for layer_name, layer_spec in kv_cache_spec_one_worker.items():
            if merged_kv_cache_specs.setdefault(layer_name, layer_spec) != layer_spec:
                raise ValueError(f"layer {layer_name!r} has different KV cache specs on different workers.")
    global_kv_cache_groups = get_kv_cache_groups(vllm_config, merged_kv_cache_specs)

    kv_cache_configs = []
    for kv_cache_spec_one_worker, available_memory_one_worker in zip(kv_cache_specs, available_memory):
        groups_one_worker = [
            KVCacheGroupSpec(
                [name for name in group.layer_names if name in kv_cache_spec_one_worker], group.kv_cache_spec
            )
            for group in global_kv_cache_groups
        ]
        kv_cache_configs.append(
            get_kv_cache_config_from_groups(
                vllm_config, groups_one_worker, kv_cache_spec_one_worker, available_memory_one_worker
            )
        )
    # A worker with more memory keeps tensors larger than it uses: only the first blocks are ever named.
    min_num_blocks = min(config.num_blocks for config in kv_cache_configs)
    for config in kv_cache_configs:
        config.num_blocks = min_num_blocks
    return kv_cache_configs
