"""Asynchronous scheduling (chapter 14): step N + 1 is scheduled while step N runs.

The scheduler tests drive an `AsyncScheduler` as `EngineCore.step_with_batch_queue`
does, with up to two steps in flight, over test_scheduler.py's fake model runner (its
"model" is a function of the token history, so every output is known in advance). They
check, after every schedule and every update, that placeholders stay bounded by the
steps in flight and never reach an output or a cached block's hash. The cases of
v0.11.0's tests/v1/core/test_async_scheduler.py are ported below them (v0.11.0's own
batch-queue loop and AsyncScheduler, recorded by tests/helpers/record_traces.py, are
replayed in test_vllm_traces.py, field by field, placeholders included). The engine tests
compare greedy (and seeded) outputs with and without async scheduling through `LLM`,
with the worker in its own process so that the steps really overlap.
"""

from __future__ import annotations

import argparse
import random
import threading
from collections import deque

import pytest
import torch
import transformers
from helpers.checkpoints import TINY_SHAPES, make_tiny_checkpoint, make_vllm_config
from helpers.engine_core import LoopOnlyCore, start_input_loop, wait
from helpers.kv_cache import full_attention_kv_cache_config
from helpers.scheduler import (
    FakeModelRunner,
    arrive_and_abort,
    make_requests,
    make_scheduler,
    reference_output,
    run_workload,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from nano_v1 import LLM, SamplingParams
from nano_v1.core.kv_cache_utils import get_request_block_hasher, make_block_hash_with_group_id
from nano_v1.core.sched.async_scheduler import AsyncScheduler
from nano_v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.entrypoints.cli import main as cli_main
from nano_v1.executor.abstract import UniProcExecutor
from nano_v1.executor.multiproc_executor import MultiprocExecutor
from nano_v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.worker.gpu_model_runner import GPUModelRunner

pytestmark = pytest.mark.ch14

BLOCK_SIZE = 16


# ---------------------------------------------------------------------- the scheduler
def check_placeholders(sched: Scheduler, num_in_flight: int) -> None:
    """What placeholders may be, with `num_in_flight` steps not yet updated."""
    for request in sched.requests.values():
        assert 0 <= request.num_output_placeholders <= num_in_flight, (
            f"{request.request_id} has {request.num_output_placeholders} placeholders with "
            f"{num_in_flight} steps in flight"
        )
        assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders, (
            f"{request.request_id}: computed beyond its tokens and the tokens on their way"
        )


def check_cached_blocks_hold_real_tokens(sched: Scheduler) -> None:
    """A running request's cached blocks are full of its real tokens: each one's hash is the
    hash of the request's own tokens there, and none lies past them."""
    manager = sched.kv_cache_manager
    block_size = sched.block_size
    for request in sched.running:
        (blocks,) = manager.get_blocks(request.request_id).blocks
        for i, block in enumerate(blocks):
            if block.block_hash is None:
                continue
            assert (i + 1) * block_size <= request.num_tokens, (
                f"{request.request_id}'s block {i} is cached, but its tokens up to "
                f"{(i + 1) * block_size} are not all sampled yet ({request.num_tokens} are)"
            )
            assert block.block_hash == make_block_hash_with_group_id(request.block_hashes[i], 0)


class OneTokenMore(dict):
    """Each request's token limit in the fake runner, one above its own."""

    def __setitem__(self, req_id: str, max_tokens: int) -> None:
        super().__setitem__(req_id, max_tokens + 1)


class AsyncFakeModelRunner(FakeModelRunner):
    """test_scheduler.py's runner, allowed one token past a request's max_tokens: the step
    scheduled while the request's last token was on its way samples one more, which the
    scheduler drops (as v0.11.0 does, and as a real runner may: only max_model_len binds it)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.max_tokens = OneTokenMore()


def run_async_workload(
    sched: AsyncScheduler,
    requests: list[Request],
    abort_prob: float,
    rng: random.Random,
    max_steps: int = 5000,
    runner=None,
) -> tuple[dict[str, list[int]], set[str]]:
    """Run as step_with_batch_queue does, with a batch queue of 2. The runner (the fake one
    unless given) runs each step when it is scheduled (a worker runs the steps in the order
    they are sent); the scheduler sees a step's output only when it is popped, after the
    next step is scheduled, unless the draw says the step was done before the next one could
    start. An `AsyncModelRunnerOutput` is waited for when it is popped, as the executor does."""
    runner = runner or AsyncFakeModelRunner(sched.block_size)
    batch_queue: deque[tuple[ModelRunnerOutput | AsyncModelRunnerOutput, SchedulerOutput]] = deque()
    pending = list(requests)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: set[str] = set()
    aborted: set[str] = set()
    steps = 0
    while pending or sched.has_unfinished_requests() or batch_queue:
        steps += 1
        assert steps < max_steps, f"the scheduler stopped making progress ({max_steps} steps)"
        arrive_and_abort(sched, pending, abort_prob, rng, aborted)
        if sched.has_unfinished_requests():
            for request in sched.waiting:
                assert request.num_output_placeholders == 0, f"{request.request_id} waits on a step in flight"
            scheduler_output = sched.schedule()
            check_placeholders(sched, len(batch_queue) + 1)
            check_cached_blocks_hold_real_tokens(sched)
            batch_queue.appendleft((runner.execute_model(scheduler_output), scheduler_output))
            if (
                scheduler_output.total_num_scheduled_tokens > 0
                and len(batch_queue) < 2
                and rng.random() < 0.8
            ):
                continue
        elif not batch_queue:
            continue
        model_runner_output, scheduler_output = batch_queue.pop()
        if isinstance(model_runner_output, AsyncModelRunnerOutput):
            model_runner_output = model_runner_output.get_output()
        for out in sched.update_from_output(scheduler_output, model_runner_output).outputs:
            assert out.request_id not in finished, f"{out.request_id} got a token after it finished"
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
        check_placeholders(sched, len(batch_queue))
        check_cached_blocks_hold_real_tokens(sched)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1, "with every request done, every block is free"
    return outputs, aborted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 96),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    abort_prob=st.sampled_from([0.0, 0.1]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_async_scheduler_invariants_and_outputs(
    seed, block_size, budget, max_seqs, caching, abort_prob, policy
):
    """Chunked prefill, preemption (small pools), prefix caching and aborts, with steps in
    flight: every request that is not aborted gets exactly the model's continuation."""
    rng = random.Random(seed)
    max_prompt, max_out = 40, 12
    max_model_len = 3 * 16 + max_prompt + max_out + 1
    num_blocks = rng.randint(max_model_len // block_size + 2, 3 * max_model_len // block_size + 2)
    sched = make_scheduler(
        num_blocks, block_size, budget, max_seqs, max_model_len, caching, policy=policy, async_scheduling=True
    )
    requests = make_requests(rng, rng.randint(1, 12), block_size, max_prompt, max_out, shared=True)
    for r in requests:
        r.priority = rng.randint(0, 2)
    outputs, aborted = run_async_workload(sched, requests, abort_prob, rng)
    for r in requests:
        if r.request_id in aborted:
            continue
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED, f"{r.request_id} ended {r.status.name}"
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens)
        assert r.output_token_ids == outputs[r.request_id], "the request holds a token it never emitted"


def make_async_scheduler(num_blocks: int = 1000, budget: int = 8192, caching: bool = False) -> AsyncScheduler:
    sched = make_scheduler(num_blocks, BLOCK_SIZE, budget, 16, 2048, caching, async_scheduling=True)
    assert isinstance(sched, AsyncScheduler)
    return sched


def make_uniform_requests(
    num: int, prompt_len: int = 10, max_tokens: int = 16, same_prompt: bool = False, first_token: int = 0
) -> list[Request]:
    """Request i's prompt is token i repeated (token 0 for all with `same_prompt`), as v0.11.0's tests build them."""
    hasher = get_request_block_hasher(BLOCK_SIZE)
    return [
        Request(
            f"{first_token + i}",
            [0 if same_prompt else first_token + i] * prompt_len,
            SamplingParams(max_tokens=max_tokens),
            eos_token_id=None,
            block_hasher=hasher,
        )
        for i in range(num)
    ]


def indexed_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    """Request i of the step samples token i (v0.11.0's `_make_model_runner_output`)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[i] for i in range(len(req_ids))],
    )


def drain(sched: Scheduler, in_flight: deque[SchedulerOutput], before_each_update=lambda: None) -> None:
    """Update the oldest step, schedule the next, until nothing is left in flight."""
    while in_flight:
        before_each_update()
        scheduler_output = in_flight.popleft()
        sched.update_from_output(scheduler_output, indexed_output(scheduler_output))
        scheduler_output = sched.schedule()
        if scheduler_output.num_scheduled_tokens:
            in_flight.append(scheduler_output)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_stop_by_max_tokens(max_tokens):
    """A step scheduled past max_tokens (its request still had a step in flight) gives nothing."""
    sched = make_async_scheduler()
    req0, req1 = make_uniform_requests(2, max_tokens=max_tokens)
    in_flight: deque[SchedulerOutput] = deque()
    sched.add_request(req0)
    in_flight.append(sched.schedule())
    sched.add_request(req1)
    in_flight.append(sched.schedule())
    drain(sched, in_flight)
    assert sched.get_num_unfinished_requests() == 0
    assert req0.num_output_tokens == req1.num_output_tokens == max_tokens


def test_abort():
    """A request aborted with steps in flight keeps the tokens it had, and gets none after."""
    sched = make_async_scheduler()
    requests = make_uniform_requests(10, max_tokens=20)
    for request in requests:
        sched.add_request(request)
    in_flight: deque[SchedulerOutput] = deque([sched.schedule(), sched.schedule()])
    abort_order = [0, 8, 3, 1, 6, 4, 2, 5, 7, 9]
    to_abort = list(abort_order)

    def abort_next() -> None:
        if to_abort:
            sched.finish_requests(requests[to_abort.pop(0)].request_id, RequestStatus.FINISHED_ABORTED)

    drain(sched, in_flight, abort_next)
    for i, request in enumerate(requests):
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert request.num_output_tokens == abort_order.index(i)


def test_preempt_with_a_step_in_flight():
    """v0.11.0's test_preempt repeats its test_abort; this one preempts. A request preempted
    while a step for it runs keeps that step's token (it is real), holds no placeholder
    once the step is updated, and is resumed and finished like any other."""
    # 2 requests of 16-token prompts: 2 blocks each once decoding; 3 usable blocks.
    sched = make_scheduler(4, BLOCK_SIZE, 8192, 16, 2048, False, async_scheduling=True)
    req0, req1 = make_uniform_requests(2, prompt_len=BLOCK_SIZE, max_tokens=3)
    sched.add_request(req0)
    sched.add_request(req1)
    first = sched.schedule()  # both prompts: one block each
    assert set(first.num_scheduled_tokens) == {"0", "1"}
    assert req0.num_output_placeholders == req1.num_output_placeholders == 1
    second = sched.schedule()  # each decode needs a second block; only one is free
    assert req1.status == RequestStatus.PREEMPTED and req1.num_computed_tokens == 0
    assert list(second.num_scheduled_tokens) == ["0"]
    assert req1.num_output_placeholders == 1  # the first step still samples for it
    sched.update_from_output(first, indexed_output(first))
    assert req1.output_token_ids == [1] and req1.num_output_placeholders == 0
    assert req1.status == RequestStatus.PREEMPTED
    drain(sched, deque([second]))
    assert req0.output_token_ids == [0, 0, 0]
    assert req1.num_preemptions == 1 and req1.output_token_ids == [1, 0, 0]
    assert sched.get_num_unfinished_requests() == 0


def test_a_preempted_request_that_stops_on_the_step_in_flight_leaves_the_queue():
    """Only async scheduling can finish a waiting request with a token: the step in flight
    when it was preempted. It leaves the waiting queue and frees nothing twice."""
    sched = make_scheduler(4, BLOCK_SIZE, 8192, 16, 2048, False, async_scheduling=True)
    (req0,) = make_uniform_requests(1, prompt_len=BLOCK_SIZE, max_tokens=3)
    (req1,) = make_uniform_requests(1, prompt_len=BLOCK_SIZE, max_tokens=1, first_token=1)
    sched.add_request(req0)
    sched.add_request(req1)
    first = sched.schedule()
    sched.schedule()  # req1 preempted, its first (and last) token on its way
    assert req1.status == RequestStatus.PREEMPTED
    outputs = sched.update_from_output(first, indexed_output(first)).outputs
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("0", [0], None),
        ("1", [1], "length"),
    ]
    assert req1.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req1 not in sched.waiting and "1" not in sched.requests


def test_prefix_caching_for_prefill_dedup():
    """Two requests with the same prompt in one step share its full blocks, and so do the
    requests that arrive while steps are in flight."""
    sched = make_async_scheduler(budget=1000, caching=True)
    num_prompt_tokens = 100
    requests = make_uniform_requests(5, prompt_len=num_prompt_tokens, max_tokens=3, same_prompt=True)
    later = list(requests[2:])
    sched.add_request(requests[0])
    sched.add_request(requests[1])
    first = sched.schedule()
    assert len(first.num_scheduled_tokens) == 2
    num_full_blocks = num_prompt_tokens // BLOCK_SIZE
    assert requests[0].num_cached_tokens == 0
    assert requests[1].num_cached_tokens >= num_full_blocks * BLOCK_SIZE
    in_flight = deque([first, sched.schedule()])
    drain(sched, in_flight, lambda: later and sched.add_request(later.pop(0)))
    assert sched.get_num_unfinished_requests() == 0
    for request in requests[1:]:
        assert request.num_cached_tokens >= num_full_blocks * BLOCK_SIZE


def test_prefix_caching_for_multi_turn():
    """The blocks of sampled tokens are cached as their tokens come back: a next turn whose
    prompt is a whole conversation hits every full block of it."""
    sched = make_async_scheduler(budget=1000, caching=True)
    num_prompt_tokens, num_output_tokens = 100, 200
    requests = make_uniform_requests(5, prompt_len=num_prompt_tokens, max_tokens=num_output_tokens)
    for request in requests:
        sched.add_request(request)
    drain(sched, deque([sched.schedule(), sched.schedule()]))
    assert sched.get_num_unfinished_requests() == 0
    hasher = get_request_block_hasher(BLOCK_SIZE)
    next_turn = [
        Request(
            f"next{i}", r.prompt_token_ids + r.output_token_ids, SamplingParams(max_tokens=num_output_tokens),
            eos_token_id=None, block_hasher=hasher,
        )
        for i, r in enumerate(requests)
    ]  # fmt: skip
    for request in next_turn:
        sched.add_request(request)
    sched.schedule()
    for request in next_turn:
        assert request.num_cached_tokens == request.num_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_synchronous_scheduler_never_has_placeholders():
    """The placeholder bookkeeping is AsyncScheduler's alone."""
    sched = make_scheduler(1000, BLOCK_SIZE, 8192, 16, 2048, True)
    rng = random.Random(0)
    requests = make_requests(rng, 6, BLOCK_SIZE, 40, 8, shared=True)
    for request in requests:
        sched.add_request(request)
    runner = FakeModelRunner(BLOCK_SIZE)
    while sched.has_unfinished_requests():
        scheduler_output = sched.schedule()
        assert all(r.num_output_placeholders == 0 for r in sched.requests.values())
        sched.update_from_output(scheduler_output, runner.execute_model(scheduler_output))
    assert all(r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens) for r in requests)


