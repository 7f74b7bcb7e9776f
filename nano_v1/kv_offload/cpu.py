"""The CPU tier: an LRU manager over CPU block ids, and a handler copying between the device and CPU tensors.

Mirrors vllm/v1/kv_offload/cpu.py (chapter 16).

Why it exists: host memory is usually many times the device's KV cache, so prefixes the
device cache evicts can live on in the CPU tier and be copied back instead of recomputed.
Setting read here: "num_cpu_blocks", the tier's size in offloaded blocks (required). The
tier then holds num_cpu_blocks * block_size tokens of KV, as much memory per token as
the device cache (per layer: 2 x num_kv_heads x head_size x dtype bytes).

What differs from v0.11.0: a missing, non-int or non-positive "num_cpu_blocks" is a
ValueError naming the key (v0.11.0 raises a bare Exception only when it is missing or
0); it runs on any device (v0.11.0: CUDA only); no KV events.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from nano_v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager
from nano_v1.kv_offload.backends.cpu import CPUBackend
from nano_v1.kv_offload.lru_manager import LRUOffloadingManager
from nano_v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from nano_v1.kv_offload.spec import OffloadingSpec
from nano_v1.kv_offload.worker.cpu_gpu import CpuGpuOffloadingHandler
from nano_v1.kv_offload.worker.worker import OffloadingHandler

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig


class CPUOffloadingSpec(OffloadingSpec):
    """Offloading to `num_cpu_blocks` blocks of CPU memory, evicted by LRU."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.num_cpu_blocks = self._get_positive_int("num_cpu_blocks")
        self._manager: OffloadingManager | None = None  # scheduler side, built on first use
        self._handler: OffloadingHandler | None = None  # worker side, built on first use

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = LRUOffloadingManager(
                CPUBackend(block_size=self.offloaded_block_size, num_blocks=self.num_cpu_blocks)
            )
        return self._manager

    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if self._handler is None:
            self._handler = CpuGpuOffloadingHandler(
                gpu_block_size=self.gpu_block_size,
                cpu_block_size=self.offloaded_block_size,
                num_cpu_blocks=self.num_cpu_blocks,
                gpu_caches=kv_caches,
            )
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handler  # stores
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handler  # loads
