"""The scheduler with a KV connector (chapter 16), through a scripted connector (tests/helpers/kv_connector.py).

Ported from vLLM v0.11.0's tests/v1/core/test_scheduler.py (`test_kv_connector_basic`,
`test_kv_connector_unable_to_allocate`, `test_kv_connector_handles_preemption`, where a
Mock answers `get_num_new_matched_tokens`) and tests/v1/kv_connector/unit/
test_remote_prefill_lifecycle.py and test_remote_decode_lifecycle.py (with
NixlConnector's scheduler half), assertion by assertion: the scheduled tokens are the
prompt minus the local and external hits, blocks cover the external tokens, a remote
prefill waits in WAITING_FOR_REMOTE_KVS with uncached blocks until `finished_recving`,
a remote decode's blocks stay until `finished_sending`, and nothing leaks. Then the
parts nano_v1 adds: the factory's and the config's errors, the one-group rule, the engine
argument, and a request aborted while its KV loads.
"""

from __future__ import annotations

import argparse
import json

import pytest
from helpers.kv_cache import hybrid_kv_cache_config
from helpers.kv_connector import RecordingConnector
from helpers.scheduler import make_scheduler

from nano_v1.config import KVTransferConfig
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.outputs import KVConnectorOutput, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch16

EOS_TOKEN_ID = 50256
KV_BOTH = KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_both")


def create_scheduler(num_blocks: int = 10000, block_size: int = 16, budget: int = 8192, max_model_len: int = 8192):
    """v0.11.0's test scheduler: prefix caching, 16 running requests, a KV connector."""
    return make_scheduler(
        num_blocks, block_size, budget, max_seqs=16, max_model_len=max_model_len, caching=True,
        kv_transfer_config=KV_BOTH,
    )  # fmt: skip


def create_lifecycle_scheduler(num_blocks: int = 10000) -> Scheduler:
    """The scheduler of v0.11.0's kv_connector/unit/utils.py: budget and context 64 tokens."""
    return create_scheduler(num_blocks=num_blocks, budget=64, max_model_len=64)


def create_requests(num_requests: int, num_tokens: int, max_tokens: int, block_size: int) -> list[Request]:
    """v0.11.0's test_scheduler requests: request i's prompt is `num_tokens` copies of i."""
    hasher = get_request_block_hasher(block_size)
    return [
        Request(str(i), [i] * num_tokens, SamplingParams(max_tokens=max_tokens), EOS_TOKEN_ID, block_hasher=hasher)
        for i in range(num_requests)
    ]


def create_request(
    request_id: int, num_tokens: int, block_size: int = 16, max_tokens: int = 16,
    do_remote_decode: bool = False, do_remote_prefill: bool = False, use_all_1s_for_prompt_tokens: bool = False,
) -> Request:  # fmt: skip
    """v0.11.0's kv_connector/unit request, with the kv_transfer_params of a P/D transfer."""
    kv_transfer_params = None
    if do_remote_decode:
        kv_transfer_params = {"do_remote_prefill": False, "do_remote_decode": True}
    elif do_remote_prefill:
        kv_transfer_params = {"do_remote_prefill": True, "do_remote_decode": False}
    prompt = [1] * num_tokens if use_all_1s_for_prompt_tokens else [i * request_id for i in range(num_tokens)]
    params = SamplingParams(
        max_tokens=1 if do_remote_decode else max_tokens,
        extra_args=None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params},
    )
    return Request(f"id-{request_id}", prompt, params, EOS_TOKEN_ID, block_hasher=get_request_block_hasher(block_size))


def create_model_runner_output(
    reqs: list[Request], finished_sending: list[str] | None = None, finished_recving: list[str] | None = None,
    use_eos: bool = False, token_id: int = 0,
) -> ModelRunnerOutput:  # fmt: skip
    req_ids = [req.request_id for req in reqs]
    kv_connector_output = None
    if finished_sending is not None or finished_recving is not None:
        kv_connector_output = KVConnectorOutput(
            finished_sending=set(finished_sending or ()), finished_recving=set(finished_recving or ())
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[EOS_TOKEN_ID if use_eos else token_id] for _ in req_ids],
        kv_connector_output=kv_connector_output,
    )


