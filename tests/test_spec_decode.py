"""Speculative decoding: the n-gram proposer, the rejection sampler, and the engine with both.

Oracles: a brute-force n-gram search; the target distribution computed directly in
float64 (the rejection sampler's output must follow it, and two deliberately wrong
samplers must fail the same bound); transformers' greedy tokens; the scheduler's
fake-runner KV-memory model (tests/test_scheduler.py) with random drafts.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from helpers.checkpoints import make_vllm_config
from helpers.generation import hf_greedy
from helpers.sampling import make_sampling_metadata
from helpers.scheduler import make_requests, make_scheduler, reference_output, run_workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.context import SuiteContext
from benchmarks.spec_decode_verify import (
    break_even_acceptance_rate,
    expected_tokens_per_step,
    verify_cost_sweep,
)
from nano_v1 import LLM, SamplingParams
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.entrypoints import cli
from nano_v1.metrics.reader import Counter, spec_decoding_stats_from_metrics
from nano_v1.outputs import DraftTokenIds, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from nano_v1.sample.sampler import random_sample
from nano_v1.spec_decode.metadata import SpecDecodeMetadata
from nano_v1.spec_decode.ngram_proposer import find_ngram_drafts

pytestmark = pytest.mark.ch10


# ---------------------------------------------------------------- n-gram proposer
def brute_force_drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; the latest earlier occurrence followed by k tokens, else the latest."""
    for n in range(max_n, min_n - 1, -1):
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == tokens[-n:]]
        if ends:
            full = [e for e in ends if e <= len(tokens) - 1 - k]
            end = (full or ends)[-1]
            return tokens[end + 1 : end + 1 + k]
    return []


@pytest.mark.ch10_t1
@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=5),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 2),
    k=st.integers(1, 5),
)
def test_ngram_proposer_matches_brute_force(rows, min_n, extra_n, k):
    """Rule: «The longest n in [min_n, max_n] that occurs earlier wins»; «the latest followed by k known
    tokens is preferred to the latest overall»; «fewer than k when the occurrence is close to the end,
    0 when nothing matches», against brute force."""
    width = max(map(len, rows)) + 3
    token_ids = np.full((len(rows), width), 7, dtype=np.int32)  # junk after each row's tokens
    for i, row in enumerate(rows):
        token_ids[i, : len(row)] = row
    num_tokens = np.array([len(r) for r in rows])
    drafts, num_drafts = find_ngram_drafts(token_ids, num_tokens, min_n, min_n + extra_n, k)
    for i, row in enumerate(rows):
        got, expected = (
            drafts[i, : num_drafts[i]].tolist(),
            brute_force_drafts(row, min_n, min_n + extra_n, k),
        )
        assert got == expected, (
            f"row {row}, n in [{min_n}, {min_n + extra_n}], k = {k}: the drafts must be {expected}, got {got}"
        )


@pytest.mark.ch10_t1
@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected, why",
    [
        pytest.param([1, 2, 3, 1, 2], 1, 3, 3, [3, 1, 2],
                     "the suffix 2-gram `1 2` occurred at positions 0-1; `3 1 2` followed", id="docstring"),
        pytest.param([1, 2, 3, 4], 1, 3, 2, [], "no token recurs: no drafts", id="no_match"),
        pytest.param([5, 1, 2, 9, 2, 1, 2], 1, 2, 1, [9],
                     "the 2-gram `1 2` wins over the later 1-gram `2`", id="longest_n"),
        pytest.param([5, 1, 2, 9, 2, 1, 2], 3, 3, 1, [],
                     "with min_n = 3 no 3-gram recurs, and a 2-gram does not count", id="min_n"),
        pytest.param([7, 8, 9, 7, 5, 7], 1, 1, 3, [8, 9, 7],
                     "the latest `7` followed by k = 3 known tokens beats the latest `7`", id="full_k"),
        pytest.param([7, 8, 9, 7, 5, 7], 1, 1, 6, [5, 7],
                     "no `7` has 6 known tokens after it: the latest one, with the 2 it has", id="short"),
        pytest.param([4, 4, 4], 1, 2, 3, [4],
                     "the 2-gram `4 4` also ends at position 1, and one known token follows", id="overlap"),
    ],
)  # fmt: skip
def test_ngram_drafts_by_hand(tokens, min_n, max_n, k, expected, why):
    """Rule: «the k tokens after the latest earlier occurrence of its last n tokens»; «an occurrence counts if
    at least one known token follows it»."""
    token_ids = np.array([tokens + [0, 0]], dtype=np.int32)  # junk after the row's tokens
    drafts, num_drafts = find_ngram_drafts(token_ids, np.array([len(tokens)]), min_n, max_n, k)
    got = drafts[0, : num_drafts[0]].tolist()
    assert got == expected, f"tokens {tokens}, n in [{min_n}, {max_n}], k = {k}: {why}; got drafts {got}"


