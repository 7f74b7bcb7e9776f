"""The graded tasks of chapter 14: placeholders in, placeholders out, and the batch queue.

Each task's own tests (marked `ch14_t1`, `ch14_t2`, `ch14_t3`) drive one piece directly,
step by step, and say in their docstrings which rule of the task's docstring they hold
(tests/test_task_rules.py checks it for every task):

- ch14_t1, `AsyncScheduler._update_after_schedule`: `schedule()` called again and again with
  no output back yet, as the batch queue does; only placeholders and computed counts are
  read, so these tests need no model output (nor ch14_t2).
- ch14_t2, `AsyncScheduler._update_request_with_output`: steps updated in the order they
  were scheduled, every step sampling one token; a spy on `KVCacheManager.cache_blocks`
  checks what each update caches.
- ch14_t3, `EngineCore.step_with_batch_queue`: an engine core whose scheduler and executor
  are stand-ins that record what is asked of them, with futures the test finishes.

The engine-level tests of chapter 14 (same outputs with and without async scheduling, the
executors, the server) are in test_async_scheduling.py.
"""

from __future__ import annotations

import types
from collections import deque

import pytest
from helpers.scheduler import make_scheduler

from nano_v1 import SamplingParams
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.async_scheduler import AsyncScheduler
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.engine.core import EngineCore
from nano_v1.outputs import ModelRunnerOutput
from nano_v1.request import Request, RequestStatus

pytestmark = pytest.mark.ch14


def async_scheduler(num_blocks: int = 100, block_size: int = 4, budget: int = 1000) -> AsyncScheduler:
    sched = make_scheduler(num_blocks, block_size, budget, 16, 512, True, async_scheduling=True)
    assert isinstance(sched, AsyncScheduler)
    return sched


def request(req_id: str, prompt: list[int], max_tokens: int = 50, block_size: int = 4) -> Request:
    return Request(
        req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=None,
        block_hasher=get_request_block_hasher(block_size),
    )  # fmt: skip


def placeholders(sched: AsyncScheduler) -> dict[str, int]:
    return {req_id: r.num_output_placeholders for req_id, r in sched.requests.items()}


# ----------------------------------------------------------------------------- ch14_t1: placeholders in


@pytest.mark.ch14_t1
def test_a_prefill_chunk_short_of_the_prompt_samples_nothing():
    """Rules: «First the base class's update» (computed counts grow by the step's tokens); «A prefill chunk
    that stops short of the prompt's end samples nothing: no placeholder»; the step that reaches the
    end gets one, and a step scheduled while it is in flight another."""
    sched = async_scheduler(budget=8)
    sched.add_request(request("0", list(range(20))))
    expected = [(8, 0), (16, 0), (20, 1), (21, 2)]  # (num_computed_tokens, placeholders) after each step
    for step, (computed, num_placeholders) in enumerate(expected, start=1):
        sched.schedule()  # no output comes back: every step is still in flight
        (req,) = sched.requests.values()
        assert req.num_computed_tokens == computed, (
            f"after step {step} of a 20-token prompt under a budget of 8, num_computed_tokens must be {computed} "
            f"(the base class's _update_after_schedule counts the step's tokens as computed); it is "
            f"{req.num_computed_tokens}"
        )
        assert req.num_output_placeholders == num_placeholders, (
            f"after step {step} ({computed} of the prompt's 20 tokens computed, no output back yet) request 0 "
            f"must have {num_placeholders} placeholder(s): a chunk short of the prompt's end samples nothing, "
            f"the step that reaches it samples one token, and so does each step after it; it has "
            f"{req.num_output_placeholders}"
        )


