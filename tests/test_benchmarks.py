"""The benchmarks at toy sizes: they run end to end, do the workload they claim, and write JSON.

No timing is asserted (these machines are shared); token counts are, because a benchmark
that silently runs a different workload reports a meaningless rate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nano_v1 import benchmarks
from nano_v1.benchmarks import serve
from nano_v1.benchmarks.utils import length_range, sample_random_requests
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.entrypoints import cli

REPO_ROOT = Path(__file__).resolve().parents[1]


def read_report(path) -> dict:
    report = json.loads(path.read_text())
    env = report["environment"]
    assert env["date"] and env["device"] and env["torch"] and env["transformers"] and env["cpu_count"] >= 1
    return report


def test_length_range_follows_vllm_random_dataset():
    # vLLM: [floor(len * (1 - r)), ceil(len * (1 + r))]; an explicit range wins.
    assert length_range(100, 0.25, None) == (75, 125)
    assert length_range(48, 0.0, None) == (48, 48)
    assert length_range(48, 0.5, (32, 256)) == (32, 256)
    with pytest.raises(ValueError, match="range-ratio"):
        length_range(48, 1.0, None)
    with pytest.raises(ValueError, match="low <= high"):
        length_range(None, 0.0, (10, 5))


def test_random_requests_are_seeded_and_in_range():
    a = sample_random_requests(50, (3, 9), (1, 4), vocab_size=17, seed=5)
    b = sample_random_requests(50, (3, 9), (1, 4), vocab_size=17, seed=5)
    assert [(r.prompt_token_ids, r.output_len) for r in a] == [(r.prompt_token_ids, r.output_len) for r in b]
    assert {r.prompt_len for r in a} == set(range(3, 10))  # both ends reachable
    assert {r.output_len for r in a} == set(range(1, 5))
    assert all(0 <= t < 17 for r in a for t in r.prompt_token_ids)


@pytest.mark.ch04
def test_scheduler_benchmark_runs_the_whole_workload(tmp_path):
    out = tmp_path / "sched.json"
    cli.main([
        "bench", "scheduler", "--num-requests", "12", "--input-len-range", "20", "70",
        "--output-len-range", "3", "30", "--block-size", "4", "--max-num-batched-tokens", "64",
        "--max-num-seqs", "8", "--sliding-window", "16", "--output-json", str(out),
    ])
    report = read_report(out)
    assert report["workload"]["finished"]
    # Every prompt token and every output token but the last is computed exactly once
    # (random prompts never hit the prefix cache, and the cache holds everything: no preemption).
    requests = sample_random_requests(12, (20, 70), (3, 30), vocab_size=4096, seed=0)
    num_tokens = sum(r.prompt_len + r.output_len - 1 for r in requests)
    assert report["num_scheduled_tokens"] == num_tokens
    assert report["num_steps"] >= report["num_scheduled_tokens"] / 64
    for part in ("schedule", "prepare_inputs", "bookkeeping", "update_from_output"):
        s = report["per_step"][part]
        assert all(s[k] > 0 for k in ("median_us", "mean_us", "p99_us", "us_per_token", "cpu_median_us", "cpu_us_per_token"))
    assert all(report[k] > 0 for k in ("scheduler_us_per_token", "scheduler_cpu_us_per_token", "runner_us_per_token", "runner_cpu_us_per_token"))

    # The same workload through the scheduler alone, in every variant, to the end.
    variants = report["variants"]
    assert {name: (v["kv_cache_groups"], v["scheduler"], v["batch_queue_size"]) for name, v in variants.items()} == {
        "single-group": ("full", "Scheduler", 1),
        "hybrid": ("full+sliding", "Scheduler", 1),
        "single-group async": ("full", "AsyncScheduler", 2),
        "hybrid async": ("full+sliding", "AsyncScheduler", 2),
    }
    assert report["sliding_window"] == 16
    for name, v in variants.items():
        assert v["finished"], name
        assert all(v[k] > 0 for k in ("schedule_cpu_median_us", "update_from_output_cpu_median_us", "scheduler_cpu_us_per_token"))
    # Synchronously, every token once, as above; asynchronously, a request's last token is
    # still in flight when the next step is scheduled, which may give it one token more
    # (dropped when its output arrives).
    assert variants["single-group"]["num_scheduled_tokens"] == variants["hybrid"]["num_scheduled_tokens"] == num_tokens
    for name in ("single-group async", "hybrid async"):
        assert num_tokens < variants[name]["num_scheduled_tokens"] <= num_tokens + len(requests), name


@pytest.mark.ch04
def test_scheduler_benchmark_max_steps(tmp_path):
    out = tmp_path / "sched.json"
    cli.main(["bench", "scheduler", "--num-requests", "4", "--max-steps", "3", "--output-json", str(out)])
    report = read_report(out)
    assert report["num_steps"] == 3 and not report["workload"]["finished"]
    # Three outputs taken in every variant; with a batch queue of two, step N + 1 is
    # scheduled before step N's output is taken, so one more step was scheduled.
    assert {name: (v["num_steps"], v["finished"]) for name, v in report["variants"].items()} == {
        "single-group": (3, False),
        "hybrid": (3, False),
        "single-group async": (4, False),
        "hybrid async": (4, False),
    }


@pytest.mark.ch01
def test_throughput_benchmark_against_both_peers(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "tput.json"
    cli.main([
        "bench", "throughput", "--model", tiny_qwen3, "--num-prompts", "4", "--input-len-range", "5", "40",
        "--output-len-range", "2", "6", "--peers", "all", "--output-json", str(out),
    ])
    report = read_report(out)
    requests = sample_random_requests(4, (5, 40), (2, 6), vocab_size=512, seed=0)
    assert len({r.output_len for r in requests}) > 1  # per-request output lengths are exercised
    # Each engine is checked inside the run to produce exactly these lengths; the counts follow.
    for engine in ("nano_v1", "generate_batch", "generate"):
        s = report["results"][engine]
        assert s["num_output_tokens"] == sum(r.output_len for r in requests)
        assert s["num_prompt_tokens"] == sum(r.prompt_len for r in requests)
        assert s["output_tokens_per_s"] > 0 and s["total_tokens_per_s"] > s["output_tokens_per_s"]
    assert set(report["ratios"]) == {"nano_v1/generate_batch", "nano_v1/generate"}
    assert "nano_v1/generate_batch" in capsys.readouterr().out


@pytest.mark.ch01
def test_throughput_benchmark_rejects_requests_longer_than_the_context(tiny_qwen3, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "throughput", "--model", tiny_qwen3, "--input-len", "1000", "--output-len", "100",
                  "--peers", "none"])
    assert e.value.code == 2
    assert "max_model_len" in capsys.readouterr().err


@pytest.mark.ch00
def test_no_benchmark_module_writes_the_environment_at_import():
    # In a fresh interpreter with neither variable set (this process has them from conftest):
    # importing every benchmark module, the package's and the checkout's benchmarks/, must leave
    # os.environ exactly as it was.
    modules = sorted(
        f"{package}.{p.stem}" for package, folder in (("nano_v1.benchmarks", Path(benchmarks.__file__).parent),
                                                     ("benchmarks", REPO_ROOT / "benchmarks"))
        for p in folder.glob("*.py") if p.stem != "__init__"
    )
    script = (
        "import importlib, os\n"
        "before = dict(os.environ)\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "changed = {k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)}\n"
        "assert not changed, f'importing the benchmarks changed {sorted(changed)}'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.ch09
def test_engine_flags_give_the_server_what_differs_from_the_defaults():
    engine_args = EngineArgs(dtype="float32", max_model_len=64, enable_prefix_caching=False,
                             compilation_config={"level": 3})
    assert serve.engine_flags(engine_args) == [
        "--dtype", "float32", "--max-model-len", "64", "--no-enable-prefix-caching",
        "--compilation-config", '{"level": 3}',
    ]
    assert serve.engine_flags(EngineArgs()) == []


# `nano-v1 serve` needs FastAPI, uvicorn and, for its engine-core process, ZMQ and msgspec:
# none of them is on the GPU image.
needs_server = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("fastapi", "uvicorn", "zmq", "msgspec")),
    reason="nano-v1 serve needs fastapi, uvicorn, pyzmq and msgspec",
)


@pytest.fixture
def server_pythonpath(monkeypatch):
    """`nano-v1 serve` in a child process imports this checkout's nano_v1."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