# ---------------------------------------------------------------- rejection sampler
def spec_metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """Only the fields the rejection sampler reads; the logits index arrays are the runner's business."""
    num_draft = np.array([len(d) for d in drafts])
    unused = torch.empty(0, dtype=torch.int64)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        num_draft_tokens=num_draft,
        cu_num_draft_tokens=np.cumsum(num_draft),
        target_logits_indices=unused,
        bonus_logits_indices=unused,
        logits_indices=unused,
    )


def test_greedy_rows_keep_drafts_while_they_equal_the_argmax():
    torch.manual_seed(0)
    rng = random.Random(0)
    vocab, num_reqs = 20, 12
    drafts, logits_rows, expected = [], [], []
    bonus = torch.randint(0, vocab, (num_reqs, 1), dtype=torch.int32)
    temperature = []
    for r in range(num_reqs):
        k = rng.randint(1, 4)
        logits = torch.randn(k, vocab)
        argmax = logits.argmax(-1).tolist()
        # Each draft is right with probability 1/2: acceptance lengths 0 .. k all occur.
        row = [a if rng.random() < 0.5 else (a + 1) % vocab for a in argmax]
        num_ok = next((i for i, (d, a) in enumerate(zip(row, argmax)) if d != a), k)
        out = row[:num_ok] + [argmax[num_ok] if num_ok < k else int(bonus[r])]
        drafts.append(row)
        logits_rows.append(logits)
        # Odd rows are sampled rows in the same batch: greedy rows must not care.
        temperature.append(0.0 if r % 2 == 0 else 1.0)
        expected.append(out)
    output = RejectionSampler()(
        spec_metadata(drafts), torch.cat(logits_rows), bonus, make_sampling_metadata(temperature)
    )
    for r in range(0, num_reqs, 2):
        row = output[r].tolist()
        assert row[: len(expected[r])] == expected[r]
        assert all(t == PLACEHOLDER_TOKEN_ID for t in row[len(expected[r]) :])
    # All-greedy batches take a shortcut; same answers.
    greedy = [i for i in range(num_reqs) if i % 2 == 0]
    output = RejectionSampler()(
        spec_metadata([drafts[i] for i in greedy]),
        torch.cat([logits_rows[i] for i in greedy]),
        bonus[greedy],
        make_sampling_metadata([0.0] * len(greedy)),
    )
    for row, i in zip(output.tolist(), greedy):
        assert row[: len(expected[i])] == expected[i]


VOCAB = 6
P1 = [0.12, 0.40, 0.20, 0.15, 0.08, 0.05]  # first position; draft 1 has p = 0.4 (no ties: top-k is exact)
P2 = [0.25, 0.12, 0.30, 0.05, 0.20, 0.08]  # second position (given draft 1)
P3 = [0.30, 0.10, 0.10, 0.20, 0.20, 0.10]  # bonus position (given both drafts)


def processed(p: list[float], temperature: float, top_k: int | None) -> np.ndarray:
    """The target distribution the plain sampler would draw from, in float64."""
    logits = np.log(np.array(p, dtype=np.float64)) / temperature
    if top_k is not None:
        logits[np.argsort(logits)[: len(p) - top_k]] = -np.inf
    q = np.exp(logits - logits.max())
    return q / q.sum()


def total_variation(samples: np.ndarray, p: np.ndarray) -> float:
    freq = np.bincount(samples, minlength=len(p)) / len(samples)
    return 0.5 * float(np.abs(freq - p).sum())


class AcceptsAlways(RejectionSampler):
    """Wrong: keeps every draft."""

    @staticmethod
    def _verify_random(metadata, target_logits, draft_token_ids, req_of_token, sampling_metadata):
        _, recovered = RejectionSampler._verify_random(
            metadata, target_logits, draft_token_ids, req_of_token, sampling_metadata
        )
        return torch.ones_like(draft_token_ids, dtype=torch.bool), recovered


class RedrawsFromTarget(RejectionSampler):
    """Wrong: on rejection draws from p itself instead of the residual."""

    @staticmethod
    def _verify_random(metadata, target_logits, draft_token_ids, req_of_token, sampling_metadata):
        accepted, _ = RejectionSampler._verify_random(
            metadata, target_logits, draft_token_ids, req_of_token, sampling_metadata
        )
        return accepted, random_sample(target_logits.softmax(-1), {})


