"""The one-shot GPU script stays ready: it runs end to end at smoke sizes, and no measurement can stop it.

A GPU session is minutes long; a crash or a hang found there costs the whole session. So
the whole suite runs here on the CPU (`--smoke`), every measurement with its CUDA-only
parts stubbed, and the runner's promises are checked with measurements made to fail: one
that raises, one that passes its time cap, one that runs after the budget is spent. What
the measurements decide before they run (graph sizes, the workload's size) is checked as
it would be decided on CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_suite, spec_decode_verify
from benchmarks.context import CONFIGS_DIR, SMOKE_NUM_GPU_BLOCKS, SuiteContext
from benchmarks.gpu_suite import Measurement, register, run_measurement, run_suite
from nano_v1.benchmarks.roofline import H200_DATASHEET, ModelShape, decode_step_cost
from nano_v1.benchmarks.throughput import MANAGER_STOP_TIMEOUT_S, dummy_hf_model, run_generate_batch
from nano_v1.benchmarks.utils import BenchRequest, write_tiny_qwen3
from nano_v1.config import CompilationConfig
from tools import ledger

pytestmark = pytest.mark.ch01
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    gpu_suite.main(["--out", str(out), "--smoke"])
    return out, json.loads((out / "gpu_suite.json").read_text())


@pytest.mark.slow
def test_smoke_run_writes_every_measurement(smoke_report):
    out, report = smoke_report
    assert report["benchmark"] == "gpu_suite" and report["smoke"] is True
    env = report["environment"]
    assert env["date"] and env["device"] and env["torch"] and env["transformers"] and env["python"]
    assert "triton" in report["device"] and report["device"]["name"]
    records = report["measurements"]
    assert list(records) == list(gpu_suite.MEASUREMENTS)
    for name, record in records.items():
        assert record["status"] == "ok", (name, record.get("traceback") or record.get("error"))
        stub = gpu_suite.MEASUREMENTS[name].cpu_stub
        assert record.get("stubbed_on_cpu") == (None if torch.cuda.is_available() else stub), name
    log = (out / "gpu_suite.log").read_text()
    assert all(f"[{name}]" in log for name in records)


@pytest.mark.slow
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


@pytest.mark.slow
def test_smoke_async_scheduling_pairs_each_batch_size(smoke_report):
    _, report = smoke_report
    result = report["measurements"]["async_scheduling"]["result"]
    assert result["executors"] == {"sync": "UniProcExecutor", "async": "MultiprocExecutor"}
    rows = result["rows"]
    assert [(r["batch_size"], r["scheduling"]) for r in rows] == [(1, "sync"), (1, "async"), (4, "sync"), (4, "async")]
    for r in rows:
        assert r["num_decode_steps"] >= 2 and 0 < r["engine_core_host_ms"] < r["step_ms"]
        assert r["engine_core_host_ms"] == pytest.approx(r["schedule_ms"] + r["update_ms"])
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch_size"] / (r["step_ms"] / 1e3))
    assert set(result["async_decode_speedup"]) == {"1", "4"}  # JSON keys
    assert report["summary"]["async_decode_speedup"] == result["async_decode_speedup"]


@pytest.mark.slow
def test_the_smoke_report_goes_into_the_ledger(smoke_report, tmp_path):
    out, report = smoke_report
    target = ledger.add_to_ledger(out / "gpu_suite.json", tmp_path)
    assert target.name == f"gpu_suite-{report['environment']['date'][:10]}-{ledger.device_slug(report['environment']['device'])}.json"
    latest = ledger.latest_gpu_results("gpu_suite", tmp_path)
    assert latest["measurements"] == report["measurements"] and latest["ledger_file"] == target.name


@pytest.mark.slow
def test_the_triton_kernels_run_in_a_plain_smoke_run(tmp_path):
    # As the device script and CI run it: a plain command from the checkout's root, no pytest
    # conftest before it, TRITON_INTERPRET not set (the suite sets it before Triton's import,
    # and nano_v1.triton_utils repairs the interpreter the installed Triton has).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "benchmarks.gpu_suite", "--smoke", "--only", "attention_kernels",
               "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "gpu_suite.json").read_text())["measurements"]["attention_kernels"]
    assert record["status"] == "ok", record.get("traceback") or record.get("error")
    assert record["result"]["rows"], record["result"]

def test_decode_sweep_times_pure_decode_steps_after_a_multi_step_prefill(tmp_path):
    # A step budget of 8 tokens spreads each batch's prefill over several steps, during which
    # the first requests already decode: none may run out of tokens before the timed steps end.
    ctx = SuiteContext(device=torch.device("cpu"), smoke=True, work_dir=tmp_path, num_prompts=1,
                       max_num_batched_tokens=8)
    record = run_measurement(gpu_suite.MEASUREMENTS["decode_latency"], ctx, cap_s=60)
    assert record["status"] == "ok", record.get("traceback")
    assert [r["batch_size"] for r in record["result"]["rows"]] == [1, 2, 4]


def decode_rows(shape: ModelShape, batch_sizes, step_ms: float) -> dict:
    """A decode_latency result (Qwen3-0.6B shape, H200 datasheet) whose steps all take `step_ms`."""
    rows = [{"batch_size": b, "step_ms": step_ms,
             "fraction_of_roofline": 1e3 * decode_step_cost(shape, b, 512).time_floor(H200_DATASHEET) / step_ms}
            for b in batch_sizes]
    return {"decode_latency": {"result": {"rows": rows, "context_len": 512, "dtype": "bfloat16"}}}


def test_throughput_workload_is_scaled_to_fit_and_shared(tmp_path):
    ctx = SuiteContext(device=torch.device("cpu"), smoke=False, work_dir=tmp_path, num_prompts=256,
                       _ceilings=H200_DATASHEET)
    ctx.deadline = time.perf_counter() + 110
    shape = ModelShape.from_pretrained(CONFIGS_DIR / "qwen3-0.6b")

    requests, workload = gpu_suite.throughput_workload(ctx, shape)
    assert len(requests) == workload["num_prompts"] == 256 and "scaled_down" not in workload
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in requests)
    ctx.results = decode_rows(shape, (1, 256), 1.0)  # 1 ms steps: 256 requests take seconds
    assert gpu_suite.throughput_workload(ctx, shape)[1]["num_prompts"] == 256
    ctx.results = decode_rows(shape, (1, 256), 1000.0)  # 1 s steps: ~1000 steps cannot fit, however few the requests
    workload = gpu_suite.throughput_workload(ctx, shape)[1]
    assert workload["num_prompts"] == 16 and "ran 16" in workload["scaled_down"]
    # Once nano_v1 has run, the peer gets exactly its workload.
    ctx.results["throughput_qwen3_0.6b"] = {"result": {"workload": {"num_prompts": 48}}}
    assert len(gpu_suite.throughput_workload(ctx, shape)[0]) == 48


def test_a_decode_sweep_of_one_row_does_not_shrink_the_workload(tmp_path):
    # A sweep cut after B = 1 at 4 ms a step (launch bound, 6% of its roofline): prompt tokens are
    # prefilled 8,192 to a step, not one step each, and larger batches cost more than B = 1.
    ctx = SuiteContext(device=torch.device("cpu"), smoke=False, work_dir=tmp_path, num_prompts=256,
                       _ceilings=H200_DATASHEET)
    ctx.deadline = time.perf_counter() + 110
    shape = ModelShape.from_pretrained(CONFIGS_DIR / "qwen3-0.6b")
    ctx.results = decode_rows(shape, (1,), 4.0)
    assert gpu_suite.throughput_workload(ctx, shape)[1]["num_prompts"] >= 128


@pytest.mark.slow
def test_engines_capture_graphs_for_exactly_the_step_sizes_they_time(tmp_path, monkeypatch):
    # Resolved as on CUDA: a step size without its graph runs eagerly (a biased row), and a
    # graph for a size never timed costs capture time before the first row.
    built, timed = {}, {}
    build = SuiteContext.llm

    def recording_llm(self, model_dir, **overrides):
        llm = build(self, model_dir, **overrides)
        built[id(llm.llm_engine)] = overrides
        return llm

    def recording(time_decode_steps):
        def timed_steps(engine, prompts, num_steps, *, num_spec_tokens=0, **kwargs):
            timed.setdefault(id(engine), set()).add(len(prompts) * (1 + num_spec_tokens))
            return time_decode_steps(engine, prompts, num_steps, num_spec_tokens=num_spec_tokens, **kwargs)
        return timed_steps

    monkeypatch.setattr(SuiteContext, "llm", recording_llm)
    monkeypatch.setattr(gpu_suite, "time_decode_steps", recording(gpu_suite.time_decode_steps))
    monkeypatch.setattr(spec_decode_verify, "time_decode_steps", recording(spec_decode_verify.time_decode_steps))
    ctx = SuiteContext(device=torch.device("cpu"), smoke=True, work_dir=tmp_path, num_prompts=1)
    for name in ("decode_latency", "spec_decode_verify_cost"):
        assert run_measurement(gpu_suite.MEASUREMENTS[name], ctx, cap_s=120)["status"] == "ok", name
    assert built.keys() == timed.keys() and len(built) == 2
    for engine, overrides in built.items():
        config = CompilationConfig.from_arg(overrides.get("compilation_config"))
        config.resolve("cuda", False, overrides["max_num_seqs"], ctx.max_num_batched_tokens)
        assert config.cudagraph_capture_sizes == sorted(timed[engine])


def test_smoke_engines_get_a_tiny_cache_on_cuda_too(tmp_path):
    # On CUDA a cache is otherwise sized to fill 90% of the GPU: millions of blocks for the tiny model.
    ctx = SuiteContext(device=torch.device("cuda"), smoke=True, work_dir=tmp_path, num_prompts=1)
    assert ctx.engine_args(ctx.model_dir("qwen3-0.6b")).num_gpu_blocks_override == SMOKE_NUM_GPU_BLOCKS


@pytest.mark.slow
def test_the_generate_batch_peer_stops_at_its_time_cap(tmp_path):
    # transformers' manager, cut by the cap in its timed pass, must stop within seconds (its
    # own exit flushes every queued request first), and say how long its timed pass ran.
    model = dummy_hf_model(write_tiny_qwen3(tmp_path, weights=False), torch.float32, torch.device("cpu"))
    warm_up = [BenchRequest(list(range(1, 17)), 4)] * 2
    requests = warm_up + [BenchRequest(list(range(1, 17)), 3000)] * 16  # minutes of decoding on a CPU
    peer = Measurement("peer", lambda ctx: run_generate_batch(model, requests, 512, progress=ctx.partial),
                       cap_s=8, cpu_stub=None, description="")
    ctx = SuiteContext(device=torch.device("cpu"), smoke=True, work_dir=tmp_path, num_prompts=len(requests))
    record = run_measurement(peer, ctx, peer.cap_s)
    assert record["status"] == "timed_out"
    assert record["wall_s"] < peer.cap_s + MANAGER_STOP_TIMEOUT_S + 10
    assert 0 < record["partial"]["timed_s"] < record["wall_s"]
    assert record["partial"]["num_finished"] == len(warm_up)  # the long ones were cut


def test_the_at_least_ratio_counts_only_the_peers_timed_pass():
    ours = {"status": "ok", "result": {"output_tokens_per_s": 1000.0, "elapsed_s": 10.0, "fraction_of_roofline": 0.5,
                                       "roofline": {"output_tokens_per_s": 2000.0}}}
    # 60 s of wall time, of which 25 s building the model and warming up: the peer's
    # timed pass ran 35 s and had not finished what nano_v1 did in 10 s.
    peer = {"status": "timed_out", "wall_s": 60.0, "partial": {"timed_s": 35.0, "num_finished": 3}}
    summary = gpu_suite.summarize({"throughput_qwen3_0.6b": ours, "throughput_qwen3_0.6b.generate_batch": peer})
    assert summary["ratio_vs_generate_batch_at_least"] == pytest.approx(3.5)
    cut_before_timing = {"status": "timed_out", "wall_s": 60.0, "partial": {}}
    summary = gpu_suite.summarize({"throughput_qwen3_0.6b": ours,
                                   "throughput_qwen3_0.6b.generate_batch": cut_before_timing})
    assert "ratio_vs_generate_batch_at_least" not in summary


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

    @register("stubbed", cap_s=5, cpu_stub="no GPU kernel")
    def stubbed(ctx):
        return {"on_cuda": ctx.on_cuda}

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
    assert records["stubbed"]["result"] == {"on_cuda": torch.cuda.is_available()}
    assert records["stubbed"].get("stubbed_on_cpu") == (None if torch.cuda.is_available() else "no GPU kernel")
    assert records["after"] == {**records["after"], "status": "ok", "result": {"saw": ["boom", "hang", "stubbed"]}}
    assert json.loads((tmp_path / "gpu_suite.json").read_text())["measurements"]["after"]["status"] == "ok"


def test_an_overrun_the_alarm_cannot_interrupt_is_still_recorded():
    # Off the main thread there is no SIGALRM: the elapsed-time check must catch the overrun.
    m = Measurement("slow", lambda ctx: time.sleep(0.4) or {"value": 1}, cap_s=0.1, cpu_stub=None, description="")
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
