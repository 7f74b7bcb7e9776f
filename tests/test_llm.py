"""End-to-end parity: nano_v1's greedy tokens equal Hugging Face transformers' exactly.

The oracle is `transformers`' own `generate(do_sample=False)` in float32 on the same
tiny random checkpoint, one prompt at a time (no padding). nano_v1 runs the prompts as
one batch, under settings that exercise every path of the engine: chunked prefill,
preemption, prefix caching and two block sizes.
"""

from __future__ import annotations

import random

import pytest
import torch

from nano_v1 import LLM, SamplingParams
from nano_v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.ch01

MAX_NEW = 20


def make_prompts(seed: int, vocab: int = 512, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    lengths = [1, 5, 17, 40, 95, 150]  # from one token to many blocks
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int = MAX_NEW) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
            outs.append(gen[0, len(p) :].tolist())
    return outs


def nano_greedy(path: str, prompts: list[list[int]], max_new_tokens: int = MAX_NEW, **engine_args):
    llm = LLM(model=path, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], outputs


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
