"""The unified scheduler against invariants and a brute-force "KV memory" model.

The fake model runner (tests/helpers/scheduler.py) sees only what a real runner sees (the `SchedulerOutput`
diff and its own samples). It simulates the paged KV cache as a table slot -> token and
checks, every step, that each scheduled request's whole context is present in its
blocks. Its "model" is a deterministic function of the token history, so the final
outputs must equal a direct computation no matter how requests were chunked, preempted
or served from the prefix cache. With `num_spec_tokens > 0` it also proposes random
drafts (right or wrong) and verifies them exactly, as speculative decoding does (chapter 10).
"""

from __future__ import annotations

import random

import pytest
from helpers.scheduler import FakeModelRunner, make_requests, make_scheduler, reference_output, run_workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch04


@pytest.mark.ch04_t2
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 96),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    abort_prob=st.sampled_from([0.0, 0.1]),
    policy=st.sampled_from(["fcfs", "priority"]),
    reserve_full_isl=st.booleans(),
)
def test_scheduler_invariants_and_outputs(
    seed, block_size, budget, max_seqs, caching, abort_prob, policy, reserve_full_isl
):
    """Rule: «What it lacks», and «No prompt may hog a step» «Nor outgrow the context»: over random workloads,
    the scheduler's invariants hold and every request gets its outputs."""
    rng = random.Random(seed)
    max_prompt, max_out = 40, 12
    max_model_len = 3 * 16 + max_prompt + max_out + 1
    # Between "one request at a time" and "plenty": small pools force preemption.
    num_blocks = rng.randint(max_model_len // block_size + 2, 3 * max_model_len // block_size + 2)
    sched = make_scheduler(
        num_blocks, block_size, budget, max_seqs, max_model_len, caching, policy=policy,
        reserve_full_isl=reserve_full_isl,
    )  # fmt: skip
    requests = make_requests(rng, rng.randint(1, 12), block_size, max_prompt, max_out, shared=True)
    for r in requests:
        r.priority = rng.randint(0, 2)
    outputs, aborted = run_workload(sched, requests, abort_prob, rng)
    for r in requests:
        if r.request_id in aborted:
            continue
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
            f"{r.request_id} ended {r.status.name}, not at max_tokens"
        )
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens), (
            f"{r.request_id}'s outputs differ from the model's own continuation of its prompt"
        )


@pytest.mark.ch04_t2
def test_chunked_prefill_splits_long_prompt_under_budget():
    """Rule: «What it lacks», before the budget: a long prompt lacks all its tokens, and the budget cuts it
    into chunks."""
    sched = make_scheduler(64, 4, budget=10, max_seqs=4, max_model_len=100, caching=False)
    runner = FakeModelRunner(4)
    req = Request("a", list(range(1, 26)), SamplingParams(max_tokens=2, ignore_eos=True), None)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished_requests() and len(chunks) < 10:
        so = sched.schedule()
        chunks.append(so.num_scheduled_tokens.get("a", 0))
        sched.update_from_output(so, runner.execute_model(so))
    assert chunks == [10, 10, 5, 1], (
        f"a 25-token prompt under a budget of 10 was scheduled in steps of {chunks}; expected chunks of "
        "10, 10 and 5, then one decode"
    )


@pytest.mark.ch04_t2
def test_decodes_and_prefill_share_one_step():
    """Rule: «What it lacks»: a decode lacks one token, a new prompt all of its own."""
    sched = make_scheduler(64, 4, budget=8, max_seqs=4, max_model_len=100, caching=False)
    runner = FakeModelRunner(4)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), None))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    sched.add_request(Request("c", list(range(1, 21)), SamplingParams(max_tokens=5, ignore_eos=True), None))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}, (
        f"two decodes and a new 20-token prompt under a budget of 8 scheduled {so.num_scheduled_tokens}; the "
        "decodes take 1 token each and the prompt the 6 left"
    )


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched = make_scheduler(64, 4, budget=10, max_seqs=4, max_model_len=100, caching=False, chunked=False)
    runner = FakeModelRunner(4)
    sched.add_request(Request("a", [1] * 4, SamplingParams(max_tokens=3, ignore_eos=True), None))
    sched.add_request(Request("b", [2] * 9, SamplingParams(max_tokens=3, ignore_eos=True), None))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4}  # b (9 tokens) does not fit in the 6 left
    sched.update_from_output(so, runner.execute_model(so))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_lets_smaller_ones_pass():
    """vLLM v0.11.0 skips a whole prompt larger than the budget left and admits those behind it."""
    sched = make_scheduler(64, 4, budget=10, max_seqs=4, max_model_len=100, caching=False, chunked=False)
    for rid, n in (("a", 4), ("b", 9), ("c", 5), ("d", 9)):
        sched.add_request(Request(rid, [1] * n, SamplingParams(max_tokens=3, ignore_eos=True), None))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4, "c": 5}  # b and d wait; c fits in the 6 left
    # The skipped ones go back to the front, in v0.11.0's order (the last skipped first).
    assert [r.request_id for r in sched.waiting] == ["d", "b"]


