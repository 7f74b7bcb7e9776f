"""The fields of one trace step, read alike from vLLM v0.11.0's scheduler and from nano_v1's.

Why it exists: record_traces.py reads these fields from vLLM (in vLLM's own virtual
environment) and tests/test_vllm_traces.py reads them from nano_v1 (in CI, without vLLM).
One definition for both sides means a field cannot mean one thing when recorded and
another when replayed. It imports neither engine: both schedulers expose the same names.

Both keep a value per KV cache group (nano_v1 since chapter 12): block ids as a tuple of
lists (None for "no new blocks"), `num_common_prefix_blocks` as a list of counts. The
recorded workloads run a model of one full-attention group, so a trace stores that
group's value (`first_group`). The async traces (chapter 14) add each request's
placeholders (`placeholder_fields`), and their batch queue holds `PendingOutput`s.
"""

from __future__ import annotations


def first_group(value):
    """One KV cache group's value out of a per-group one; None ("no new blocks") is []."""
    return [] if value is None else value[0]


def schedule_fields(scheduler, so, was_running: list[str]) -> dict:
    """What `schedule()` decided: its SchedulerOutput, and who it preempted (from `was_running`)."""
    cached = so.scheduled_cached_reqs
    pairs = list(zip(cached.req_ids, cached.resumed_from_preemption))
    return {
        "scheduled": dict(so.num_scheduled_tokens),
        "total_num_scheduled_tokens": so.total_num_scheduled_tokens,
        "new_req_ids": [r.req_id for r in so.scheduled_new_reqs],
        "resumed_req_ids": [rid for rid, resumed in pairs if resumed],
        "running_req_ids": [rid for rid, resumed in pairs if not resumed],
        "preempted_req_ids": [
            rid for rid in was_running if scheduler.requests[rid].status.name == "PREEMPTED"
        ],
        "finished_req_ids": sorted(so.finished_req_ids),
        "spec_decode_tokens": {rid: list(t) for rid, t in so.scheduled_spec_decode_tokens.items()},
        # New requests: their whole block list; the others: the blocks added this step.
        "block_ids": {
            **{r.req_id: list(first_group(r.block_ids)) for r in so.scheduled_new_reqs},
            **{rid: list(first_group(ids)) for rid, ids in zip(cached.req_ids, cached.new_block_ids)},
        },
        # For a new or resumed request, this is its prefix-cache hit.
        "scheduled_num_computed_tokens": {
            **{r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs},
            **dict(zip(cached.req_ids, cached.num_computed_tokens)),
        },
        "num_common_prefix_blocks": first_group(so.num_common_prefix_blocks),
    }


def output_fields(engine_core_outputs) -> dict:
    """What `update_from_output` reported per request: its new tokens and why it finished, if it did."""
    return {
        out.request_id: {
            "new_token_ids": list(out.new_token_ids),
            "finish_reason": None if out.finish_reason is None else str(out.finish_reason),
            "stop_reason": out.stop_reason,
        }
        for out in engine_core_outputs
    }


def state_fields(scheduler) -> dict:
    """The state a step leaves: queues, progress, drafts, block tables and the free queue's order."""
    manager = scheduler.kv_cache_manager
    live = [r.request_id for r in scheduler.running] + [r.request_id for r in scheduler.waiting]
    tables = {rid: list(first_group(manager.get_block_ids(rid))) for rid in live}
    return {
        "running": [r.request_id for r in scheduler.running],
        "waiting": [r.request_id for r in scheduler.waiting],
        "num_computed_tokens": {rid: scheduler.requests[rid].num_computed_tokens for rid in live},
        # Drafts of running requests, and apart those of waiting ones (v0.11.0 keeps them on preemption).
        "spec_token_ids": {
            r.request_id: list(r.spec_token_ids) for r in scheduler.running if r.spec_token_ids
        },
        "waiting_spec_token_ids": {
            r.request_id: list(r.spec_token_ids) for r in scheduler.waiting if r.spec_token_ids
        },
        "block_ids": {rid: table for rid, table in tables.items() if table},
        "num_free_blocks": manager.block_pool.get_num_free_blocks(),
        "free_block_queue": [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()],
    }


def placeholder_fields(scheduler) -> dict:
    """Async scheduling's own state (chapter 14): each live request's tokens still on their way."""
    live = [r.request_id for r in scheduler.running] + [r.request_id for r in scheduler.waiting]
    return {"num_output_placeholders": {rid: scheduler.requests[rid].num_output_placeholders for rid in live}}


class PendingOutput:
    """A step's output in the batch queue of the async traces (`record_async` records them,
    tests/test_async_scheduling.py replays them): never done before the engine waits for
    it, so every step is scheduled while the one before it runs (a device slower than the host)."""

    def __init__(self, output) -> None:
        self.output = output

    def done(self) -> bool:
        return False

    def result(self):
        return self.output