def req_blocks(scheduler: Scheduler, request_id: str):
    return scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[request_id]


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, block or id left behind."""
    assert len(scheduler.requests) == 0, f"requests left: {list(scheduler.requests)}"
    assert len(scheduler.waiting) == 0, "requests left waiting"
    assert len(scheduler.running) == 0, "requests left running"
    assert len(scheduler.finished_req_ids) == 0, "finished ids left"
    assert len(scheduler.finished_recving_kv_req_ids) == 0, (
        f"ids left in finished_recving_kv_req_ids: {scheduler.finished_recving_kv_req_ids}"
    )
    assert len(scheduler.encoder_cache_manager.freed) == 0, "encoder cache entries left to free"
    assert len(scheduler.encoder_cache_manager.cached) == 0, "encoder cache entries left"
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert len(manager.req_to_blocks) == 0, f"blocks left held by {list(manager.req_to_blocks)}"
    assert len(manager.num_cached_block) == 0, f"cached-block counts left for {list(manager.num_cached_block)}"
    block_pool = scheduler.kv_cache_manager.block_pool
    num_free = block_pool.free_block_queue.num_free_blocks
    assert num_free == block_pool.num_gpu_blocks - 1, f"{num_free} of {block_pool.num_gpu_blocks - 1} blocks free"
    # Hashes stay (eviction is lazy); references do not.
    assert all(block.ref_cnt == 0 for block in block_pool.blocks), "blocks still referenced"


# ----------------------------------------------------------------------------- v0.11.0's test_scheduler.py
def _assert_right_scheduler_output(output: SchedulerOutput, num_requests: int, expected_num_scheduled_tokens: int):
    """The connector's metadata names the requests that load KV; each scheduled the rest of its prompt."""
    num_loading = len(output.kv_connector_metadata.requests)
    assert num_loading == num_requests, f"{num_loading} requests in the connector's metadata, {num_requests} expected"
    for req_id, num_scheduled_tokens in output.num_scheduled_tokens.items():
        assert num_scheduled_tokens == expected_num_scheduled_tokens, (
            f"{req_id} scheduled {num_scheduled_tokens} tokens, {expected_num_scheduled_tokens} expected"
        )


def _assert_right_kv_cache_manager(scheduler, requests, num_tokens, block_size, num_requests, num_total_blocks):
    """Every prompt block, external ones included, is allocated, hashed and committed."""
    expected_total_blocks = num_tokens // block_size
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    for req in requests:
        num_cached = manager.num_cached_block[req.request_id]
        assert num_cached == expected_total_blocks, f"{num_cached} blocks cached, {expected_total_blocks} expected"
        num_held = len(manager.req_to_blocks[req.request_id])
        assert num_held == expected_total_blocks, f"{num_held} blocks held, {expected_total_blocks} expected"
        assert len(req.block_hashes) == expected_total_blocks, f"{len(req.block_hashes)} block hashes"
    num_free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    expected_free = num_total_blocks - num_requests * num_tokens // block_size
    assert num_free == expected_free, f"{num_free} blocks free, {expected_free} expected"


def _step_until_done(scheduler: Scheduler, output: SchedulerOutput, model_runner_output: ModelRunnerOutput):
    """Decode steps (one token each, nothing loaded) until every request finishes."""
    scheduler.update_from_output(output, model_runner_output)
    all_finished = False
    while not all_finished:
        output = scheduler.schedule()
        assert len(scheduler.running), "nothing running before every request finished"
        for req_id, num_scheduled_tokens in output.num_scheduled_tokens.items():
            assert num_scheduled_tokens == 1, f"{req_id} scheduled {num_scheduled_tokens} tokens in a decode step"
        assert len(output.kv_connector_metadata.requests) == 0, "a decode step loads KV"
        ecos = scheduler.update_from_output(output, model_runner_output)
        all_finished = all(eco.finish_reason is not None for eco in ecos.outputs)


def _add(scheduler: Scheduler, requests: list[Request]) -> ModelRunnerOutput:
    for request in requests:
        scheduler.add_request(request)
    return create_model_runner_output(requests, token_id=1000)


