"""The offloading manager's interface: which KV blocks a slower tier holds, and where.

Mirrors vllm/v1/kv_offload/abstract.py (chapter 16).

Why it exists: the scheduler-side OffloadingConnector decides what to copy out of the
device's KV cache and what to copy back, but not how a tier stores blocks or which block
it drops when full. It asks an `OffloadingManager`, keyed by the prefix cache's block
hashes (chapter 03), so that one block of KV is offloaded once whichever request made it:

- `lookup(hashes)`: how many of these blocks, from the first, are offloaded and readable;
- `prepare_load(hashes)` -> where to read them; they cannot be evicted until `complete_load`;
- `touch(hashes)`: mark them recently used (also for blocks the device cache already
  hits, which are never loaded);
- `prepare_store(hashes)` -> which of them still need storing, where to write them, and
  what was evicted to make room; None if there is no room (nothing evictable); the new
  blocks are not readable until `complete_store`.

A transfer in flight pins its blocks, so eviction never drops a block being read or written.

What differs from v0.11.0: no `OffloadingEvent` / `take_events` (nano_v1 publishes no KV
cache events).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from nano_v1.core.kv_cache_utils import BlockHash


class LoadStoreSpec(ABC):
    """Where a worker reads or writes blocks of KV, in one medium (its subclasses: nano_v1/kv_offload/mediums.py)."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name ("GPU", "CPU"); a worker picks its transfer handler by (source, destination) medium."""


@dataclass(slots=True)
class PrepareStoreOutput:
    block_hashes_to_store: list[BlockHash]  # those not offloaded yet, in the order asked
    store_spec: LoadStoreSpec  # where to write them, in the same order
    block_hashes_evicted: list[BlockHash]  # dropped from the tier to make room


class OffloadingManager(ABC):
    """Tracks the blocks of one offloading tier, in the scheduler."""

    @abstractmethod
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """The number of leading blocks that are offloaded and readable (stores completed)."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Where to read these offloaded blocks; they stay unevictable until `complete_load`."""

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark these blocks (those offloaded) as recently used, the first one most recently: a
        block is useless without those before it, so a prefix's tail should go first."""
        return

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """A load of these blocks finished: they may be evicted again."""
        return

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Make room for those blocks not offloaded yet, evicting if needed; None if it cannot."""

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """A store of these blocks finished: on success they become readable, otherwise the
        blocks it was writing are dropped (blocks stored before are kept)."""
        return
