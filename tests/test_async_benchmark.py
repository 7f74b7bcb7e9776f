"""The async scheduling benchmark (benchmarks/async_scheduling.py) at smoke size: it runs from the
command line, writes its JSON, and the numbers in it agree with each other.

No speed-up is asserted (these machines are shared); what a measurement cannot get wrong
by noise is: a synchronous step waits for the device, so it takes at least T; the ratios
are the columns they are computed from; and every measured cell has both modes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq")  # the demo model part starts engine-core processes (chapter 09)
pytest.importorskip("msgspec")

pytestmark = [pytest.mark.ch14, pytest.mark.slow]  # every test reads one smoke run of the benchmark

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("async_bench") / "async.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run(
        [sys.executable, "-m", "benchmarks.async_scheduling", "--smoke", "--out", str(out)],
        cwd=REPO_ROOT, env=env, check=True, timeout=180,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_report_says_where_and_how_it_ran(report):
    assert report["smoke"] is True
    assert report["torch_num_threads"] == 1
    assert report["environment"]["date"] and report["environment"]["device"]
    assert {"simulated_device", "host_vs_roofline", "demo_model"} <= report.keys()


def test_simulated_device_rows_are_consistent(report):
    """Every T has both modes; a synchronous step waits for the device before the next one is
    scheduled, so every one lasts at least T (an asynchronous step only on average: two
    outputs can arrive close together after a late one); host + T, max(host, T) and the
    ratios are computed from the columns beside them."""
    sim = report["simulated_device"]
    host = sim["host_ms"]
    assert host > 0
    assert [r["device_ms"] for r in sim["rows"]] == sorted({r["device_ms"] for r in sim["rows"]})
    for row in sim["rows"]:
        t = row["device_ms"]
        assert row["sync_ms"] >= t, row  # the fastest repeat
        assert row["sync_ms"] <= row["sync_ms_median"] <= row["sync_ms_max"], row
        assert row["async_ms"] <= row["async_ms_median"] <= row["async_ms_max"], row
        assert row["host_plus_device_ms"] == pytest.approx(host + t)
        assert row["max_host_device_ms"] == pytest.approx(max(host, t))
        assert row["async_over_max"] == pytest.approx(row["async_ms"] / row["max_host_device_ms"])
        assert row["sync_over_sum"] == pytest.approx(row["sync_ms"] / row["host_plus_device_ms"])
    assert sim["max_async_over_max"] == pytest.approx(max(r["async_over_max"] for r in sim["rows"]))
    # The host is the synchronous step at T=0 of the same run.
    assert sim["rows"][0]["device_ms"] == 0 and sim["rows"][0]["sync_ms"] == pytest.approx(host)
    runs = sim["every_run"]
    assert len(runs) == 2 * len(sim["rows"]) * sim["repeats"]
    assert all(r["num_intervals"] >= sim["num_steps"] - 1 for r in runs)


def test_host_vs_roofline_predictions_follow_from_the_host(report):
    hr = report["host_vs_roofline"]
    batches = [r["batch_size"] for r in hr["rows"]]
    assert batches == sorted(batches)
    for row in hr["rows"]:
        host, device = row["host_ms"], row["h200_forward_ms"]
        assert device > 0 and host > 0
        assert host <= row["host_ms_median"] <= row["host_ms_max"]
        assert row["sync_step_ms"] == pytest.approx(host + device)
        assert row["async_step_ms"] == pytest.approx(max(host, device))
        assert row["sync_tokens_per_s"] == pytest.approx(row["batch_size"] / row["sync_step_ms"] * 1e3)
        assert row["async_tokens_per_s"] >= row["sync_tokens_per_s"]
    # The roofline's forward reads every weight once per step: it grows with the batch, never shrinks.
    devices = [r["h200_forward_ms"] for r in hr["rows"]]
    assert devices == sorted(devices)


def test_demo_model_runs_both_modes_alternated(report):
    demo = report["demo_model"]
    modes = [r["mode"] for r in demo["runs"]]
    assert sorted(modes) == sorted(["sync", "async"] * demo["repeats"])
    # Alternated: each repeat runs both modes, the first one swapping from repeat to repeat.
    assert all({modes[2 * i], modes[2 * i + 1]} == {"sync", "async"} for i in range(demo["repeats"]))
    for mode in ("sync", "async"):
        s = demo["output_tokens_per_s"][mode]
        assert s["min"] <= s["median"] <= s["max"] and s["min"] > 0
    assert demo["async_over_sync"] == pytest.approx(
        demo["output_tokens_per_s"]["async"]["median"] / demo["output_tokens_per_s"]["sync"]["median"]
    )
