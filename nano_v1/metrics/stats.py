"""Statistics of the engine: what the scheduler reports each step, and what the frontend times.

Mirrors vllm/v1/metrics/stats.py (chapters 03, 09 and 10).

Why it exists: only the engine core knows some facts (queue lengths, KV cache usage, how
many prompt tokens the prefix cache served, how many drafts were accepted), and only the
frontend keeps anything across steps (it outlives the core's steps and, in chapter 09,
lives in another process). So the scheduler packs each step's facts into
`SchedulerStats`, which rides on `EngineCoreOutputs`, and the frontend adds them up. The
frontend measures the rest itself as outputs arrive (`IterationStats`): tokens in and
out, time to first token and between tokens, which is what a user waits for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nano_v1.spec_decode.metrics import SpecDecodingStats


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups of the requests admitted in some steps (chapter 03).

    Counted once per admission, new or resumed after preemption (see
    `KVCacheManager.record_prefix_cache_stats`). vLLM's also has a `reset` flag, which
    only its logging window reads; our counters, like vLLM's Prometheus counters, never
    go back to zero.
    """

    # Requests admitted.
    requests: int = 0
    # Tokens they looked up: each request's num_tokens at admission.
    queries: int = 0
    # Of those, tokens served from the cache.
    hits: int = 0

    def add(self, other: "PrefixCacheStats") -> None:
        """Accumulate another interval's counts into this one."""
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits


@dataclass(slots=True)
class SchedulerStats:
    """One step's statistics from the scheduler."""

    # The queues and the cache as the step leaves them (gauges: the latest value is the truth).
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of the usable blocks held by requests
    # Admissions of this step; all zero when nothing was admitted or caching is off.
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Drafts verified this step; None when nothing was speculated.
    spec_decoding_stats: SpecDecodingStats | None = None


@dataclass(slots=True)
class RequestStateStats:
    """What the frontend remembers of one engine-core request between its outputs."""

    arrival_time: float  # time.monotonic() when the frontend accepted it
    num_generation_tokens: int = 0
    last_token_ts: float = 0.0  # when its latest output arrived


@dataclass(slots=True)
class FinishedRequestStats:
    """An engine-core request that finished in this step, and why: "stop", "length" or "abort".

    vLLM's also has the request's latencies (end to end, queued, prefill, decode), which
    feed histograms nano_v1 does not export.
    """

    finish_reason: str


class IterationStats:
    """What the frontend saw in one batch of engine-core outputs (one step's worth).

    Times are the frontend's own clock when the outputs arrive, so TTFT includes the
    queue, the prefill and both trips through the sockets, as a client sees it; vLLM
    stamps the same intervals with the core's clock at the end of its step.
    """

    def __init__(self) -> None:
        self.iteration_timestamp = time.monotonic()
        self.num_prompt_tokens = 0  # prompts of requests that got their first token now
        self.num_generation_tokens = 0
        self.time_to_first_tokens_iter: list[float] = []
        self.inter_token_latencies_iter: list[float] = []
        self.finished_requests: list[FinishedRequestStats] = []

    def update_from_output(self, num_new_tokens: int, prompt_len: int, req_stats: RequestStateStats) -> None:
        """Count one request's new tokens; its first output closes the prefill (TTFT), later ones an ITL."""
        now = self.iteration_timestamp
        if req_stats.num_generation_tokens == 0:
            self.num_prompt_tokens += prompt_len
            self.time_to_first_tokens_iter.append(now - req_stats.arrival_time)
        else:
            self.inter_token_latencies_iter.append(now - req_stats.last_token_ts)
        self.num_generation_tokens += num_new_tokens
        req_stats.num_generation_tokens += num_new_tokens
        req_stats.last_token_ts = now

    def update_from_finished_request(self, finish_reason: str) -> None:
        self.finished_requests.append(FinishedRequestStats(finish_reason))
