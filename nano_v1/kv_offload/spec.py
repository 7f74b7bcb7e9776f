"""What an offloading connector is configured with: its block size, its manager, its transfer handlers.

Mirrors vllm/v1/kv_offload/spec.py (chapter 16).

Why it exists: one connector (OffloadingConnector) serves every tier; a spec says which
one, from `kv_connector_extra_config`. The scheduler side asks it for the
`OffloadingManager` (`get_manager`), each worker for the handlers that move the data
(`get_handlers`), with the worker's KV cache tensors.

Settings read here: "block_size", the tokens per offloaded block, a multiple of the
engine's block size (default: the same). Offloading larger blocks means fewer, larger
copies and fewer hashes to track, but a lookup only hits whole offloaded blocks.

What differs from v0.11.0: a bad "block_size" is a ValueError naming the key (v0.11.0
asserts), and there is no warning that the API is experimental.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from nano_v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager
from nano_v1.kv_offload.worker.worker import OffloadingHandler

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig


class OffloadingSpec(ABC):
    """The configuration of one offloading tier, and the factory of its manager and handlers."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        self.extra_config: dict[str, Any] = kv_transfer_config.kv_connector_extra_config
        self.gpu_block_size: int = vllm_config.cache_config.block_size
        self.offloaded_block_size = self._get_positive_int("block_size", self.gpu_block_size)
        if self.offloaded_block_size % self.gpu_block_size != 0:
            raise ValueError(
                f"kv_connector_extra_config['block_size']={self.offloaded_block_size} must be a multiple "
                f"of the engine's block_size {self.gpu_block_size}."
            )

    def _get_positive_int(self, key: str, default: int | None = None) -> int:
        """`extra_config[key]` (or `default` when absent), checked to be an int > 0."""
        value = self.extra_config.get(key, default)
        if value is None:
            raise ValueError(f"kv_connector_extra_config must set {key!r} (a positive int) for {type(self).__name__}.")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be a positive int, got {value!r}.")
        return value

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The manager the scheduler-side connector tracks offloaded blocks with (one per spec)."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """(source spec type, destination spec type, handler) for each transfer type, given the
        worker's KV cache tensors by layer name."""
