"""The persistent batch and the runner's input preparation against a from-scratch rebuild.

A random but legal fake scheduler (new requests with prefix hits, chunked prefills,
decodes, skipped steps, preemption and resumption with fresh blocks, finishes) keeps a
plain per-request record of the truth: prompt, outputs, computed count, block list. Every
step, the runner applies only the scheduler's diff; its flat inputs are then compared
with a naive rebuild from those per-request lists, written as plainly as possible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers.checkpoints import TINY_SHAPES, make_vllm_config
from helpers.kv_cache import full_attention_kv_cache_config
from torch import nn

from nano_v1.config import VllmConfig
from nano_v1.core.kv_cache_utils import get_kv_cache_configs
from nano_v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from nano_v1.outputs import ModelRunnerOutput
from nano_v1.sample.logits_processor import MinTokensLogitsProcessor
from nano_v1.sample.sampler import SamplerOutput
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from nano_v1.worker.gpu_model_runner import GPUModelRunner

pytestmark = pytest.mark.ch05

VOCAB = TINY_SHAPES["vocab_size"]  # also the tiny checkpoint's, for the real-model test
BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
MAX_NUM_SEQS = 8
BUDGET = 48
NUM_BLOCKS = 4096  # block ids are drawn at random from 1 .. NUM_BLOCKS - 1
ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=MAX_MODEL_LEN,
    block_size=BLOCK_SIZE,
    max_num_seqs=MAX_NUM_SEQS,
    max_num_batched_tokens=BUDGET,
)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory) -> VllmConfig:
    # Only config.json is needed: these tests never load weights.
    path = tmp_path_factory.mktemp("config_only")
    transformers.Qwen3Config(**TINY_SHAPES, head_dim=32, architectures=["Qwen3ForCausalLM"]).save_pretrained(
        path
    )
    return make_vllm_config(str(path), **ENGINE_ARGS)


class CharTokenizer:
    """One token per character: enough to turn bad words into token ids."""

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def random_logits_params(rng: random.Random) -> dict:
    """The SamplingParams fields whose state the persistent batch keeps beyond plain columns."""
    return dict(
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        logit_bias=rng.choice([None, {3: 2.0, 11: -5.0}]),
        allowed_token_ids=rng.choice([None, None, [1, 2, 3, 40]]),
        bad_words=rng.choice([[], [], ["ab", "c"]]),
    )


def tokenized(params: SamplingParams) -> SamplingParams:
    params.update_from_tokenizer(CharTokenizer())
    return params


def random_params(rng: random.Random, penalties: bool = True) -> SamplingParams:
    """Random parameters; without `penalties`, none of the three (the same draws otherwise)."""
    logits_params = random_logits_params(rng)
    if not penalties:
        logits_params.update(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    return tokenized(
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 5]),
            seed=rng.choice([None, rng.randrange(1000)]),
            logprobs=rng.choice([None, None, 0, 3]),
            max_tokens=rng.randint(1, 12),
            **logits_params,
        )
    )


def check_sampling_state(
    batch: InputBatch, prompts_outputs_params: list[tuple[list[int], list[int], SamplingParams]]
) -> None:
    """After `refresh_metadata`, the state the batch updated by diff equals the state rebuilt from
    each row's request: penalty columns and token bins, allowed-token mask, bad words, the
    logits processors' rows and the sampling metadata."""
    md = batch.sampling_metadata
    penalized = {}
    min_p, biases = {}, {}
    for i, (prompt, outputs, params) in enumerate(prompts_outputs_params):
        assert batch.presence_penalties.np[i] == pytest.approx(params.presence_penalty)
        assert batch.frequency_penalties.np[i] == pytest.approx(params.frequency_penalty)
        assert batch.repetition_penalties.np[i] == pytest.approx(params.repetition_penalty)
        if (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) != (0.0, 0.0, 1.0):
            penalized[i] = (prompt, outputs)
        if params.min_p > 0:
            min_p[i] = params.min_p
        if params.logit_bias:
            biases[i] = params.logit_bias
        assert md.output_token_ids[i] is outputs
        masked = torch.ones(VOCAB, dtype=torch.bool)  # True where the row may not sample
        masked[params.allowed_token_ids or list(range(VOCAB))] = False
        if md.allowed_token_ids_mask is not None:
            assert torch.equal(md.allowed_token_ids_mask[i], masked)
        else:
            assert params.allowed_token_ids is None
    assert md.no_penalties == (not penalized)
    for i, (prompt, outputs) in penalized.items():
        assert torch.equal(md.prompt_mask[i], torch.bincount(torch.tensor(prompt), minlength=VOCAB) > 0)
        want_counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=VOCAB)
        assert torch.equal(md.output_bin_counts[i].long(), want_counts)
    assert md.bad_words_token_ids == {
        i: p.bad_words_token_ids for i, (_, _, p) in enumerate(prompts_outputs_params) if p.bad_words
    }
    processors = {type(p).__name__: p for p in batch.logitsprocs}
    assert processors["MinPLogitsProcessor"].min_p == min_p
    if min_p:
        column = processors["MinPLogitsProcessor"].min_p_column.squeeze(1).tolist()
        assert column == pytest.approx([min_p.get(i, 0.0) for i in range(len(prompts_outputs_params))])
    assert processors["LogitBiasLogitsProcessor"].biases == biases