@pytest.mark.ch09
@pytest.mark.slow
@needs_server
def test_bench_serve_without_a_base_url_runs_its_own_server_and_stops_it(server_pythonpath, monkeypatch, tmp_path):
    started = []
    popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(serve.subprocess, "Popen", recording_popen)
    out = tmp_path / "serve.json"
    cli.main(["bench", "serve", "--num-prompts", "2", "--request-rate", "inf", "--input-len", "8",
              "--output-len", "3", "--max-model-len", "64", "--num-gpu-blocks-override", "64", "--dtype", "float32",
              "--output-json", str(out)])
    (run,) = read_report(out)["runs"]
    assert run["completed"] == 2 and run["output_throughput"] > 0 and run["median_itl_ms"] > 0
    (server,) = [p for p in started if p.args[:4] == [sys.executable, "-m", "nano_v1.entrypoints.cli", "serve"]]
    assert server.returncode is not None, "the server is still running"


@pytest.mark.ch09
@pytest.mark.slow
@needs_server
def test_bench_serve_says_when_its_server_dies_on_start(server_pythonpath):
    with pytest.raises(RuntimeError, match="exited with code") as e:
        with serve.running_server(EngineArgs(dtype="no-such-dtype"), "demo"):
            pass
    assert "no-such-dtype" in str(e.value)  # the end of the server's log


