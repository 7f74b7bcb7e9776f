"""OffloadingConnector and its CPU tier (chapter 16): LRU bookkeeping, copies, scheduling, end to end.

Oracles, in order:
- the LRU manager, against v0.11.0's tests/v1/kv_offload/test_cpu_manager.py (ported
  assertion by assertion, events left out) and against a brute-force model (a list in LRU
  order) under random operations: lookups, the blocks stored and evicted, refusals, ids;
- the CPU <-> device handler, against plain torch indexing: blocks copied out and back are
  bit-equal, and nothing else is written;
- the scheduler side, through v0.11.0's tests/v1/kv_connector/unit/test_offloading_connector.py
  (its mock tier, tests/helpers/offloading.py): which device blocks each step stores and loads;
- end to end, on a device cache too small for the working set: a plain engine recomputes
  the prompts' unique blocks every time; with a CPU tier that holds the working set, the
  second round loads them instead (counted), with the plain engine's tokens (greedy,
  float32); with a tier one prompt too small, LRU under a cyclic access pattern keeps
  nothing useful, and the counts are the plain engine's.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers.offloading import MockLoadStoreSpec, MockOffloadingSpec, generate_store_output
from helpers.scheduler import make_scheduler

from benchmarks.kv_connectors import offload_sweep
from nano_v1.config import KVTransferConfig
from nano_v1.core.kv_cache_utils import BlockHash, get_request_block_hasher
from nano_v1.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from nano_v1.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
    OffloadingConnectorMetadata,
)
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.entrypoints.llm import LLM
from nano_v1.forward_context import ForwardContext
from nano_v1.kv_offload.backends.cpu import CPUBackend
from nano_v1.kv_offload.factory import OffloadingSpecFactory
from nano_v1.kv_offload.lru_manager import LRUOffloadingManager
from nano_v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from nano_v1.kv_offload.worker.cpu_gpu import CpuGpuOffloadingHandler, expand_block_ids
from nano_v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from nano_v1.request import Request
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch16


def to_hashes(int_hashes: list[int]) -> list[BlockHash]:
    return [BlockHash(str(i).encode()) for i in int_hashes]


# ----------------------------------------------------------------------------- the LRU manager
def assert_store(output, to_store: list[int], block_ids: list[int], evicted: list[int]) -> None:
    assert output is not None
    assert output.block_hashes_to_store == to_hashes(to_store)
    assert output.block_hashes_evicted == to_hashes(evicted)
    assert isinstance(output.store_spec, CPULoadStoreSpec)
    assert output.store_spec.block_ids.tolist() == block_ids


def test_cpu_manager_as_v0_11_0():
    """v0.11.0's test_cpu_manager: a tier of 4 blocks."""
    manager = LRUOffloadingManager(CPUBackend(block_size=256, num_blocks=4))
    assert_store(manager.prepare_store(to_hashes([1, 2])), [1, 2], [0, 1], [])
    assert manager.lookup(to_hashes([1, 2])) == 0  # not ready: the store is in flight
    manager.complete_store(to_hashes([1, 2]))
    assert manager.lookup(to_hashes([1])) == 1
    assert manager.lookup(to_hashes([1, 2])) == 2
    assert manager.lookup(to_hashes([1, 2, 3])) == 2
    # [2] is there already; two fresh ids, then 1's freed id.
    assert_store(manager.prepare_store(to_hashes([2, 3, 4, 5])), [3, 4, 5], [2, 3, 0], [1])
    assert manager.prepare_store(to_hashes([1, 6])) is None  # only [2] is evictable: no room for two
    manager.complete_store(to_hashes([2, 3, 4, 5]))
    assert manager.prepare_load(to_hashes([2, 3])).block_ids.tolist() == [1, 2]
    assert manager.prepare_store(to_hashes([6, 7, 8])) is None  # [2, 3] are being loaded
    manager.complete_load(to_hashes([2, 3]))
    assert_store(manager.prepare_store(to_hashes([6, 7, 8])), [6, 7, 8], [3, 2, 1], [2, 3, 4])
    manager.complete_store(to_hashes([6, 7, 8]))
    manager.touch(to_hashes([5, 6, 7]))
    assert_store(manager.prepare_store(to_hashes([9])), [9], [1], [8])  # 8 is the oldest after the touch
    manager.complete_store(to_hashes([7, 9]), success=False)
    assert manager.lookup(to_hashes([7])) == 1  # stored before: kept
    assert manager.lookup(to_hashes([9])) == 0  # its store failed: dropped


