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
"""

from __future__ import annotations

from collections.abc import Iterable

from nano_v1.config import VllmConfig
from nano_v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nano_v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from nano_v1.core.sched.request_queue import create_request_queue
from nano_v1.core.sched.utils import check_stop
from nano_v1.engine import EngineCoreOutput, EngineCoreOutputs
from nano_v1.kv_cache_interface import KVCacheConfig
from nano_v1.metrics.stats import SchedulerStats
from nano_v1.outputs import DraftTokenIds, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.spec_decode.metrics import SpecDecodingStats


class Scheduler:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        scheduler_config = vllm_config.scheduler_config
        cache_config = vllm_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
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

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last step: the model runner drops their cached state.
        self.finished_req_ids: set[str] = set()

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

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

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

        # Pass 1: RUNNING requests, in order. Each wants to close the gap between its
        # computed tokens and its known tokens (1 for a decode, more for a chunked prompt).
        # (Hot loop: one iteration per running request per step, so attributes are hoisted.)
        allocate_slots = self.kv_cache_manager.allocate_slots
        threshold = self.long_prefill_token_threshold
        max_position = self.max_model_len - 1
        num_lookahead_tokens = self.num_lookahead_tokens
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_computed = request.num_computed_tokens
            # BEGIN TASK ch04_t2: tokens to schedule: the gap, capped by threshold, budget, max_model_len - 1
            num_new_tokens = request.num_tokens_with_spec - num_computed
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            # Never compute a position past the context window (drafts could push it there).
            num_new_tokens = min(num_new_tokens, token_budget, max_position - num_computed)
            # END TASK
            if num_new_tokens <= 0:
                req_index += 1
                continue

            while True:
                new_blocks = allocate_slots(request, num_new_tokens, 0, None, num_lookahead_tokens)
                if new_blocks is not None:
                    break
                # Out of KV blocks: preempt the lowest-priority running request, which
                # may be this one. Its blocks go back to the pool; it will recompute.
                victim = self._pick_preemption_victim()
                if victim.request_id in num_scheduled_tokens:
                    # Already scheduled this step: give its tokens back to the budget.
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
            if request.spec_token_ids:
                # Drafts beyond what the budget allowed are dropped, not deferred.
                num_spec = num_new_tokens + num_computed - request.num_tokens
                del request.spec_token_ids[max(num_spec, 0) :]
                if request.spec_token_ids:
                    scheduled_spec_decode_tokens[request.request_id] = list(request.spec_token_ids)

        # Pass 2: WAITING requests, in queue order, only if nobody was preempted this
        # step (memory is tight: admitting new work would just thrash).
        if not preempted_reqs:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs:
                request = self.waiting.peek_request()
                # A new request (or one preempted earlier, which restarts from zero) first
                # looks for its prompt's leading full blocks in the prefix cache.
                new_computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
                num_new_tokens = request.num_tokens - num_computed_tokens
                if 0 < self.long_prefill_token_threshold < num_new_tokens:
                    num_new_tokens = self.long_prefill_token_threshold
                if not self.enable_chunked_prefill and num_new_tokens > token_budget:
                    break  # the whole prompt must fit into one step; wait for a roomier one
                num_new_tokens = min(num_new_tokens, token_budget)
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request,
                    num_new_tokens,
                    num_new_computed_tokens=num_computed_tokens,
                    new_computed_blocks=new_computed_blocks,
                    num_lookahead_tokens=self.num_lookahead_tokens,
                )
                if new_blocks is None:
                    break  # the cache is full; the head of the queue waits (FCFS)

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
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed_tokens

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs

        num_common_prefix_blocks = [0] * len(self.kv_cache_config.kv_cache_groups)
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0], len(self.running)
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
        )
        # Advance optimistically: the tokens are "computed" as of the end of this step, so
        # the next schedule() can already build on them (rejected drafts roll back later).
        for req_id, num_tokens in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self.finished_req_ids = set()
        return scheduler_output

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

    @staticmethod
    def _make_cached_request_data(
        running_reqs: list[Request], resumed_reqs: list[Request], req_to_new_blocks: dict[str, KVCacheBlocks]
    ) -> CachedRequestData:
        reqs = running_reqs + resumed_reqs
        req_ids = [req.request_id for req in reqs]
        return CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=[False] * len(running_reqs) + [True] * len(resumed_reqs),
            new_block_ids=[req_to_new_blocks[req_id].get_block_ids(allow_none=True) for req_id in req_ids],
            num_computed_tokens=[req.num_computed_tokens for req in reqs],
        )

    # ------------------------------------------------------------------ after the step
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, roll back rejected drafts, and finish stopped requests."""
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        req_id_to_index = model_runner_output.req_id_to_index
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        spec_decoding_stats: SpecDecodingStats | None = None
        requests = self.requests
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue  # finished (aborted) while the step ran: finished requests are forgotten
            req_index = req_id_to_index[req_id]
            new_token_ids = sampled[req_index]
            if spec_tokens and req_id in spec_tokens:
                # k drafts scheduled, len(new) - 1 accepted. schedule() counted all k as
                # computed; the rejected ones' KV slots will be overwritten by later tokens.
                num_draft_tokens = len(spec_tokens[req_id])
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= num_draft_tokens - num_accepted
                if spec_decoding_stats is None:
                    spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
                spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted)
            if not new_token_ids:
                continue  # a prefill chunk that has not reached the last prompt token

            is_stopped = False
            for num_kept, token_id in enumerate(new_token_ids, start=1):
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len):
                    is_stopped = True
                    new_token_ids = new_token_ids[:num_kept]
                    break
            new_logprobs = logprobs[req_index][: len(new_token_ids)] if logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    new_logprobs,
                    request.get_finished_reason() if is_stopped else None,
                    request.stop_reason,
                    request.num_cached_tokens,
                )
            )
            if is_stopped:
                stopped.append(request)
                self._free_request(request)

        if stopped:
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]
        scheduler_stats = None if spec_decoding_stats is None else SchedulerStats(spec_decoding_stats)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=scheduler_stats)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Store the proposer's drafts on their requests; the next schedule() schedules them.

        Drafts are clipped so that a step can never take a request past `max_tokens` or
        `max_model_len`: k drafts can yield k + 1 tokens.
        """
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished during the step
            num_allowed = self.max_model_len - request.num_tokens
            if request.max_tokens is not None:
                num_allowed = min(num_allowed, request.max_tokens - request.num_output_tokens)
            request.spec_token_ids = spec_token_ids[: max(num_allowed - 1, 0)]

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