def test_full_prompt_admission_gate():
    """scheduler_reserve_full_isl: a prompt is admitted only if the cache holds all of it.

    10 usable blocks of 4 tokens. "a" (16 prompt tokens) prefills in two steps and then
    decodes into a 5th block, leaving 5 free. "b" has a 30-token prompt (8 blocks): its
    first chunk, the 9 tokens the budget has left, fits in 3 blocks; its whole prompt does not.
    """
    for gate, admitted in ((False, True), (True, False)):
        sched = make_scheduler(11, 4, budget=10, max_seqs=4, max_model_len=40, caching=False, reserve_full_isl=gate)
        runner = FakeModelRunner(4)
        sched.add_request(Request("a", [1] * 16, SamplingParams(max_tokens=8, ignore_eos=True), None))
        for _ in range(2):
            so = sched.schedule()
            sched.update_from_output(so, runner.execute_model(so))
        sched.add_request(Request("b", [2] * 30, SamplingParams(max_tokens=2, ignore_eos=True), None))
        so = sched.schedule()
        assert ("b" in so.num_scheduled_tokens) == admitted, gate
        free_blocks = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        if admitted:
            assert so.num_scheduled_tokens == {"a": 1, "b": 9} and free_blocks == 2
        else:
            assert so.num_scheduled_tokens == {"a": 1} and free_blocks == 5  # b took nothing


def test_preemption_sends_victim_to_head_of_queue_and_recomputes():
    block_size = 4
    # 6 usable blocks: two requests of 12 prompt tokens fill them; decoding needs a 7th.
    sched = make_scheduler(7, block_size, budget=64, max_seqs=4, max_model_len=20, caching=False)
    runner = FakeModelRunner(block_size)
    reqs = [Request(rid, [i + 1] * 12, SamplingParams(max_tokens=4, ignore_eos=True), None) for i, rid in enumerate("ab")]
    for r in reqs:
        sched.add_request(r)
    outputs = {"a": [], "b": []}
    preempted_seen = False
    while sched.has_unfinished_requests():
        so = sched.schedule()
        if reqs[1].status == RequestStatus.PREEMPTED:
            preempted_seen = True
            assert sched.waiting.peek_request() is reqs[1]
            assert reqs[1].num_computed_tokens == 0
        for out in sched.update_from_output(so, runner.execute_model(so)).outputs:
            outputs[out.request_id].extend(out.new_token_ids)
    assert preempted_seen and reqs[1].num_preemptions >= 1
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, 4)


def test_prefix_cache_hit_on_admission_counts_cached_tokens():
    block_size = 4
    sched = make_scheduler(64, block_size, budget=64, max_seqs=4, max_model_len=100, caching=True)
    runner = FakeModelRunner(block_size)
    hasher = get_request_block_hasher(block_size)
    shared = list(range(1, 14))  # 13 tokens: 3 full blocks
    first = Request("a", shared, SamplingParams(max_tokens=1, ignore_eos=True), None, block_hasher=hasher)
    sched.add_request(first)
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    second = Request("b", shared + [40, 41], SamplingParams(max_tokens=1, ignore_eos=True), None, block_hasher=hasher)
    sched.add_request(second)
    so = sched.schedule()
    assert second.num_cached_tokens == 12
    assert so.num_scheduled_tokens == {"b": 3}
    # The same prompt again: never a full hit, the last token is always recomputed.
    third = Request("c", list(shared[:12]), SamplingParams(max_tokens=1, ignore_eos=True), None, block_hasher=hasher)
    sched.update_from_output(so, runner.execute_model(so))
    sched.add_request(third)
    so = sched.schedule()
    assert third.num_cached_tokens == 8 and so.num_scheduled_tokens["c"] == 4


def test_stop_token_and_abort_free_blocks():
    sched = make_scheduler(32, 4, budget=64, max_seqs=4, max_model_len=100, caching=True)
    runner = FakeModelRunner(4)
    prompt = [3, 4, 5]
    stop_tok = reference_output(prompt, 3)[2]
    params = SamplingParams(max_tokens=10, stop_token_ids=[stop_tok])
    hasher = get_request_block_hasher(4)
    a = Request("a", prompt, params, None, block_hasher=hasher)
    b = Request("b", [9] * 10, SamplingParams(max_tokens=50, ignore_eos=True), None, block_hasher=hasher)
    sched.add_request(a)
    sched.add_request(b)
    outs = []
    for _ in range(4):
        so = sched.schedule()
        outs += [o for o in sched.update_from_output(so, runner.execute_model(so)).outputs if o.request_id == "a"]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_tok
    sched.finish_requests(["b", "unknown-id"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1