def run_distribution_trial(
    sampler: RejectionSampler, drafts: list[int], temperature: float, top_k: int | None
):
    """Many identical requests, each verifying `drafts` against P1, P2; bonus drawn from P3."""
    num_trials = 200_000
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([P1, P2]))  # [2, vocab]
    target_logits = logits.repeat(num_trials, 1)  # [2 * num_trials, vocab]
    bonus_p = torch.from_numpy(processed(P3, temperature, top_k))
    bonus = torch.multinomial(bonus_p, num_trials, replacement=True).to(torch.int32)[:, None]
    top_ks = None if top_k is None else [top_k] * num_trials
    md = make_sampling_metadata([temperature] * num_trials, top_k=top_ks)
    return sampler(spec_metadata([drafts] * num_trials), target_logits, bonus, md).numpy()


TOLERANCE = 0.015  # total variation; sampling noise is ~0.006 for the rarest case (24k of 200k trials)


def distribution_errors(output: np.ndarray, drafts: list[int], temperature: float, top_k: int | None):
    """TV distance of: the first token; the second given the first was draft 1; the third given both."""
    first, second, third = output[:, 0], output[:, 1], output[:, 2]
    # (A wrong sampler may redraw the draft itself, and then stop: hence the placeholder test.)
    after_one = (first == drafts[0]) & (second != PLACEHOLDER_TOKEN_ID)
    after_two = after_one & (second == drafts[1]) & (third != PLACEHOLDER_TOKEN_ID)
    return [
        total_variation(first, processed(P1, temperature, top_k)),
        total_variation(second[after_one], processed(P2, temperature, top_k)),
        total_variation(third[after_two], processed(P3, temperature, top_k)) if after_two.any() else 0.0,
    ]


@pytest.mark.parametrize(
    "drafts, temperature, top_k",
    [([1, 2], 1.0, None), ([1, 5], 0.8, 4)],  # (1, 5): draft 2 lies outside the top-k, never kept
    ids=["plain", "temperature-top-k"],
)
@pytest.mark.ch10_t2
def test_rejection_sampler_output_follows_the_target_distribution(drafts, temperature, top_k):
    """Rule: «keep draft x with probability p(x), else redraw from p without x: output ~ p»."""
    output = run_distribution_trial(RejectionSampler(), drafts, temperature, top_k)
    errors = distribution_errors(output, drafts, temperature, top_k)
    positions = ("first token", "second token after draft 1 was kept", "bonus token after both were kept")
    for where, error in zip(positions, errors):
        assert error < TOLERANCE, (
            f"the {where} must follow the target distribution p: total variation {error:.3f} from p over "
            f"200,000 trials (noise is under {TOLERANCE}); kept or redrawn, each token must be distributed as p"
        )
    # The drafts are really accepted at p(draft): one-hot q makes that the acceptance rate.
    rate, p_draft = np.mean(output[:, 0] == drafts[0]), processed(P1, temperature, top_k)[drafts[0]]
    assert rate == pytest.approx(p_draft, abs=0.01), (
        f"draft 1 must be kept at the rate p(draft) = {p_draft:.3f} (an n-gram draft's q is one-hot), got {rate:.3f}"
    )


@pytest.mark.parametrize("wrong", [AcceptsAlways, RedrawsFromTarget])
def test_wrong_rejection_samplers_fail_the_same_bound(wrong):
    drafts = [1, 2]
    errors = distribution_errors(run_distribution_trial(wrong(), drafts, 1.0, None), drafts, 1.0, None)
    assert max(errors) > 5 * TOLERANCE, errors


