"""The one-shot GPU script stays ready: it runs end to end at smoke sizes, and no measurement can stop it.

A GPU session is minutes long; a crash or a hang found there costs the whole session. So
the whole suite runs here on the CPU (`--smoke`), and the runner's promises are checked
with measurements made to fail: one that raises, one that passes its time cap, one that
needs CUDA, one that runs after the budget is spent.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from nano_v1.benchmarks import gpu_suite, ledger
from nano_v1.benchmarks.gpu_suite import Measurement, register, run_measurement, run_suite
from nano_v1.benchmarks.utils import SuiteContext

pytestmark = pytest.mark.ch01


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    gpu_suite.main(["--out", str(out), "--smoke"])
    return out, json.loads((out / "gpu_suite.json").read_text())


def test_smoke_run_writes_every_measurement(smoke_report):
    out, report = smoke_report
    assert report["benchmark"] == "gpu_suite" and report["smoke"] is True
    env = report["environment"]
    assert env["date"] and env["device"] and env["torch"] and env["transformers"] and env["python"]
    assert "triton" in report["device"] and report["device"]["name"]
    records = report["measurements"]
    assert list(records) == list(gpu_suite.MEASUREMENTS)
    on_cuda = torch.cuda.is_available()
    for name, record in records.items():
        if gpu_suite.MEASUREMENTS[name].needs_cuda and not on_cuda:
            assert record["status"] == "skipped" and "needs CUDA" in record["reason"], name
        else:
            assert record["status"] == "ok", (name, record.get("traceback") or record.get("error"))
    log = (out / "gpu_suite.log").read_text()
    assert all(f"[{name}]" in log for name in records)


def test_smoke_results_are_complete_and_consistent(smoke_report):
    _, report = smoke_report
    records = report["measurements"]
    ceilings = records["ceilings"]["result"]
    assert ceilings["memory_bandwidth_GBps"] > 0 and ceilings["matmul_TFLOPs"] > 0

    rows = records["decode_latency"]["result"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert 0 < r["execute_model_ms"] <= r["step_ms"]
        assert r["fraction_of_roofline"] == pytest.approx(r["roofline_floor_ms"] / r["step_ms"])

    ours = records["throughput_qwen3_0.6b"]["result"]
    peer = records["throughput_qwen3_0.6b.generate_batch"]["result"]
    assert ours["workload"] == peer["workload"]  # the same requests on both sides
    assert ours["workload"]["num_prompts"] == 4
    assert ours["num_output_tokens"] == peer["num_output_tokens"] > 0
    assert ours["roofline"]["time_floor_s"] <= ours["elapsed_s"]
    summary = report["summary"]
    assert summary["ratio_vs_generate_batch"] == pytest.approx(
        ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
    )
    assert summary["nano_v1_fraction_of_roofline"] == ours["fraction_of_roofline"]


def test_the_smoke_report_goes_into_the_ledger(smoke_report, tmp_path):
    out, report = smoke_report
    target = ledger.add_to_ledger(out / "gpu_suite.json", tmp_path)
    assert target.name == f"gpu_suite-{report['environment']['date'][:10]}-{ledger.device_slug(report['environment']['device'])}.json"
    latest = ledger.latest_gpu_results("gpu_suite", tmp_path)
    assert latest["measurements"] == report["measurements"] and latest["ledger_file"] == target.name


def test_decode_sweep_times_pure_decode_steps_after_a_multi_step_prefill(tmp_path):
    # A step budget of 8 tokens spreads each batch's prefill over several steps, during which
    # the first requests already decode: none may run out of tokens before the timed steps end.
    ctx = SuiteContext(device=torch.device("cpu"), smoke=True, work_dir=tmp_path, num_prompts=1,
                       max_num_batched_tokens=8)
    record = run_measurement(gpu_suite.MEASUREMENTS["decode_latency"], ctx, cap_s=60)
    assert record["status"] == "ok", record.get("traceback")
    assert [r["batch_size"] for r in record["result"]["rows"]] == [1, 2, 4]


def test_throughput_workload_is_scaled_to_fit_and_shared(tmp_path):
    ctx = SuiteContext(device=torch.device("cpu"), smoke=False, work_dir=tmp_path, num_prompts=256)
    ctx.deadline = time.perf_counter() + 110

    def decode_rows(step_ms):
        return {"decode_latency": {"result": {"rows": [{"batch_size": b, "step_ms": step_ms} for b in (1, 256)]}}}

    requests, workload = gpu_suite.throughput_workload(ctx, vocab_size=100)
    assert len(requests) == workload["num_prompts"] == 256 and "scaled_down" not in workload
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in requests)
    ctx.results = decode_rows(1.0)  # 1 ms steps: 256 requests take seconds
    assert gpu_suite.throughput_workload(ctx, vocab_size=100)[1]["num_prompts"] == 256
    ctx.results = decode_rows(1000.0)  # 1 s steps: ~1000 steps cannot fit, however few the requests
    workload = gpu_suite.throughput_workload(ctx, vocab_size=100)[1]
    assert workload["num_prompts"] == 16 and "ran 16" in workload["scaled_down"]
    # Once nano_v1 has run, the peer gets exactly its workload.
    ctx.results["throughput_qwen3_0.6b"] = {"result": {"workload": {"num_prompts": 48}}}
    assert len(gpu_suite.throughput_workload(ctx, vocab_size=100)[0]) == 48


@pytest.fixture
def registry(monkeypatch):
    """An empty registry, so that test measurements do not leak into the real one."""
    monkeypatch.setattr(gpu_suite, "MEASUREMENTS", {})
    return gpu_suite.MEASUREMENTS


def test_a_failing_or_overrunning_measurement_does_not_stop_the_suite(registry, tmp_path):
    @register("boom", cap_s=5)
    def boom(ctx):
        raise ValueError("the kernel disagrees with its reference")

    @register("hang", cap_s=0.3)
    def hang(ctx):
        ctx.partial["rows"] = [1, 2]
        time.sleep(30)

    @register("cuda_only", cap_s=5, needs_cuda=True)
    def cuda_only(ctx):
        return {"ran": True}

    @register("after", cap_s=5)
    def after(ctx):
        return {"saw": sorted(ctx.results)}

    start = time.perf_counter()
    report = run_suite(tmp_path, smoke=True)
    assert time.perf_counter() - start < 10
    records = report["measurements"]
    assert records["boom"]["status"] == "error"
    assert "ValueError: the kernel disagrees" in records["boom"]["error"]
    assert "raise ValueError" in records["boom"]["traceback"]
    assert records["hang"]["status"] == "timed_out" and records["hang"]["wall_s"] < 5
    assert records["hang"]["partial"] == {"rows": [1, 2]}
    if torch.cuda.is_available():
        assert records["cuda_only"]["result"] == {"ran": True}
    else:
        assert records["cuda_only"]["status"] == "skipped" and "needs CUDA" in records["cuda_only"]["reason"]
    assert records["after"] == {**records["after"], "status": "ok", "result": {"saw": ["boom", "cuda_only", "hang"]}}
    assert json.loads((tmp_path / "gpu_suite.json").read_text())["measurements"]["after"]["status"] == "ok"


def test_an_overrun_the_alarm_cannot_interrupt_is_still_recorded():
    # Off the main thread there is no SIGALRM: the elapsed-time check must catch the overrun.
    m = Measurement("slow", lambda ctx: time.sleep(0.4) or {"value": 1}, cap_s=0.1, needs_cuda=False, description="")
    ctx = SuiteContext(device=torch.device("cpu"), smoke=True, work_dir=None, num_prompts=1)
    records = []
    thread = threading.Thread(target=lambda: records.append(run_measurement(m, ctx, m.cap_s)))
    thread.start()
    thread.join()
    assert records[0]["status"] == "timed_out" and records[0]["result"] == {"value": 1}
    assert "over its cap" in records[0]["error"]


def test_the_suite_budget_skips_what_no_longer_fits(registry, tmp_path):
    register("first", cap_s=5)(lambda ctx: time.sleep(3) or {})
    register("second", cap_s=5)(lambda ctx: {})
    records = run_suite(tmp_path, smoke=True, time_budget_s=1.5)["measurements"]
    # The budget, not its own cap, cuts the first short; nothing is left for the second.
    assert records["first"]["status"] == "timed_out" and records["first"]["cap_s"] == pytest.approx(1.5, abs=0.05)
    assert records["second"]["status"] == "skipped" and "budget" in records["second"]["reason"]


def test_selection_and_registration_errors(registry):
    register("throughput", cap_s=1)(lambda ctx: {})
    register("throughput.peer", cap_s=1)(lambda ctx: {})
    register("decode", cap_s=1)(lambda ctx: {})
    assert [m.name for m in gpu_suite.select(["throughput"])] == ["throughput", "throughput.peer"]
    assert [m.name for m in gpu_suite.select(["decode", "throughput.peer"])] == ["throughput.peer", "decode"]
    with pytest.raises(ValueError, match="unknown measurement"):
        gpu_suite.select(["through"])
    with pytest.raises(ValueError, match="already registered"):
        register("decode", cap_s=1)(lambda ctx: {})
    with pytest.raises(ValueError, match="cap_s"):
        register("free", cap_s=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_real_sizes_without_cuda_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--smoke"):
        run_suite(tmp_path, smoke=False)


def test_ledger_names_and_order(tmp_path):
    assert ledger.result_filename("gpu_suite", "2025-11-30T10:00:00+00:00", "NVIDIA H200") == \
        "gpu_suite-2025-11-30-nvidia-h200.json"
    assert ledger.latest_gpu_results("gpu_suite", tmp_path) is None
    for name, value in [("gpu_suite-2025-12-01-nvidia-h200.json", 2), ("gpu_suite-2025-11-30-nvidia-h100.json", 1),
                        ("gpu_suite_extra-2026-01-01-x.json", 3), ("notes.json", 4)]:
        (tmp_path / name).write_text(json.dumps({"value": value}))
    assert [p.name for p in ledger.list_gpu_results("gpu_suite", tmp_path)] == [
        "gpu_suite-2025-11-30-nvidia-h100.json", "gpu_suite-2025-12-01-nvidia-h200.json"]
    assert ledger.latest_gpu_results("gpu_suite", tmp_path)["value"] == 2
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        ledger.result_filename("gpu_suite", "yesterday", "NVIDIA H200")
    with pytest.raises(ValueError, match="not a benchmark report"):
        (tmp_path / "bad.json").write_text("{}")
        ledger.add_to_ledger(tmp_path / "bad.json", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_measurement_runs_on_cuda_at_smoke_sizes(smoke_report):
    # The pre-flight check of a GPU session: on CUDA nothing is skipped and nothing fails.
    _, report = smoke_report
    assert {r["status"] for r in report["measurements"].values()} == {"ok"}
    assert report["device"]["capability"]
