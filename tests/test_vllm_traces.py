"""nano_v1's scheduler against vLLM v0.11.0's own, step by step, block ids included.

The oracle is vLLM itself: tests/helpers/record_traces.py drove v0.11.0's
`Scheduler` and `KVCacheManager` through each workload on a fake model and wrote every
step to tests/vllm_v0_11_0/traces/. Here nano_v1's scheduler gets the same requests,
the same aborts, the same model outputs and the same draft tokens, and each step's
decision (`schedule()`) and the state after it (`update_from_output`) must equal the
recorded ones, field by field. No vLLM is needed: only the committed JSON is read.

Where nano_v1 deliberately differs from v0.11.0, the workload is a strict xfail that
names the difference and the exact step and field where it first shows; chapter 04
explains each. A difference confined to one field that no scheduling decision reads is
left out of those workloads' main replay and replayed alone, as its own strict xfail, so
the rest of the workload is still compared. A strict xfail turns into a failure the day
the difference disappears, and a mismatch anywhere else is an ordinary failure.
"""

from __future__ import annotations

import json
import types
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.kv_cache import full_attention_kv_cache_config
from helpers.trace_fields import (
    PendingOutput,
    output_fields,
    placeholder_fields,
    schedule_fields,
    state_fields,
)

from nano_v1.config import CacheConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.async_scheduler import AsyncScheduler
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine.core import EngineCore
from nano_v1.outputs import DraftTokenIds, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch04

TRACES = Path(__file__).parent / "vllm_v0_11_0" / "traces"
WORKLOADS = sorted(path.stem for path in TRACES.glob("*.json"))


class TraceMismatch(AssertionError):
    """nano_v1 and the trace disagree; the first disagreement of a replay."""

    def __init__(self, workload: str, step: int, field: str, expected, actual) -> None:
        super().__init__(f"{workload}: step {step}, {field}: vLLM v0.11.0 {expected!r}, nano_v1 {actual!r}")
        self.step, self.field = step, field


class KnownDifference(Exception):
    """The replay first disagreed exactly where a known difference says it will."""


@dataclass(frozen=True)
class Difference:
    """Where a replay first departs from the trace, and why."""

    step: int
    field: str
    reason: str


@dataclass(frozen=True)
class FieldDifference:
    """A field that differs in some workloads, and at which step it first does in each."""

    reason: str
    first_steps: dict[str, int]


# Workloads whose schedules part ways with v0.11.0's, at the step and field where they first
# do. Line numbers are v0.11.0's vllm/v1/core/sched/scheduler.py.
KNOWN_DIFFERENCES = {
    "priority_preempt_scheduled": Difference(
        step=3,
        field="scheduled",
        reason=(
            "priority preemption of a request already scheduled this step: v0.11.0 takes it out of "
            "running and scheduled_running_reqs (lines 262-269) but keeps its num_scheduled_tokens "
            "entry, its req_to_new_blocks entry and its share of the budget, and does not step "
            "req_index back, so the step still runs it; nano_v1 unschedules it and returns its "
            "tokens to the budget"
        ),
    ),
    "spec_decode_past_max_tokens": Difference(
        step=1,
        field="after.spec_token_ids",
        reason=(
            "drafts that would take a request past max_tokens: v0.11.0's update_draft_token_ids "
            "stores them all (line 1091) and schedule() schedules them all, check_stop dropping "
            "the surplus tokens afterwards; nano_v1 clips drafts on arrival to "
            "max_tokens - num_output_tokens - 1, so it schedules fewer tokens"
        ),
    ),
}

# Differences in one field that no scheduling decision reads. The main replay leaves the
# field out for these workloads; test_field_difference replays that field alone, so the
# rest of each workload is still held to v0.11.0 step by step.
FIELD_DIFFERENCES = {
    "after.spec_token_ids": FieldDifference(
        reason=(
            "drafts reaching max_model_len: v0.11.0 stores every draft (its n-gram proposer offers "
            "up to max_model_len - num_tokens) and schedule() trims them, capping the step at "
            "max_model_len - 1 - num_computed_tokens (line 226) and deleting the rest (line 309) "
            "only when some draft is scheduled; nano_v1 clips them on arrival to "
            "max_model_len - num_tokens - 1, so its request holds one draft fewer. Both schedule "
            "the same tokens"
        ),
        first_steps={"spec_decode_max_model_len": 3},
    ),
    "after.waiting_spec_token_ids": FieldDifference(
        reason=(
            "drafts of a preempted request: v0.11.0's preemption (lines 274-281) resets status and "
            "num_computed_tokens but leaves spec_token_ids, which stay until the request runs "
            "again and the proposer's next drafts replace them; nano_v1's Scheduler._preempt "
            "clears them. No step schedules them either way: the waiting pass that resumes a "
            "request counts num_tokens, not num_tokens_with_spec"
        ),
        first_steps={"spec_decode_preemption": 9},
    ),
}