class BruteForceTier:
    """The LRU tier as a list, least recently used first, and a ref count per hash (-1: being stored)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.order: list[int] = []
        self.ref: dict[int, int] = {}

    def lookup(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and self.ref.get(hashes[n], -1) >= 0:
            n += 1
        return n

    def touch(self, hashes: list[int]) -> None:
        for h in reversed(hashes):
            if h in self.ref:
                self.order.remove(h)
                self.order.append(h)

    def prepare_store(self, hashes: list[int]) -> tuple[list[int], list[int]] | None:
        new = [h for h in hashes if h not in self.ref]
        need = len(new) - (self.num_blocks - len(self.order))
        evicted = [h for h in self.order if self.ref[h] == 0][: max(need, 0)]
        if len(evicted) < need:
            return None
        for h in evicted:
            self.order.remove(h)
            del self.ref[h]
        self.order += new
        self.ref.update(dict.fromkeys(new, -1))
        return new, evicted

    def complete_store(self, hashes: list[int], success: bool) -> None:
        for h in hashes:
            if self.ref[h] == -1:
                if success:
                    self.ref[h] = 0
                else:
                    self.order.remove(h)
                    del self.ref[h]


@pytest.mark.parametrize("seed", range(6))
def test_lru_manager_matches_brute_force(seed):
    """Random stores, loads, touches and lookups over 10 hashes on a tier of 5 blocks: every
    answer is the brute force's, a loaded block reads the id its store got, ids stay distinct."""
    rng = random.Random(seed)
    manager = LRUOffloadingManager(CPUBackend(block_size=16, num_blocks=5))
    model = BruteForceTier(5)
    block_id: dict[int, int] = {}  # hash -> the CPU block its store was given
    pending_stores: list[list[int]] = []
    pending_loads: list[list[int]] = []
    refusals = evictions = 0
    for _ in range(300):
        op = rng.choice(["store", "store", "complete_store", "load", "complete_load", "touch", "lookup"])
        hashes = rng.sample(range(10), rng.randint(1, 4))
        if op == "store":
            output, expected = manager.prepare_store(to_hashes(hashes)), model.prepare_store(hashes)
            if expected is None:
                assert output is None
                refusals += 1
                continue
            new, evicted = expected
            assert output.block_hashes_to_store == to_hashes(new)
            assert output.block_hashes_evicted == to_hashes(evicted)
            evictions += len(evicted)
            for h in evicted:
                del block_id[h]
            block_id.update(zip(new, output.store_spec.block_ids.tolist()))
            assert sorted(block_id.values()) == sorted(set(block_id.values())) and set(block_id.values()) <= set(
                range(5)
            )
            pending_stores.append(new)
        elif op == "complete_store" and pending_stores:
            done = pending_stores.pop(rng.randrange(len(pending_stores)))
            success = rng.random() < 0.8
            manager.complete_store(to_hashes(done), success)
            model.complete_store(done, success)
            for h in done:
                if h not in model.ref:
                    del block_id[h]
        elif op == "load":
            ready = [h for h in hashes if model.ref.get(h, -1) >= 0]
            if ready:
                assert manager.prepare_load(to_hashes(ready)).block_ids.tolist() == [block_id[h] for h in ready]
                for h in ready:
                    model.ref[h] += 1
                pending_loads.append(ready)
        elif op == "complete_load" and pending_loads:
            done = pending_loads.pop(rng.randrange(len(pending_loads)))
            manager.complete_load(to_hashes(done))
            for h in done:
                model.ref[h] -= 1
        elif op == "touch":
            manager.touch(to_hashes(hashes))
            model.touch(hashes)
        assert manager.lookup(to_hashes(hashes)) == model.lookup(hashes)
        assert list(manager.blocks) == to_hashes(model.order)  # the same LRU order
    assert refusals > 0 and evictions > 0  # both paths ran