# ---------------------------------------------------------------------------- fake scheduler
@dataclass
class TruthRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_len: int  # finishes once it holds this many tokens
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    state: str = "waiting"  # waiting | running | preempted

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class FakeScheduler:
    """Random legal SchedulerOutputs; a plain record of what each request should look like."""

    def __init__(
        self,
        rng: random.Random,
        spawn: bool = True,
        p_preempt: float = 0.05,
        p_skip: float = 0.05,
        chunk: bool = True,
        prefix_hits: bool = True,
        max_requests: int = 60,
        penalties: bool = True,
    ) -> None:
        self.rng = rng
        self.penalties = penalties  # whether new requests may have penalties
        self.spawn, self.p_preempt, self.p_skip, self.chunk = spawn, p_preempt, p_skip, chunk
        # Fake prefix-cache hits: "computed" tokens whose blocks hold nothing. Only for runs
        # whose model does not read the KV cache.
        self.prefix_hits = prefix_hits
        self.max_requests = max_requests
        self.num_preemptions = 0
        self.live: dict[str, TruthRequest] = {}
        self.protected: set[str] = set()  # never finished at random
        self.finished: dict[str, TruthRequest] = {}
        self.free_blocks = set(range(1, NUM_BLOCKS))
        self.next_id = 0

    def add(self, prompt: list[int], params: SamplingParams, protected: bool = False) -> str:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        max_len = min(len(prompt) + params.max_tokens, MAX_MODEL_LEN - 1)
        self.live[req_id] = TruthRequest(req_id, list(prompt), params, max_len)
        if protected:
            self.protected.add(req_id)
        return req_id

    def has_work(self) -> bool:
        return bool(self.live)

    def _num_new_tokens(self, r: TruthRequest, budget: int) -> int:
        n = min(len(r.tokens) - r.computed, budget)
        return self.rng.randint(1, n) if self.chunk and self.rng.random() < 0.5 else n

    def _allocate(self, r: TruthRequest, n: int) -> list[int]:
        need = -(-(r.computed + n) // BLOCK_SIZE) - len(r.blocks)
        new = self.rng.sample(sorted(self.free_blocks), need) if need > 0 else []
        self.free_blocks.difference_update(new)
        r.blocks += new
        return new

    def _free(self, r: TruthRequest) -> None:
        self.free_blocks.update(r.blocks)
        r.blocks = []

    def _prefix_hit(self, r: TruthRequest) -> int:
        # A prefix-cache hit is whole blocks, and at least one token is always computed.
        return self.rng.randrange(0, len(r.tokens)) // BLOCK_SIZE * BLOCK_SIZE if self.prefix_hits else 0

    def schedule(self) -> SchedulerOutput:
        rng = self.rng
        finished = set()
        for r in list(self.live.values()):
            done = len(r.tokens) >= r.max_len
            aborted = r.req_id not in self.protected and rng.random() < 0.05  # waiting ones too
            if done or aborted:
                finished.add(r.req_id)
                self._free(r)
                self.finished[r.req_id] = self.live.pop(r.req_id)
        if self.spawn and self.next_id < self.max_requests and rng.random() < 0.6:
            self.add([rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))], random_params(rng, self.penalties))

        budget, num_scheduled = BUDGET, {}
        cached, new_reqs = CachedRequestData(), []

        def schedule_cached(r: TruthRequest, resumed: bool) -> None:
            nonlocal budget
            n = self._num_new_tokens(r, budget)
            new_blocks = self._allocate(r, n)
            cached.req_ids.append(r.req_id)
            cached.resumed_from_preemption.append(resumed)
            # One KV cache group; None when a running request gained no block.
            cached.new_block_ids.append(
                (list(r.blocks),) if resumed else (new_blocks,) if new_blocks else None
            )
            cached.num_computed_tokens.append(r.computed)
            num_scheduled[r.req_id] = n
            budget -= n

        for r in [r for r in self.live.values() if r.state == "running"]:
            u = rng.random()
            if u < self.p_preempt:
                r.state, r.computed = "preempted", 0
                self._free(r)
                self.num_preemptions += 1
            elif u < self.p_preempt + self.p_skip or budget == 0 or len(num_scheduled) == MAX_NUM_SEQS:
                pass  # keeps its blocks and progress, just not scheduled this step
            else:
                schedule_cached(r, resumed=False)
        for r in list(self.live.values()):
            if budget == 0 or len(num_scheduled) == MAX_NUM_SEQS:
                break
            if r.state == "preempted" and rng.random() < 0.5:
                r.state, r.computed = "running", self._prefix_hit(r)
                schedule_cached(r, resumed=True)
            elif r.state == "waiting":
                r.state, r.computed = "running", self._prefix_hit(r)
                n = self._num_new_tokens(r, budget)
                self._allocate(r, n)
                new_reqs.append(
                    NewRequestData(r.req_id, list(r.prompt), r.params, (list(r.blocks),), r.computed)
                )
                num_scheduled[r.req_id] = n
                budget -= n
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens={},
            num_common_prefix_blocks=[0],
            finished_req_ids=finished,
        )

    def update_from_output(self, so: SchedulerOutput, output: ModelRunnerOutput) -> None:
        for req_id, n in so.num_scheduled_tokens.items():
            r = self.live[req_id]
            r.computed += n
            sampled = output.sampled_token_ids[output.req_id_to_index[req_id]]
            # A sample is kept exactly when the step reached the request's last known token.
            assert len(sampled) == (1 if r.computed == len(r.tokens) else 0), (req_id, r.computed, sampled)
            r.outputs += sampled