def test_kv_connector_basic():
    """External hits are computed tokens: only the rest of each prompt is scheduled; then a
    local prefix-cache hit and an external hit add up."""
    scheduler = create_scheduler()
    num_total_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    block_size = scheduler.block_size
    num_matched_new_tokens = block_size * 2
    scheduler.connector.num_matched_tokens = num_matched_new_tokens

    # External hit only.
    num_requests, num_tokens, max_tokens = 2, num_matched_new_tokens * 2, 3
    requests = create_requests(num_requests, num_tokens, max_tokens, block_size)
    model_runner_output = _add(scheduler, requests)
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests, num_tokens - num_matched_new_tokens)
    _assert_right_kv_cache_manager(scheduler, requests, num_tokens, block_size, num_requests, num_total_blocks)
    _step_until_done(scheduler, output, model_runner_output)
    scheduler.schedule()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_total_blocks

    # Local hit of the first set's prompts, then the external hit.
    num_tokens_prefix = num_tokens
    num_tokens = num_tokens_prefix * 2
    requests = create_requests(num_requests, num_tokens, max_tokens, block_size)
    model_runner_output = _add(scheduler, requests)
    output = scheduler.schedule()
    _assert_right_scheduler_output(output, num_requests, num_tokens - num_tokens_prefix - num_matched_new_tokens)
    _assert_right_kv_cache_manager(scheduler, requests, num_tokens, block_size, num_requests, num_total_blocks)
    _step_until_done(scheduler, output, model_runner_output)
    scheduler.schedule()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_total_blocks
    # The connector was asked with each request's local hit.
    asked = [call[2] for call in scheduler.connector.calls if call[0] == "get_num_new_matched_tokens"]
    assert asked == [0, 0, num_tokens_prefix, num_tokens_prefix]


