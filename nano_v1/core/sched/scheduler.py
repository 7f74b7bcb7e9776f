"""The unified scheduler: one token budget per step, shared by every kind of work.

Mirrors vllm/v1/core/sched/scheduler.py (chapter 04).

Why it is "unified": there is no prefill phase and no decode phase. Each request has
`num_computed_tokens` (tokens whose KV is in the cache) chasing `num_tokens_with_spec`
(prompt + output + draft tokens). Every step the scheduler hands out up to
`max_num_batched_tokens` tokens as `{request_id: num_tokens}`:

    a new prompt of 700 tokens, budget left 512  ->  512   (a prefill chunk)
    the rest of that prompt next step            ->  188
    a request that is decoding                    ->    1
    a decode with 3 draft tokens to verify        ->    4   (chapter 10)
    a prompt whose first 512 tokens hit the cache ->  the rest only (chapter 03)

One `schedule()` does two passes under that budget: requests already running first
(they hold KV blocks, so finishing them frees memory), then waiting requests in queue
order. When the KV cache cannot give a running request its blocks, the scheduler
preempts the lowest-priority running request (the last one, under FCFS): it frees the
victim's blocks and sends it back to the head of the waiting queue to be recomputed.

Images (chapter 11) are scheduled as the placeholder positions they fill, under the same
token budget, and `_try_schedule_encoder_inputs` adds one rule: a chunk may cover an
image's positions only if the image's encoder output is cached or the image is encoded
in this very step, whole, within the step's encoder compute budget and the encoder
cache's space. Otherwise the chunk stops just before the image.

Structured outputs (chapter 15) add a state and a column: a request whose grammar is
still compiling waits in `WAITING_FOR_FSM` and is passed over (the requests behind it
go on), and each step's output carries the grammar bitmask of its structured requests
(`get_grammar_bitmask`); `update_from_output` advances their matchers by the tokens
kept, and `update_draft_token_ids` cuts drafts at the first token the grammar forbids.

KV connectors (chapter 16) let a prompt's KV come from outside this engine's cache (a
prefill engine, a CPU or disk store) and keep a finished request's blocks while its KV is
sent or saved. At admission the connector says how many tokens past the local prefix-cache
hit it can load: they count as computed, like hits, and only the rest is scheduled. If it
loads them asynchronously, the request gets its blocks (not committed to the prefix cache:
they hold no KV yet) and waits in `WAITING_FOR_REMOTE_KVS` until the workers report the
load finished (`KVConnectorOutput.finished_recving`); then it is admitted with those
tokens computed. A finished request whose KV the connector is still sending keeps its
blocks until `finished_sending` names it. Without a connector (`self.connector is None`)
none of this runs.

What differs from v0.11.0: the encoder budget and cache size come settled in the
`SchedulerConfig` (`SchedulerConfig.resolve_encoder_budget`); v0.11.0's scheduler takes
an `mm_registry` and computes them itself (`compute_encoder_budget`). With a KV
connector: a `finished_recving` for a request aborted while its KV loaded is dropped
(v0.11.0 keeps its id in `finished_recving_kv_req_ids` for good), and a request whose KV
arrived asynchronously is counted in the prefix-cache statistics once, when admitted, with
no local hit (v0.11.0 counts each lookup); there are no KV cache events to collect.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from nano_v1.config import VllmConfig
from nano_v1.core.encoder_cache_manager import EncoderCacheManager
from nano_v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nano_v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from nano_v1.core.sched.request_queue import create_request_queue
from nano_v1.core.sched.utils import check_stop
from nano_v1.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from nano_v1.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from nano_v1.engine import EngineCoreOutput, EngineCoreOutputs
from nano_v1.kv_cache_interface import KVCacheConfig
from nano_v1.metrics.stats import SchedulerStats
from nano_v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.spec_decode.metrics import SpecDecodingStats
from nano_v1.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        scheduler_config = vllm_config.scheduler_config
        cache_config = vllm_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # Admit a waiting request only if the cache can hold its whole prompt (vLLM 0.33's
        # gate, absent from v0.11.0: off by default; chapter 04 measures it).
        self.scheduler_reserve_full_isl = scheduler_config.scheduler_reserve_full_isl
        self.policy = scheduler_config.policy
        self.block_size = cache_config.block_size
        # Speculative decoding (chapter 10): at most num_spec_tokens drafts per request per
        # step. N-gram drafts are known when the step is scheduled and are scheduled like
        # any token, so they need no lookahead slots; vLLM reserves those only for
        # proposers that write KV for drafts of their own during the step (EAGLE).
        speculative_config = vllm_config.speculative_config
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self.num_lookahead_tokens = 0

        self.kv_cache_manager = KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
        )

        # The encoder (chapter 11): image tokens it may compute per step, and the cache of
        # its outputs the model runner keeps; both 0 for a text-only model.
        self.max_num_encoder_input_tokens = scheduler_config.max_num_encoder_input_tokens
        self.encoder_cache_manager = EncoderCacheManager(cache_size=scheduler_config.encoder_cache_size)
        self.disable_chunked_mm_input = scheduler_config.disable_chunked_mm_input

        # Grammars and their matchers (chapter 15); the engine core shares its manager.
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(vllm_config)

        # The KV connector's scheduler half (chapter 16); each worker builds its own worker half.
        self.connector: KVConnectorBase_V1 | None = None
        if vllm_config.kv_transfer_config is not None:
            if len(kv_cache_config.kv_cache_groups) != 1:
                raise ValueError(
                    f"KV connectors support one KV cache group; this model has "
                    f"{len(kv_cache_config.kv_cache_groups)} (a hybrid model, chapter 12)."
                )
            self.connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last step: the model runner drops their cached state.
        self.finished_req_ids: set[str] = set()
        # Requests finished before they ran (their grammar failed to compile): reported next update.
        self.finished_before_running: list[EngineCoreOutput] = []
        # Requests in WAITING_FOR_REMOTE_KVS whose KV the workers reported loaded (chapter 16).
        self.finished_recving_kv_req_ids: set[str] = set()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside the step loop (abort, a stop string, a disconnect).

        Unknown or already finished ids are ignored: an abort can race a natural finish.
        """
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running, waiting = [], []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            (running if request.status == RequestStatus.RUNNING else waiting).append(request)
            request.status = finished_status
            self._free_request(request)
        if running:
            gone = {id(r) for r in running}
            self.running = [r for r in self.running if id(r) not in gone]
        if waiting:
            self.waiting.remove_requests(waiting)

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Forget a finished request; return the KV transfer params for its last output.

        Its blocks stay allocated, and the request known, while the KV connector sends or
        saves its KV (chapter 16): `_update_from_kv_xfer_finished` frees them.
        """
        assert request.is_finished()
        delay_free_blocks, kv_xfer_params = False, None
        if self.connector is not None:
            delay_free_blocks, kv_xfer_params = self._connector_finished(request)
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        if not delay_free_blocks:
            self._free_blocks(request)
        return kv_xfer_params

    def _free_blocks(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones whose ids the runner has not been sent yet
        (`finished_req_ids`, carried by the next step): what the batch-queue loop schedules for."""
        return self.has_unfinished_requests() or bool(self.finished_req_ids)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        token_budget = self.max_num_scheduled_tokens
        # {request_id: its inputs encoded this step} and what the step may still encode (chapter 11).
        scheduled_encoder_inputs: dict[str, list[int]] = {}
        encoder_compute_budget = self.max_num_encoder_input_tokens

        # Pass 1: RUNNING requests, in order. Each wants to close the gap between its
        # computed tokens and its known tokens (1 for a decode, more for a chunked prompt).
        # (One iteration per running request per step: the methods it calls are looked up once.)
        running = self.running
        get_num_new_tokens = self._get_num_new_tokens
        allocate_slots = self.kv_cache_manager.allocate_slots
        num_lookahead_tokens = self.num_lookahead_tokens
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_computed = request.num_computed_tokens
            num_new_tokens = get_num_new_tokens(request, num_computed)
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            encoder_inputs_to_schedule: list[int] | None = None
            if request.has_encoder_inputs and num_new_tokens > 0:
                encoder_inputs_to_schedule, num_new_tokens, new_encoder_compute_budget = (
                    self._try_schedule_encoder_inputs(request, num_computed, num_new_tokens, encoder_compute_budget)
                )
            if num_new_tokens <= 0:
                req_index += 1
                continue

            while True:
                new_blocks = allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
                if new_blocks is not None:
                    break
                # Out of KV blocks: preempt the lowest-priority running request, which
                # may be this one. Its blocks go back to the pool; it will recompute.
                victim = self._pick_preemption_victim()
                if victim.request_id in num_scheduled_tokens:
                    # Already scheduled this step: give its tokens back to the budget. Images
                    # it was given stay scheduled: the encoder cache now counts them, so
                    # the runner must compute them (its references go at the end of the step).
                    scheduled_running_reqs.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    req_to_new_blocks.pop(victim.request_id)
                    scheduled_spec_decode_tokens.pop(victim.request_id, None)
                    req_index -= 1
                self._preempt(victim)
                preempted_reqs.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break

            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            if encoder_inputs_to_schedule:
                self._allocate_encoder_inputs(request, encoder_inputs_to_schedule, scheduled_encoder_inputs)
                encoder_compute_budget = new_encoder_compute_budget
            if request.spec_token_ids:
                # Drafts beyond what the budget allowed are dropped, not deferred.
                num_spec = num_new_tokens + num_computed - request.num_tokens
                del request.spec_token_ids[max(num_spec, 0) :]
                if request.spec_token_ids:
                    scheduled_spec_decode_tokens[request.request_id] = list(request.spec_token_ids)

        # Pass 2: WAITING requests, in queue order, only if nobody was preempted this
        # step (memory is tight: admitting new work would just thrash).
        skipped_waiting_reqs = create_request_queue(self.policy)
        connector = self.connector
        if not preempted_reqs:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs:
                request = self.waiting.peek_request()
                # A request whose KV the connector is loading is passed over until the
                # workers report it loaded (chapter 16).
                if connector is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if not self._update_waiting_for_remote_kv(request):
                        skipped_waiting_reqs.prepend_request(self.waiting.pop_request())
                        continue
                    request.status = RequestStatus.WAITING
                # A structured request whose grammar is still compiling is passed over (chapter 15).
                if request.status == RequestStatus.WAITING_FOR_FSM:
                    structured_output_req = request.structured_output_request
                    if not structured_output_req.is_grammar_ready:
                        skipped_waiting_reqs.prepend_request(self.waiting.pop_request())
                        continue
                    if structured_output_req.error is not None:
                        self._finish_before_running(self.waiting.pop_request(), structured_output_req.error)
                        continue
                    request.status = RequestStatus.WAITING
                # A new request (or one preempted earlier, which restarts from zero) first
                # looks for its prompt's leading full blocks in the prefix cache; with a
                # connector, the tokens it can load past them count as computed too.
                num_external_computed_tokens = 0
                load_kv_async = False
                if connector is None:
                    new_computed_blocks, num_new_local_computed_tokens = self.kv_cache_manager.get_computed_blocks(
                        request
                    )
                    num_computed_tokens = num_new_local_computed_tokens
                elif request.num_computed_tokens == 0:
                    new_computed_blocks, num_new_local_computed_tokens = self.kv_cache_manager.get_computed_blocks(
                        request
                    )
                    num_external_computed_tokens, load_kv_async = connector.get_num_new_matched_tokens(
                        request, num_new_local_computed_tokens
                    )
                    if num_external_computed_tokens is None:
                        # The connector does not know yet: ask again next step.
                        skipped_waiting_reqs.prepend_request(self.waiting.pop_request())
                        continue
                    num_computed_tokens = num_new_local_computed_tokens + num_external_computed_tokens
                else:
                    # Its KV has arrived: it holds its blocks, committed to the cache.
                    new_computed_blocks = self.kv_cache_manager.empty_kv_cache_blocks
                    num_new_local_computed_tokens = 0
                    num_computed_tokens = request.num_computed_tokens

                encoder_inputs_to_schedule = []
                if load_kv_async:
                    # Nothing to compute before its KV arrives: it only gets the blocks to load into.
                    assert num_external_computed_tokens > 0
                    num_new_tokens = 0
                else:
                    num_new_tokens = self._get_num_new_tokens(request, num_computed_tokens)
                    if not self.enable_chunked_prefill and num_new_tokens > token_budget:
                        # The whole prompt must fit into one step: it waits for a roomier one,
                        # and the requests behind it that fit go first (vLLM v0.11.0).
                        skipped_waiting_reqs.prepend_request(self.waiting.pop_request())
                        continue
                    num_new_tokens = min(num_new_tokens, token_budget)
                    if request.has_encoder_inputs:
                        encoder_inputs_to_schedule, num_new_tokens, new_encoder_compute_budget = (
                            self._try_schedule_encoder_inputs(
                                request, num_computed_tokens, num_new_tokens, encoder_compute_budget
                            )
                        )
                        if num_new_tokens == 0:
                            break  # the head of the queue waits for the encoder (FCFS)
                # Slots for the external tokens too: the connector loads their KV into them.
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request,
                    num_new_tokens + num_external_computed_tokens,
                    num_new_computed_tokens=num_new_local_computed_tokens,
                    new_computed_blocks=new_computed_blocks,
                    num_lookahead_tokens=self.num_lookahead_tokens,
                    full_sequence_must_fit=self.scheduler_reserve_full_isl,
                    delay_cache_blocks=load_kv_async,
                )
                if new_blocks is None:
                    # The cache is full; the head of the queue waits (FCFS), and lets go of
                    # the encoder outputs it found cached: held by a waiting request, they
                    # could keep a request queued before it from ever fitting its image.
                    self.encoder_cache_manager.free(request)
                    break

                if connector is not None:
                    connector.update_state_after_alloc(
                        request, new_computed_blocks + new_blocks, num_external_computed_tokens
                    )
                    if load_kv_async:
                        # It waits, blocks allocated, until its KV has arrived; it is counted
                        # in the prefix-cache statistics when it is admitted then.
                        skipped_waiting_reqs.prepend_request(self.waiting.pop_request())
                        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                        continue

                self.kv_cache_manager.record_prefix_cache_stats(request, num_new_local_computed_tokens)
                self.waiting.pop_request()
                self.running.append(request)
                if request.status == RequestStatus.PREEMPTED:
                    scheduled_resumed_reqs.append(request)
                else:
                    scheduled_new_reqs.append(request)
                req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(request.request_id)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed_tokens
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = num_computed_tokens
                if encoder_inputs_to_schedule:
                    self._allocate_encoder_inputs(request, encoder_inputs_to_schedule, scheduled_encoder_inputs)
                    encoder_compute_budget = new_encoder_compute_budget

        # Preempted requests let go of their encoder outputs only now, so that nothing
        # scheduled this step can be evicted in the same step.
        for request in preempted_reqs:
            self.encoder_cache_manager.free(request)

        if skipped_waiting_reqs:
            self.waiting.prepend_requests(skipped_waiting_reqs)

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs

        num_common_prefix_blocks = [0] * len(self.kv_cache_config.kv_cache_groups)
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0], len(self.running)
            )

        structured_output_request_ids, grammar_bitmask = self.get_grammar_bitmask(
            scheduled_new_reqs + scheduled_running_reqs + scheduled_resumed_reqs, scheduled_spec_decode_tokens
        )
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids())
                for req in scheduled_new_reqs
            ],
            scheduled_cached_reqs=self._make_cached_request_data(
                scheduled_running_reqs, scheduled_resumed_reqs, req_to_new_blocks
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            scheduled_encoder_inputs=scheduled_encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            structured_output_request_ids=structured_output_request_ids,
            grammar_bitmask=grammar_bitmask,
        )
        if connector is not None:
            # What the workers load and save this step; resets the connector's step state.
            scheduler_output.kv_connector_metadata = connector.build_connector_meta(scheduler_output)
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def get_grammar_bitmask(
        self, requests: list[Request], scheduled_spec_decode_tokens: dict[str, list[int]]
    ) -> tuple[dict[str, int], np.ndarray | None]:
        """The structured requests among this step's (request id -> index in `requests`, the
        order of the bitmask's rows) and their bitmask, None when there are none. A prefill
        chunk that samples nothing gets its row too, as in v0.11.0: the runner discards it."""
        structured_output_request_ids = {
            request.request_id: i for i, request in enumerate(requests) if request.use_structured_output
        }
        if not structured_output_request_ids:
            return structured_output_request_ids, None
        bitmask = self.structured_output_manager.grammar_bitmask(
            self.requests, structured_output_request_ids, scheduled_spec_decode_tokens
        )
        return structured_output_request_ids, bitmask

    def _finish_before_running(self, request: Request, error: str) -> None:
        """Abort a waiting request whose grammar could not be built; its client is told at the
        next update. The engine and every other request go on."""
        logger.warning("request %s aborted: its grammar failed to compile: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self.finished_before_running.append(
            EngineCoreOutput(request.request_id, [], None, request.get_finished_reason(), error, 0, None)
        )

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance optimistically: the scheduled tokens are "computed" as of the end of the
        step, so the next schedule() can already build on them (rejected drafts roll back
        in `update_from_output`). The output keeps the counts from before: the runner
        derives the step's positions from them."""
        requests = self.requests
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += num_tokens
            if request.has_encoder_inputs:
                self._free_encoder_inputs(request)
        # A new set: the output just built holds the old one.
        self.finished_req_ids = set()

    def _get_num_new_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens `request` computes this step from `num_computed_tokens` on, before the budget.

        What it lacks: its tokens, drafts included, and the output placeholders of async
        scheduling (chapter 14), past `num_computed_tokens`. No prompt may hog a step:
        `long_prefill_token_threshold` (0: none) caps every chunk, a running request's
        too. Nor outgrow the context: the token sampled after them must stay below
        `max_model_len`.

        Each pass cuts the answer to the budget left itself: without chunked prefill the
        waiting pass first checks the uncut count against the budget (vLLM v0.11.0's
        order: threshold, whole-prompt check, budget). A waiting request has no drafts
        (`_preempt` clears them) and at most max_model_len - 1 tokens (the Processor
        rejects longer prompts, `check_stop` finishes a request at max_model_len), so the
        context cap never binds for it; v0.11.0 applies that cap in the running pass only.
        """
        # BEGIN TASK ch04_t2: what it lacks (drafts too); no prompt may hog a step, nor outgrow the context
        num_new_tokens = request.num_tokens_with_spec - num_computed_tokens
        # Async scheduling (chapter 14): tokens still being sampled are known to be coming.
        num_new_tokens += request.num_output_placeholders
        # One long prompt must not take every step's whole budget (0: no threshold).
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        # Leave room for the token sampled after them: its position must stay below
        # max_model_len (drafts could push a request past it). A comparison, not min():
        # this runs for every running request every step, and CPython's min() costs more.
        max_num_new_tokens = self.max_model_len - 1 - num_computed_tokens
        if num_new_tokens > max_num_new_tokens:
            num_new_tokens = max_num_new_tokens
        # END TASK
        return num_new_tokens

    def _try_schedule_encoder_inputs(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, encoder_compute_budget: int
    ) -> tuple[list[int], int, int]:
        """Which of the request's images this step must encode, and how far its chunk may go.

        The chunk is positions `[num_computed_tokens, num_computed_tokens + num_new_tokens)`.
        An image whose positions overlap it is needed, unless it is computed already (its
        positions are behind the chunk), cached (`check_and_update_cache`, which makes the
        request refer to it) or already chosen in this call. A needed image is encoded
        whole, so it must fit the remaining compute budget and the cache
        (`EncoderCacheManager.can_allocate`); if it does not, the chunk is cut to end just
        before the image, and to nothing if it starts inside it (a prefix-cache hit can
        land there). With `disable_chunked_mm_input`, the chunk is also cut before any
        image it would cover only in part, cached or not (vLLM v0.11.0 lets a cached one
        be split).

        Returns (input ids to encode, num_new_tokens, the budget left after them).
        """
        encoder_inputs_to_schedule: list[int] = []
        # BEGIN TASK ch11_t1: per image: skip done or cached ones, cut the chunk before one not encodable now
        mm_hashes_to_schedule: set[str] = set()
        num_tokens_to_schedule = 0
        for i, mm_feature in enumerate(request.mm_features):
            start_pos = mm_feature.mm_position.offset
            num_encoder_tokens = mm_feature.mm_position.length
            if start_pos >= num_computed_tokens + num_new_tokens:
                break  # this image, and every later one, lies beyond the chunk
            if start_pos + num_encoder_tokens <= num_computed_tokens:
                continue  # its positions are in the KV cache already
            if (
                self.disable_chunked_mm_input
                and num_computed_tokens < start_pos
                and num_computed_tokens + num_new_tokens < start_pos + num_encoder_tokens
            ):
                num_new_tokens = start_pos - num_computed_tokens  # stop before an image taken in part
                break
            if mm_feature.identifier in mm_hashes_to_schedule:
                continue  # the same image earlier in this prompt: encoded once
            if self.encoder_cache_manager.check_and_update_cache(request, i):
                continue  # encoded in an earlier step (maybe for another request)
            if not self.encoder_cache_manager.can_allocate(
                request, i, encoder_compute_budget, num_tokens_to_schedule
            ):
                # Only the text before the image, and nothing if the chunk starts inside it.
                num_new_tokens = max(start_pos - num_computed_tokens, 0)
                break
            num_tokens_to_schedule += num_encoder_tokens
            encoder_compute_budget -= num_encoder_tokens
            mm_hashes_to_schedule.add(mm_feature.identifier)
            encoder_inputs_to_schedule.append(i)
        # END TASK
        return encoder_inputs_to_schedule, num_new_tokens, encoder_compute_budget

    def _allocate_encoder_inputs(
        self, request: Request, input_ids: list[int], scheduled_encoder_inputs: dict[str, list[int]]
    ) -> None:
        """Record the request's images encoded this step and reserve their cache space."""
        scheduled_encoder_inputs[request.request_id] = input_ids
        for input_id in input_ids:
            self.encoder_cache_manager.allocate(request, input_id)

    def _free_encoder_inputs(self, request: Request) -> None:
        """Drop the request's references to images whose positions are all computed now:
        their KV is in the cache, and the decoder never reads their encoder output again."""
        num_computed_tokens = request.num_computed_tokens
        for input_id in self.encoder_cache_manager.get_cached_input_ids(request):
            position = request.mm_features[input_id].mm_position
            if position.offset + position.length <= num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, input_id)

    def _pick_preemption_victim(self) -> Request:
        if self.policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _make_cached_request_data(
        self, running_reqs: list[Request], resumed_reqs: list[Request], req_to_new_blocks: dict[str, KVCacheBlocks]
    ) -> CachedRequestData:
        reqs = running_reqs + resumed_reqs
        req_ids = [req.request_id for req in reqs]
        # Most running requests get no new block in a step: `allocate_slots` then returns the
        # manager's shared empty KVCacheBlocks, whose block ids are None (the runner keeps
        # its block table as it is), known without asking.
        empty = self.kv_cache_manager.empty_kv_cache_blocks
        new_block_ids = []
        for req_id in req_ids:
            new_blocks = req_to_new_blocks[req_id]
            new_block_ids.append(None if new_blocks is empty else new_blocks.get_block_ids(allow_none=True))
        return CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=[False] * len(running_reqs) + [True] * len(resumed_reqs),
            new_block_ids=new_block_ids,
            num_computed_tokens=[req.num_computed_tokens for req in reqs],
        )

    # ------------------------------------------------------------------ after the step
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, roll back rejected drafts, and finish stopped requests."""
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        stopped_preempted: list[Request] = []
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        req_id_to_index = model_runner_output.req_id_to_index
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        spec_decoding_stats: SpecDecodingStats | None = None
        prompt_logprobs_dict = model_runner_output.prompt_logprobs_dict
        requests = self.requests
        update_request_with_output = self._update_request_with_output
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue  # finished (aborted) while the step ran: finished requests are forgotten
            req_index = req_id_to_index[req_id]
            new_token_ids = sampled[req_index]
            if spec_tokens and req_id in spec_tokens:
                # k drafts scheduled, len(new) - 1 accepted. schedule() counted all k as
                # computed; the rejected ones' KV slots will be overwritten by later tokens.
                # An empty output (the runner discarded the step's sample) gives -1: the
                # drafts and the token before them are computed again, as in v0.11.0.
                num_draft_tokens = len(spec_tokens[req_id])
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= num_draft_tokens - num_accepted
                if new_token_ids:  # v0.11.0 also records the -1 as "accepted"; we count no draft
                    if spec_decoding_stats is None:
                        spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
                    spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted)
            if not new_token_ids:
                continue  # a prefill chunk that has not reached the last prompt token

            status_before_stop = request.status
            new_token_ids, is_stopped = update_request_with_output(request, new_token_ids)
            if request.use_structured_output and self.structured_output_manager.should_advance(request):
                request.structured_output_request.grammar.accept_tokens(req_id, new_token_ids)
            kv_transfer_params = None
            if is_stopped:
                # Only under async scheduling can a preempted request still get a token: from
                # the step in flight when it was preempted.
                if status_before_stop == RequestStatus.RUNNING:
                    stopped.append(request)
                else:
                    stopped_preempted.append(request)
                kv_transfer_params = self._free_request(request)
            new_logprobs = logprobs[req_index][: len(new_token_ids)] if logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    new_logprobs,
                    request.get_finished_reason() if is_stopped else None,
                    request.stop_reason,
                    request.num_cached_tokens,
                    prompt_logprobs_dict.get(req_id) if prompt_logprobs_dict else None,
                    kv_transfer_params,
                )
            )

        if stopped:
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)
        if self.finished_before_running:
            outputs.extend(self.finished_before_running)
            self.finished_before_running = []
        if model_runner_output.kv_connector_output is not None:
            self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(spec_decoding_stats))

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append the sampled tokens one by one, stopping at the first that finishes the
        request; return the tokens kept and whether it finished."""
        for num_kept, token_id in enumerate(new_token_ids, start=1):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                return new_token_ids[:num_kept], True
        return new_token_ids, False

    def make_stats(self, spec_decoding_stats: SpecDecodingStats | None = None) -> SchedulerStats:
        """This step's statistics, sent every step as in vLLM: the queues and KV cache usage
        as the step leaves them, the prefix-cache lookups of the requests it admitted, and
        its drafts."""
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            spec_decoding_stats=spec_decoding_stats,
        )

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Store the proposer's drafts on their requests; the next schedule() schedules them.

        Drafts are clipped so that a step can never take a request past `max_tokens` or
        `max_model_len`: k drafts can yield k + 1 tokens; a structured request's are cut
        before the first token its grammar forbids (chapter 15).
        """
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished during the step
            num_allowed = self.max_model_len - request.num_tokens
            if request.max_tokens is not None:
                num_allowed = min(num_allowed, request.max_tokens - request.num_output_tokens)
            spec_token_ids = spec_token_ids[: max(num_allowed - 1, 0)]
            if spec_token_ids and self.structured_output_manager.should_advance(request):
                spec_token_ids = request.structured_output_request.grammar.validate_tokens(spec_token_ids)
            request.spec_token_ids = spec_token_ids

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ KV connector (chapter 16)
    def shutdown(self) -> None:
        """Shut the connector's scheduler half down with the engine."""
        if self.connector is not None:
            self.connector.shutdown()

    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Tell the connector a request finished: (keep its blocks until its KV is sent,
        the KV transfer params for its last output)."""
        assert self.connector is not None
        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)  # one KV cache group
        return self.connector.request_finished(request, block_ids)

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """Whether the KV of a request in WAITING_FOR_REMOTE_KVS has arrived; if so, commit
        its blocks to the prefix cache and count their tokens computed.

        It has arrived once the workers' `finished_recving` named it
        (`self.finished_recving_kv_req_ids`); take it out of that set then, or a later
        request with its id would be admitted before its own KV arrived. Every block it
        holds was loaded, so its tokens computed are the tokens those blocks hold
        («never more than the request has»), but «at most num_tokens - 1»: the last prompt
        token must run through the model to sample the first output token. Those computed
        tokens' full blocks are committed to the prefix cache now
        (`self.kv_cache_manager.cache_blocks`): admission left them out, as they were empty.
        """
        # BEGIN TASK ch16_t1: arrived? then the loaded blocks' tokens (capped, never the last one) are computed and cached
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
        num_computed_tokens = min(len(block_ids) * self.block_size, request.num_tokens)
        if num_computed_tokens == request.num_tokens:
            num_computed_tokens -= 1
        self.kv_cache_manager.cache_blocks(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens
        self.finished_recving_kv_req_ids.remove(request.request_id)
        return True
        # END TASK

    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput) -> None:
        """Take in the transfers the workers finished: a loaded request may be scheduled from
        the next step on; a sent one's blocks are freed now."""
        assert self.connector is not None, "KV connector output without a KV connector"
        self.connector.update_connector_output(kv_connector_output)
        for req_id in kv_connector_output.finished_recving or ():
            # A request aborted while its KV was loading is gone: nothing waits for it.
            if req_id in self.requests:
                self.finished_recving_kv_req_ids.add(req_id)
        for req_id in kv_connector_output.finished_sending or ():
            request = self.requests.get(req_id)
            if request is None:
                logger.warning("finished sending the KV of request %s, which is already freed", req_id)
            else:
                self._free_blocks(request)

