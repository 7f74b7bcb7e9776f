"""A KV connector that offloads prefix blocks to a slower tier (CPU memory) and loads them back.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py (chapter 16).

Why it exists: the device's prefix cache (chapter 03) forgets a prefix as soon as its
blocks are evicted, and the next request with that prefix recomputes it. Host memory is
larger, and copying a block back costs far less than recomputing it. This connector keeps
a second, larger prefix cache in a tier behind the device's, keyed by the same block
hashes (`request.block_hashes`), with the tier's bookkeeping in an `OffloadingManager`
(nano_v1/kv_offload/abstract.py; LRU over CPU blocks by default) and the copies in the
workers' `OffloadingHandler`s.

Scheduler side (`OffloadingConnectorScheduler`):
- Lookup, at admission: from the request's first block the device cache missed, count
  the consecutive offloaded blocks (`manager.lookup`); if at least one whole offloaded
  block hits, `get_num_new_matched_tokens` answers (those tokens, True): the load is
  asynchronous, so the request waits in WAITING_FOR_REMOTE_KVS.
- Load: `update_state_after_alloc` pins the hit blocks (`prepare_load`) and pairs them
  with the device blocks the scheduler just allocated for them; the pair goes to the
  workers in the step's metadata (`reqs_to_load`). When a worker reports the request in
  `finished_recving`, `update_connector_output` unpins them (`complete_load`) and the
  scheduler admits the request with those tokens computed.
- Store: every step, for each scheduled request, the offloaded blocks that become full
  once the step's tokens are computed (`_get_reqs_to_store`) are allocated in the tier
  (`prepare_store`, which may evict) and sent as `reqs_to_store`. The worker starts
  them in `wait_for_save`, after the step's forward pass has written their KV: a store
  is never decided before the step that computes its blocks, nor run before it. They
  become loadable (`complete_store`) when the request finishes and its stores are done
  (`finished_sending`); until then `request_finished` keeps the request's device blocks
  (delay_free_blocks), as the copies read them.

Worker side (`OffloadingConnectorWorker`): turns each load and store into a job of the
`OffloadingWorker` and reports a request through `get_finished` once its load, or (after
it finished) all its stores, completed. This is the scheduler's only way to learn of
completion, whether a handler copies asynchronously (v0.11.0's CUDA streams) or, as
nano_v1's CPU handler, within `transfer_async`.

What differs from v0.11.0: no KV cache events (`take_events`); the scheduler side counts
the tokens it schedules to load (`num_loaded_tokens`), for benchmarks; stores stop at the
blocks the request's hashes cover (v0.11.0 asserts, which a step's unverified draft
tokens could trip); the loaded device blocks may end inside an offloaded block's span
(the handler skips its first rows; v0.11.0's handler asserts against it).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch

from nano_v1.core.kv_cache_utils import BlockHash
from nano_v1.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from nano_v1.kv_offload.factory import OffloadingSpecFactory
from nano_v1.kv_offload.mediums import GPULoadStoreSpec
from nano_v1.kv_offload.worker.worker import OffloadingWorker, TransferSpec

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig
    from nano_v1.core.kv_cache_manager import KVCacheBlocks
    from nano_v1.core.sched.output import SchedulerOutput
    from nano_v1.forward_context import ForwardContext
    from nano_v1.kv_offload.abstract import OffloadingManager
    from nano_v1.kv_offload.spec import OffloadingSpec
    from nano_v1.outputs import KVConnectorOutput
    from nano_v1.request import Request

ReqId = str

logger = logging.getLogger(__name__)


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    reqs_to_load: dict[ReqId, TransferSpec]  # request -> (tier blocks, its device blocks)
    reqs_to_store: dict[ReqId, TransferSpec]  # request -> (its device blocks, tier blocks)


class OffloadingConnector(KVConnectorBase_V1):
    """Role dispatch: the scheduler's half and the worker's half share only the spec."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        super().__init__(vllm_config, role)
        spec = OffloadingSpecFactory.create_spec(vllm_config)
        self.connector_scheduler: OffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadingConnectorScheduler(spec)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = OffloadingConnectorWorker(spec)

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, OffloadingConnectorMetadata)
        self.connector_worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are for requests not in this step's batch: no layer waits for them."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Stores copy whole blocks of every layer at once, in `wait_for_save`."""
        return

    def wait_for_save(self) -> None:
        """After the forward pass: start the stores of the blocks it completed."""
        assert self.connector_worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, OffloadingConnectorMetadata)
        self.connector_worker.start_store_kv(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids)

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)


