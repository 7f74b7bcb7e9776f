"""`nano-v1 bench serve`: serving latency under load, from the client's side.

Mirrors vllm/benchmarks/serve.py (chapter 09).

Why from the client: a server is judged by what its users wait for. Requests arrive as a
Poisson process at a given rate (exponential gaps, as `vllm bench serve` draws them),
each streams its completion over HTTP, and we record per request the time to first
token (TTFT: queueing + prefill + the first trip through both processes) and the gaps
between later chunks (inter-token latency, ITL: one decode step each, when the server
keeps up). Sweeping the rate shows where the engine saturates: past it, requests queue
and TTFT grows without bound while ITL stays near the step time.

Against `--base-url` it measures any running OpenAI-compatible server; without one it
starts ours (`BackgroundServer`) with the engine flags given.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import time
from typing import Any

import numpy as np

from nano_v1.benchmarks.utils import sample_random_requests, write_json
from nano_v1.engine.arg_utils import EngineArgs

NAME = "serve"
USES_ENGINE_ARGS = True


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

    report = run(args, EngineArgs.from_cli_args(args))
    print_table(report)
    if args.output_json:
        write_json(args.output_json, report)
    return report


def run(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    if args.base_url is not None:
        return _sweep(args, args.base_url, vocab_size=None)
    from nano_v1.entrypoints.openai.api_server import BackgroundServer

    server = BackgroundServer(engine_args, served_model_name=args.served_model_name)
    try:
        vocab_size = server.engine.vllm_config.model_config.get_vocab_size()
        return _sweep(args, server.base_url, vocab_size)
    finally:
        server.stop()


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


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{'rate (req/s)':>12} {'out tok/s':>10} {'TTFT med':>9} {'TTFT p99':>9} {'ITL med':>8} {'ITL p99':>8}  (ms)"
    )
    for r in report["runs"]:
        print(
            f"{r['request_rate']!s:>12} {r['output_throughput']:>10.1f} {r['median_ttft_ms']:>9.1f} "
            f"{r['p99_ttft_ms']:>9.1f} {r.get('median_itl_ms', 0.0):>8.1f} {r.get('p99_itl_ms', 0.0):>8.1f}"
        )