def load(workload: str) -> dict:
    return json.loads((TRACES / f"{workload}.json").read_text())


def build_scheduler(config: dict, async_scheduling: bool = False) -> Scheduler:
    """nano_v1's scheduler with the trace's config (no checkpoint: only max_model_len and is_multimodal_model are read);
    an `AsyncScheduler` with `async_scheduling` (chapter 14)."""
    vllm_config = VllmConfig.__new__(VllmConfig)
    vllm_config.cache_config = CacheConfig(
        block_size=config["block_size"],
        enable_prefix_caching=config["enable_prefix_caching"],
        num_gpu_blocks=config["num_gpu_blocks"],
    )
    vllm_config.scheduler_config = SchedulerConfig(
        max_num_batched_tokens=config["max_num_batched_tokens"],
        max_num_seqs=config["max_num_seqs"],
        enable_chunked_prefill=config["enable_chunked_prefill"],
        long_prefill_token_threshold=config["long_prefill_token_threshold"],
        policy=config["policy"],
        async_scheduling=async_scheduling,
    )
    vllm_config.model_config = types.SimpleNamespace(
        max_model_len=config["max_model_len"], is_multimodal_model=False
    )
    vllm_config.speculative_config = (
        SpeculativeConfig(num_speculative_tokens=config["num_spec_tokens"], prompt_lookup_min=1)
        if config["num_spec_tokens"]
        else None
    )
    return (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config, full_attention_kv_cache_config(config["num_gpu_blocks"], config["block_size"])
    )


def make_request(spec: dict, block_hasher) -> Request:
    params = SamplingParams(
        max_tokens=spec["max_tokens"],
        min_tokens=spec["min_tokens"],
        ignore_eos=spec["ignore_eos"],
        stop_token_ids=list(spec["stop_token_ids"]),
    )
    return Request(
        spec["req_id"],
        list(spec["prompt_token_ids"]),
        params,
        spec["eos_token_id"],
        arrival_time=spec["arrival_time"],
        priority=spec["priority"],
        block_hasher=block_hasher,
    )


def apply_trace_step_requests(sched: Scheduler, entry: dict, specs: dict[str, dict], block_hasher) -> None:
    """The trace step's arrivals, then its aborts, as the recorder applied them."""
    for req_id in entry["arrivals"]:
        sched.add_request(make_request(specs[req_id], block_hasher))
    for req_id in entry["aborts"]:
        sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)


def ordered(value):
    """Dicts compare with their order: the order of `scheduled` is the order of the batch."""
    return list(value.items()) if isinstance(value, dict) else value


SCHEDULE_FIELDS = (
    "scheduled",
    "total_num_scheduled_tokens",
    "new_req_ids",
    "resumed_req_ids",
    "running_req_ids",
    "preempted_req_ids",
    "finished_req_ids",
    "spec_decode_tokens",
    "block_ids",
    "scheduled_num_computed_tokens",
    "num_common_prefix_blocks",
)
OUTPUT_FIELDS = ("outputs",)
STATE_FIELDS = tuple(
    "after." + name
    for name in (
        "running",
        "waiting",
        "num_computed_tokens",
        "spec_token_ids",
        "waiting_spec_token_ids",
        "block_ids",
        "num_free_blocks",
        "free_block_queue",
    )
)
ALL_FIELDS = SCHEDULE_FIELDS + OUTPUT_FIELDS + STATE_FIELDS


def compare(workload: str, step: int, expected: dict, actual: dict, fields, checked) -> None:
    for field in fields:
        key = field.removeprefix("after.")
        if field in checked and ordered(expected[key]) != ordered(actual[key]):
            raise TraceMismatch(workload, step, field, expected[key], actual[key])