@pytest.mark.ch14_t1
def test_each_sampling_step_in_flight_adds_one_placeholder():
    """Rules: a step reaches the end of a request's tokens when it reaches `num_tokens +
    num_output_placeholders` (the tokens on their way count); exactly one placeholder per
    sampling step, so k steps in flight give k."""
    sched = async_scheduler()
    sched.add_request(request("0", list(range(5))))
    for step in range(1, 4):
        scheduler_output = sched.schedule()
        (req,) = sched.requests.values()
        assert scheduler_output.num_scheduled_tokens == {"0": 5 if step == 1 else 1}, (
            f"step {step}: the prompt, then one token per step ({scheduler_output.num_scheduled_tokens})"
        )
        assert req.num_output_placeholders == step, (
            f"with {step} sampling step(s) in flight and none updated, request 0 must have {step} placeholder(s) "
            f"(a step samples when it reaches num_tokens + num_output_placeholders); it has "
            f"{req.num_output_placeholders}"
        )
        assert req.num_computed_tokens == 5 + step - 1 and req.num_tokens == 5, (
            "placeholders are not tokens: num_tokens stays the prompt's 5 until an output comes back"
        )


@pytest.mark.ch14_t1
def test_only_the_requests_of_the_step_change():
    """Rules: «requests not in this step are untouched»; a request whose chunk stops short gains none, and the
    one whose chunk ends its prompt gains one."""
    sched = async_scheduler(budget=10)
    sched.add_request(request("a", list(range(10))))
    sched.add_request(request("b", list(range(100, 110))))
    expected = [  # (request a's placeholders, request b's) after each step
        (1, 0),  # a's whole prompt; no budget left for b
        (2, 0),  # a decodes one token; b gets 9 of its 10
        (3, 1),  # a decodes; b's last prompt token: b samples
    ]
    for step, (for_a, for_b) in enumerate(expected, start=1):
        scheduler_output = sched.schedule()
        got = placeholders(sched)
        assert got == {"a": for_a, "b": for_b}, (
            f"after step {step} (scheduled {scheduler_output.num_scheduled_tokens}, no output back yet) the "
            f"placeholders must be a: {for_a}, b: {for_b}; they are {got}"
        )


# ----------------------------------------------------------------------------- ch14_t2: placeholders out


def every_request_samples(scheduler_output: SchedulerOutput, token: int) -> ModelRunnerOutput:
    """The step's output when each scheduled request samples `token` (no chunked prefill)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
    )


class CacheSpy:
    """Wraps `KVCacheManager.cache_blocks` (called by the update, not by `allocate_slots`) and
    checks every call against ch14_t2's rule before passing it on."""

    def __init__(self, sched: AsyncScheduler) -> None:
        self.calls: list[tuple[str, int]] = []
        self.cache_blocks = sched.kv_cache_manager.cache_blocks
        sched.kv_cache_manager.cache_blocks = self

    def __call__(self, req: Request, num_tokens: int) -> None:
        assert req.status != RequestStatus.PREEMPTED, (
            f"the update cached blocks of request {req.request_id}, which was preempted with a step in flight: "
            "it holds no blocks; cache only a request that was running when the output arrived"
        )
        done = req.num_computed_tokens - req.num_output_placeholders
        assert num_tokens <= done, (
            f"the update cached request {req.request_id}'s first {num_tokens} tokens, but only {done} have their "
            f"KV written by steps that are done (num_computed_tokens {req.num_computed_tokens} counts "
            f"{req.num_output_placeholders} step(s) still in flight; {req.num_tokens} tokens are known): a block "
            "past them holds a token on its way (no hash) or one whose KV is not computed yet"
        )
        self.calls.append((req.request_id, num_tokens))
        self.cache_blocks(req, num_tokens)