# ----------------------------------------------------------------------------- the CPU <-> device handler
@pytest.mark.parametrize("block_size_factor", [1, 3])
def test_blocks_copied_out_and_back_are_bit_equal(block_size_factor):
    """Device blocks -> CPU tier -> other device blocks: the same bits, per layer, keys and values;
    no other block changes (plain torch indexing is the reference). With larger offloaded
    blocks, a load may start inside the first one (v0.11.0's test_cpu_gpu skips likewise)."""
    gen = torch.Generator().manual_seed(0)
    num_gpu_blocks, num_cpu_blocks, num_mappings = 20, 6, 2
    shape = (2, num_gpu_blocks, 4, 2, 8)  # [2, num_blocks, block_size, num_kv_heads, head_size]
    caches = {f"layer.{i}": torch.randn(shape, generator=gen, dtype=torch.float32) for i in range(2)}
    handler = CpuGpuOffloadingHandler(4, 4 * block_size_factor, num_cpu_blocks, caches)
    originals = [t.clone() for t in handler.gpu_tensors]
    rng = random.Random(0)
    src = rng.sample(range(num_gpu_blocks), num_mappings * block_size_factor)
    cpu_blocks = rng.sample(range(num_cpu_blocks), num_mappings)
    assert handler.transfer_async(0, (GPULoadStoreSpec(src), CPULoadStoreSpec(cpu_blocks)))
    assert handler.get_finished() == [(0, True)]
    assert handler.get_finished() == []
    rows = expand_block_ids(np.array(cpu_blocks), block_size_factor).tolist()
    for cpu_tensor, original in zip(handler.cpu_tensors, originals):
        assert torch.equal(cpu_tensor[:, rows], original[:, src])
    # Load back all but the first device block's worth into other blocks.
    skip = block_size_factor - 1
    dst = [b for b in range(num_gpu_blocks) if b not in src][: len(src) - skip]
    assert handler.transfer_async(1, (CPULoadStoreSpec(cpu_blocks), GPULoadStoreSpec(dst)))
    assert handler.get_finished() == [(1, True)]
    for gpu_tensor, original in zip(handler.gpu_tensors, originals):
        expected = original.clone()
        expected[:, dst] = original[:, src[skip:]]
        assert torch.equal(gpu_tensor, expected)


def test_expand_block_ids_as_v0_11_0():
    assert expand_block_ids(np.array([0, 1, 3]), 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    assert expand_block_ids(np.array([0, 1, 3]), 4, skip_count=1).tolist()[:3] == [1, 2, 3]


# ----------------------------------------------------------------------------- configuration
def offloading_config(model: str, extra_config: dict[str, Any]):
    return EngineArgs(
        model=model, dtype="float32",
        kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": extra_config},
    ).create_engine_config()  # fmt: skip


@pytest.mark.parametrize(
    "extra_config, match",
    [
        ({}, "must set 'num_cpu_blocks'"),
        ({"num_cpu_blocks": 0}, r"\['num_cpu_blocks'\] must be a positive int, got 0"),
        ({"num_cpu_blocks": -3}, r"\['num_cpu_blocks'\] must be a positive int, got -3"),
        ({"num_cpu_blocks": "64"}, r"\['num_cpu_blocks'\] must be a positive int, got '64'"),
        ({"num_cpu_blocks": 2.5}, r"\['num_cpu_blocks'\] must be a positive int, got 2.5"),
        ({"num_cpu_blocks": True}, r"\['num_cpu_blocks'\] must be a positive int, got True"),
        ({"num_cpu_blocks": 8, "block_size": 24}, r"\['block_size'\]=24 must be a multiple"),
        ({"num_cpu_blocks": 8, "spec_name": "DiskSpec"}, "Unsupported kv_connector_extra_config\\['spec_name'\\]"),
    ],
)
def test_bad_config_is_a_value_error_naming_the_key(tiny_qwen3, extra_config, match):
    config = offloading_config(tiny_qwen3, extra_config)
    with pytest.raises(ValueError, match=match):
        OffloadingSpecFactory.create_spec(config)


def test_bad_config_fails_the_engine(tiny_qwen3):
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        LLM(model=tiny_qwen3, dtype="float32", kv_transfer_config={
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}})  # fmt: skip


