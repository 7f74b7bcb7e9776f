"""Metrics as `LLM.get_metrics()` returns them: named counters, vLLM's names.

Mirrors vllm/v1/metrics/reader.py (chapters 03 and 10).

Why it exists: vLLM exposes its counters to Prometheus and lets offline users read a
snapshot with `LLM.get_metrics()`. We have no Prometheus registry; the frontend keeps
the running totals itself and this module turns them into the same records
(`Counter`, `Vector`) under the same names, so code written against vLLM's snapshot
reads ours. The prefix-cache counters are in tokens (hits / queries is the hit rate);
`spec_decoding_stats_from_metrics` turns a snapshot back into `SpecDecodingStats`, whose
properties give the acceptance rate and mean acceptance length, the two numbers vLLM's
Prometheus documentation derives from these counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from nano_v1.metrics.stats import PrefixCacheStats
from nano_v1.spec_decode.metrics import SpecDecodingStats

# vLLM's names (vllm/v1/metrics/loggers.py::PrometheusStatLogger); both count tokens.
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
SPEC_DECODE_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(slots=True)
class Metric:
    name: str


@dataclass(slots=True)
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass(slots=True)
class Vector(Metric):
    """An ordered list of counts (vLLM uses it for acceptances per draft position only)."""

    values: list[int]


def prefix_cache_metrics(stats: PrefixCacheStats) -> list[Metric]:
    """The two prefix-cache counters of vLLM, from running totals."""
    return [Counter(PREFIX_CACHE_QUERIES, stats.queries), Counter(PREFIX_CACHE_HITS, stats.hits)]


def spec_decoding_metrics(stats: SpecDecodingStats) -> list[Metric]:
    """The four speculative-decoding metrics of vLLM, from running totals."""
    metrics: list[Metric] = [Counter(name, getattr(stats, attr)) for name, attr in SPEC_DECODE_COUNTERS.items()]
    metrics.append(Vector(SPEC_DECODE_PER_POS, list(stats.num_accepted_tokens_per_pos)))
    return metrics


def spec_decoding_stats_from_metrics(metrics: list[Metric]) -> SpecDecodingStats | None:
    """Read the speculative-decoding counters back out of a snapshot (None if absent).

    `stats.acceptance_rate` and `stats.mean_acceptance_length` then give the summary.
    """
    by_name = {m.name: m for m in metrics}
    per_pos = by_name.get(SPEC_DECODE_PER_POS)
    if not isinstance(per_pos, Vector):
        return None
    stats = SpecDecodingStats.new(len(per_pos.values))
    stats.num_accepted_tokens_per_pos = list(per_pos.values)
    for name, attr in SPEC_DECODE_COUNTERS.items():
        setattr(stats, attr, by_name[name].value)
    return stats