@pytest.mark.ch14_t2
def test_each_token_that_arrives_takes_its_placeholder_back():
    """Rules: «The base class appends the tokens» (and the request reports it); «Each token kept was on its
    way: one placeholder fewer per token»."""
    sched = async_scheduler()
    sched.add_request(request("0", list(range(5))))
    in_flight = deque([sched.schedule(), sched.schedule()])
    (req,) = sched.requests.values()
    for step, token in enumerate([70, 71, 72, 73], start=1):
        scheduler_output = in_flight.popleft()
        outputs = sched.update_from_output(scheduler_output, every_request_samples(scheduler_output, token))
        assert [(o.request_id, o.new_token_ids) for o in outputs.outputs] == [("0", [token])], (
            f"the update of step {step} must report its token {token} for request 0: {outputs.outputs}"
        )
        assert req.output_token_ids[-1] == token, (
            f"the token of step {step} must be appended: {req.output_token_ids}"
        )
        assert req.num_output_placeholders == len(in_flight), (
            f"after step {step}'s token came back, request 0 has {len(in_flight)} step(s) in flight and so "
            f"{len(in_flight)} placeholder(s) (one taken back per token kept); it has {req.num_output_placeholders}"
        )
        in_flight.append(sched.schedule())


@pytest.mark.ch14_t2
def test_blocks_are_cached_only_where_the_steps_are_done():
    """Rules: cache (`self.kv_cache_manager.cache_blocks(request, n)`) up to
    `num_computed_tokens - num_output_placeholders`, never further (a token on its way has no
    hash; the token that just arrived has no KV yet). Three steps in flight, a block of 4
    tokens, prefix caching on; the spy checks every call."""
    sched = async_scheduler()
    spy = CacheSpy(sched)
    sched.add_request(request("0", list(range(6))))
    in_flight = deque([sched.schedule(), sched.schedule(), sched.schedule()])
    for token in range(200, 212):
        scheduler_output = in_flight.popleft()
        sched.update_from_output(scheduler_output, every_request_samples(scheduler_output, token))
        in_flight.append(sched.schedule())
    assert spy.calls, "the update must cache the blocks of a running request (KVCacheManager.cache_blocks)"


@pytest.mark.ch14_t2
def test_a_request_that_stops_with_no_step_in_flight_leaves_its_last_token_uncached():
    """Rules: «up to the tokens whose steps are done»: «a request that stops on it with no step in flight
    never does» compute that token's KV, so the block it completes must not be cached (a later prompt
    would reuse KV that was never written)."""
    sched = async_scheduler()
    spy = CacheSpy(sched)
    sched.add_request(request("0", [1, 2, 3], max_tokens=1))
    scheduler_output = sched.schedule()  # the prompt; it samples token 4, which fills block 0
    outputs = sched.update_from_output(scheduler_output, every_request_samples(scheduler_output, 4))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs.outputs] == [
        ("0", [4], "length")
    ], f"request 0 samples token 4 and stops at max_tokens=1: {outputs.outputs}"
    assert spy.calls, "a request that was running when its output arrived is cached, even if it stopped"
    sched.add_request(request("1", [1, 2, 3, 4, 5]))
    sched.schedule()
    hit = sched.requests["1"].num_cached_tokens
    assert hit == 0, (
        f"a prompt starting [1, 2, 3, 4] hit {hit} cached tokens, but token 4's KV was never computed: request 0 "
        "stopped on it with no step in flight; cache only num_computed_tokens - num_output_placeholders tokens"
    )


@pytest.mark.ch14_t2
def test_a_request_preempted_with_a_step_in_flight_keeps_its_token_and_caches_nothing():
    """Rules: «Only for a request that was running when the output arrived»: «a request preempted with a step
    in flight holds no blocks, although it keeps that step's token» (and its placeholder back)."""
    # Prompts of one block each; a second block each when decoding, and 3 usable blocks.
    sched = make_scheduler(4, 16, 1000, 16, 512, True, async_scheduling=True)
    spy = CacheSpy(sched)
    sched.add_request(request("0", list(range(16)), max_tokens=3, block_size=16))
    sched.add_request(request("1", list(range(100, 116)), max_tokens=3, block_size=16))
    first = sched.schedule()
    second = sched.schedule()  # each decode needs a second block; one is free: request 1 is preempted
    req1 = sched.requests["1"]
    assert req1.status == RequestStatus.PREEMPTED and list(second.num_scheduled_tokens) == ["0"], (
        "the scenario: step 2 runs request 0 alone, request 1 preempted for its block"
    )
    outputs = sched.update_from_output(first, every_request_samples(first, 9))
    assert {o.request_id: o.new_token_ids for o in outputs.outputs} == {"0": [9], "1": [9]}, (
        f"the step in flight when request 1 was preempted samples a real token for it: {outputs.outputs}"
    )
    assert req1.output_token_ids == [9] and req1.num_output_placeholders == 0, (
        f"request 1 keeps the token and takes its placeholder back: tokens {req1.output_token_ids}, "
        f"{req1.num_output_placeholders} placeholder(s)"
    )
    assert [req_id for req_id, _ in spy.calls] == ["0"], f"only request 0 was running; cached: {spy.calls}"