# ----------------------------------------------------------------------------- v0.11.0's scheduler-side test
EOS_TOKEN_ID = 50256


@dataclass
class TransferSummary:
    gpu_block_indices: list[int]  # positions in the request's block list
    offload_addresses: list[Any]  # (block hash, sub-block)


class RequestRunner:
    """v0.11.0's harness: a scheduler with the mock tier, the worker connector, one request at a time."""

    def __init__(self, offloaded_block_size: int, gpu_block_size: int, num_gpu_blocks: int) -> None:
        self.offloaded_block_size = offloaded_block_size
        self.gpu_block_size = gpu_block_size
        self.req_id = -1
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": "MockOffloadingSpec", "block_size": offloaded_block_size},
        )  # fmt: skip
        self.scheduler = make_scheduler(
            num_gpu_blocks, gpu_block_size, budget=1000, max_seqs=16, max_model_len=1000, caching=True,
            kv_transfer_config=kv_transfer_config,
        )  # fmt: skip
        self.scheduler_connector = self.scheduler.connector
        assert isinstance(self.scheduler_connector, OffloadingConnector)
        self.worker_connector = OffloadingConnector(self.scheduler_connector._vllm_config, KVConnectorRole.WORKER)
        self.worker_connector.register_kv_caches({"a": torch.empty(0)})
        connector_scheduler = self.scheduler_connector.connector_scheduler
        self.manager = connector_scheduler.manager
        assert connector_scheduler.gpu_block_size == gpu_block_size
        assert connector_scheduler.offloaded_block_size == offloaded_block_size
        self.offloading_spec = self.worker_connector.connector_worker.spec
        assert isinstance(self.offloading_spec, MockOffloadingSpec)
        self.offloaded: dict[Any, int] = {}  # offloaded address -> the device block index stored there
        self.pending_loads_count = 0
        self.pending_stores_count = 0
        self.completed_loads: list[TransferSummary] = []
        self.completed_stores: list[TransferSummary] = []
        self.gpu_block_index: dict[int, int] = {}  # block id -> its position in the request
        self._block_hasher = get_request_block_hasher(gpu_block_size)
        self._dummy_ctx = ForwardContext(attn_metadata={}, no_compile_layers={})

    def new_request(self, token_ids: list[int]) -> None:
        assert not self.scheduler.requests
        self.req_id += 1
        self.scheduler.add_request(
            Request(str(self.req_id), token_ids, SamplingParams(max_tokens=1000), EOS_TOKEN_ID,
                    block_hasher=self._block_hasher)
        )  # fmt: skip

    def _wait_for_transfers(self) -> None:
        factor = self.offloaded_block_size // self.gpu_block_size
        while self.pending_loads_count or self.pending_stores_count:
            for src_spec, dst_spec in self.offloading_spec.get_completed_transfers():
                store = isinstance(src_spec, GPULoadStoreSpec)
                gpu_spec, offload_spec = (src_spec, dst_spec) if store else (dst_spec, src_spec)
                assert isinstance(offload_spec, MockLoadStoreSpec) and isinstance(gpu_spec, GPULoadStoreSpec)
                gpu_block_indices = [self.gpu_block_index[b] for b in gpu_spec.block_ids.tolist()]
                offload_addresses = [(h, i) for h in offload_spec.block_hashes for i in range(factor)]
                if store:
                    assert len(gpu_block_indices) == len(offload_addresses)
                    self.completed_stores.append(TransferSummary(gpu_block_indices, offload_addresses))
                    self.pending_stores_count -= 1
                else:
                    remainder = len(offload_addresses) - len(gpu_block_indices)
                    assert 0 <= remainder < factor
                    self.completed_loads.append(TransferSummary(gpu_block_indices, offload_addresses[remainder:]))
                    self.pending_loads_count -= 1

    def _update_gpu_block_idx(self) -> None:
        for blocks in self.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.values():
            for block_idx, block in enumerate(blocks):
                self.gpu_block_index[block.block_id] = block_idx

    def _run(self, decoded_tokens: list[int]) -> None:
        tokens_iter = iter(decoded_tokens)
        token_id = next(tokens_iter, None)
        while token_id is not None:
            assert self.scheduler.requests
            scheduler_output = self.scheduler.schedule()
            self._update_gpu_block_idx()
            metadata = scheduler_output.kv_connector_metadata
            assert isinstance(metadata, OffloadingConnectorMetadata)
            self.pending_loads_count += len(metadata.reqs_to_load)
            self.pending_stores_count += len(metadata.reqs_to_store)
            self.worker_connector.bind_connector_metadata(metadata)
            self.worker_connector.start_load_kv(self._dummy_ctx)
            if scheduler_output.total_num_scheduled_tokens > 0:
                self.worker_connector.wait_for_save()
            finished_sending, finished_recving = self.worker_connector.get_finished(scheduler_output.finished_req_ids)
            self.worker_connector.clear_connector_metadata()
            req_ids = list(scheduler_output.num_scheduled_tokens)
            output = ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[token_id] for _ in req_ids],
                kv_connector_output=KVConnectorOutput(finished_sending, finished_recving),
            )  # fmt: skip
            if self.scheduler.running:
                token_id = next(tokens_iter, None)
            self.scheduler.update_from_output(scheduler_output, output)
        self._wait_for_transfers()
        if EOS_TOKEN_ID in decoded_tokens:
            # One more step tells the worker the request finished; its stores report it sent.
            assert not self.scheduler.running
            while self.scheduler.requests:
                scheduler_output = self.scheduler.schedule()
                finished_sending, finished_recving = self.worker_connector.get_finished(
                    scheduler_output.finished_req_ids
                )
                assert not finished_recving
                output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
                output.kv_connector_output = KVConnectorOutput(finished_sending=finished_sending)
                self.scheduler.update_from_output(scheduler_output, output)

    def run(
        self, decoded_tokens: list[int], expected_stored_gpu_block_indexes: tuple[int, ...] = (),
        expected_loaded_gpu_block_indexes: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        """Run the steps that sample `decoded_tokens`; check which of the request's blocks
        were stored and loaded, and that each load reads what a store wrote there."""
        self.manager.reset_mock()
        self._run(decoded_tokens)
        loaded = set()
        for transfer in self.completed_loads:
            for gpu_block_idx, address in zip(transfer.gpu_block_indices, transfer.offload_addresses):
                loaded.add(gpu_block_idx)
                assert gpu_block_idx == self.offloaded[address]
        assert loaded == set(expected_loaded_gpu_block_indexes)
        self.completed_loads.clear()
        stored = set()
        for transfer in self.completed_stores:
            for gpu_block_idx, address in zip(transfer.gpu_block_indices, transfer.offload_addresses):
                stored.add(gpu_block_idx)
                self.offloaded[address] = gpu_block_idx
        assert stored == set(expected_stored_gpu_block_indexes)
        self.completed_stores.clear()


def test_offloading_connector_as_v0_11_0():
    """v0.11.0's test_offloading_connector: offloaded blocks of 12 tokens over device blocks of 4."""
    offloaded_block_size, gpu_block_size = 12, 4
    factor = offloaded_block_size // gpu_block_size
    runner = RequestRunner(offloaded_block_size, gpu_block_size, num_gpu_blocks=100)
    manager = runner.manager

    # 3 blocks; store just the middle one.
    runner.new_request(token_ids=[0] * offloaded_block_size * 3)
    manager.prepare_store.side_effect = lambda block_hashes: generate_store_output(list(block_hashes)[1:2])
    runner.run(decoded_tokens=[0], expected_stored_gpu_block_indexes=(3, 4, 5))
    # A block short of one token: nothing to offload.
    runner.run(decoded_tokens=[0] * (offloaded_block_size - 1))
    manager.prepare_store.assert_not_called()
    # One more token completes a block; the tier refuses it.
    manager.prepare_store.side_effect = lambda block_hashes: None
    runner.run(decoded_tokens=[0])
    manager.prepare_store.assert_called()
    # One more block; the tier already has everything.
    manager.prepare_store.side_effect = lambda block_hashes: generate_store_output([])
    runner.run(decoded_tokens=[0] * offloaded_block_size)
    # One more block, stored; the whole prefix (6 blocks) is touched.
    manager.prepare_store.side_effect = generate_store_output
    runner.run(decoded_tokens=[0] * offloaded_block_size, expected_stored_gpu_block_indexes=(15, 16, 17))
    manager.touch.assert_called()
    block_hashes1 = list(manager.touch.call_args.args[0])
    assert len(block_hashes1) == 6
    # It finishes while it has stored blocks: its device blocks are kept until its stores report.
    runner.run(decoded_tokens=[EOS_TOKEN_ID])
    assert not runner.scheduler.requests

    # A request differing only in the last token: all 6 blocks stored.
    runner.new_request(token_ids=[0] * (offloaded_block_size * 6 - 1) + [1])
    runner.run(decoded_tokens=[0], expected_stored_gpu_block_indexes=tuple(range(6 * factor)))
    manager.touch.assert_called()
    block_hashes2 = list(manager.touch.call_args.args[0])
    assert len(block_hashes2) == 6
    assert block_hashes1[:5] == block_hashes2[:5]
    assert block_hashes1[5] != block_hashes2[5]
    runner.run(decoded_tokens=[EOS_TOKEN_ID])

    # Less than an offloaded block past the device hit: no lookup.
    runner.new_request(token_ids=[0] * gpu_block_size + [1] * (offloaded_block_size - gpu_block_size))
    manager.prepare_store.side_effect = lambda block_hashes: generate_store_output([])
    runner.run(decoded_tokens=[EOS_TOKEN_ID])
    manager.lookup.assert_not_called()

    # A one-block lookup that misses.
    runner.new_request(token_ids=[1] * offloaded_block_size)
    runner.run(decoded_tokens=[EOS_TOKEN_ID])
    manager.lookup.assert_called()
    assert len(list(manager.lookup.call_args.args[0])) == 1

    # A one-block lookup that hits: loaded into the request's first 3 device blocks.
    runner.scheduler.reset_prefix_cache()
    runner.new_request(token_ids=[0] * offloaded_block_size)
    manager.lookup.return_value = 1
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_loaded_gpu_block_indexes=(0, 1, 2))

    # A hit in a middle block: the device cache has the first one.
    runner.new_request(token_ids=[0] * offloaded_block_size * 2 + [1] * offloaded_block_size)
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_loaded_gpu_block_indexes=(3, 4, 5))


