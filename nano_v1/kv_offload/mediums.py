"""Where offloaded KV blocks live: block ids in the device's KV cache or in the CPU tier.

Mirrors vllm/v1/kv_offload/mediums.py (chapter 16).

Why it exists: a transfer is a (source, destination) pair of `LoadStoreSpec`s; for both
media nano_v1 has, a spec is just a list of block ids in that medium's tensors, and the
medium's name picks the worker's handler.
"""

from __future__ import annotations

from abc import ABC

import numpy as np

from nano_v1.kv_offload.abstract import LoadStoreSpec


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Blocks given by their ids in one medium."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)  # [num_blocks]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the device's paged KV cache (on a CPU-only engine too: the name is v0.11.0's)."""

    @staticmethod
    def medium() -> str:
        return "GPU"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the CPU tier, in units of the offloaded block size."""

    @staticmethod
    def medium() -> str:
        return "CPU"