# ----------------------------------------------------------------------------- ch14_t3: the batch queue


class StepFuture:
    """A step the fake worker runs: done when the test says so, or when someone waits for it."""

    def __init__(self, step: int, done: bool) -> None:
        self.step = step
        self.finished = done
        self.waited = False

    def done(self) -> bool:
        return self.finished

    def result(self) -> str:
        self.waited = True
        self.finished = True  # waiting lasts until the worker is done
        return f"output of step {self.step}"


class BatchQueueCore(EngineCore):
    """`step_with_batch_queue`'s engine core with stand-ins: a scheduler that records what it is
    asked (its steps schedule `num_tokens` tokens each) and an executor whose steps finish when
    the test says (`done_at_once`) or when waited for."""

    def __init__(self, has_requests: bool = True, num_tokens: int = 4, done_at_once: bool = False) -> None:
        self.batch_queue_size = 2
        self.batch_queue = deque(maxlen=2)
        self.launched: list[StepFuture] = []
        self.updated: list[int] = []
        self.non_block: list[bool] = []
        self.num_tokens = num_tokens
        self.done_at_once = done_at_once
        self.has = has_requests
        self.scheduler = types.SimpleNamespace(
            has_requests=lambda: self.has,
            # A step of no tokens stands for one that only tells the runner of finished ids.
            has_unfinished_requests=lambda: self.has and self.num_tokens > 0,
            schedule=self._schedule,
            update_from_output=self._update_from_output,
        )
        self.model_executor = types.SimpleNamespace(execute_model=self._execute_model)

    def _schedule(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(step=len(self.launched) + 1, total_num_scheduled_tokens=self.num_tokens)

    def _execute_model(self, scheduler_output, non_block: bool = False) -> StepFuture:
        self.non_block.append(non_block)
        self.launched.append(StepFuture(scheduler_output.step, self.done_at_once))
        return self.launched[-1]

    def _update_from_output(self, scheduler_output, model_output: str) -> str:
        assert model_output == f"output of step {scheduler_output.step}", (
            "a step's output goes with its own step"
        )
        self.updated.append(scheduler_output.step)
        return f"outputs of step {scheduler_output.step}"

    def waited_for(self) -> list[int]:
        return [future.step for future in self.launched if future.waited]


def check_launched_without_blocking(core: BatchQueueCore) -> None:
    assert all(core.non_block), (
        "launch each step with execute_model(scheduler_output, non_block=True): without it the executor "
        "returns only when the step has run, and nothing overlaps"
    )


@pytest.mark.ch14_t3
def test_a_step_is_launched_without_waiting_while_the_queue_has_room():
    """Rules: schedule and launch with `non_block=True`; return None at once, waiting for
    nothing, when the step computes tokens, the queue has room and the oldest step runs."""
    core = BatchQueueCore()
    got = core.step_with_batch_queue()
    check_launched_without_blocking(core)
    assert len(core.launched) == 1, (
        f"the first call must schedule and launch one step; it launched {len(core.launched)}"
    )
    assert got is None and not core.waited_for(), (
        "with room in the queue and step 1 still running, step_with_batch_queue must return None without "
        f"waiting; it returned {got!r} and waited for steps {core.waited_for()}"
    )
    assert len(core.batch_queue) == 1, "the launched step must stay in the batch queue until it is updated"


@pytest.mark.ch14_t3
def test_a_full_queue_waits_for_the_oldest_step():
    """Rules: with the queue full after the launch, wait for the oldest step (the first
    launched) and return `update_from_output` of it; steps are updated in launch order."""
    core = BatchQueueCore()
    results = [core.step_with_batch_queue() for _ in range(4)]
    check_launched_without_blocking(core)
    assert results[0] is None, "the first call has room in the queue: it returns None"
    assert results[1:] == ["outputs of step 1", "outputs of step 2", "outputs of step 3"], (
        "once two steps are in flight, each call launches one more and then waits for the oldest and returns "
        f"its outputs (steps 1, 2, 3 in order); the calls returned {results}"
    )
    assert core.updated == [1, 2, 3] and core.waited_for() == [1, 2, 3], (
        f"steps must be updated in the order they were launched, the oldest first: updated {core.updated}, "
        f"waited for {core.waited_for()}"
    )
    assert [future.step for future, _ in core.batch_queue] == [4], "step 4 stays in flight"


@pytest.mark.ch14_t3
def test_an_oldest_step_already_done_is_updated_at_once():
    """Rules: if «the oldest step is already done», do not return None: «wait for the oldest step» (at once)
    and update it."""
    core = BatchQueueCore(done_at_once=True)
    got = core.step_with_batch_queue()
    assert got == "outputs of step 1", (
        f"step 1 was done before the call could return: its outputs must be returned at once, not None; got {got!r}"
    )
    assert not core.batch_queue, "the updated step leaves the queue"


@pytest.mark.ch14_t3
def test_an_empty_step_is_not_left_in_flight():
    """Rules: if «the step is empty» (it computes no tokens, only finished ids to tell the runner), it is no
    reason to return early: «wait for the oldest step» and update it."""
    core = BatchQueueCore(num_tokens=0)
    got = core.step_with_batch_queue()
    check_launched_without_blocking(core)
    assert got == "outputs of step 1" and not core.batch_queue, (
        "a step of 0 tokens must not be left in flight with None returned: wait for the oldest step (here that "
        f"one) and return its outputs; got {got!r} with {len(core.batch_queue)} step(s) queued"
    )


@pytest.mark.ch14_t3
def test_finished_requests_not_yet_reported_still_get_a_step():
    """Rules: schedule while the scheduler `has_requests()`, which counts finished requests
    whose ids the runner has not been sent (`has_unfinished_requests()` does not)."""
    core = BatchQueueCore(num_tokens=0)
    core.step_with_batch_queue()
    assert len(core.launched) == 1, (
        "the scheduler has_requests() (finished ids the runner must be told about) but no unfinished one: "
        "step_with_batch_queue must still schedule and launch a step"
    )


@pytest.mark.ch14_t3
def test_with_nothing_to_do_it_returns_none_and_with_a_step_in_flight_it_waits():
    """Rules: with «nothing to schedule», «wait for the oldest step» in flight if there is one; «With nothing
    to schedule and nothing in flight, return None»."""
    core = BatchQueueCore()
    assert core.step_with_batch_queue() is None, "the first call has room in the queue: it returns None"
    core.has = False
    got = core.step_with_batch_queue()
    assert len(core.launched) == 1, "with nothing to schedule, no step may be launched"
    assert got == "outputs of step 1", (
        f"with nothing to schedule and step 1 in flight, wait for it and return its outputs; got {got!r}"
    )
    try:
        got = core.step_with_batch_queue()
    except IndexError as error:
        raise AssertionError(
            f"with nothing to schedule and nothing in flight, return None: the call failed with {error!r}"
        ) from error
    assert got is None, f"with nothing to schedule and nothing in flight, return None; got {got!r}"