def test_finished_request_keeps_its_blocks_until_its_stores_report():
    """`request_finished` delays the free while a store reads the blocks; `finished_sending` frees them."""
    runner = RequestRunner(offloaded_block_size=4, gpu_block_size=4, num_gpu_blocks=20)
    runner.manager.prepare_store.side_effect = generate_store_output
    runner.new_request(token_ids=[3] * 8)
    runner.run(decoded_tokens=[0], expected_stored_gpu_block_indexes=(0, 1))
    scheduler = runner.scheduler
    output = scheduler.schedule()
    runner.worker_connector.bind_connector_metadata(output.kv_connector_metadata)
    runner.worker_connector.clear_connector_metadata()
    # The request samples EOS: finished, but its blocks stay while the connector says its stores run.
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=["0"], req_id_to_index={"0": 0}, sampled_token_ids=[[EOS_TOKEN_ID]]))  # fmt: skip
    assert "0" in scheduler.requests and not scheduler.running
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert len(manager.req_to_blocks["0"]) == 3
    output = scheduler.schedule()
    assert output.finished_req_ids == {"0"}
    finished_sending, _ = runner.worker_connector.get_finished(output.finished_req_ids)
    assert finished_sending == {"0"}
    runner.manager.complete_store.assert_not_called()
    empty = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
    empty.kv_connector_output = KVConnectorOutput(finished_sending=finished_sending)
    scheduler.update_from_output(output, empty)
    assert not scheduler.requests and "0" not in manager.req_to_blocks
    runner.manager.complete_store.assert_called_once()