# ---------------------------------------------------------------------------- naive oracle
def naive_inputs(sched: FakeScheduler, so: SchedulerOutput, req_ids: list[str]) -> dict[str, list[int]]:
    """Rebuild every flat input from the per-request lists, one token at a time."""
    out = {k: [] for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices", "discard")}
    out["query_start_loc"] = [0]
    for i, req_id in enumerate(req_ids):
        r = sched.live[req_id]
        n = so.num_scheduled_tokens[req_id]
        for pos in range(r.computed, r.computed + n):
            out["input_ids"].append(r.tokens[pos])
            out["positions"].append(pos)
            out["slot_mapping"].append(r.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        out["query_start_loc"].append(out["query_start_loc"][-1] + n)
        out["seq_lens"].append(r.computed + n)
        out["logits_indices"].append(out["query_start_loc"][-1] - 1)
        if r.computed + n < len(r.tokens):
            out["discard"].append(i)
    return out


# What each flat input holds, for the message when one differs from the naive rebuild.
FLAT_INPUTS = {
    "input_ids": "each token's id, from its request's row of the token table at its position",
    "positions": "each token's position: its request's computed tokens plus its offset in this step's chunk",
    "slot_mapping": "each token's KV cache slot, from its request's block table at its position",
    "query_start_loc": "where each request's tokens start in the flat batch, then where the last one ends",
    "seq_lens": "each request's context after the step: computed plus scheduled tokens",
    "logits_indices": "where each request's last scheduled token sits in the flat batch",
    "discard": "the rows whose chunk stops short of their known tokens",
}


def check_flat_input(name: str, got: list[int], want: list[int], so: SchedulerOutput) -> None:
    """`got` is the naive rebuild `want`, else the message names the first wrong entry."""
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    assert got == want, (
        f"{name} differs from a naive rebuild from entry {first} on: {got[first : first + 4]} instead of "
        f"{want[first : first + 4]} ({name} is {FLAT_INPUTS[name]}; tokens scheduled: {so.num_scheduled_tokens})"
    )


def check_batch_rows(runner: GPUModelRunner, sched: FakeScheduler, before_step: bool) -> None:
    """Every row of every column describes the request named by req_ids at that row.

    After a step the runner's computed counts lag until the next scheduler output brings them.
    """
    batch = runner.input_batch
    for i, req_id in enumerate(batch.req_ids):
        r = sched.live[req_id]
        state = runner.requests[req_id]
        assert batch.req_id_to_index[req_id] == i
        assert batch.num_tokens[i] == len(r.tokens) and batch.num_prompt_tokens[i] == len(r.prompt)
        assert batch.token_ids_cpu[i, : len(r.tokens)].tolist() == r.tokens
        if before_step:
            assert batch.num_computed_tokens_cpu[i] == r.computed
        assert batch.block_table[0].num_blocks_per_row[i] == len(r.blocks)
        assert batch.block_table[0].block_table.np[i, : len(r.blocks)].tolist() == r.blocks
        assert state.block_ids == (r.blocks,) and state.output_token_ids == r.outputs
        assert batch.temperature.np[i] == pytest.approx(r.params.temperature)
        assert batch.top_p.np[i] == pytest.approx(r.params.top_p)
        assert batch.top_k.np[i] == (r.params.top_k or VOCAB)
        assert batch.generators.get(i) is state.generator
        assert (state.generator is not None) == (r.params.seed is not None and r.params.temperature > 0)
    if before_step:  # the bins count the outputs up to the step about to run
        check_sampling_state(
            batch,
            [
                (sched.live[r].prompt, runner.requests[r].output_token_ids, sched.live[r].params)
                for r in batch.req_ids
            ],
        )
    metadata = batch.sampling_metadata
    expected_temperature = [sched.live[r].params.temperature for r in batch.req_ids]
    if metadata.all_greedy:
        assert not any(expected_temperature)
    else:
        assert metadata.temperature.tolist() == pytest.approx(expected_temperature)
    assert metadata.all_random == all(expected_temperature)


# ch05_t2's runs have no penalties: their bins are ch05_t3's, which a student writes after it.
@pytest.mark.parametrize("penalties", [pytest.param(False, marks=pytest.mark.ch05_t2), True])
@pytest.mark.parametrize("seed", range(6))
def test_prepare_inputs_matches_naive_rebuild(vllm_config, seed, penalties):
    """Rule: «Fills `self.input_ids` and `self.positions`» and the attention metadata, «with no loop over
    tokens», as a naive rebuild of every step's inputs does."""
    rng = random.Random(seed)
    sched = FakeScheduler(rng, penalties=penalties)
    runner = GPUModelRunner(vllm_config, torch.device("cpu"))
    steps_with_preemption_resume = 0
    for _ in range(150):
        so = sched.schedule()
        steps_with_preemption_resume += any(so.scheduled_cached_reqs.resumed_from_preemption)
        runner._update_states(so)
        batch = runner.input_batch
        assert set(batch.req_ids) == set(so.num_scheduled_tokens)
        # Preempted requests keep their state; waiting ones were never sent.
        assert set(runner.requests) == {r.req_id for r in sched.live.values() if r.state != "waiting"}
        if so.total_num_scheduled_tokens == 0:
            continue
        check_batch_rows(runner, sched, before_step=True)
        (common,), logits_indices, discard = runner._prepare_inputs(so)  # one KV cache group
        want = naive_inputs(sched, so, batch.req_ids)
        t = so.total_num_scheduled_tokens
        got = {
            "input_ids": runner.input_ids.np[:t].tolist(),
            "positions": runner.positions.np[:t].tolist(),
            "slot_mapping": common.slot_mapping.tolist(),
            "query_start_loc": common.query_start_loc.tolist(),
            "seq_lens": common.seq_lens.tolist(),
            "logits_indices": logits_indices.tolist(),
            "discard": discard.tolist(),
        }
        # Positions first: most other inputs are read at them.
        for name in ("positions", *(name for name in FLAT_INPUTS if name != "positions")):
            check_flat_input(name, got[name], want[name], so)
        assert common.num_actual_tokens == t and common.num_reqs == batch.num_reqs
        assert common.max_query_len == max(so.num_scheduled_tokens.values())
        assert common.max_seq_len == max(want["seq_lens"])
        for i, req_id in enumerate(batch.req_ids):
            blocks = sched.live[req_id].blocks
            assert common.block_table_tensor[i, : len(blocks)].tolist() == blocks
        # Stand-in for the model: random samples, kept or discarded by the runner.
        sampled = torch.tensor([[rng.randrange(VOCAB)] for _ in batch.req_ids], dtype=torch.int32)
        output = runner._bookkeeping_sync(SamplerOutput(sampled, None), discard)
        assert output.req_ids == batch.req_ids
        sched.update_from_output(so, output)
        check_batch_rows(runner, sched, before_step=False)
    assert steps_with_preemption_resume > 0 and sched.finished


# ---------------------------------------------------------------------------- InputBatch alone
def cpu_input_batch(max_num_reqs: int, max_model_len: int) -> InputBatch:
    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=VOCAB,
        block_sizes=[BLOCK_SIZE],
    )


def test_condense_keeps_rows_and_logits_processors_consistent():
    rng = random.Random(0)
    batch = cpu_input_batch(max_num_reqs=16, max_model_len=64)
    states: dict[str, CachedRequestState] = {}

    def check() -> None:
        assert batch.req_ids == [r for r in batch.req_ids if r is not None]  # dense
        assert sorted(batch.req_ids) == sorted(states)
        for i, req_id in enumerate(batch.req_ids):
            s = states[req_id]
            assert batch.req_id_to_index[req_id] == i
            assert batch.token_ids_cpu[i, : s.num_tokens].tolist() == s.prompt_token_ids + s.output_token_ids
            assert batch.num_tokens[i] == s.num_tokens
            assert batch.num_computed_tokens_cpu[i] == s.num_computed_tokens
            (ids,) = s.block_ids
            assert batch.block_table[0].block_table.np[i, : len(ids)].tolist() == ids
            assert batch.block_table[0].num_blocks_per_row[i] == len(ids)
            assert batch.temperature.np[i] == pytest.approx(s.sampling_params.temperature)
            assert batch.generators.get(i) is s.generator
        # The min-tokens processor, told only the batch's changes, knows exactly the rows still
        # short of their minimum, at their current rows.
        batch.refresh_metadata()
        check_sampling_state(
            batch,
            [
                (states[r].prompt_token_ids, states[r].output_token_ids, states[r].sampling_params)
                for r in batch.req_ids
            ],
        )
        (min_tokens,) = [p for p in batch.logitsprocs if isinstance(p, MinTokensLogitsProcessor)]
        short = {
            i: s.sampling_params.min_tokens
            for i, s in enumerate(states[r] for r in batch.req_ids)
            if len(s.output_token_ids) < s.sampling_params.min_tokens
        }
        assert {row: entry[0] for row, entry in min_tokens.min_toks.items()} == short

    for step in range(300):
        removed = []
        for req_id in rng.sample(sorted(states), k=rng.randint(0, min(3, len(states)))):
            removed.append(batch.remove_request(req_id))
            del states[req_id]
        removed.sort(reverse=True)
        for _ in range(rng.randint(0, 3)):
            if len(states) == batch.max_num_reqs:
                break
            n_prompt, n_out = rng.randint(1, 30), rng.randint(0, 10)
            temperature = rng.choice([0.0, 0.5, 1.5])
            s = CachedRequestState(
                req_id=f"q{step}_{len(states)}",
                prompt_token_ids=[rng.randrange(VOCAB) for _ in range(n_prompt)],
                sampling_params=tokenized(
                    SamplingParams(
                        temperature=temperature,
                        min_tokens=rng.choice([0, 0, 5, 12]),
                        stop_token_ids=[2],
                        **random_logits_params(rng),
                    )
                ),
                generator=torch.Generator() if temperature and rng.random() < 0.5 else None,
                block_ids=(rng.sample(range(1000), -(-(n_prompt + n_out) // BLOCK_SIZE)),),
                num_computed_tokens=rng.randint(0, n_prompt),
                output_token_ids=[rng.randrange(VOCAB) for _ in range(n_out)],
            )
            states[s.req_id] = s
            batch.add_request(s, removed.pop() if removed else None)
        batch.condense(removed)
        check()
        for i, req_id in enumerate(
            batch.req_ids
        ):  # requests sample, as the runner keeps them; some pass min_tokens
            k = min(rng.randint(0, 2), batch.token_ids_cpu.shape[1] - int(batch.num_tokens[i]))
            states[req_id].output_token_ids.extend([7] * k)
            batch.token_ids_cpu[i, batch.num_tokens[i] : batch.num_tokens[i] + k] = 7
            batch.num_tokens[i] += k


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_sampling_state_after_any_adds_removes_condenses_and_preemptions(data):
    """Penalty bins, allowed-token mask, bad words, min-p and logit-bias rows, updated by diff,
    equal the state rebuilt from scratch after any sequence of batch changes. A preempted
    request leaves the batch and comes back with the output it had, as the runner re-adds it."""
    batch = cpu_input_batch(max_num_reqs=6, max_model_len=64)
    running: dict[str, CachedRequestState] = {}
    preempted: list[CachedRequestState] = []
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    holes: list[int] = []
    for step in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["add", "add", "finish", "preempt", "resume", "sample"]))
        if op == "add" and len(running) < batch.max_num_reqs:
            n_prompt = rng.randint(1, 20)
            state = CachedRequestState(
                req_id=f"r{step}",
                prompt_token_ids=[rng.randrange(VOCAB) for _ in range(n_prompt)],
                sampling_params=tokenized(SamplingParams(**random_logits_params(rng))),
                generator=None,
                block_ids=([1],),
                num_computed_tokens=0,
                output_token_ids=[],
            )
            running[state.req_id] = state
            batch.add_request(state, holes.pop() if holes else None)
        elif op in ("finish", "preempt") and running:
            req_id = data.draw(st.sampled_from(sorted(running)))
            holes.append(batch.remove_request(req_id))
            holes.sort(reverse=True)
            state = running.pop(req_id)
            if op == "preempt":
                preempted.append(state)
        elif op == "resume" and preempted and len(running) < batch.max_num_reqs:
            state = preempted.pop(0)
            running[state.req_id] = state
            batch.add_request(state, holes.pop() if holes else None)
        elif op == "sample":
            for state in running.values():  # the runner extends the request's own list
                state.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.randint(0, 2)))
        if data.draw(st.booleans()):  # a step: close the holes, refresh, compare
            batch.condense(holes)
            holes = []
            batch.refresh_metadata()
            check_sampling_state(
                batch,
                [
                    (running[r].prompt_token_ids, running[r].output_token_ids, running[r].sampling_params)
                    for r in batch.req_ids
                ],
            )