# ---------------------------------------------------------------------- configuration
def test_async_scheduling_flag_defaults_to_the_multiprocess_executor():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"]))
    assert args.async_scheduling is True
    config = EngineArgs(async_scheduling=True).create_engine_config()
    assert config.scheduler_config.async_scheduling
    assert config.parallel_config.distributed_executor_backend == "mp"
    explicit = EngineArgs(async_scheduling=True, distributed_executor_backend="uni")
    assert explicit.create_engine_config().parallel_config.distributed_executor_backend == "uni"
    assert EngineArgs().create_engine_config().parallel_config.distributed_executor_backend == "uni"


@pytest.mark.slow
def test_cli_generate_and_serve_take_the_flag(capsys):
    """`nano-v1 generate --async-scheduling` prints what the synchronous engine prints; `serve` takes it."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--help"])
    assert exit_info.value.code == 0 and "--async-scheduling" in capsys.readouterr().out
    args = ["generate", "def fibonacci(n):", "--max-tokens", "12", "--temperature", "0"]
    cli_main(args)
    synchronous = capsys.readouterr().out
    cli_main([*args, "--async-scheduling"])
    asynchronous = capsys.readouterr().out
    assert synchronous.startswith("def fibonacci(n):") and asynchronous == synchronous


def test_async_scheduling_refuses_speculative_decoding():
    args = EngineArgs(
        async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    with pytest.raises(ValueError, match="speculative decoding is not supported with async scheduling"):
        args.create_engine_config()


# ---------------------------------------------------------------------- the engine
ENGINE_KWARGS = dict(
    dtype="float32",
    block_size=BLOCK_SIZE,
    max_model_len=128,
    num_gpu_blocks_override=20,  # 19 usable blocks: 8 requests of up to 8 blocks preempt
    max_num_batched_tokens=48,  # the prompts are chunked
    enable_prefix_caching=True,
)


def prompts_with_a_shared_prefix(n: int = 8, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 4096) for _ in range(2 * BLOCK_SIZE)]
    return [
        {
            "prompt_token_ids": prefix[: rng.choice([0, BLOCK_SIZE, 2 * BLOCK_SIZE])]
            + [rng.randrange(3, 4096) for _ in range(rng.randint(5, 40))]
        }
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def sync_and_async_llms():
    """The demo model twice: synchronous with its worker in this process, and async with its
    worker in a process of its own (the default with async scheduling), so that steps overlap."""
    sync = LLM(**ENGINE_KWARGS)
    asynchronous = LLM(**ENGINE_KWARGS, async_scheduling=True)
    core = asynchronous.llm_engine.engine_core.engine_core
    assert isinstance(sync.llm_engine.engine_core.engine_core.model_executor, UniProcExecutor)
    assert isinstance(core.model_executor, MultiprocExecutor) and core.batch_queue_size == 2
    assert isinstance(core.scheduler, AsyncScheduler)
    yield sync, asynchronous
    asynchronous.llm_engine.shutdown()


def spy_on(monkeypatch, core) -> tuple[list[int], list[str]]:
    """Record, at each update, how many steps are still in flight; and every preemption."""
    in_flight_at_update: list[int] = []
    preempted: list[str] = []
    update, preempt = core.scheduler.update_from_output, core.scheduler._preempt

    def spy_update(scheduler_output, model_runner_output):
        in_flight_at_update.append(len(core.batch_queue))
        return update(scheduler_output, model_runner_output)

    monkeypatch.setattr(core.scheduler, "update_from_output", spy_update)
    monkeypatch.setattr(core.scheduler, "_preempt", lambda r: (preempted.append(r.request_id), preempt(r)))
    return in_flight_at_update, preempted


def completions(outputs) -> list:
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def assert_same_logprobs(got, expected) -> None:
    """The same top tokens at each position, their logprobs equal up to float32 rounding: a
    step that samples for a request finished meanwhile is a larger batch than the
    synchronous engine's, so reductions may add in another order."""
    for g, e in zip(got, expected):
        for gc, ec in zip(g.outputs, e.outputs):
            assert [list(d) for d in gc.logprobs] == [list(d) for d in ec.logprobs]
            for gd, ed in zip(gc.logprobs, ec.logprobs):
                assert list(gd.values()) == pytest.approx(list(ed.values()), abs=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["e", " t"]),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=3, ignore_eos=True),
    ],
    ids=["greedy", "n2-seeded", "stop-strings", "logprobs"],
)
def test_async_scheduling_changes_no_output(sync_and_async_llms, monkeypatch, params):
    """Preemption, prefix caching and chunked prefill in every case; stop strings (the frontend
    aborts the request while its next step runs), n > 1 and logprobs in their own."""
    sync, asynchronous = sync_and_async_llms
    core = asynchronous.llm_engine.engine_core.engine_core
    in_flight_at_update, preempted = spy_on(monkeypatch, core)
    prompts = prompts_with_a_shared_prefix()
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = asynchronous.generate(prompts, params, use_tqdm=False)
    assert completions(got) == completions(expected)
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in expected]
    if params.logprobs:
        assert_same_logprobs(got, expected)
    assert max(in_flight_at_update) == 1, "no step was updated while the next one ran"
    if not params.stop:
        assert preempted, "the cache was meant to be too small for the batch"
    if params.stop:  # requests stop early, and then fit
        assert any(
            c.finish_reason == "stop" and isinstance(c.stop_reason, str) for o in got for c in o.outputs
        )