def replay(trace: dict, checked=frozenset(ALL_FIELDS)) -> None:
    """Drive nano_v1 through the trace; raise TraceMismatch at the first `checked` field that differs."""
    workload, config = trace["workload"], trace["config"]
    sched = build_scheduler(config)
    block_hasher = get_request_block_hasher(config["block_size"]) if config["enable_prefix_caching"] else None
    specs = {spec["req_id"]: spec for spec in trace["requests"]}
    for entry in trace["steps"]:
        step = entry["step"]
        apply_trace_step_requests(sched, entry, specs, block_hasher)

        was_running = [r.request_id for r in sched.running]
        so = sched.schedule()
        compare(
            workload,
            step,
            entry,
            schedule_fields(sched, so, was_running),
            SCHEDULE_FIELDS,
            checked,
        )

        req_ids = list(so.num_scheduled_tokens)
        model_output = entry["model_output"]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[list(model_output[rid]) for rid in req_ids],
        )
        engine_outputs = sched.update_from_output(so, runner_output)
        outputs = output_fields(engine_outputs.outputs)
        compare(workload, step, entry, {"outputs": outputs}, OUTPUT_FIELDS, checked)
        if "draft_token_ids" in entry:
            drafts = entry["draft_token_ids"]
            sched.update_draft_token_ids(DraftTokenIds(list(drafts), [list(d) for d in drafts.values()]))
        compare(workload, step, entry["after"], state_fields(sched), STATE_FIELDS, checked)
    assert not sched.has_unfinished_requests(), (
        f"{workload}: nano_v1 has requests left after the trace's last step"
    )


def replay_expecting(workload: str, known: Difference | None, checked=frozenset(ALL_FIELDS)) -> None:
    """Replay; a mismatch exactly where `known` says becomes KnownDifference, any other stays a failure."""
    try:
        replay(load(workload), checked)
    except TraceMismatch as mismatch:
        if known is not None and (mismatch.step, mismatch.field) == (known.step, known.field):
            raise KnownDifference(str(mismatch)) from mismatch
        raise


def xfail_known(reason: str):
    return pytest.mark.xfail(strict=True, raises=KnownDifference, reason=reason)


ISSUE_WORKLOADS = {
    "plain",
    "chunked_prefill",
    "long_prefill_threshold",
    "chunked_prefill_off",
    "preemption",
    "prefix_caching",
    "preemption_prefix_caching",
    "max_model_len",
    "priority",
    "aborts",
    "spec_decode",
    "max_num_seqs",
}


def steps(workload: str) -> list[dict]:
    return load(workload)["steps"]


def test_traces_cover_the_issue_workloads():
    """Every trace is v0.11.0's, the workloads do what their names promise, and every known
    difference names a recorded workload."""
    assert ISSUE_WORKLOADS <= set(WORKLOADS)
    for workload in WORKLOADS:
        trace = load(workload)
        assert trace["vllm_version"] == "0.11.0" and trace["workload"] == workload
    assert any(s["preempted_req_ids"] for s in steps("preemption"))
    assert any(
        s["scheduled_num_computed_tokens"][rid] > 0
        for s in steps("preemption_prefix_caching")
        for rid in s["resumed_req_ids"]
    ), "no resumed request hit the prefix cache"
    rejections = [
        (s, rid)
        for s in steps("spec_decode")
        for rid, drafts in s["spec_decode_tokens"].items()
        if len(s["model_output"][rid]) <= len(drafts)
    ]
    assert rejections, "no draft was rejected"
    assert any(s["aborts"] for s in steps("aborts"))
    assert (
        max(len(s["after"]["running"]) for s in steps("max_num_seqs"))
        == load("max_num_seqs")["config"]["max_num_seqs"]
    )
    assert set(KNOWN_DIFFERENCES) <= set(WORKLOADS)
    for field, difference in FIELD_DIFFERENCES.items():
        assert field in ALL_FIELDS and set(difference.first_steps) <= set(WORKLOADS)


@pytest.mark.parametrize(
    "workload",
    [
        pytest.param(w, marks=xfail_known(KNOWN_DIFFERENCES[w].reason)) if w in KNOWN_DIFFERENCES else w
        for w in WORKLOADS
    ],
)
def test_replay_matches_vllm(workload):
    """Every recorded field at every step, less the field differences named for this workload."""
    checked = {
        f
        for f in ALL_FIELDS
        if f not in FIELD_DIFFERENCES or workload not in FIELD_DIFFERENCES[f].first_steps
    }
    replay_expecting(workload, KNOWN_DIFFERENCES.get(workload), checked)