class OffloadingConnectorScheduler:
    """The scheduler's half: decides, per step, which blocks to load and which to store."""

    def __init__(self, spec: OffloadingSpec) -> None:
        self.gpu_block_size = spec.gpu_block_size
        self.offloaded_block_size = spec.offloaded_block_size
        self.block_size_factor = self.offloaded_block_size // self.gpu_block_size
        self.manager: OffloadingManager = spec.get_manager()
        self._requests: dict[ReqId, Request] = {}
        # A request's device block ids, in order, as the scheduler outputs hand them out.
        self._request_block_ids: dict[ReqId, list[int]] = {}
        self._reqs_to_load: dict[ReqId, TransferSpec] = {}  # this step's loads
        # The request's first offloaded block not stored (nor loaded) yet: blocks are stored in order.
        self._next_stored_block_idx: dict[ReqId, int] = {}
        # The hashes each request is storing / loading, until the worker reports it.
        self._reqs_being_stored = defaultdict[ReqId, set[BlockHash]](set)
        self._reqs_being_loaded = defaultdict[ReqId, set[BlockHash]](set)
        self.num_loaded_tokens = 0  # tokens scheduled to load from the tier, in all (for benchmarks)

    def _get_block_hashes(self, req: Request, start_idx: int = 0, end_idx: int | None = None) -> Iterator[BlockHash]:
        """The hashes of offloaded blocks [start_idx, end_idx): an offloaded block is named by the
        hash of its last device block, which chains all the tokens before it."""
        f = self.block_size_factor
        return islice(req.block_hashes, f * start_idx + f - 1, None if end_idx is None else f * end_idx, f)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past the `num_computed_tokens` the device cache hit that the tier can load
        (whole offloaded blocks only), loaded asynchronously."""
        num_blocks = request.num_tokens // self.offloaded_block_size
        assert len(request.block_hashes) // self.block_size_factor == num_blocks, "block hashes out of date"
        # The whole prefix is wanted again: keep its offloaded blocks from eviction longest.
        self.manager.touch(self._get_block_hashes(request))
        full_block_tokens = self.offloaded_block_size * num_blocks
        if full_block_tokens - num_computed_tokens < self.offloaded_block_size:
            return 0, False  # less than one offloaded block could be loaded
        start_block_idx = num_computed_tokens // self.offloaded_block_size
        hits = self.manager.lookup(self._get_block_hashes(request, start_idx=start_block_idx))
        if hits == 0:
            return 0, False
        num_hit_tokens = self.offloaded_block_size * (start_block_idx + hits) - num_computed_tokens
        logger.debug(
            "Request %s hit %s offloaded tokens after %s device hit tokens",
            request.request_id, num_hit_tokens, num_computed_tokens,
        )  # fmt: skip
        if num_hit_tokens < self.offloaded_block_size:
            return 0, False
        return num_hit_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Track the request; if it loads, pin its hit blocks and pair them with its new device blocks."""
        self._requests[request.request_id] = request
        self._request_block_ids[request.request_id] = []  # filled from the scheduler outputs
        if num_external_tokens == 0:
            return
        block_ids = blocks.get_block_ids()[0]
        # The device hits are the hashed blocks; the rest were allocated for the load.
        num_computed_gpu_blocks = sum(block.block_hash is not None for block in blocks.blocks[0])
        num_computed_tokens = num_computed_gpu_blocks * self.gpu_block_size
        full_block_tokens = num_computed_tokens + num_external_tokens
        assert full_block_tokens % self.offloaded_block_size == 0
        assert num_external_tokens == (len(block_ids) - num_computed_gpu_blocks) * self.gpu_block_size
        start_block_idx = num_computed_tokens // self.offloaded_block_size
        num_blocks = full_block_tokens // self.offloaded_block_size
        block_hashes = list(self._get_block_hashes(request, start_idx=start_block_idx, end_idx=num_blocks))
        src_spec = self.manager.prepare_load(block_hashes)
        dst_spec = GPULoadStoreSpec(block_ids[num_computed_gpu_blocks:])
        self._reqs_to_load[request.request_id] = (src_spec, dst_spec)
        self._reqs_being_loaded[request.request_id].update(block_hashes)
        self._next_stored_block_idx[request.request_id] = num_blocks  # loaded blocks are stored already
        self.num_loaded_tokens += num_external_tokens

    def _get_reqs_to_store(self, scheduler_output: SchedulerOutput) -> dict[ReqId, TransferSpec]:
        """For each scheduled request, the offloaded blocks this step completes and the tier lacks."""
        reqs_to_store: dict[ReqId, TransferSpec] = {}
        for req_id, new_block_id_groups, preempted in yield_req_data(scheduler_output):
            if preempted:
                self._request_block_ids[req_id] = []  # its old blocks were freed; these are all of them
            if new_block_id_groups:
                self._request_block_ids[req_id] += new_block_id_groups[0]
            block_ids = self._request_block_ids[req_id]
            req = self._requests[req_id]
            total_tokens = req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]
            # Draft tokens (chapter 10) are computed but not hashed: only hashed blocks are stored.
            num_blocks = min(total_tokens // self.offloaded_block_size, len(req.block_hashes) // self.block_size_factor)
            start_block_idx = self._next_stored_block_idx.get(req_id, 0)
            if num_blocks <= start_block_idx:
                continue
            store_output = self.manager.prepare_store(
                self._get_block_hashes(req, start_idx=start_block_idx, end_idx=num_blocks)
            )
            if store_output is None:
                logger.warning("Cannot store %s blocks", num_blocks - start_block_idx)
                break  # the tier is full of blocks in flight; retried next step
            self._next_stored_block_idx[req_id] = num_blocks
            if not store_output.block_hashes_to_store:
                continue  # all offloaded already (another request stored them)
            block_hashes_to_store = set(store_output.block_hashes_to_store)
            # Recently used: the whole prefix so far, the first block most recently.
            self.manager.touch(self._get_block_hashes(req, end_idx=num_blocks))
            new_block_hashes = self._get_block_hashes(req, start_idx=start_block_idx, end_idx=num_blocks)
            src_block_ids: list[int] = []
            for offloaded_block_idx, block_hash in enumerate(new_block_hashes, start=start_block_idx):
                if block_hash in block_hashes_to_store:
                    gpu_block_idx = offloaded_block_idx * self.block_size_factor
                    src_block_ids += block_ids[gpu_block_idx : gpu_block_idx + self.block_size_factor]
            reqs_to_store[req_id] = (GPULoadStoreSpec(src_block_ids), store_output.store_spec)
            self._reqs_being_stored[req_id] |= block_hashes_to_store
            logger.debug(
                "Request %s offloading %s blocks starting from block #%d",
                req_id, len(block_hashes_to_store), start_block_idx,
            )  # fmt: skip
        return reqs_to_store

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OffloadingConnectorMetadata(
            reqs_to_load=self._reqs_to_load, reqs_to_store=self._get_reqs_to_store(scheduler_output)
        )
        self._reqs_to_load = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A finished store makes its blocks loadable; a finished load lets its blocks be evicted."""
        for req_id in connector_output.finished_sending or ():
            block_hashes = self._reqs_being_stored.pop(req_id, None)
            if block_hashes:
                self.manager.complete_store(block_hashes)
        for req_id in connector_output.finished_recving or ():
            block_hashes = self._reqs_being_loaded.pop(req_id, None)
            if block_hashes:
                self.manager.complete_load(block_hashes)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; keep its device blocks (True) while stores read them."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._request_block_ids.pop(req_id, None)
        self._next_stored_block_idx.pop(req_id, None)
        return req_id in self._reqs_being_stored, None


class OffloadingConnectorWorker:
    """The worker's half: runs the step's loads and stores as jobs, and reports finished requests."""

    def __init__(self, spec: OffloadingSpec) -> None:
        self.spec = spec
        self.worker = OffloadingWorker()
        self._job_counter = 0
        self._jobs: dict[int, tuple[ReqId, bool]] = {}  # job id -> (request, is a store)
        self._load_job: dict[ReqId, int] = {}  # request -> its load's job (one per request)
        self._store_jobs = defaultdict[ReqId, set[int]](set)  # request -> its stores' jobs in flight
        self._finished_reqs_waiting_for_store: set[ReqId] = set()

    def _generate_job_id(self) -> int:
        job_id = self._job_counter
        self._job_counter = job_id + 1
        return job_id

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for src_cls, dst_cls, handler in self.spec.get_handlers(kv_caches):
            self.worker.register_handler(src_cls, dst_cls, handler)

    def start_load_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        for req_id, transfer_spec in metadata.reqs_to_load.items():
            job_id = self._generate_job_id()
            self._jobs[job_id] = (req_id, False)
            assert req_id not in self._load_job, f"request {req_id} loads twice"
            self._load_job[req_id] = job_id
            success = self.worker.transfer_async(job_id, transfer_spec)
            assert success, "nano_v1 has no path for a failed transfer"

    def start_store_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        for req_id, transfer_spec in metadata.reqs_to_store.items():
            job_id = self._generate_job_id()
            self._jobs[job_id] = (req_id, True)
            self._store_jobs[req_id].add(job_id)
            success = self.worker.transfer_async(job_id, transfer_spec)
            assert success, "nano_v1 has no path for a failed transfer"

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished requests whose stores all completed, requests whose load completed).

        A request is reported as sent once it has finished and none of its stores is in
        flight; a request that stored anything is always reported so, so that the scheduler
        frees the blocks it kept (`request_finished` answered True).
        """
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        for job_id, success in self.worker.get_finished():
            assert success, "nano_v1 has no path for a failed transfer"
            req_id, store = self._jobs.pop(job_id)
            if not store:
                assert self._load_job.pop(req_id) == job_id
                finished_recving.add(req_id)
                continue
            req_jobs = self._store_jobs[req_id]
            req_jobs.remove(job_id)
            if not req_jobs and req_id in self._finished_reqs_waiting_for_store:
                self._finished_reqs_waiting_for_store.remove(req_id)
                finished_sending.add(req_id)
                del self._store_jobs[req_id]
        for req_id in finished_req_ids:
            pending_req_jobs = self._store_jobs.get(req_id)
            if pending_req_jobs:
                self._finished_reqs_waiting_for_store.add(req_id)
            elif pending_req_jobs is not None:
                finished_sending.add(req_id)
                del self._store_jobs[req_id]
        return finished_sending, finished_recving


def yield_req_data(scheduler_output: SchedulerOutput) -> Iterator[tuple[str, tuple[list[int], ...] | None, bool]]:
    """(request id, its new block ids per group, whether it resumed from preemption) for every
    scheduled request, new ones first."""
    for req_data in scheduler_output.scheduled_new_reqs:
        yield req_data.req_id, req_data.block_ids, False
    cached_reqs = scheduler_output.scheduled_cached_reqs
    yield from zip(cached_reqs.req_ids, cached_reqs.new_block_ids, cached_reqs.resumed_from_preemption)
