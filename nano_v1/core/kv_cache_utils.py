"""KV cache building blocks: the block record, the O(1) free queue, and block hashing.

Mirrors vllm/v1/core/kv_cache_utils.py (chapters 02, 03 and 11).

Why it exists: the paged KV cache is a pool of fixed-size blocks. The pool needs a
record per block (`KVCacheBlock`), an ordering of the free blocks that doubles as the
prefix cache's LRU eviction order (`FreeKVCacheBlockQueue`), and a content address for
every full block (`hash_block_tokens`) so that a new request can find blocks another
request already computed. A block whose positions hold part of an image carries the
image's content hash in its extra keys (`generate_block_hash_extra_keys`, chapter 11):
the KV there depends on the image, which the placeholder token ids do not show.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

if TYPE_CHECKING:
    from nano_v1.request import Request

# The content address of one full block *and everything before it* (a chain hash):
# a 32-byte SHA-256 digest. A distinct type so raw bytes are not passed by mistake.
BlockHash = NewType("BlockHash", bytes)

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
    # Set once the block is full and registered in the prefix cache; cleared when the
    # block is evicted (reused for other tokens). Read through the `block_hash` property.
    _block_hash: BlockHash | None = None
    # Links of the free queue's doubly linked list; only FreeKVCacheBlockQueue touches them.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder block 0: never allocated, never cached, never freed.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
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
        # BEGIN TASK ch02_t1: unlink the first n blocks, clear their links, reconnect the head sentinel
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
        last block gets no hash until it fills)."""
        # BEGIN TASK ch03_t1: hash each newly full block and its extra keys, chaining from the previous hash
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
