"""The worker's side of offloading: start transfers between media, report the ones that finished.

Mirrors vllm/v1/kv_offload/worker/worker.py (chapter 16).

Why it exists: a transfer (a job) may take longer than a step, so the worker only starts
it (`transfer_async`) and later collects what finished (`get_finished`); the connector
turns finished jobs into `finished_recving` / `finished_sending`, the only way the
scheduler learns of them. `OffloadingWorker` routes each job to the `OffloadingHandler`
registered for its (source medium, destination medium).

What differs from v0.11.0: a handler that raises is not caught and logged as a failed
submission; the error propagates (nano_v1 has no failure path for a transfer either way).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from nano_v1.kv_offload.abstract import LoadStoreSpec

logger = logging.getLogger(__name__)

# One transfer: (source blocks, destination blocks).
TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
# (source medium, destination medium), e.g. ("GPU", "CPU") for a store.
TransferType = tuple[str, str]
# A finished job: (job id, whether it succeeded).
TransferResult = tuple[int, bool]


class OffloadingHandler(ABC):
    """Runs the transfers of one or more transfer types, in the worker."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start copying `spec`'s source blocks to its destination blocks; True if started."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """The jobs that finished since the last call."""


class OffloadingWorker:
    """Dispatches jobs to the handler of their transfer type, and gathers every handler's finished jobs."""

    def __init__(self) -> None:
        self.handlers: list[OffloadingHandler] = []  # each once, in registration order
        self.transfer_type_to_handler: dict[TransferType, OffloadingHandler] = {}

    def register_handler(
        self, src_cls: type[LoadStoreSpec], dst_cls: type[LoadStoreSpec], handler: OffloadingHandler
    ) -> None:
        transfer_type = (src_cls.medium(), dst_cls.medium())
        assert transfer_type not in self.transfer_type_to_handler, f"two handlers for {transfer_type}"
        if handler not in self.handlers:
            self.handlers.append(handler)
        self.transfer_type_to_handler[transfer_type] = handler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        transfer_type = (src.medium(), dst.medium())
        handler = self.transfer_type_to_handler.get(transfer_type)
        assert handler is not None, f"no handler registered for {transfer_type}"
        success = handler.transfer_async(job_id, spec)
        if not success:
            logger.warning("Failed to submit %r transfer %d", transfer_type, job_id)
        return success

    def get_finished(self) -> list[TransferResult]:
        return [result for handler in self.handlers for result in handler.get_finished()]
