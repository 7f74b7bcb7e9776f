"""The scheduler without a model: a fake model runner, workloads, and the outputs they must give.

- `make_scheduler`: a `Scheduler` over a KV cache config, no checkpoint (chapter 04).
- `FakeModelRunner` sees only what a real runner sees (the `SchedulerOutput` diff and its
  own samples). It simulates the paged KV cache as a table slot -> token and checks, every
  step, that each scheduled request's whole context is present in its blocks. Its "model"
  (`next_token`) is a deterministic function of the token history, so the final outputs
  must equal `reference_output` no matter how requests were chunked, preempted or served
  from the prefix cache. With `num_spec_tokens > 0` it also proposes random drafts (right
  or wrong) and verifies them exactly, as speculative decoding does (chapter 10).
- `make_requests` and `run_workload` drive a scheduler with random arrivals and aborts,
  checking the budget and `check_kv_invariants` (block reference counts) every step.
"""

from __future__ import annotations

import random
import types

from helpers.kv_cache import full_attention_kv_cache_config
from nano_v1.config import CacheConfig, DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.async_scheduler import AsyncScheduler
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.outputs import DraftTokenIds, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams

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
            (self.block_ids[new.req_id],) = map(list, new.block_ids)  # one KV cache group
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.max_tokens[new.req_id] = len(new.prompt_token_ids) + new.sampling_params.max_tokens
        cached = so.scheduled_cached_reqs
        for rid, resumed, new_blocks, computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
        ):
            if resumed:
                (self.block_ids[rid],) = map(list, new_blocks)
            elif new_blocks is not None:
                self.block_ids[rid].extend(new_blocks[0])
                # Progress must match what the runner itself has computed so far.
                assert computed == self.num_computed[rid], (
                    f"{rid}: the scheduler says {computed} tokens are computed; the runner computed {self.num_computed[rid]}"
                )
            self.num_computed[rid] = computed

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            start, n = self.num_computed[rid], so.num_scheduled_tokens[rid]
            tokens = self.tokens[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            context = tokens + drafts
            assert n >= 1 and start + n <= len(context), (
                f"{rid}: {n} tokens scheduled from position {start}, but it has only {len(tokens)} tokens "
                f"and {len(drafts)} drafts"
            )
            assert not drafts or start + n == len(context), (
                f"{rid}: {n} tokens scheduled from position {start} with {len(drafts)} drafts: drafts are "
                "scheduled whole, after every known token"
            )
            # A prefix-cache hit must have handed us blocks that already hold our tokens, and
            # a rejected draft's slot must have been rewritten before it counts as computed.
            for pos in range(start):
                assert self.kv.get(self.slot(rid, pos)) == tokens[pos], (
                    f"{rid}: the KV at position {pos} is not its token's, yet the scheduler counts it computed"
                )
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
        for blocks in manager.get_blocks(req.request_id).blocks:  # every KV cache group (chapter 12)
            assert len(blocks) * sched.block_size >= req.num_computed_tokens, (
                f"{req.request_id} has {req.num_computed_tokens} computed tokens but only {len(blocks)} blocks"
            )
            for b in blocks:
                if not b.is_null:  # a sliding window's dropped blocks (chapter 12)
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for block in manager.block_pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), (
            f"block {block.block_id} has ref_cnt {block.ref_cnt} but {holders.get(block.block_id, 0)} running holders"
        )
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "only cached full blocks may be shared"


def arrive_and_abort(
    sched: Scheduler, pending: list[Request], abort_prob: float, rng: random.Random, aborted: set[str]
) -> None:
    """One step's arrivals (0 to 3 of the pending requests) and, with `abort_prob`, one abort."""
    for _ in range(rng.randint(0, 3)):
        if pending:
            sched.add_request(pending.pop(0))
    if sched.requests and rng.random() < abort_prob:
        victim = rng.choice(sorted(sched.requests))
        sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        aborted.add(victim)


def run_workload(
    sched: Scheduler, requests, abort_prob: float, rng: random.Random, max_steps: int = 5000, runner=None
):
    runner = runner or FakeModelRunner(sched.block_size, sched.num_spec_tokens, rng)
    pending = list(requests)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    aborted: set[str] = set()
    steps = 0
    while pending or sched.has_unfinished_requests():
        steps += 1
        assert steps < max_steps, f"the scheduler stopped making progress ({max_steps} steps)"
        arrive_and_abort(sched, pending, abort_prob, rng, aborted)
        if not sched.has_unfinished_requests():
            continue
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()), "the total is the sum"
        assert so.total_num_scheduled_tokens <= sched.max_num_scheduled_tokens, (
            f"{so.total_num_scheduled_tokens} tokens scheduled, over the budget of {sched.max_num_scheduled_tokens}"
        )
        assert len(so.num_scheduled_tokens) <= sched.max_num_running_reqs, (
            "more requests scheduled than max_num_seqs"
        )
        assert len(sched.running) <= sched.max_num_running_reqs, "more requests running than max_num_seqs"
        check_kv_invariants(sched)
        for out in sched.update_from_output(so, runner.execute_model(so)).outputs:
            outputs[out.request_id].extend(out.new_token_ids)
        draft_token_ids = runner.take_draft_token_ids()
        if draft_token_ids is not None:
            sched.update_draft_token_ids(draft_token_ids)
        check_kv_invariants(sched)
    # Every block is back in the free queue once nothing is running.
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1, "with every request done, every block is free"
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


def make_scheduler(
    num_blocks, block_size, budget, max_seqs, max_model_len, caching,
    chunked=True, policy="fcfs", num_spec_tokens=0, reserve_full_isl=False, kv_cache_config=None,
    async_scheduling=False, kv_transfer_config=None,
) -> Scheduler:  # fmt: skip
    """A scheduler over `num_blocks` KV blocks (block 0 is the null block), with no checkpoint.

    One full-attention KV cache group unless the test brings its own `kv_cache_config` (chapter 12);
    an `AsyncScheduler` with `async_scheduling` (chapter 14); a KV connector with `kv_transfer_config` (chapter 16).
    """
    config = VllmConfig.__new__(VllmConfig)
    config.cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=caching, num_gpu_blocks=num_blocks
    )
    config.scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        policy=policy,
        scheduler_reserve_full_isl=reserve_full_isl,
        async_scheduling=async_scheduling,
    )
    # The scheduler reads only max_model_len and whether the model takes images (chapter 11)
    # from the model's config: no checkpoint needed.
    config.model_config = types.SimpleNamespace(max_model_len=max_model_len, is_multimodal_model=False)
    config.device_config = DeviceConfig("cpu")
    if num_spec_tokens:
        config.speculative_config = SpeculativeConfig(
            num_speculative_tokens=num_spec_tokens, prompt_lookup_min=1
        )
    config.kv_transfer_config = kv_transfer_config
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_cls(config, kv_cache_config or full_attention_kv_cache_config(num_blocks, block_size))