@pytest.mark.ch10_t2
def test_seeded_request_does_not_depend_on_the_batch():
    """Rule: «a redraw uses the draft's generator»: «a seeded request's tokens do not depend on the batch
    around it»."""
    torch.manual_seed(0)
    vocab = 32
    row_logits = torch.randn(3, vocab) * 0.3  # flat: many different outcomes
    drafts = [4, 9, 17]

    def run(seed: int, position: int, batch: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        outputs = []
        for _ in range(15):
            other = torch.randn(batch * 2, vocab)
            all_drafts = [[1, 2]] * batch
            all_drafts.insert(position, drafts)
            logits = torch.cat([other[: 2 * position], row_logits, other[2 * position :]])
            temperature = [0.0 if i % 2 else 1.0 for i in range(batch + 1)]
            temperature[position] = 1.0
            out = RejectionSampler()(
                spec_metadata(all_drafts),
                logits,
                torch.zeros(batch + 1, 1, dtype=torch.int32),
                make_sampling_metadata(temperature, generators={position: generator}),
            )
            outputs.append(out[position].tolist())
        return outputs

    alone = run(seed=7, position=0, batch=0)
    assert run(seed=7, position=2, batch=4) == alone, (
        "a seeded request must keep and redraw the same tokens alone or at row 2 of a batch of 5: its "
        "uniforms and its redraws must come from its own generator"
    )
    assert run(seed=8, position=0, batch=0) != alone, "another seed must give other tokens"


# ---------------------------------------------------------------- the scheduler with drafts
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    num_spec_tokens=st.integers(1, 5),
)
def test_scheduler_with_random_drafts_keeps_kv_exact(
    seed, block_size, budget, max_seqs, caching, num_spec_tokens
):
    """Drafts right or wrong, scheduled whole or cut by the budget: the fake runner's KV
    memory must hold the true token at every computed position, outputs must equal the
    reference, nothing may pass max_tokens, and every block must be free at the end."""
    rng = random.Random(seed)
    max_prompt, max_out = 30, 16
    max_model_len = 3 * 16 + max_prompt + max_out + 1
    num_blocks = rng.randint(max_model_len // block_size + 2, 3 * max_model_len // block_size + 2)
    sched = make_scheduler(
        num_blocks, block_size, budget, max_seqs, max_model_len, caching, num_spec_tokens=num_spec_tokens
    )
    requests = make_requests(rng, rng.randint(1, 10), block_size, max_prompt, max_out, shared=True)
    outputs, _ = run_workload(sched, requests, abort_prob=0.0, rng=rng)
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens)


def test_empty_output_for_drafts_rolls_the_whole_step_back():
    """v0.11.0's arithmetic when the runner returns no token for a request with drafts:
    num_accepted = -1, so the drafts and the token before them are scheduled again."""
    sched = make_scheduler(16, 4, budget=64, max_seqs=2, max_model_len=64, caching=False, num_spec_tokens=3)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), None)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(["a"], {"a": 0}, [[10]]))
    sched.update_draft_token_ids(DraftTokenIds(["a"], [[11, 12, 13]]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and req.num_computed_tokens == 7
    out = sched.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[]]))
    assert req.num_computed_tokens == 3 and req.output_token_ids == [10]
    assert not out.outputs
    assert out.scheduler_stats is None or out.scheduler_stats.spec_decoding_stats is None
    so = sched.schedule()  # the sampled token and the same drafts, verified again
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}


def test_rejected_drafts_roll_back_and_their_slots_are_reused():
    block_size = 4
    sched = make_scheduler(
        16, block_size, budget=64, max_seqs=2, max_model_len=64, caching=True, num_spec_tokens=5
    )
    hasher = get_request_block_hasher(block_size)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), None, block_hasher=hasher)
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[10]]))
    sched.update_draft_token_ids(DraftTokenIds(["a"], [[11, 12, 13, 14, 15]]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 6} and so.scheduled_spec_decode_tokens == {
        "a": [11, 12, 13, 14, 15]
    }
    (blocks,) = sched.kv_cache_manager.get_block_ids("a")
    assert len(blocks) == 3  # 4 known tokens + 5 drafts = 9 slots
    # Two drafts accepted, then a correction: 3 tokens gained, 3 drafts rolled back.
    out = sched.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[11, 12, 20]]))
    assert out.outputs[0].new_token_ids == [11, 12, 20]
    assert req.num_computed_tokens == req.num_tokens - 1 == 6
    stats = out.scheduler_stats.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 5, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0]
    # The next step's tokens go into the slots the rejected drafts used: no new block.
    sched.update_draft_token_ids(DraftTokenIds(["a"], [[21]]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 2} and sched.kv_cache_manager.get_block_ids("a") == (blocks,)


def test_drafts_are_clipped_at_max_tokens_and_max_model_len():
    sched = make_scheduler(32, 4, budget=64, max_seqs=2, max_model_len=12, caching=False, num_spec_tokens=5)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), None)
    b = Request("b", [1] * 8, SamplingParams(max_tokens=100, ignore_eos=True), None)
    for r in (a, b):
        sched.add_request(r)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[5], [5]]))
    sched.update_draft_token_ids(DraftTokenIds(["a", "b"], [[6, 7, 8, 9, 10]] * 2))
    # a has 1 of 4 tokens: 3 more at most, so 2 drafts. b has 9 of 12 positions: 3 more, 2 drafts.
    assert a.spec_token_ids == [6, 7] and b.spec_token_ids == [6, 7]