@pytest.mark.slow
def test_async_scheduling_with_the_engine_core_in_its_own_process(sync_and_async_llms, monkeypatch):
    """The busy loop of EngineCoreProc collects the step still in flight when the last
    request finishes, and serves the next requests after it."""
    for package in ("zmq", "msgspec"):  # the engine core's own process talks ZMQ; the GPU image has neither
        pytest.importorskip(package)
    sync, _ = sync_and_async_llms
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(**ENGINE_KWARGS, async_scheduling=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, stop=["e"])
        prompts = prompts_with_a_shared_prefix(4, seed=1)
        for _ in range(2):
            assert completions(llm.generate(prompts, params, use_tqdm=False)) == completions(
                sync.generate(prompts, params, use_tqdm=False)
            )
    finally:
        llm.llm_engine.shutdown()


def test_an_idle_core_with_a_step_in_flight_does_not_wait_for_input():
    """The step in flight must be collected (its stats, the requests' last tokens): the busy
    loop goes on to `step_with_batch_queue` instead of blocking on the input queue."""
    core = LoopOnlyCore()
    core.batch_queue = deque([("a future", "its scheduler output")])
    loop, errors = start_input_loop(core)
    wait(loop, errors, 5)
    assert not loop.is_alive(), "the core waited for input with a step in flight"