def test_kv_connector_unable_to_allocate():
    """Blocks for external tokens count against the pool: the second request waits for them."""
    block_size, num_blocks = 4, 10
    scheduler = create_scheduler(num_blocks=num_blocks, block_size=block_size)
    num_matched_new_tokens = block_size * 2
    scheduler.connector.num_matched_tokens = num_matched_new_tokens
    num_tokens = (num_blocks // 2 + 1) * block_size
    requests = create_requests(2, num_tokens, 2, block_size)
    model_runner_output = _add(scheduler, requests)

    for num_waiting_after in (1, 0):
        output = scheduler.schedule()
        _assert_right_scheduler_output(output, 1, num_tokens - num_matched_new_tokens)
        assert len(scheduler.running) == 1
        assert len(scheduler.waiting) == num_waiting_after
        _step_until_done(scheduler, output, model_runner_output)
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
        assert len(scheduler.running) == 0
        assert len(scheduler.waiting) == num_waiting_after


def test_kv_connector_handles_preemption():
    """A preempted request is admitted again with a local and an external hit."""
    block_size, num_blocks = 2, 7  # 6 usable blocks
    scheduler = create_scheduler(num_blocks=num_blocks, block_size=block_size)
    num_matched_new_tokens = block_size
    scheduler.connector.num_matched_tokens = num_matched_new_tokens
    num_tokens = block_size * 2 + 1
    requests = create_requests(2, num_tokens, block_size * 2, block_size)
    model_runner_output = _add(scheduler, requests)

    def step(num_loading: int, num_scheduled: int, num_running: int, num_waiting: int | None = None) -> None:
        output = scheduler.schedule()
        _assert_right_scheduler_output(output, num_loading, num_scheduled)
        assert len(scheduler.running) == num_running
        if num_waiting is not None:
            assert len(scheduler.waiting) == num_waiting
        scheduler.update_from_output(output, model_runner_output)

    step(2, num_tokens - num_matched_new_tokens, 2)  # both prompts, after 2 external tokens each
    step(0, 1, 2)  # 2nd token
    step(0, 1, 1, 1)  # 3rd token: a new block, request "1" preempted
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 1
    step(0, 1, 1, 1)  # 4th and last token of request "0"
    assert len(scheduler.running) == 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
    # Request "1" again: one local block hit, one external block, so one token to compute.
    step(1, 1, 1, 0)
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 0
    step(0, 1, 1)
    assert len(scheduler.running) == 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1


# ----------------------------------------------------------------------------- remote prefill lifecycle
@pytest.mark.ch16_t1
def test_remote_prefill_basic_lifecycle():
    """Rules: a request waits until `self.finished_recving_kv_req_ids` names it; then its loaded
    blocks' tokens, «never more than the request has», count as computed, their full blocks
    committed to the prefix cache (`self.kv_cache_manager.cache_blocks`)."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    num_external_full_blocks = 2
    num_tokens = int(block_size * (num_external_full_blocks + 0.5))
    block_pool = scheduler.kv_cache_manager.block_pool
    start_free_block_queue_size = block_pool.free_block_queue.num_free_blocks
    request = create_request(1, num_tokens, block_size, do_remote_prefill=True)
    scheduler.add_request(request)
    request_id = request.request_id

    # Step 1: nothing scheduled; the request waits for its KV ...
    scheduler_output = scheduler.schedule()
    assert len(scheduler.running) == 0
    assert len(scheduler_output.scheduled_new_reqs) == 0
    assert scheduler_output.scheduled_cached_reqs.num_reqs == 0
    assert len(scheduler_output.num_scheduled_tokens) == 0
    assert scheduler_output.total_num_scheduled_tokens == 0
    assert len(scheduler.waiting) == 1
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == 0
    # ... with blocks to load into, not committed to the prefix cache.
    assert block_pool.free_block_queue.num_free_blocks < start_free_block_queue_size
    assert len(block_pool.cached_block_hash_to_block) == 0
    assert all(block.block_hash is None for block in req_blocks(scheduler, request_id))
    assert scheduler_output.kv_connector_metadata.requests == [request_id]
    engine_core_outputs = scheduler.update_from_output(scheduler_output, create_model_runner_output([]))
    assert not engine_core_outputs.outputs

    # Step 2: nothing happens; the workers report the KV loaded.
    scheduler_output = scheduler.schedule()
    assert len(scheduler.waiting) == 1 and len(scheduler.running) == 0
    scheduler.update_from_output(scheduler_output, create_model_runner_output([], finished_recving=[request_id]))
    assert len(scheduler.waiting) == 1
    assert request_id in scheduler.finished_recving_kv_req_ids

    # Step 3: scheduled, with its loaded full blocks committed and the rest of the prompt to compute.
    scheduler_output = scheduler.schedule()
    assert len(scheduler.running) == 1
    blocks = req_blocks(scheduler, request_id)
    assert all(block.ref_cnt == 1 for block in blocks)
    assert sum(block.block_hash is not None for block in blocks) == num_external_full_blocks
    scheduled_req = scheduler_output.scheduled_new_reqs[0]
    assert scheduler_output.num_scheduled_tokens[request_id] == (
        len(scheduled_req.prompt_token_ids) - scheduled_req.num_computed_tokens
    )
    scheduler.update_from_output(scheduler_output, create_model_runner_output([request]))

    # Step 4: EOS.
    finish_with_eos(scheduler, request)


def finish_with_eos(scheduler, request) -> None:
    """One more step, which samples EOS: the request stops, and the scheduler is left empty."""
    scheduler_output = scheduler.schedule()
    engine_core_outputs = scheduler.update_from_output(scheduler_output, create_model_runner_output([request], use_eos=True))
    scheduler.schedule()
    (output,) = engine_core_outputs.outputs
    assert output.finish_reason == "stop"
    assert_scheduler_empty(scheduler)


@pytest.mark.ch16_t1
def test_remote_prefill_interleaved_lifecycle():
    """Other requests run while a remote prefill's KV arrives.

    Rule: it is admitted only once `self.finished_recving_kv_req_ids` names it, and taken out
    of that set then."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    num_tokens = int(block_size * 2.5)
    request_remote = create_request(1, num_tokens, block_size, do_remote_prefill=True)
    request_local_a = create_request(2, num_tokens, block_size)
    request_local_b = create_request(3, num_tokens, block_size)

    def step(reqs, num_running, num_waiting, num_new, num_cached, **kwargs) -> None:
        scheduler_output = scheduler.schedule()
        assert len(scheduler.running) == num_running
        assert len(scheduler.waiting) == num_waiting
        assert len(scheduler_output.scheduled_new_reqs) == num_new
        assert scheduler_output.scheduled_cached_reqs.num_reqs == num_cached
        scheduler.update_from_output(scheduler_output, create_model_runner_output(reqs, **kwargs))

    scheduler.add_request(request_local_a)
    step([request_local_a], 1, 0, 1, 0)
    scheduler.add_request(request_local_b)
    scheduler.add_request(request_remote)
    step([request_local_a, request_local_b], 2, 1, 1, 1)
    step([request_local_a, request_local_b], 2, 1, 0, 2)  # the KV has not arrived
    step([request_local_a, request_local_b], 2, 1, 0, 2, finished_recving=[request_remote.request_id])
    step([request_local_a, request_local_b, request_remote], 3, 0, 1, 2)
    step([request_local_a, request_local_b, request_remote], 3, 0, 0, 3, use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_no_spurious_prefix_caching():
    """Blocks still waiting for their KV are no prefix-cache hit for an identical prompt."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    num_tokens = int(block_size * 2.5)
    request_remote = create_request(1, num_tokens, block_size, do_remote_prefill=True, use_all_1s_for_prompt_tokens=True)
    request_local = create_request(2, num_tokens, block_size, use_all_1s_for_prompt_tokens=True)

    scheduler.add_request(request_remote)
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(scheduler_output, create_model_runner_output([]))
    assert len(scheduler.waiting) == 1

    scheduler.add_request(request_local)
    scheduler.schedule()
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 1
    local_blocks = req_blocks(scheduler, request_local.request_id)
    remote_blocks = req_blocks(scheduler, request_remote.request_id)
    assert all(block.ref_cnt == 1 for block in local_blocks)
    assert sum(block.block_hash is not None for block in local_blocks) > 0
    assert all(block.ref_cnt == 1 and block.block_hash is None for block in remote_blocks)


@pytest.mark.ch16_t1
def test_full_block_prompt():
    """A prompt of whole blocks: all loaded, yet its last token is computed again to sample from.

    Rule: «at most num_tokens - 1» tokens count as computed."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    num_external_full_blocks = 2
    num_tokens = block_size * num_external_full_blocks
    request = create_request(1, num_tokens, block_size, do_remote_prefill=True)
    scheduler.add_request(request)
    request_id = request.request_id

    scheduler_output = scheduler.schedule()
    assert len(req_blocks(scheduler, request_id)) == num_external_full_blocks
    scheduler.update_from_output(scheduler_output, create_model_runner_output([]))
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(scheduler_output, create_model_runner_output([], finished_recving=[request_id]))
    assert len(scheduler.waiting) == 1
    assert request_id in scheduler.finished_recving_kv_req_ids

    scheduler_output = scheduler.schedule()
    assert len(req_blocks(scheduler, request_id)) == num_external_full_blocks  # no new block
    assert scheduler_output.scheduled_new_reqs[0].num_computed_tokens == num_tokens - 1
    assert scheduler_output.num_scheduled_tokens[request_id] == 1
    scheduler.update_from_output(scheduler_output, create_model_runner_output([request]))

    finish_with_eos(scheduler, request)


@pytest.mark.ch16_t1
def test_update_waiting_for_remote_kv_directly():
    """The arrival check on its own, before admission allocates anything more.

    Rules: False, nothing changed, until `self.finished_recving_kv_req_ids` names the request;
    then its tokens computed are those its blocks hold, «never more than the request has» and
    «at most num_tokens - 1», and their full blocks are committed to the prefix cache
    (`self.kv_cache_manager.cache_blocks`) right away; the id leaves the set."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    request = create_request(1, int(block_size * 2.5), block_size, do_remote_prefill=True)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), create_model_runner_output([]))
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, request.status
    blocks = req_blocks(scheduler, request.request_id)
    assert len(blocks) == 3, f"{len(blocks)} blocks allocated for 40 tokens"

    assert scheduler._update_waiting_for_remote_kv(request) is False, "the workers have not reported it loaded"
    assert request.num_computed_tokens == 0, "nothing counts as computed before the KV arrives"
    assert all(block.block_hash is None for block in blocks), "blocks committed to the cache before the KV arrived"

    scheduler.finished_recving_kv_req_ids.add(request.request_id)
    assert scheduler._update_waiting_for_remote_kv(request) is True, "finished_recving_kv_req_ids names it"
    # 3 blocks hold 48 slots: capped at the 40 prompt tokens, less the last one.
    assert request.num_computed_tokens == int(block_size * 2.5) - 1, (
        f"{request.num_computed_tokens} tokens computed; 39 expected (40 prompt tokens, the last one left to compute)"
    )
    committed = [block.block_hash is not None for block in blocks]
    assert committed == [True, True, False], f"blocks committed to the prefix cache: {committed}; the 2 full ones expected"
    assert request.request_id not in scheduler.finished_recving_kv_req_ids, "its id is left in finished_recving_kv_req_ids"

    # A prompt of whole blocks: its last token is left to compute.
    full = create_request(2, block_size * 2, block_size, do_remote_prefill=True)
    scheduler.add_request(full)
    scheduler.update_from_output(scheduler.schedule(), create_model_runner_output([]))
    scheduler.finished_recving_kv_req_ids.add(full.request_id)
    assert scheduler._update_waiting_for_remote_kv(full) is True, "finished_recving_kv_req_ids names it"
    assert full.num_computed_tokens == block_size * 2 - 1, f"{full.num_computed_tokens} tokens computed; 31 expected"
    committed = [block.block_hash is not None for block in req_blocks(scheduler, full.request_id)]
    assert committed == [True, False], f"blocks committed: {committed}; the block holding the last token is not full of computed tokens"


@pytest.mark.ch16_t1
def test_cannot_schedule_after_recv():
    """Loaded, admitted, then preempted for want of a block: admitted again on its cached blocks.

    Rule: the loaded blocks are committed to the prefix cache (`self.kv_cache_manager.cache_blocks`)
    when the request is admitted, so they are its hits when it comes back."""
    scheduler = create_lifecycle_scheduler(num_blocks=6)  # 5 usable blocks
    block_size = scheduler.block_size
    num_prompt_blocks = 2
    request_normal = create_request(1, block_size * num_prompt_blocks, block_size)
    request_remote = create_request(2, block_size * num_prompt_blocks, block_size, do_remote_prefill=True)

    def step(reqs, num_running, num_waiting, **kwargs) -> SchedulerOutput:
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(scheduler_output, create_model_runner_output(reqs, **kwargs))
        assert len(scheduler.running) == num_running, f"{len(scheduler.running)} running, {num_running} expected"
        assert len(scheduler.waiting) == num_waiting, f"{len(scheduler.waiting)} waiting, {num_waiting} expected"
        return scheduler_output

    scheduler.add_request(request_normal)
    step([request_normal], 1, 0)  # 2 blocks, then 3 for the decode
    scheduler.add_request(request_remote)
    step([request_normal], 1, 1)  # 2 more for the remote prefill: 5 in use
    step([request_normal], 1, 1, finished_recving=[request_remote.request_id])
    step([request_normal, request_remote], 2, 0)  # the KV has arrived: running
    step([request_normal], 1, 1)  # its first output needs a block: preempted
    step([request_normal], 0, 1, use_eos=True)
    scheduler_output = scheduler.schedule()
    assert scheduler_output.scheduled_cached_reqs.num_computed_tokens[0] == num_prompt_blocks * block_size
    scheduler.update_from_output(scheduler_output, create_model_runner_output([request_remote]))
    assert (len(scheduler.running), len(scheduler.waiting)) == (1, 0), "the loaded request runs again, nothing waits"
    step([request_remote], 0, 0, use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_cannot_recv():
    """No transfer starts until the blocks to receive into can be allocated."""
    scheduler = create_lifecycle_scheduler(num_blocks=6)  # 5 usable blocks
    block_size = scheduler.block_size
    request_normal = create_request(1, block_size * 2, block_size)
    request_remote = create_request(2, int(block_size * 2.5), block_size, do_remote_prefill=True)

    def step(reqs, num_running, num_waiting, **kwargs) -> None:
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(scheduler_output, create_model_runner_output(reqs, **kwargs))
        assert len(scheduler.running) == num_running
        assert len(scheduler.waiting) == num_waiting

    scheduler.add_request(request_normal)
    step([request_normal], 1, 0)
    scheduler.add_request(request_remote)
    step([request_normal], 1, 1)  # needs 3 blocks, 2 are free
    assert request_remote.status != RequestStatus.WAITING_FOR_REMOTE_KVS
    step([request_normal], 0, 1, use_eos=True)
    step([], 0, 1)
    assert request_remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step([], 0, 1, finished_recving=[request_remote.request_id])
    step([request_remote], 1, 0)
    step([request_remote], 0, 0, use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


# ----------------------------------------------------------------------------- remote decode lifecycle
def test_remote_decode_basic_lifecycle():
    """A prefill for a remote decode finishes after one token; its blocks stay until sent."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    request = create_request(1, int(block_size * 2.5), block_size, do_remote_decode=True)
    scheduler.add_request(request)
    request_id = request.request_id

    scheduler_output = scheduler.schedule()
    assert len(scheduler.running) == 1
    assert len(scheduler_output.scheduled_new_reqs) == 1
    engine_core_outputs = scheduler.update_from_output(scheduler_output, create_model_runner_output([request]))
    assert request.is_finished()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    (output,) = engine_core_outputs.outputs
    assert output.finish_reason == "length"
    assert output.kv_transfer_params is not None
    # Gone from the queues and the runner's batch ...
    assert request_id in scheduler.finished_req_ids
    assert len(scheduler.running) == 0 and len(scheduler.waiting) == 0
    # ... but its blocks are kept.
    assert all(block.ref_cnt == 1 for block in req_blocks(scheduler, request_id))

    # The runner is told; the blocks still stay.
    scheduler_output = scheduler.schedule()
    assert len(scheduler.running) == 0
    assert scheduler_output.finished_req_ids == {request_id}
    assert len(scheduler_output.scheduled_new_reqs) == 0
    assert scheduler_output.scheduled_cached_reqs.num_reqs == 0
    assert len(scheduler.finished_req_ids) == 0
    scheduler.update_from_output(scheduler_output, create_model_runner_output([]))
    assert all(block.ref_cnt == 1 for block in req_blocks(scheduler, request_id))

    # Sent: freed.
    scheduler_output = scheduler.schedule()
    assert len(scheduler_output.finished_req_ids) == 0
    assert len(scheduler_output.scheduled_new_reqs) == 0
    assert scheduler_output.scheduled_cached_reqs.num_reqs == 0
    scheduler.update_from_output(scheduler_output, create_model_runner_output([], finished_sending=[request_id]))
    assert_scheduler_empty(scheduler)


def test_short_prompt_lifecycle():
    """A prompt shorter than a block still sends its one partial block."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    request = create_request(1, block_size // 2, block_size, do_remote_decode=True)
    scheduler.add_request(request)
    scheduler_output = scheduler.schedule()
    assert len(scheduler.running) == 1 and len(scheduler_output.scheduled_new_reqs) == 1
    eco = scheduler.update_from_output(scheduler_output, create_model_runner_output([request]))
    assert len(eco.outputs[0].kv_transfer_params["remote_block_ids"]) == 1
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(
        scheduler_output, create_model_runner_output([request], finished_sending=[request.request_id])
    )
    assert_scheduler_empty(scheduler)


def test_prefix_cache_lifecycle():
    """With a prefix-cache hit, every block is sent, the hit's and the partial one too."""
    scheduler = create_lifecycle_scheduler()
    block_size = scheduler.block_size
    request_normal = create_request(1, int(block_size * 3.5), block_size)
    scheduler.add_request(request_normal)
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(scheduler_output, create_model_runner_output([request_normal], use_eos=True))
    scheduler.schedule()
    scheduler.update_from_output(scheduler_output, create_model_runner_output([]))

    num_external_full_blocks = 2
    request_remote = create_request(1, int(block_size * (num_external_full_blocks + 0.5)), block_size, do_remote_decode=True)
    scheduler.add_request(request_remote)
    scheduler_output = scheduler.schedule()
    assert request_remote.num_cached_tokens == num_external_full_blocks * block_size  # the hit
    eco = scheduler.update_from_output(scheduler_output, create_model_runner_output([request_remote]))
    assert len(eco.outputs[0].kv_transfer_params["remote_block_ids"]) == num_external_full_blocks + 1
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(
        scheduler_output, create_model_runner_output([], finished_sending=[request_remote.request_id])
    )
    assert_scheduler_empty(scheduler)


# ----------------------------------------------------------------------------- nano_v1's own
def test_unknown_matched_tokens_defer_only_that_request():
    """None from `get_num_new_matched_tokens`: the request is asked again next step; those behind it go on."""
    scheduler = create_lifecycle_scheduler()
    unknown, known = create_request(1, 8), create_request(2, 8)
    scheduler.connector.num_matched_tokens_by_req[unknown.request_id] = None
    scheduler.add_request(unknown)
    scheduler.add_request(known)
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == [known.request_id]
    assert unknown.status == RequestStatus.WAITING and list(scheduler.waiting) == [unknown]
    scheduler.update_from_output(output, create_model_runner_output([known]))
    scheduler.connector.num_matched_tokens_by_req[unknown.request_id] = 4
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {known.request_id: 1, unknown.request_id: 8 - 4}
    asked = [call[1] for call in scheduler.connector.calls if call[0] == "get_num_new_matched_tokens"]
    assert asked == [unknown.request_id, known.request_id, unknown.request_id]


def test_abort_while_waiting_for_remote_kvs():
    """An aborted remote prefill gives its blocks back at once; a late `finished_recving` is ignored."""
    scheduler = create_lifecycle_scheduler()
    request = create_request(1, 40, do_remote_prefill=True)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), create_model_runner_output([]))
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    block_ids = [block.block_id for block in req_blocks(scheduler, request.request_id)]
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert ("request_finished", request.request_id, block_ids) in scheduler.connector.calls
    scheduler.update_from_output(scheduler.schedule(), create_model_runner_output([], finished_recving=[request.request_id]))
    assert ("update_connector_output", set(), {request.request_id}) in scheduler.connector.calls
    assert_scheduler_empty(scheduler)