def test_condense_moves_last_rows_into_holes():
    batch = cpu_input_batch(max_num_reqs=8, max_model_len=16)
    for name in "abcdef":
        batch.add_request(CachedRequestState(name, [1], SamplingParams(), None, ([7],), 0, []))
    holes = [batch.remove_request("b"), batch.remove_request("c"), batch.remove_request("f")]
    batch.condense(sorted(holes, reverse=True))
    # f's row (5) was a trailing hole; e then d fill b's and c's rows.
    assert batch.req_ids == ["a", "e", "d"]


def test_refresh_metadata_rebuilds_the_sampling_metadata_only_when_rows_changed():
    batch = cpu_input_batch(max_num_reqs=8, max_model_len=16)
    batch.add_request(CachedRequestState("a", [1], SamplingParams(temperature=0.0), None, ([7],), 0, []))
    batch.refresh_metadata()
    assert batch.sampling_metadata.all_greedy
    unchanged = batch.sampling_metadata
    batch.refresh_metadata()  # a step in which no row changed
    assert batch.sampling_metadata is unchanged
    batch.add_request(CachedRequestState("b", [1], SamplingParams(temperature=0.5), None, ([8],), 0, []))
    batch.refresh_metadata()
    metadata = batch.sampling_metadata
    assert not metadata.all_greedy and metadata.temperature.tolist() == pytest.approx([0.0, 0.5])


