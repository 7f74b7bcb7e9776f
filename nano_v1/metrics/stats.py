"""Statistics the scheduler attaches to a step's outputs.

Mirrors vllm/v1/metrics/stats.py (chapters 03 and 10).

Why it exists: only the engine core knows some facts (how many prompt tokens the prefix
cache served, how many drafts were accepted), and only the frontend keeps anything
across steps (it outlives the core's steps and, in chapter 09, lives in another
process). So the scheduler packs each step's counts into `SchedulerStats`, which rides
on `EngineCoreOutputs`, and the frontend adds them up. vLLM's version also carries
queue lengths and KV cache usage for its loggers; we carry what something here reads.
"""

from __future__ import annotations

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

    # Admissions of this step; all zero when nothing was admitted or caching is off.
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Drafts verified this step; None when nothing was speculated.
    spec_decoding_stats: SpecDecodingStats | None = None
