"""Greedy generation on a tiny checkpoint, by transformers and by nano_v1, and the prompts to feed both.

- `hf_greedy`: the parity oracle, transformers' `generate(do_sample=False)` in float32,
  one prompt at a time (no padding).
- `nano_greedy`: the same prompts as one batch through `LLM`, under any engine arguments.
- `make_prompts`: prompts from one token to many blocks, optionally behind a shared prefix;
  `shared_prefix_prompts`: prompts that hit none, some or all of a shared prefix (chapter 03),
  and `prefix_cache_counters` reads what the engine's metrics say they hit.
"""

from __future__ import annotations

import random

import torch

from nano_v1 import LLM, SamplingParams
from nano_v1.metrics.reader import Counter

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


def shared_prefix_prompts(seed: int, block_size: int = 16) -> list[list[int]]:
    """Prompts that hit 0, some or all of a 3-block shared prefix, repeat, or miss entirely."""
    rng = random.Random(seed)

    def own(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    prefix = own(3 * block_size)
    repeated = prefix + own(20)
    return [prefix + own(5), repeated, prefix[: 2 * block_size], repeated, own(30), prefix[:20] + own(10)]


def prefix_cache_counters(llm: LLM) -> tuple[int, int]:
    """(`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`) from `LLM.get_metrics()`."""
    counters = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
    return counters["vllm:prefix_cache_queries"], counters["vllm:prefix_cache_hits"]