# ---------------------------------------------------------------- the engine end to end
def repetitive_prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat a pattern (drafts get accepted) and one that does not."""
    rng = random.Random(seed)
    prompts = [
        ([rng.randrange(3, 512) for _ in range(n)] * 12)[:length] for n, length in ((3, 40), (5, 37), (8, 60))
    ]
    return prompts + [[rng.randrange(3, 512) for _ in range(30)]]


@pytest.fixture(scope="module")
def greedy_reference(tiny_qwen3):
    prompts = repetitive_prompts(0)
    return tiny_qwen3, prompts, hf_greedy(tiny_qwen3, prompts, max_new_tokens=40)


def run_engine(path: str, prompts: list[list[int]], speculative_config: dict | None, **engine_args):
    llm = LLM(model=path, dtype="float32", speculative_config=speculative_config, **engine_args)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=40),
        use_tqdm=False,
    )
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_greedy_with_speculation_equals_transformers(greedy_reference, k):
    """k = 0 is the engine without speculation: it, and every k, must give transformers' tokens."""
    path, prompts, expected = greedy_reference
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # A 16-token budget chunks the prompts and cuts drafts; a small block size makes
    # drafts cross block boundaries; prefix caching is on.
    llm, got = run_engine(
        path,
        prompts,
        spec if k else None,
        max_num_batched_tokens=16,
        block_size=4,
        enable_prefix_caching=True,
    )
    assert got == expected
    if not k:
        return
    stats = spec_decoding_stats_from_metrics(llm.get_metrics())
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1  # every block is back


def test_greedy_speculation_on_the_demo_model_keeps_outputs_and_gains_tokens_per_step():
    prompt = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def"
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outputs = {}
    for k in (0, 3):
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
        llm = LLM(max_model_len=256, dtype="float32", speculative_config=spec if k else None)
        outputs[k] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[3] == outputs[0]
    stats = spec_decoding_stats_from_metrics(llm.get_metrics())
    assert stats.mean_acceptance_length > 1.3, stats


def test_metrics_are_vllms_names_and_absent_without_speculation(tiny_qwen3):
    llm, _ = run_engine(
        tiny_qwen3, repetitive_prompts(1)[:1], {"num_speculative_tokens": 2, "prompt_lookup_max": 2}
    )
    prefix_cache_names = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits"]
    names = [m.name for m in llm.get_metrics()]
    assert names == prefix_cache_names + [
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ]
    counters = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
    assert counters["vllm:spec_decode_num_draft_tokens"] <= 2 * counters["vllm:spec_decode_num_drafts"]
    without = run_engine(tiny_qwen3, repetitive_prompts(1)[:1], None)[0]
    assert [m.name for m in without.get_metrics()] == prefix_cache_names


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_spec_tokens": 3}, "unknown"),
        ("{not json", "JSON"),
    ],
)
def test_bad_speculative_config_is_a_value_error(tiny_qwen3, config, message):
    with pytest.raises(ValueError, match=message):
        make_vllm_config(tiny_qwen3, speculative_config=config)


# ---------------------------------------------------------------- the benchmark, at smoke sizes
def test_break_even_acceptance_rate_inverts_expected_tokens_per_step():
    for k in (1, 3, 5):
        for ratio in (1.2, 1.8, 1.99):
            rate = break_even_acceptance_rate(ratio, k)
            assert expected_tokens_per_step(rate, k) == pytest.approx(ratio, rel=1e-6)
    assert break_even_acceptance_rate(0.9, 3) == 0.0  # cheaper than a decode step: always pays
    assert math.isnan(break_even_acceptance_rate(2.5, 1))  # k + 1 tokens could not pay for it


def test_spec_benchmarks_run_at_smoke_sizes(tmp_path):
    out = tmp_path / "spec.json"
    cli.main(
        [
            "bench",
            "spec",
            "--num-prompts",
            "1",
            "--prompt-len",
            "32",
            "--max-tokens",
            "8",
            "--ks",
            "2",
            "--lookup-maxes",
            "2",
            "--output-json",
            str(out),
        ]
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["k"] == 2 and row["identical_to_baseline"] and row["tokens_per_request_step"] >= 1.0
    ctx = SuiteContext(device=torch.device("cpu"), smoke=True, work_dir=tmp_path, num_prompts=1)
    cost = verify_cost_sweep(ctx, batch_sizes=[1], ks=[0, 2])
    assert [(r["k"], r["cost_ratio"] > 0) for r in cost["rows"]] == [(0, True), (2, True)]
    assert cost["rows"][0]["cost_ratio"] == 1.0 and cost["rows"][1]["break_even_acceptance_rate"] is not None