def test_connector_refuses_several_kv_cache_groups():
    with pytest.raises(ValueError, match="one KV cache group; this model has 3"):
        make_scheduler(
            64, 4, 64, 4, 64, True, kv_cache_config=hybrid_kv_cache_config(64, 4, sliding_window=8),
            kv_transfer_config=KV_BOTH,
        )  # fmt: skip


def test_factory_names_the_unknown_connector_and_the_registered_ones():
    config = KVTransferConfig(kv_connector="NoSuchConnector", kv_role="kv_both")
    registered = r"\['OffloadingConnector', 'ParamsSharedStorageConnector', 'RecordingConnector', 'SharedStorageConnector'\]"
    with pytest.raises(ValueError, match=r"'NoSuchConnector'.*" + registered):
        make_scheduler(16, 4, 64, 4, 64, True, kv_transfer_config=config)
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector("RecordingConnector", "helpers.kv_connector", "RecordingConnector")
    assert isinstance(create_scheduler(num_blocks=16).connector, RecordingConnector)


def test_kv_transfer_config_roles_and_errors():
    producer = KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_producer")
    consumer = KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_consumer")
    assert (producer.is_kv_producer, producer.is_kv_consumer) == (True, False)
    assert (consumer.is_kv_producer, consumer.is_kv_consumer) == (False, True)
    assert KV_BOTH.is_kv_producer and KV_BOTH.is_kv_consumer and KV_BOTH.is_kv_transfer_instance
    assert not KVTransferConfig().is_kv_transfer_instance
    assert producer.engine_id != consumer.engine_id  # a fresh id each
    assert KVTransferConfig(kv_connector_extra_config={"path": "/x"}).get_from_extra_config("path", None) == "/x"
    with pytest.raises(ValueError, match="Unsupported kv_role: 'kv_sender'"):
        KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_sender")
    with pytest.raises(ValueError, match="needs a kv_role"):
        KVTransferConfig(kv_connector="RecordingConnector")