@pytest.mark.parametrize(
    "field, workload",
    [
        pytest.param(field, workload, marks=xfail_known(difference.reason))
        for field, difference in FIELD_DIFFERENCES.items()
        for workload in sorted(difference.first_steps)
    ],
)
def test_field_difference(field, workload):
    """One field alone, where it is known to differ: the first difference is where it is said to be."""
    difference = FIELD_DIFFERENCES[field]
    known = Difference(step=difference.first_steps[workload], field=field, reason=difference.reason)
    replay_expecting(workload, known, checked={field})


# ---------------------------------------------------------------------- vLLM v0.11.0's traces
ASYNC_TRACES = TRACES / "async"
ASYNC_WORKLOADS = sorted(path.stem for path in ASYNC_TRACES.glob("*.json"))


class TraceExecutor:
    """Hands back, for the step scheduled in the current trace step, the recorded model output."""

    def __init__(self) -> None:
        self.entry: dict = {}

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> PendingOutput:
        assert non_block
        model_output = self.entry["model_output"]
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return PendingOutput(
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=[list(model_output[rid]) for rid in req_ids],
            )
        )


def replay_async(trace: dict) -> None:
    """Drive nano_v1's `EngineCore.step_with_batch_queue` and `AsyncScheduler` through a trace of
    v0.11.0's; raise TraceMismatch at the first field that differs. Each trace step is one
    call of the loop: what it scheduled (or None), the outputs of the step it waited for (or
    None), and the state it left, placeholders included."""
    workload, config = "async/" + trace["workload"], trace["config"]
    sched = build_scheduler(config, async_scheduling=True)
    block_hasher = get_request_block_hasher(config["block_size"]) if config["enable_prefix_caching"] else None
    specs = {spec["req_id"]: spec for spec in trace["requests"]}
    executor = TraceExecutor()
    core = EngineCore.__new__(EngineCore)  # the loop's state only: no model, no workers
    core.scheduler, core.model_executor = sched, executor
    core.batch_queue_size = 2
    core.batch_queue = deque(maxlen=2)
    scheduled: list[dict] = []
    schedule = sched.schedule

    def recording_schedule() -> SchedulerOutput:
        was_running = [r.request_id for r in sched.running]
        scheduler_output = schedule()
        scheduled.append(schedule_fields(sched, scheduler_output, was_running))
        return scheduler_output

    sched.schedule = recording_schedule
    for entry in trace["steps"]:
        step = entry["step"]
        apply_trace_step_requests(sched, entry, specs, block_hasher)
        scheduled.clear()
        executor.entry = entry
        engine_outputs = core.step_with_batch_queue()
        actual = {
            "schedule": scheduled[0] if scheduled else None,
            "outputs": None if engine_outputs is None else output_fields(engine_outputs.outputs),
        }
        compare(workload, step, entry, actual, ("schedule", "outputs"), {"schedule", "outputs"})
        after = dict(state_fields(sched), **placeholder_fields(sched))
        fields = (*STATE_FIELDS, "after.num_output_placeholders")
        compare(workload, step, entry["after"], after, fields, set(fields))
    assert not sched.has_unfinished_requests() and not core.batch_queue, (
        f"{workload}: nano_v1 has work left after the trace's last step"
    )


@pytest.mark.ch14
def test_async_traces_are_v0_11_0s_and_overlap():
    assert len(ASYNC_WORKLOADS) >= 10
    for workload in ASYNC_WORKLOADS:
        trace = json.loads((ASYNC_TRACES / f"{workload}.json").read_text())
        assert trace["vllm_version"] == "0.11.0" and trace["workload"] == workload
        assert any(s["schedule"] and s["outputs"] is not None for s in trace["steps"]), (
            f"{workload}: no step was scheduled while the one before it ran"
        )


@pytest.mark.ch14
@pytest.mark.parametrize("workload", ASYNC_WORKLOADS)
def test_async_replay_matches_vllm(workload):
    """Every recorded field of every call of the batch-queue loop, block ids and placeholders included."""
    replay_async(json.loads((ASYNC_TRACES / f"{workload}.json").read_text()))
