"""`nano-v1 bench serve`: serving latency under load, from the client's side.

Mirrors vllm/benchmarks/serve.py (chapter 09).

Why from the client: a server is judged by what its users wait for. Requests arrive as a
Poisson process at a given rate (exponential gaps, as `vllm bench serve` draws them),
each streams its completion over HTTP, and we record per request the time to first
token (TTFT: queueing + prefill + the first trip through both processes) and the gaps
between later chunks (inter-token latency, ITL: one decode step each, when the server
keeps up). Sweeping the rate shows where the engine saturates: past it, requests queue
and TTFT grows without bound while ITL stays near the step time.

Against `--base-url` it measures any running OpenAI-compatible server. Without one it
starts ours, `nano-v1 serve` with the engine flags given, as a process of its own (as
`vllm bench serve` measures a server running apart): it waits for `/health`, runs the
sweep, then stops the server (SIGINT, then SIGKILL if it does not exit in time).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import math
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

import numpy as np

from nano_v1.benchmarks.utils import print_table, sample_random_requests, write_json
from nano_v1.engine.arg_utils import EngineArgs

NAME = "serve"
USES_ENGINE_ARGS = True
SERVER_START_TIMEOUT_S = 300.0  # model load and, on a GPU, CUDA graph capture included
SERVER_STOP_TIMEOUT_S = 30.0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--served-model-name", default="demo")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[2.0, 8.0, math.inf],
        help="requests per second (inf: all at once); one run per rate",
    )
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--output-json", default=None, help="write the results here")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark from parsed CLI flags; print a table, write JSON, return the results."""
    report = run(args, EngineArgs.from_cli_args(args))
    print_report(report)
    if args.output_json:
        write_json(args.output_json, report)
    return report


def run(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    """The sweep against `args.base_url`, or against a `nano-v1 serve` of `engine_args` started for it."""
    if args.base_url is not None:
        return _sweep(args, args.base_url, vocab_size=None)
    vocab_size = engine_args.create_engine_config().model_config.get_vocab_size()
    with running_server(engine_args, args.served_model_name) as base_url:
        return _sweep(args, base_url, vocab_size)


def engine_flags(engine_args: EngineArgs) -> list[str]:
    """The `nano-v1 serve` flags of every engine argument that differs from its default."""
    defaults = EngineArgs()
    flags = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(engine_args, f.name)
        if value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag.removeprefix("--"))
        else:
            flags += [flag, value if isinstance(value, str) else json.dumps(value)]  # dicts as JSON
    return flags


@contextmanager
def running_server(
    engine_args: EngineArgs,
    served_model_name: str,
    extra_flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
) -> Iterator[str]:
    """`nano-v1 serve` in a process of its own on a free loopback port; yields its base URL once healthy.

    `extra_flags`: more `nano-v1 serve` flags; `env`: the process's environment (default:
    this one's), e.g. OMP_NUM_THREADS; `command`: another server to start instead (given
    `--port`), e.g. the disaggregated-serving proxy (chapter 16). Its output goes to a
    temporary log, whose end a start-up failure quotes.
    """
    with socket.socket() as s:  # a free port: the server binds it a moment later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if command is None:
        command = [sys.executable, "-m", "nano_v1.entrypoints.cli", "serve", *engine_flags(engine_args),
                   "--host", "127.0.0.1", "--served-model-name", served_model_name, *extra_flags]
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_until_healthy(server, base_url, log)
            yield base_url
        finally:
            _stop(server)


def _wait_until_healthy(server: subprocess.Popen, base_url: str, log: TextIO) -> None:
    """Poll `/health` until it answers 200; raise if the server exits or `SERVER_START_TIMEOUT_S` passes."""
    import httpx

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            tail = "".join(log.readlines()[-20:])
            raise RuntimeError(f"the server exited with code {server.returncode} before it was healthy:\n{tail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"the server at {base_url} was not healthy after {SERVER_START_TIMEOUT_S:.0f} s.")


def _stop(server: subprocess.Popen) -> None:
    """SIGINT (the server shuts its engine core down), then SIGKILL if it is still there after the timeout."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _sweep(args: argparse.Namespace, base_url: str, vocab_size: int | None) -> dict[str, Any]:
    seed = args.seed or 0  # the engine's --seed also seeds the workload and the arrivals
    # Random token ids defeat the prefix cache; against a foreign server, stay in a small vocabulary.
    requests = sample_random_requests(
        args.num_prompts,
        (args.input_len, args.input_len),
        (args.output_len, args.output_len),
        vocab_size or 1000,
        seed,
    )
    # A loop of its own in a worker thread: works from a script and from a notebook's running loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        runs = [
            pool.submit(
                asyncio.run, benchmark(base_url, args.served_model_name, requests, rate, seed)
            ).result()
            for rate in args.request_rate
        ]
    return {
        "benchmark": NAME,
        "base_url": base_url,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "runs": runs,
    }


async def benchmark(
    base_url: str, model: str, requests: list, request_rate: float, seed: int
) -> dict[str, Any]:
    """Send `requests` as a Poisson process at `request_rate`/s; return latency percentiles."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, size=len(requests)) if math.isfinite(request_rate) else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            tasks.append(
                asyncio.create_task(_one_request(client, model, request.prompt_token_ids, request.output_len))
            )
            if gaps is not None:
                await asyncio.sleep(gaps[i])
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results]
    itls = [gap for r in results for gap in r["itl"]]
    num_output_tokens = sum(r["output_tokens"] for r in results)
    return {
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "completed": len(results),
        "duration_s": duration,
        "request_throughput": len(results) / duration,
        "output_throughput": num_output_tokens / duration,
        **_percentiles("ttft_ms", ttfts),
        **_percentiles("itl_ms", itls),
    }


async def _one_request(client, model: str, prompt_token_ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt_token_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    chunk_times: list[float] = []
    output_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                chunk_times.append(time.perf_counter())
    return {
        "ttft": chunk_times[0] - sent,
        "itl": np.diff(chunk_times).tolist(),
        "output_tokens": output_tokens,
    }


def _percentiles(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    if ms.size == 0:
        return {}
    return {
        f"mean_{name}": float(ms.mean()),
        f"median_{name}": float(np.median(ms)),
        f"p99_{name}": float(np.percentile(ms, 99)),
    }


def print_report(report: dict[str, Any]) -> None:
    columns = [("rate (req/s)", "request_rate", ""), ("out tok/s", "output_throughput", ".1f"),
               ("TTFT med", "median_ttft_ms", ".1f"), ("TTFT p99", "p99_ttft_ms", ".1f"),
               ("ITL med", "median_itl_ms", ".1f"), ("ITL p99", "p99_itl_ms", ".1f")]
    print_table(columns, report["runs"], title="latencies in ms")
