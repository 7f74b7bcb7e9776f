"""The stat loggers: what a step's statistics become on /metrics and in the periodic log line.

Oracle: statistics built by hand, and the values they must produce under vLLM's names
(tests/test_serve_reliability.py checks the same page against a real server's traffic).
"""

from __future__ import annotations

import logging
import types

import pytest

prometheus_client = pytest.importorskip("prometheus_client")  # the GPU image has none (README)
from prometheus_client.parser import text_string_to_metric_families

from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from nano_v1.metrics.stats import IterationStats, PrefixCacheStats, RequestStateStats, SchedulerStats
from nano_v1.spec_decode.metrics import SpecDecodingStats

pytestmark = pytest.mark.ch09

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_config():
    return EngineArgs(speculative_config=SPECULATIVE).create_engine_config()


def step_stats() -> tuple[SchedulerStats, IterationStats]:
    spec = SpecDecodingStats.new(2)
    spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    scheduler_stats = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_stats=PrefixCacheStats(requests=1, queries=10, hits=4),
        spec_decoding_stats=spec,
    )
    iteration = IterationStats()
    first = RequestStateStats(arrival_time=iteration.iteration_timestamp - 0.45)
    later = RequestStateStats(arrival_time=0.0, num_generation_tokens=3)
    later.last_token_ts = iteration.iteration_timestamp - 0.02
    iteration.update_from_output(1, prompt_len=10, req_stats=first)  # its first token: TTFT 0.45 s
    iteration.update_from_output(2, prompt_len=7, req_stats=later)  # two more (a draft accepted): ITL 0.02 s
    return scheduler_stats, iteration


def test_iteration_stats_time_first_and_later_tokens():
    _, iteration = step_stats()
    assert (iteration.num_prompt_tokens, iteration.num_generation_tokens) == (10, 3)
    assert iteration.time_to_first_tokens_iter == [pytest.approx(0.45)]
    assert iteration.inter_token_latencies_iter == [pytest.approx(0.02)]


def samples(registry: prometheus_client.CollectorRegistry) -> dict[tuple[str, str], float]:
    """{(sample name, position label or ""): value} for the samples labelled as this engine."""
    text = prometheus_client.generate_latest(registry).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["model_name"] == "demo" and sample.labels["engine"] == "0"
            found[(sample.name, sample.labels.get("position", sample.labels.get("le", "")))] = sample.value
    return found


def test_prometheus_page_has_vllms_names_and_values(spec_config):
    registry = prometheus_client.CollectorRegistry()
    stat_logger = PrometheusStatLogger(spec_config, "demo", registry)
    for _ in range(2):
        stat_logger.record(*step_stats())
    page = samples(registry)
    assert page[("vllm:num_requests_running", "")] == 2 and page[("vllm:num_requests_waiting", "")] == 1
    assert page[("vllm:kv_cache_usage_perc", "")] == 0.25
    assert (
        page[("vllm:prefix_cache_queries_total", "")] == 20
        and page[("vllm:prefix_cache_hits_total", "")] == 8
    )
    assert page[("vllm:prompt_tokens_total", "")] == 20 and page[("vllm:generation_tokens_total", "")] == 6
    assert page[("vllm:time_to_first_token_seconds_count", "")] == 2
    assert page[("vllm:time_to_first_token_seconds_bucket", "0.25")] == 0
    assert page[("vllm:time_to_first_token_seconds_bucket", "0.5")] == 2
    assert page[("vllm:inter_token_latency_seconds_bucket", "0.025")] == 2
    assert page[("vllm:spec_decode_num_drafts_total", "")] == 2
    assert page[("vllm:spec_decode_num_draft_tokens_total", "")] == 4
    assert page[("vllm:spec_decode_num_accepted_tokens_total", "")] == 2
    assert page[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0")] == 2
    assert page[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1")] == 0


def test_no_spec_decode_metrics_without_speculation():
    registry = prometheus_client.CollectorRegistry()
    PrometheusStatLogger(EngineArgs().create_engine_config(), "demo", registry)
    assert not any(name.startswith("vllm:spec_decode") for name, _ in samples(registry))


def test_log_line_is_vllms_and_quiet_when_idle(spec_config, caplog, monkeypatch):
    clock = iter([100.0, 102.0, 104.0, 106.0])  # construction, then one log every 2 s
    monkeypatch.setattr("nano_v1.metrics.loggers.time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    stat_logger = LoggingStatLogger(spec_config)
    stat_logger.record(*step_stats())
    with caplog.at_level(logging.DEBUG, logger="nano_v1.metrics.loggers"):
        stat_logger.log()  # busy
        stat_logger.log()  # idle, after a busy interval: still shown
        stat_logger.log()  # idle twice: debug only
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert records[0] == (
        logging.INFO,
        "Engine 000: Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 1.5 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 40.0%",
    )
    assert records[1] == (
        logging.INFO,
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted: 1 tokens, Drafted: 2 tokens, "
        "Avg Draft acceptance rate: 50.0%",
    )
    assert [level for level, _ in records[2:]] == [logging.INFO, logging.DEBUG]