# ---------------------------------------------------------------------------- execute_model
class FakeModel(nn.Module):
    """Logits depend on (token, position) of the last scheduled token only; no attention layers."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, 16, generator=g))
        self.pos = nn.Parameter(torch.randn(MAX_MODEL_LEN, 16, generator=g))
        self.head = nn.Parameter(torch.randn(16, VOCAB, generator=g) * 0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids] + self.pos[positions]  # [num_tokens, 16]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.head  # [n, VOCAB]


def fake_runner(vllm_config: VllmConfig) -> GPUModelRunner:
    runner = GPUModelRunner(vllm_config, torch.device("cpu"))
    runner.model = FakeModel()
    # One KV cache group, so the runner builds one attention metadata (that no layer reads).
    runner.kv_cache_config = full_attention_kv_cache_config(NUM_BLOCKS, BLOCK_SIZE)
    return runner


def run_until_done(runner: GPUModelRunner, sched: FakeScheduler) -> None:
    while sched.has_work():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))


@pytest.mark.parametrize("seed", range(3))
def test_seeded_request_independent_of_chunking_preemption_and_batch(vllm_config, seed):
    prompt = list(range(3, 33))
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=20)
    alone = FakeScheduler(
        random.Random(seed), spawn=False, p_preempt=0, p_skip=0, chunk=False, prefix_hits=False
    )
    rid_alone = alone.add(prompt, params, protected=True)
    run_until_done(fake_runner(vllm_config), alone)
    reference = alone.finished[rid_alone].outputs
    assert len(reference) == 20

    soup = FakeScheduler(random.Random(100 + seed), p_preempt=0.1, p_skip=0.1, max_requests=25)
    for _ in range(5):
        soup.add([7] * 10, SamplingParams(temperature=1.0, max_tokens=15))
    rid = soup.add(prompt, params, protected=True)
    run_until_done(fake_runner(vllm_config), soup)
    assert soup.finished[rid].outputs == reference and soup.num_preemptions > 0

    # A different seed really changes the sample (the test above could not pass by accident).
    other = FakeScheduler(
        random.Random(seed), spawn=False, p_preempt=0, p_skip=0, chunk=False, prefix_hits=False
    )
    rid_other = other.add(prompt, SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=20), True)
    run_until_done(fake_runner(vllm_config), other)
    assert other.finished[rid_other].outputs != reference


@pytest.mark.ch05_t2
def test_execute_model_greedy_and_logprobs(vllm_config):
    """Rule: «the index of each request's last scheduled token in the flat batch (where its logits are
    taken)»: a whole step through the runner samples each request's greedy token and logprobs."""
    runner = fake_runner(vllm_config)
    model = runner.model
    sched = FakeScheduler(random.Random(5), spawn=False)
    rid = sched.add([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, logprobs=2, max_tokens=6))
    while sched.has_work():
        so = sched.schedule()
        output = runner.execute_model(so)
        if rid in so.num_scheduled_tokens:
            r = sched.live[rid]
            i = output.req_id_to_index[rid]
            if r.computed + so.num_scheduled_tokens[rid] == len(r.tokens):
                pos = len(r.tokens) - 1
                with torch.no_grad():
                    logits = model.compute_logits(model(torch.tensor([r.tokens[-1]]), torch.tensor([pos])))[0]
                logprobs = logits.log_softmax(-1)
                token = output.sampled_token_ids[i][0]
                assert token == int(logits.argmax()), (
                    f"greedy sampling after {len(r.tokens)} tokens gave {token}, not the model's argmax "
                    f"{int(logits.argmax())} at position {pos}: the model ran on wrong positions or KV slots"
                )
                (entry,) = output.logprobs[i]
                expected_ids = {token, *logprobs.topk(2).indices.tolist()}
                assert set(entry) == expected_ids, "logprobs are of the sampled token and the top 2"
                for t, lp in entry.items():
                    assert lp == pytest.approx(float(logprobs[t]), abs=1e-5), f"token {t}'s logprob is wrong"
            else:
                assert output.sampled_token_ids[i] == [] and output.logprobs[i] == [], (
                    "a prefill chunk short of the prompt samples nothing"
                )
        sched.update_from_output(so, output)


def test_runner_with_real_model_matches_transformers_greedy(tiny_qwen3):
    """Real attention over the paged cache, random block ids, chunking, preemption, skipped steps."""
    vllm_config = make_vllm_config(tiny_qwen3, num_gpu_blocks_override=NUM_BLOCKS, **ENGINE_ARGS)
    runner = GPUModelRunner(vllm_config, torch.device("cpu"))
    runner.load_model()
    # The override sets the block count: no memory to count.
    (kv_cache_config,) = get_kv_cache_configs(vllm_config, [runner.get_kv_cache_spec()], [0])
    runner.initialize_kv_cache(kv_cache_config)
    rng = random.Random(0)
    sched = FakeScheduler(rng, spawn=False, p_preempt=0.1, p_skip=0.1, prefix_hits=False)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 30, 41)]
    req_ids = [sched.add(p, SamplingParams(temperature=0.0, max_tokens=8), protected=True) for p in prompts]
    run_until_done(runner, sched)
    assert sched.num_preemptions > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    for prompt, req_id in zip(prompts, req_ids):
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert sched.finished[req_id].outputs == reference[0, len(prompt) :].tolist()
