"""End-to-end parity: nano_v1's greedy tokens equal Hugging Face transformers' exactly.

The oracle is `transformers`' own `generate(do_sample=False)` in float32 on the same
tiny random checkpoint, one prompt at a time (no padding). nano_v1 runs the prompts as
one batch, under settings that exercise every path of the engine: chunked prefill,
preemption, prefix caching and two block sizes.
"""

from __future__ import annotations

import random

import pytest
from helpers.generation import (
    MAX_NEW,
    hf_greedy,
    make_prompts,
    nano_greedy,
    prefix_cache_counters,
    shared_prefix_prompts,
)

from nano_v1 import LLM, SamplingParams
from nano_v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.ch01


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoint_any):
    prompts = make_prompts(0)
    return tiny_checkpoint_any, prompts, hf_greedy(tiny_checkpoint_any, prompts)


def test_default_settings_match_transformers(hf_reference):
    path, prompts, expected = hf_reference
    got, outputs = nano_greedy(path, prompts)
    assert got == expected
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order kept


def test_tiny_token_budget_forces_chunked_prefill(hf_reference):
    path, prompts, expected = hf_reference
    got, _ = nano_greedy(path, prompts, max_num_batched_tokens=16)
    assert got == expected


@pytest.mark.parametrize("block_size", [16, 32])
def test_block_sizes(hf_reference, block_size):
    path, prompts, expected = hf_reference
    got, _ = nano_greedy(path, prompts, block_size=block_size)
    assert got == expected


def test_small_kv_cache_preempts_and_still_matches(hf_reference, monkeypatch):
    path, prompts, expected = hf_reference
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, req: (preempted.append(req.request_id), original(self, req)))
    # 13 usable blocks of 16 tokens hold one long request, not all six at once.
    got, _ = nano_greedy(path, prompts, block_size=16, max_model_len=192, num_gpu_blocks_override=14)
    assert preempted, "the cache was meant to be too small for the batch"
    assert got == expected


def test_prefix_caching_hits_and_matches(tiny_qwen3):
    prompts = make_prompts(1, shared_prefix=70)
    expected = hf_greedy(tiny_qwen3, prompts)
    llm = LLM(model=tiny_qwen3, dtype="float32", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    # Run again: now every prompt's shared prefix (4 full blocks = 64 tokens) is cached.
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == expected
    assert all(o.num_cached_tokens >= 64 for o in second)


def test_prefix_caching_off_reports_no_hits(tiny_qwen3):
    prompts = make_prompts(1, shared_prefix=70)
    llm = LLM(model=tiny_qwen3, dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in again)


def expected_prefix_cache_hits(prompts: list[list[int]], block_size: int) -> list[int]:
    """Brute force: the tokens each prompt finds cached when each runs after the ones before it.

    A cached block is named by every token up to its end (what its chain hash stands for);
    a prompt that ran leaves its full blocks cached. A prompt hits its leading blocks up
    to the first one never cached, at most (len - 1) // block_size blocks: the last
    prompt token is always computed.
    """
    cached: set[tuple[int, ...]] = set()
    hits = []
    for prompt in prompts:
        num_blocks = 0
        while (
            num_blocks < (len(prompt) - 1) // block_size
            and tuple(prompt[: (num_blocks + 1) * block_size]) in cached
        ):
            num_blocks += 1
        hits.append(num_blocks * block_size)
        cached.update(tuple(prompt[: (i + 1) * block_size]) for i in range(len(prompt) // block_size))
    return hits


@pytest.mark.ch03
def test_prefix_cache_metrics_count_each_request_once_in_tokens(tiny_qwen3):
    prompts = shared_prefix_prompts(7)
    expected_hits = expected_prefix_cache_hits(prompts, 16)
    # The first misses; the next hits the shared prefix; one of exactly 2 prefix blocks
    # recomputes its last; the repeat hits all its full blocks; one shares no block; and
    # one shares 20 tokens, so 1 block.
    assert expected_hits == [0, 48, 16, 64, 0, 16]
    # One step admits them all, in order (the budget holds every prompt), and a prompt's
    # blocks are cached when it is scheduled: each finds those of the prompts before it.
    # One output token each: no generated token fills a block.
    llm = LLM(model=tiny_qwen3, dtype="float32", block_size=16, max_num_batched_tokens=1024)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], one_token, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == expected_hits
    assert prefix_cache_counters(llm) == (sum(map(len, prompts)), sum(expected_hits))

    # reset_prefix_cache forgets the blocks, not the counts: vLLM's counters only grow.
    queries, hits = prefix_cache_counters(llm)
    assert llm.llm_engine.engine_core.call_utility("reset_prefix_cache")
    for expected_hit in (0, 64):  # the repeated prompt misses right after the reset, then hits
        llm.generate({"prompt_token_ids": prompts[1]}, one_token, use_tqdm=False)
        queries, hits = queries + len(prompts[1]), hits + expected_hit
        assert prefix_cache_counters(llm) == (queries, hits)


@pytest.mark.ch03
def test_prefix_cache_metrics_ignore_admissions_that_failed(tiny_qwen3):
    # 4 usable blocks of 16 and prompts of 3 blocks: one request at a time. Each waiting
    # prompt looks the cache up every step until it is admitted; it is counted once.
    llm = LLM(model=tiny_qwen3, dtype="float32", block_size=16, max_model_len=64, num_gpu_blocks_override=5)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert prefix_cache_counters(llm) == (3 * 40, 0)


def test_seeded_sampling_is_independent_of_the_batch(tiny_qwen3):
    llm = LLM(model=tiny_qwen3, dtype="float32", max_num_batched_tokens=32)
    prompt = {"prompt_token_ids": make_prompts(2)[4]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in make_prompts(3)]
    batch = llm.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(temperature=1.0, max_tokens=12)] * 3 + [seeded] + [SamplingParams(temperature=1.0, max_tokens=12)] * 3,
        use_tqdm=False,
    )
    assert batch[3].outputs[0].token_ids == alone


def test_n_completions_and_max_tokens(tiny_qwen3):
    llm = LLM(model=tiny_qwen3, dtype="float32")
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=7, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 7 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct seeds, distinct samples


def test_min_tokens_holds_back_eos(tiny_qwen3):
    """With EOS forced to be the likeliest token, min_tokens still yields min_tokens tokens."""
    llm = LLM(model=tiny_qwen3, dtype="float32")
    prompt = {"prompt_token_ids": make_prompts(4)[3]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]
    first = greedy.outputs[0].token_ids[0]
    # Treat the first greedy token as a stop token: without min_tokens the request stops at once.
    stop_now = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[first])
    assert llm.generate(prompt, stop_now, use_tqdm=False)[0].outputs[0].token_ids == [first]
    held = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[first], min_tokens=5)
    tokens = llm.generate(prompt, held, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) >= 5 and first not in tokens[:5]
