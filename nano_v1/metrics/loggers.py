"""What the server does with the engine's statistics: a log line every few seconds, and Prometheus metrics.

Mirrors vllm/v1/metrics/loggers.py (`StatLoggerBase`, `LoggingStatLogger`,
`PrometheusStatLogger`) (chapter 09).

Why it exists: an operator asks two questions of a running server, "is it busy, and is
it keeping up?" (the log line: throughput, queue lengths, KV cache usage) and "how has
it behaved over time?" (the `/metrics` page a Prometheus server scrapes). Both read the
same two records, the scheduler's `SchedulerStats` and the frontend's `IterationStats`,
which `AsyncLLM` hands to every logger as each step's outputs arrive. Names, units and
buckets are vLLM v0.11.0's, so dashboards written for `vllm serve` read ours.
"""

from __future__ import annotations

import logging
import time

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from nano_v1.config import VllmConfig
from nano_v1.metrics.reader import (
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    SPEC_DECODE_COUNTERS,
    SPEC_DECODE_PER_POS,
)
from nano_v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats
from nano_v1.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger(__name__)

# vLLM's FinishReason, as its request_success counter labels them.
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets (seconds).
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]


class StatLoggerBase:
    """A consumer of each step's statistics."""

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        raise NotImplementedError

    def log(self) -> None:
        """Called every VLLM_LOG_STATS_INTERVAL seconds by the server."""


class LoggingStatLogger(StatLoggerBase):
    """vLLM's periodic one-line summary: throughput over the last interval, and the latest gauges."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.last_scheduler_stats = SchedulerStats()
        # Since the server started; vLLM's rate is over its last 1,000 requests.
        self.prefix_cache_stats = PrefixCacheStats()
        speculative_config = vllm_config.speculative_config
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self.last_throughputs = (0.0, 0.0)  # prompt, generation: the previous interval's
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        """Start a new interval: its token counts and drafts."""
        self.last_log_time = now
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.prefix_cache_stats.add(scheduler_stats.prefix_cache_stats)
            if scheduler_stats.spec_decoding_stats is not None:
                self.spec_decoding_stats.add(scheduler_stats.spec_decoding_stats)
            self.last_scheduler_stats = scheduler_stats

    def log(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last_log_time
        prompt_throughput = self.num_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_throughput = self.num_generation_tokens / elapsed if elapsed > 0 else 0.0
        spec = self.spec_decoding_stats
        self._reset(now)
        throughputs = (prompt_throughput, generation_throughput)
        # Idle this interval and the last: debug level only, as in vLLM (no noise when nothing happens).
        log_fn = logger.info if any(throughputs + self.last_throughputs) else logger.debug
        self.last_throughputs = throughputs
        stats, cache = self.last_scheduler_stats, self.prefix_cache_stats
        log_fn(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.engine_index,
            prompt_throughput,
            generation_throughput,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            100 * cache.hits / cache.queries if cache.queries else 0.0,
        )
        if spec.num_drafts:
            log_fn(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                "Drafted: %d tokens, Avg Draft acceptance rate: %.1f%%",
                spec.mean_acceptance_length,
                spec.num_accepted_tokens,
                spec.num_draft_tokens,
                spec.acceptance_rate * 100,
            )


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's Prometheus metrics (a small set of them), in `registry`.

    Each server has a registry of its own (vLLM uses the process-wide one), so that one
    process can hold several servers, as the tests do. prometheus_client appends `_total`
    to a counter's name on the page: `vllm:prompt_tokens` is scraped as
    `vllm:prompt_tokens_total`, exactly as from vLLM.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        model_name: str,
        registry: prometheus_client.CollectorRegistry,
        engine_index: int = 0,
    ) -> None:
        labels = {"model_name": model_name, "engine": str(engine_index)}

        def make(cls, name: str, documentation: str, **kwargs):
            metric = cls(name, documentation, labelnames=list(labels), registry=registry, **kwargs)
            return metric.labels(**labels)

        self.gauge_scheduler_running = make(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.gauge_scheduler_waiting = make(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.gauge_kv_cache_usage = make(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.counter_prefix_cache_queries = make(
            Counter, PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens."
        )
        self.counter_prefix_cache_hits = make(
            Counter, PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens."
        )
        self.counter_prompt_tokens = make(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.counter_generation_tokens = make(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        # By why each engine-core request finished (vLLM's FinishReason), each from zero.
        request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=[*labels, "finished_reason"],
            registry=registry,
        )
        self.counter_request_success = {
            reason: request_success.labels(**labels, finished_reason=reason) for reason in FINISH_REASONS
        }
        self.histogram_time_to_first_token = make(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.histogram_inter_token_latency = make(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
        )
        # Speculative decoding's counters exist only when it is on, as in vLLM.
        self.counters_spec_decode: dict[str, Counter] = {}
        self.counters_spec_decode_per_pos: list[Counter] = []
        speculative_config = vllm_config.speculative_config
        if speculative_config is not None:
            for name, attr in SPEC_DECODE_COUNTERS.items():
                self.counters_spec_decode[attr] = make(Counter, name, f"Speculative decoding: {attr}.")
            per_pos = Counter(
                SPEC_DECODE_PER_POS,
                "Accepted tokens per draft position.",
                labelnames=[*labels, "position"],
                registry=registry,
            )
            self.counters_spec_decode_per_pos = [
                per_pos.labels(**labels, position=str(pos))
                for pos in range(speculative_config.num_speculative_tokens)
            ]

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.gauge_scheduler_running.set(scheduler_stats.num_running_reqs)
            self.gauge_scheduler_waiting.set(scheduler_stats.num_waiting_reqs)
            self.gauge_kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.counter_prefix_cache_queries.inc(scheduler_stats.prefix_cache_stats.queries)
            self.counter_prefix_cache_hits.inc(scheduler_stats.prefix_cache_stats.hits)
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None:
                for attr, counter in self.counters_spec_decode.items():
                    counter.inc(getattr(spec, attr))
                for counter, count in zip(
                    self.counters_spec_decode_per_pos, spec.num_accepted_tokens_per_pos
                ):
                    counter.inc(count)
        if iteration_stats is not None:
            self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
            self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
            for ttft in iteration_stats.time_to_first_tokens_iter:
                self.histogram_time_to_first_token.observe(ttft)
            for itl in iteration_stats.inter_token_latencies_iter:
                self.histogram_inter_token_latency.observe(itl)
            for finished_request in iteration_stats.finished_requests:
                self.counter_request_success[finished_request.finish_reason].inc()
