"""A mock offloading tier for OffloadingConnector's scheduler tests (chapter 16), after v0.11.0's.

From vLLM v0.11.0's tests/v1/kv_connector/unit/test_offloading_connector.py: a spec whose
manager is a `MagicMock` (the test scripts `lookup` and `prepare_store` and reads its
calls) and whose handler completes every transfer at once, recording its specs. Its
tier's addresses are the block hashes themselves (`MockLoadStoreSpec`), so a test can
check that a load reads back what a store wrote. Registered with
`OffloadingSpecFactory` as "MockOffloadingSpec" when this module is imported (v0.11.0
names it by `spec_module_path`, which nano_v1's factory does not read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from unittest.mock import MagicMock

import torch

from nano_v1.config import VllmConfig
from nano_v1.core.kv_cache_utils import BlockHash
from nano_v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager, PrepareStoreOutput
from nano_v1.kv_offload.factory import OffloadingSpecFactory
from nano_v1.kv_offload.mediums import GPULoadStoreSpec
from nano_v1.kv_offload.spec import OffloadingSpec
from nano_v1.kv_offload.worker.worker import OffloadingHandler, TransferResult, TransferSpec


class MockLoadStoreSpec(LoadStoreSpec):
    def __init__(self, block_hashes: Iterable[BlockHash]) -> None:
        self.block_hashes: list[BlockHash] = list(block_hashes)

    @staticmethod
    def medium() -> str:
        return "Mock"


class MockOffloadingHandler(OffloadingHandler):
    """Finishes each transfer as it starts; `completed_specs` are the specs since the last look."""

    def __init__(self) -> None:
        self.completed_transfers: list[TransferResult] = []
        self.completed_specs: list[TransferSpec] = []

    def get_finished(self) -> list[TransferResult]:
        finished, self.completed_transfers = self.completed_transfers, []
        return finished

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        self.completed_specs.append(spec)
        self.completed_transfers.append((job_id, True))
        return True


class MockOffloadingSpec(OffloadingSpec):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.manager = MagicMock(spec=OffloadingManager)
        self.manager.lookup.return_value = 0
        self.manager.prepare_load = MockLoadStoreSpec
        self.handler = MockOffloadingHandler()

    def get_manager(self) -> OffloadingManager:
        return self.manager

    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        yield GPULoadStoreSpec, MockLoadStoreSpec, self.handler
        yield MockLoadStoreSpec, GPULoadStoreSpec, self.handler

    def get_completed_transfers(self) -> list[TransferSpec]:
        specs, self.handler.completed_specs = self.handler.completed_specs, []
        return specs


def generate_store_output(block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput:
    """A `prepare_store` answer that stores exactly `block_hashes`, evicting nothing."""
    block_hashes = list(block_hashes)
    return PrepareStoreOutput(
        block_hashes_to_store=block_hashes, store_spec=MockLoadStoreSpec(block_hashes), block_hashes_evicted=[]
    )


OffloadingSpecFactory.register_spec("MockOffloadingSpec", __name__, MockOffloadingSpec.__name__)