def test_kv_transfer_config_engine_argument():
    """A dict from `LLM(...)`, JSON from `--kv-transfer-config`; bad JSON or keys are ValueErrors.

    (The first `create_engine_config` of a process imports transformers: ~2 s alone, free in the suite.)
    """
    value = {"kv_connector": "RecordingConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"a": 1}}
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    from_cli = EngineArgs.from_cli_args(parser.parse_args(["--kv-transfer-config", json.dumps(value)]))
    assert from_cli == EngineArgs(kv_transfer_config=json.dumps(value))
    for engine_args in (from_cli, EngineArgs.from_kwargs(kv_transfer_config=value)):
        config = engine_args.create_engine_config()
        assert config.kv_transfer_config.kv_connector == "RecordingConnector"
        assert config.kv_transfer_config.is_kv_consumer
        assert config.kv_transfer_config.kv_connector_extra_config == {"a": 1}
    assert EngineArgs.from_kwargs().create_engine_config().kv_transfer_config is None
    with pytest.raises(ValueError, match="kv_transfer_config is not valid JSON"):
        EngineArgs.from_kwargs(kv_transfer_config="{kv_role").create_engine_config()
    with pytest.raises(ValueError, match=r"unknown kv_transfer_config key\(s\) \['kv_port'\]"):
        EngineArgs.from_kwargs(kv_transfer_config={"kv_port": 1}).create_engine_config()