FAKE_VLLM_PEER = '''#!{python}
import json, sys
workload = json.load(sys.stdin)
print("INFO a log line on stdout, as vLLM writes them")
print(json.dumps({{
    "vllm": "0.11.0", "num_steps": 5, "finished": True, "argv": sys.argv[1:], "workload": workload,
    "num_scheduled_tokens": sum(len(prompt) + output_len - 1 for prompt, output_len in workload["requests"]),
    "schedule_cpu_median_us": 3.0, "update_from_output_cpu_median_us": 2.0, "scheduler_cpu_us_per_token": 9.0,
}}))
'''


@pytest.mark.ch04
def test_scheduler_benchmark_sends_the_workload_to_the_vllm_peer(tmp_path, capsys):
    """--peer-vllm runs scheduler_peer_vllm.py under the given Python with the single-group
    workload on stdin, and takes its answer from the last line of stdout."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM_PEER.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "sched.json"
    cli.main(["bench", "scheduler", "--num-requests", "3", "--input-len-range", "20", "40", "--output-len-range",
              "2", "5", "--peer-vllm", str(fake), "--output-json", str(out)])
    report = read_report(out)
    peer = report["peer_vllm"]
    assert peer["argv"] == ["-I", str(REPO_ROOT / "nano_v1/benchmarks/scheduler_peer_vllm.py")]
    requests = sample_random_requests(3, (20, 40), (2, 5), vocab_size=4096, seed=0)
    assert peer["workload"]["requests"] == [[r.prompt_token_ids, r.output_len] for r in requests]
    assert {k: peer["workload"][k] for k in ("block_size", "max_num_batched_tokens", "enable_prefix_caching")} == {
        "block_size": 16, "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
    }
    assert peer["num_scheduled_tokens"] == report["variants"]["single-group"]["num_scheduled_tokens"]
    single = report["variants"]["single-group"]["scheduler_cpu_us_per_token"]
    assert peer["ratio_to_single_group"] == pytest.approx(9.0 / single)
    assert "vLLM 0.11.0" in capsys.readouterr().out

    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('no vllm here')\n")
    with pytest.raises(RuntimeError, match="no vllm here"):
        cli.main(["bench", "scheduler", "--num-requests", "2", "--max-steps", "2", "--peer-vllm", str(fake)])


@pytest.mark.ch04
@pytest.mark.skipif(not os.environ.get("NANO_V1_VLLM_PYTHON"), reason="set NANO_V1_VLLM_PYTHON to a Python with vLLM 0.11.0")
def test_scheduler_benchmark_vllm_peer_runs_the_same_workload(tmp_path):
    """vLLM v0.11.0's scheduler schedules exactly the tokens nano_v1's does, in as many steps."""
    out = tmp_path / "sched.json"
    cli.main(["bench", "scheduler", "--num-requests", "12", "--input-len-range", "20", "70", "--output-len-range",
              "3", "30", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
              "--peer-vllm", os.environ["NANO_V1_VLLM_PYTHON"], "--output-json", str(out)])
    report = read_report(out)
    peer, single = report["peer_vllm"], report["variants"]["single-group"]
    assert peer["finished"] and peer["vllm"] == "0.11.0"
    assert (peer["num_steps"], peer["num_scheduled_tokens"]) == (single["num_steps"], single["num_scheduled_tokens"])
