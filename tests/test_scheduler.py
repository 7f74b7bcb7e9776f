"""The unified scheduler against invariants and a brute-force "KV memory" model.

The fake model runner below sees only what a real runner sees (the `SchedulerOutput`
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
from conftest import make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.outputs import DraftTokenIds, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch04

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole history."""
    return (sum(tokens) * 31 + len(tokens) * 7 + tokens[-1]) % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeModelRunner:
    """Holds per-request state from the scheduler's diffs and a slot -> token KV memory."""

    def __init__(self, block_size: int, num_spec_tokens: int = 0, rng: random.Random | None = None) -> None:
        self.block_size = block_size
        self.kv: dict[int, int] = {}  # slot -> token whose KV lives there
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.max_tokens: dict[str, int] = {}
        self.num_spec_tokens = num_spec_tokens
        self.rng = rng
        self.draft_token_ids: DraftTokenIds | None = None

    def slot(self, req_id: str, pos: int) -> int:
        return self.block_ids[req_id][pos // self.block_size] * self.block_size + pos % self.block_size

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            for d in (self.tokens, self.block_ids, self.num_computed, self.max_tokens):
                d.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.block_ids[new.req_id] = list(new.block_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.max_tokens[new.req_id] = len(new.prompt_token_ids) + new.sampling_params.max_tokens
        cached = so.scheduled_cached_reqs
        for rid, resumed, new_blocks, computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
        ):
            if resumed:
                self.block_ids[rid] = list(new_blocks)
            else:
                self.block_ids[rid].extend(new_blocks)
                # Progress must match what the runner itself has computed so far.
                assert computed == self.num_computed[rid], (rid, computed, self.num_computed[rid])
            self.num_computed[rid] = computed

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            start, n = self.num_computed[rid], so.num_scheduled_tokens[rid]
            tokens = self.tokens[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            context = tokens + drafts
            assert n >= 1 and start + n <= len(context), (rid, start, n, len(tokens), drafts)
            assert not drafts or start + n == len(context), "drafts are scheduled whole, after every known token"
            # A prefix-cache hit must have handed us blocks that already hold our tokens, and
            # a rejected draft's slot must have been rewritten before it counts as computed.
            for pos in range(start):
                assert self.kv.get(self.slot(rid, pos)) == tokens[pos], f"{rid}: stale KV at position {pos}"
            for pos in range(start, start + n):
                self.kv[self.slot(rid, pos)] = context[pos]
            if start + n < len(tokens):
                self.num_computed[rid] = start + n
                sampled.append([])  # a prefill chunk short of the last prompt token
                continue
            # Exact verification: keep drafts while they equal the model's own next token.
            new_tokens = []
            for draft in [*drafts, None]:  # None: the bonus position after the last draft
                new_tokens.append(next_token(tokens))
                tokens.append(new_tokens[-1])
                if new_tokens[-1] != draft:
                    break
            assert len(tokens) <= self.max_tokens[rid], f"{rid}: drafts took it past max_tokens"
            self.num_computed[rid] = len(tokens) - 1  # KV is valid up to the last kept draft
            sampled.append(new_tokens)
        if self.num_spec_tokens:
            self.draft_token_ids = DraftTokenIds(req_ids, [self.propose(r) if s else [] for r, s in zip(req_ids, sampled)])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    def propose(self, req_id: str) -> list[int]:
        """Up to k drafts, each the true continuation (70%) or a random token."""
        tokens = list(self.tokens[req_id])
        drafts = []
        for _ in range(self.rng.randint(0, self.num_spec_tokens)):
            drafts.append(next_token(tokens) if self.rng.random() < 0.7 else self.rng.randrange(VOCAB))
            tokens.append(drafts[-1])
        return drafts

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        draft_token_ids, self.draft_token_ids = self.draft_token_ids, None
        return draft_token_ids


def check_kv_invariants(sched: Scheduler) -> None:
    manager = sched.kv_cache_manager
    holders: dict[int, int] = {}
    for req in sched.running:
        blocks = manager.req_to_blocks[req.request_id]
        assert len(blocks) * sched.block_size >= req.num_computed_tokens
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for block in manager.block_pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "only cached full blocks may be shared"


def run_workload(sched: Scheduler, requests, abort_prob: float, rng: random.Random, max_steps: int = 5000):
    runner = FakeModelRunner(sched.block_size, sched.num_spec_tokens, rng)
    pending = list(requests)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    aborted: set[str] = set()
    steps = 0
    while pending or sched.has_unfinished_requests():
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if sched.requests and rng.random() < abort_prob:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        if not sched.has_unfinished_requests():
            continue
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= sched.max_num_scheduled_tokens
        assert len(so.num_scheduled_tokens) <= sched.max_num_running_reqs
        assert len(sched.running) <= sched.max_num_running_reqs
        check_kv_invariants(sched)
        for out in sched.update_from_output(so, runner.execute_model(so)).outputs:
            outputs[out.request_id].extend(out.new_token_ids)
        draft_token_ids = runner.take_draft_token_ids()
        if draft_token_ids is not None:
            sched.update_draft_token_ids(draft_token_ids)
        check_kv_invariants(sched)
    # Every block is back in the free queue once nothing is running.
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1
    return outputs, aborted


def make_requests(rng: random.Random, num: int, block_size: int, max_prompt: int, max_out: int, shared: bool):
    prefix = [rng.randrange(VOCAB) for _ in range(3 * block_size)]
    requests = []
    for i in range(num):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
        if shared and rng.random() < 0.6:
            prompt = prefix[: rng.randint(block_size, len(prefix))] + prompt
        params = SamplingParams(max_tokens=rng.randint(1, max_out), ignore_eos=True)
        requests.append(
            Request(f"r{i}", prompt, params, eos_token_id=None, block_hasher=get_request_block_hasher(block_size))
        )
    return requests


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
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens)


@pytest.mark.ch04_t2
def test_chunked_prefill_splits_long_prompt_under_budget():
    sched = make_scheduler(64, 4, budget=10, max_seqs=4, max_model_len=100, caching=False)
    runner = FakeModelRunner(4)
    req = Request("a", list(range(1, 26)), SamplingParams(max_tokens=2, ignore_eos=True), None)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        chunks.append(so.num_scheduled_tokens["a"])
        sched.update_from_output(so, runner.execute_model(so))
    # 25 prompt tokens in chunks of <= 10, then one decode step.
    assert chunks == [10, 10, 5, 1]


@pytest.mark.ch04_t2
def test_decodes_and_prefill_share_one_step():
    sched = make_scheduler(64, 4, budget=8, max_seqs=4, max_model_len=100, caching=False)
    runner = FakeModelRunner(4)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), None))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    sched.add_request(Request("c", list(range(1, 21)), SamplingParams(max_tokens=5, ignore_eos=True), None))
    so = sched.schedule()
    # Running requests decode (1 token each); the newcomer gets the rest of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}


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
