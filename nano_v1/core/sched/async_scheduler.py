"""The scheduler for asynchronous scheduling: step N + 1 is scheduled while step N runs.

Mirrors vllm/v1/core/sched/async_scheduler.py (chapter 14).

Why it exists: the synchronous engine core schedules a step, waits for the model, and
only then updates the requests and schedules the next step, so the device idles for
the whole host part of every step. With a batch queue of two (`EngineCore.step_with_batch_queue`)
the core schedules step N + 1 before step N's tokens are back. A request decoding in
step N will have one more token than it shows: `Request.num_output_placeholders`
counts those tokens, one per step in flight that samples for the request.

    schedule N      computed = num_tokens, +1 placeholder      (N samples token t)
    schedule N + 1  num_new = num_tokens + 1 - computed = 1    (the runner feeds t itself)
    update N        t appended, -1 placeholder

The scheduler never needs the token's value: the model runner keeps `t` itself, so step
N + 1's input is there when it runs. The only thing that must wait for the value is the
prefix cache: a block's hash covers its tokens, so blocks are cached up to the real tokens
only (`num_computed_tokens - num_output_placeholders`), once each step's tokens come back.

What a request sees does not change: a request that finishes while a step for it is in
flight (a stop token, `max_tokens`, an abort) is forgotten by then, and that step's
token is dropped by `update_from_output`; a request preempted with a step in flight gets
that step's (real) token when it arrives, and is cached again from scratch when resumed.

What runs where: the engine core schedules and updates in its process while the worker
runs the step in its own (the multiprocess executor, the default with async scheduling;
with the worker in the engine core's process each step has run by the time it is
queued, and nothing overlaps, as in v0.11.0). The model runner does not wait for a step's
sampled tokens either: it keeps a placeholder for each in its own batch, returns an
`AsyncGPUModelRunnerOutput` whose tokens are copied to the host behind the step (on a
side stream on CUDA), and feeds them to step N + 1 from the device
(`prev_sampled_token_ids` in `GPUModelRunner._prepare_input_ids`). The worker's output
thread (`WorkerProc.async_output_busy_loop`) waits for the copy and sends the output, so
the worker prepares step N + 1 while step N runs on the device and its output travels.
On the CPU the same code runs; the device is the host there, so nothing waits and
nothing overlaps inside the worker.

What differs from v0.11.0: nothing in this class. The placeholders enter the scheduler's
token count in `Scheduler._get_num_new_tokens` (v0.11.0 adds them in the running pass
only; a waiting request never has any, which the tests check). The model runner's
placeholders are v0.11.0's; that the runner writes the real tokens over them during the
next step is nano_v1's (see `GPUModelRunner._fill_sampled_token_placeholders`).
"""

from __future__ import annotations

from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance as the synchronous scheduler does, then count the tokens this step will sample.

        Rules (any number of steps may be in flight; the engine keeps two, the tests drive three):
        - First the base class's update: each scheduled request's `num_computed_tokens`
          grows by its scheduled tokens, as if the step had run.
        - A scheduled request gets one placeholder when this step's tokens reach the end of
          all its tokens, those it has and those still on their way
          (`num_tokens + num_output_placeholders`): the step samples a token for it.
        - A prefill chunk that stops short of the prompt's end samples nothing: no placeholder.
        - Exactly one per sampling step (no speculative decoding here), so a request with k
          sampling steps in flight has k placeholders; requests not in this step are untouched.
        """
        # BEGIN TASK ch14_t1: advance as the base class does; then one placeholder per scheduled request whose step samples
        super()._update_after_schedule(scheduler_output)
        requests = self.requests
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests[req_id]
            # The step reaches the end of everything known: it samples the next token.
            # (Speculative decoding is refused with async scheduling: one token per step.)
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        # END TASK

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append and stop-check as the synchronous scheduler does; then take back the
        placeholders of the tokens that arrived and cache the blocks whose steps are done.

        Rules:
        - The base class appends the tokens and checks the stop conditions; return what it
          returns (the tokens kept, whether the request stopped).
        - Each token kept was on its way: one placeholder fewer per token.
        - Then cache the request's blocks (`self.kv_cache_manager.cache_blocks(request, n)`)
          up to the tokens whose steps are done, n =
          `num_computed_tokens - num_output_placeholders` (`num_computed_tokens` counts the
          steps still in flight). Never further: a token on its way has no value, so no
          block hash; and the token that just arrived has no KV until a step computes it (a
          request that stops on it with no step in flight never does).
        - Only for a request that was running when the output arrived (its status before the
          update): a request preempted with a step in flight holds no blocks, although it
          keeps that step's token; one that stops on this token was running, and is cached.
        """
        # BEGIN TASK ch14_t2: base update; one placeholder back per token kept; cache up to the tokens whose steps are done, if it was running
        status_before_update = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        # A request that stopped keeps the placeholder of a step still in flight: it is
        # forgotten, and that step's token is dropped.
        request.num_output_placeholders -= len(new_token_ids)
        assert request.num_output_placeholders >= 0
        # A preempted request holds no blocks: it is cached again when it is resumed.
        if status_before_update == RequestStatus.RUNNING:
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return new_token_ids, stopped
        # END TASK