@pytest.mark.slow
def test_the_streaming_server_with_async_scheduling(sync_and_async_llms):
    """The OpenAI server (its engine core in a process of its own, the worker in another)
    streams what the synchronous engine generates, stop strings included, and every KV
    block is free again once the requests are done."""
    openai = pytest.importorskip("openai")  # the serving packages: the GPU image has none
    from helpers.servers import BackgroundServer, stream_completion, wait_until_idle

    sync, _ = sync_and_async_llms
    server = BackgroundServer(EngineArgs(**ENGINE_KWARGS, async_scheduling=True))
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        for prompt, stop in [
            ("def fibonacci(n):\n", []),
            ("import os\n", ["e", " t"]),
            ("class Stack:\n", []),
        ]:
            params = SamplingParams(temperature=0.0, max_tokens=24, stop=stop)
            expected = sync.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            got = stream_completion(client, prompt=prompt, max_tokens=24, temperature=0.0, stop=stop)
            assert got == ({0: expected.text}, {0: expected.finish_reason})
        wait_until_idle(server, within_s=10)
    finally:
        server.stop()


def io_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith("mp_exec_io")}


def test_a_worker_error_reaches_the_engine_through_the_output_thread():
    """Fail-stop is kept: the worker's error is sent by its output thread before the
    process exits, and the engine is dead from then on; shutdown ends the executor's IO thread."""
    before = io_threads()
    llm = LLM(**ENGINE_KWARGS, async_scheduling=True)
    try:
        with pytest.raises(EngineDeadError, match="worker rank 0 failed in no_such_method: AttributeError"):
            llm.collective_rpc("no_such_method")
        with pytest.raises(EngineDeadError):
            llm.generate(prompts_with_a_shared_prefix(2), SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for thread in io_threads() - before:
        thread.join(timeout=5)
        assert not thread.is_alive(), "the executor's IO thread outlived its shutdown"


@pytest.mark.slow
def test_async_scheduling_with_tensor_parallelism(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    prompts = prompts_with_a_shared_prefix(6, seed=2)
    for p in prompts:
        p["prompt_token_ids"] = [t % 512 for t in p["prompt_token_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kwargs = {**ENGINE_KWARGS, "model": path}
    expected = LLM(**kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(**kwargs, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert completions(llm.generate(prompts, params, use_tqdm=False)) == completions(expected)
    finally:
        llm.llm_engine.shutdown()


# ---------------------------------------------------------------------- the model runner
RUNNER_VOCAB = 512  # TINY_SHAPES' vocabulary


class TokenAndPositionModel(nn.Module):
    """A model without weights whose greedy next token is (7 * token + 3 * position) mod the
    vocabulary, a function of the last input token and its position only; it records what
    every step fed it, per request, from the runner's batch at the time."""

    def __init__(self, runner: GPUModelRunner) -> None:
        super().__init__()
        self.runner = runner
        self.fed: list[dict[str, list[tuple[int, int]]]] = []  # per step: request -> (position, token)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        input_batch = self.runner.input_batch
        query_start_loc = self.runner.query_start_loc.np
        tokens, where = input_ids.tolist(), positions.tolist()
        self.fed.append({
            req_id: list(zip(where[query_start_loc[i] : query_start_loc[i + 1]],
                             tokens[query_start_loc[i] : query_start_loc[i + 1]]))
            for i, req_id in enumerate(input_batch.req_ids)
        })  # fmt: skip
        return (7 * input_ids + 3 * positions).unsqueeze(-1).float()  # [num_tokens, 1]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(hidden_states[:, 0].long() % RUNNER_VOCAB, RUNNER_VOCAB).float()


@pytest.fixture(scope="module")
def config_only_checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3's config.json: the runner tests load no weights."""
    path = tmp_path_factory.mktemp("config_only")
    transformers.Qwen3Config(**TINY_SHAPES, head_dim=32, architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return str(path)


def runner_on_cpu(checkpoint: str, num_blocks: int, async_scheduling: bool) -> GPUModelRunner:
    vllm_config = make_vllm_config(
        checkpoint, dtype="float32", block_size=BLOCK_SIZE, max_model_len=RUNNER_MAX_MODEL_LEN,
        max_num_seqs=RUNNER_MAX_SEQS, max_num_batched_tokens=RUNNER_BUDGET, async_scheduling=async_scheduling,
    )  # fmt: skip
    runner = GPUModelRunner(vllm_config, torch.device("cpu"))
    runner.model = TokenAndPositionModel(runner)
    runner.kv_cache_config = full_attention_kv_cache_config(num_blocks, BLOCK_SIZE)
    return runner


RUNNER_MAX_MODEL_LEN, RUNNER_MAX_SEQS, RUNNER_BUDGET = 128, 6, 32


def greedy_requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    hasher = get_request_block_hasher(BLOCK_SIZE)
    prefix = [rng.randrange(RUNNER_VOCAB) for _ in range(2 * BLOCK_SIZE)]
    return [
        Request(
            f"r{i}",
            prefix[: rng.choice([0, BLOCK_SIZE])] + [rng.randrange(RUNNER_VOCAB) for _ in range(rng.randint(1, 30))],
            SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True),
            eos_token_id=None,
            block_hasher=hasher,
        )
        for i in range(10)
    ]


@pytest.mark.parametrize("seed", range(3))
def test_the_runner_feeds_each_request_its_last_token_from_the_device(config_only_checkpoint, seed):
    """With async scheduling the runner feeds the token each request sampled last step from
    the device (`prev_sampled_token_ids`, gathered by last step's row), where the host holds a
    placeholder. Requests finish, arrive, are preempted and resumed, so rows move between
    steps. Every token the model is fed is the request's real token at that position (never
    a placeholder, never another row's), and every request generates what the synchronous
    runner generates."""
    num_blocks = 10  # 9 usable, for up to 6 requests of up to 5 blocks: the batch preempts
    sync_runner = runner_on_cpu(config_only_checkpoint, num_blocks, async_scheduling=False)
    sched = make_scheduler(num_blocks, BLOCK_SIZE, RUNNER_BUDGET, RUNNER_MAX_SEQS, RUNNER_MAX_MODEL_LEN, True)
    expected, _ = run_workload(sched, greedy_requests(seed), 0.0, random.Random(seed), runner=sync_runner)

    runner = runner_on_cpu(config_only_checkpoint, num_blocks, async_scheduling=True)
    from_device, moved = [], []
    prepare_input_ids = runner._prepare_input_ids

    def spy(total_num_scheduled_tokens, cu_num_tokens):
        input_batch = runner.input_batch
        common = [r for r in input_batch.prev_req_id_to_index or {} if r in input_batch.req_id_to_index]
        from_device.append(len(common))
        moved.append(any(input_batch.prev_req_id_to_index[r] != input_batch.req_id_to_index[r] for r in common))
        return prepare_input_ids(total_num_scheduled_tokens, cu_num_tokens)

    runner._prepare_input_ids = spy
    sched = make_scheduler(
        num_blocks, BLOCK_SIZE, RUNNER_BUDGET, RUNNER_MAX_SEQS, RUNNER_MAX_MODEL_LEN, True, async_scheduling=True
    )
    preempted = []
    preempt = sched._preempt
    sched._preempt = lambda request: (preempted.append(request.request_id), preempt(request))
    requests = greedy_requests(seed)
    got, _ = run_async_workload(sched, requests, 0.0, random.Random(seed), runner=runner)
    assert got == expected
    assert preempted, "the cache was meant to be too small for the batch"
    full = {r.request_id: r.prompt_token_ids + got[r.request_id] for r in requests}
    for step, fed in enumerate(runner.model.fed):
        for req_id, tokens in fed.items():
            for position, token in tokens:
                assert token == full[req_id][position], (
                    f"step {step} fed {req_id} token {token} at position {position}, not its "
                    f"token {full[req_id][position]}"
                )
    assert sum(from_device) > 0, "no step took its input from the device"
    assert any(moved), "no request changed rows between the step that sampled it and the next"


@pytest.mark.demo_model
def test_the_demo_model_generates_the_same_with_its_tokens_fed_from_the_device(sync_and_async_llms):
    """Text prompts of different lengths and budgets (requests finish at different steps, so
    rows move), some with penalties, whose token counts must see each step's real token
    (the runner waits for it before counting), one with bad words (the sampler reads the
    output tokens), and seeded sampling beside greedy: the async engine, its tokens fed from
    the device, generates exactly what the synchronous one does."""
    sync, asynchronous = sync_and_async_llms
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def ", "# A", "x = "]
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, bad_words=[" the", "e"]),
        SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, presence_penalty=1.0),
    ]
    expected = sync.generate(prompts, params, use_tqdm=False)
    assert completions(asynchronous.generate(prompts, params, use_tqdm=False)) == completions(expected)
    unpenalized = sync.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert completions(unpenalized) != completions(expected[2:3]), "the penalty must change the output"


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    from benchmarks.multimodal import write_tiny_llava

    # CLIP at 28 pixels in 7-pixel patches: 16 positions per image.
    vision_shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "image_size": 28, "patch_size": 7}  # fmt: skip
    return write_tiny_llava(
        tmp_path_factory.mktemp("llava"), text_arch="llama", text_shape=TINY_SHAPES, vision_shape=vision_shape
    )


def test_async_scheduling_changes_no_output_with_images(tiny_llava):
    """A multimodal model takes embeddings, merged from the step's input ids on the device
    after those ids were fed from the last step's tokens: images first, in the middle, last,
    two in one prompt, one prompt without; prompts chunked through their images. The worker
    stays in this process (async scheduling's runner path, without the overlap)."""
    from transformers import AutoConfig

    from benchmarks.multimodal import random_image

    image = AutoConfig.from_pretrained(tiny_llava).image_token_index
    a, b = random_image(1), random_image(2, 30, 30)
    prompts = [
        {"prompt_token_ids": [image, 11, 12, 13], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [5, 6, 7, image, 8, 9], "multi_modal_data": {"image": [b]}},
        {"prompt_token_ids": [20, 21, image], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [30, image, 31, image, 33], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [50, 51, 52, 53]},
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 7, 10)]
    kwargs = {"model": tiny_llava, "dtype": "float32", "max_num_batched_tokens": 24, "enable_prefix_caching": True}
    expected = LLM(**kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(**kwargs, async_scheduling=True, distributed_executor_backend="uni")
    assert isinstance(llm.llm_engine.engine_core.engine_core.scheduler, AsyncScheduler)
    assert completions(llm.generate(prompts, params, use_tqdm=False)) == completions(expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_scheduling_on_cuda_changes_no_output():
    """On CUDA the step's tokens go to the host on a side stream and the next step's input is
    gathered on the device while the host still holds placeholders, with the pinned step
    buffers reused only once the previous step's copies are done: greedy tokens (preemption,
    chunked prefill, penalties, CUDA graphs) are the synchronous engine's, with the worker in
    this process (whose runner we can see) and in its own."""
    kwargs = {**ENGINE_KWARGS, "device": "cuda", "gpu_memory_utilization": 0.2}
    prompts = prompts_with_a_shared_prefix()
    params = [
        SamplingParams(temperature=0.0, max_tokens=40 - 3 * i, ignore_eos=True, repetition_penalty=1.0 + 0.1 * (i % 2))
        for i in range(len(prompts))
    ]
    expected = completions(LLM(**kwargs).generate(prompts, params, use_tqdm=False))
    in_process = LLM(**kwargs, async_scheduling=True, distributed_executor_backend="uni")
    runner = in_process.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    assert runner.async_output_copy_stream is not None and runner.prepare_inputs_event is not None
    assert completions(in_process.generate(prompts, params, use_tqdm=False)) == expected
    own_process = LLM(**kwargs, async_scheduling=True)
    try:
        assert completions(own_process.generate(prompts, params, use_tqdm=False)) == expected
    finally:
        own_process.llm_engine.shutdown()


def handmade_step(new=(), cached=(), finished=()) -> SchedulerOutput:
    """A step of new requests `(req_id, prompt)`, scheduled whole in block 1 + their index, and of
    requests the runner holds `(req_id, num_computed_tokens)`, scheduled for one token each."""
    new_reqs = [
        NewRequestData(req_id, prompt, SamplingParams(temperature=0.0), ([1 + i],), 0)
        for i, (req_id, prompt) in enumerate(new)
    ]
    num_scheduled_tokens = {req_id: len(prompt) for req_id, prompt in new} | {req_id: 1 for req_id, _ in cached}
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[req_id for req_id, _ in cached], resumed_from_preemption=[False] * len(cached),
            new_block_ids=[None] * len(cached), num_computed_tokens=[n for _, n in cached],
        ),
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
        scheduled_spec_decode_tokens={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(finished),
    )  # fmt: skip


def test_a_request_back_after_an_empty_step_or_a_reused_id_is_fed_the_hosts_tokens(config_only_checkpoint):
    """The last step's tokens come from the device only for the requests they were sampled for.
    A request that left the batch in an empty step (which samples nothing, so fills nothing)
    and comes back is fed its own token; a new request that takes a finished request's id,
    with a step of the finished one's just done, must not be fed that request's token."""
    runner = runner_on_cpu(config_only_checkpoint, num_blocks=8, async_scheduling=True)
    a, b = [5, 6, 7], [9, 10]
    (a_token,) = runner.execute_model(handmade_step(new=[("a", a), ("b", b)])).get_output().sampled_token_ids[0]
    assert runner.execute_model(handmade_step()) is EMPTY_MODEL_RUNNER_OUTPUT  # a and b leave the batch
    runner.execute_model(handmade_step(cached=[("a", len(a))], finished=["b"])).get_output()
    assert runner.model.fed[-1] == {"a": [(len(a), a_token)]}
    # a finishes, and a new request takes its id, with a step of a's in flight.
    runner.execute_model(handmade_step(new=[("a", b)], finished=["a"])).get_output()
    assert runner.model.fed[-1] == {"a": [(0, 9), (1, 10)]}