# ----------------------------------------------------------------------------- end to end
BLOCK_SIZE = 16
MAX_TOKENS = 8
NUM_GPU_BLOCKS = 9  # block 0 is the null block: 8 usable, one request's 5 and a few cached
# Four prompts of 72 tokens: a 32-token prefix they share (2 blocks), then 40 tokens of their own
# (2 whole blocks and 8 tokens). Each request fills 5 device blocks; its 4 whole prompt blocks
# are offloadable. The working set: 2 shared + 4 x 2 unique = 10 offloaded blocks.
SHARED_PREFIX = [(5 * j + 3) % 400 + 1 for j in range(32)]
PROMPTS = [SHARED_PREFIX + [(7 * i + 3 * j + 11) % 450 + 20 for j in range(40)] for i in range(4)]
CYCLE = PROMPTS * 2


def run_cycle(model: str, num_cpu_blocks: int | None) -> dict[str, Any]:
    """The prompts in turn, one request at a time (each its own `generate`): tokens, cached
    tokens per request, tokens loaded from the CPU tier."""
    kv_transfer_config = None
    if num_cpu_blocks is not None:
        kv_transfer_config = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks},
        }  # fmt: skip
    args = EngineArgs(
        model=model, dtype="float32", max_model_len=128, block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_GPU_BLOCKS, kv_transfer_config=kv_transfer_config,
    )  # fmt: skip
    llm = LLM.from_engine_args(args, enable_multiprocessing=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in CYCLE]
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    finally:
        llm.llm_engine.shutdown()
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "num_cached": [o.num_cached_tokens for o in outputs],
        "num_loaded": connector.connector_scheduler.num_loaded_tokens if connector is not None else 0,
    }


