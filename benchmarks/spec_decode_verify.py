"""The cost of verifying k drafts: a step that verifies 1 + k tokens per request against a plain decode step.

Mirrors the speculative-decoding benchmarks of vllm/benchmarks/ (chapter 10).
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: speculation pays when the tokens gained per step grow faster than the
cost of a step. `nano-v1 bench spec` measures the gain on a CPU
(`nano_v1/benchmarks/spec_decode.py`); this measures the cost, on the Qwen3-0.6B shape on
a GPU, and from their ratio the acceptance rate at which speculation starts to pay.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks.context import SuiteContext, max_warm_up_steps, time_decode_steps


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """Tokens a request gains per step with k drafts, each accepted independently with probability a:
    1 + a + a^2 + ... + a^k (the run of acceptances, then the target's own token)."""
    return float(sum(acceptance_rate**i for i in range(k + 1)))


def break_even_acceptance_rate(cost_ratio: float, k: int) -> float:
    """The acceptance rate at which k drafts gain exactly `cost_ratio` tokens per step (bisection).

    `cost_ratio` is the time of a step verifying 1 + k tokens per request over a plain
    decode step; above the returned rate, speculation is faster. NaN if even accepting
    every draft (k + 1 tokens per step) would not pay.
    """
    if cost_ratio <= 1.0:
        return 0.0
    if cost_ratio >= k + 1:
        return float("nan")
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_step(mid, k) < cost_ratio else (low, mid)
    return (low + high) / 2


def verify_cost_sweep(
    ctx: SuiteContext,
    batch_sizes: list[int] | None = None,
    ks: list[int] | None = None,
    context_len: int | None = None,
    num_steps: int | None = None,
) -> dict[str, Any]:
    """Step time verifying 1 + k tokens per request vs a plain decode step, Qwen3-0.6B shape.

    One engine with k_max speculative tokens; its proposer is replaced (in the worker,
    through `collective_rpc`) by one that always proposes exactly k drafts of token 0 (a
    dummy model almost never agrees), so every timed step verifies 1 + k tokens per
    request and keeps about 1. k = 0 is the plain decode step of the same engine. Times
    come from `time_decode_steps`. Sizes default to the suite's (smoke or full); the
    notebook passes its own for the CPU.
    """
    from nano_v1.benchmarks.roofline import ModelShape

    batch_sizes = batch_sizes or ([1, 2] if ctx.smoke else [1, 4, 16, 64])
    ks = ks or ([0, 2] if ctx.smoke else [0, 1, 3, 5])
    assert ks[0] == 0, "k = 0, the plain decode step, is the reference and comes first"
    context_len = context_len or (32 if ctx.smoke else 512)
    num_steps = num_steps or (2 if ctx.smoke else 10)
    model_dir = ctx.model_dir("qwen3-0.6b")
    label = "tiny Qwen3 (smoke)" if ctx.smoke else "qwen3-0.6b"
    vocab_size = ModelShape.from_pretrained(model_dir).vocab_size
    # Every timed step may gain up to k + 1 tokens: room for all of them.
    max_warm_up = max_warm_up_steps(max(batch_sizes), context_len, ctx.max_num_batched_tokens)
    # A graph for every measured step size, B x (1 + k) tokens: the default ladder stops at
    # 2 x max_num_seqs, and a step past it would run eagerly while k = 0 replays a graph.
    llm = ctx.llm(
        model_dir, max_model_len=context_len + (max_warm_up + num_steps + 2) * (max(ks) + 1),
        max_num_seqs=max(batch_sizes), enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)},
        compilation_config={"cudagraph_capture_sizes": sorted({b * (1 + k) for b in batch_sizes for k in ks})},
    )
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = ctx.partial.setdefault("rows", [])
    for batch_size in batch_sizes:
        prompts = rng.integers(0, vocab_size, (batch_size, context_len)).tolist()
        step_ms = {}
        for k in ks:
            if rows and ctx.time_left() < 4 * rows[-1]["wall_s"]:
                ctx.partial["truncated"] = f"stopped before batch size {batch_size}, k={k}: the time cap was near"
                return {"model": label, **ctx.partial}
            start = time.perf_counter()
            llm.collective_rpc(propose_exactly, args=(k,))
            step_s, timings = time_decode_steps(engine, prompts, num_steps, num_spec_tokens=k)
            step_ms[k] = 1e3 * float(np.median(step_s))
            ratio = step_ms[k] / step_ms[0]
            rows.append({
                "batch_size": batch_size,
                "k": k,
                "step_ms": step_ms[k],
                "execute_model_ms": 1e3 * float(np.median([t.execute_model_s for t in timings])),
                "cost_ratio": ratio,
                "break_even_acceptance_rate": break_even_acceptance_rate(ratio, k) if k else None,
                "wall_s": time.perf_counter() - start,
            })
            print(f"  verify B={batch_size:>3} k={k}: step {step_ms[k]:8.3f} ms, {ratio:5.2f}x a decode step"
                  + (f", pays above acceptance {rows[-1]['break_even_acceptance_rate']:.2f}" if k else ""))
    return {"model": label, "context_len": context_len, "num_timed_steps": num_steps, **ctx.partial}


def propose_exactly(worker, k: int) -> None:
    """In the worker (`collective_rpc`): make the n-gram drafter propose k drafts of token 0 for every
    request that sampled a token, whatever its n-grams say."""
    worker.model_runner.drafter.propose = lambda sampled, *_: [[0] * k if s else [] for s in sampled]