@pytest.fixture(scope="module")
def cycles(tiny_qwen3) -> dict[str, dict[str, Any]]:
    return {
        "plain": run_cycle(tiny_qwen3, None),
        "fits": run_cycle(tiny_qwen3, 10),
        "too_small": run_cycle(tiny_qwen3, 8),
    }


def test_device_cache_alone_recomputes_the_unique_blocks(cycles):
    """The oracle's premise: the device cache keeps the shared prefix (hit by every request
    but the first) and evicts each prompt's own blocks before the prompt returns."""
    assert cycles["plain"]["num_cached"] == [0] + [32] * 7


def test_cpu_tier_turns_recomputation_into_loads(cycles):
    """With the working set in the CPU tier, the second round loads each prompt's two own
    blocks (32 tokens) after the device's 32-token hit: 128 tokens loaded, not computed;
    greedy tokens equal the plain engine's."""
    fits = cycles["fits"]
    assert fits["num_cached"] == [0, 32, 32, 32, 64, 64, 64, 64]
    assert fits["num_loaded"] == 4 * 32
    assert fits["tokens"] == cycles["plain"]["tokens"]


def test_too_small_cpu_tier_recomputes(cycles):
    """8 blocks for a working set of 10, visited cyclically: LRU always evicts the prompt
    that comes back next (the shared prefix stays, being touched by everyone), so nothing
    is loaded and the counts are the plain engine's."""
    too_small = cycles["too_small"]
    assert too_small["num_loaded"] == 0
    assert too_small["num_cached"] == cycles["plain"]["num_cached"]
    assert too_small["tokens"] == cycles["plain"]["tokens"]


def test_offload_sweep_smoke():
    """benchmarks/kv_connectors.py on the demo model: the same workload's counts add up, and
    the CPU tier that holds the working set moves 128 tokens from computed to loaded."""
    plain, fits = offload_sweep([0, 10])
    for row in (plain, fits):
        assert row["prompt_tokens"] == 8 * 72
        assert row["computed_prompt_tokens"] + row["loaded_tokens"] + row["device_hit_tokens"] == row["prompt_tokens"]
    assert (plain["loaded_tokens"], fits["loaded_tokens"]) == (0, 128)
    assert plain["device_hit_tokens"] == fits["device_hit_tokens"] == 7 * 32
    assert plain["computed_prompt_tokens"] - fits["computed_prompt_tokens"] == 128
