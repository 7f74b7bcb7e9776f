"""Decode inter-token latency, one server against disaggregated prefill (a prefill and a decode server).

Mirrors the measurement behind v0.11.0's examples/online_serving/disaggregated_serving/
(why split prefill from decode) (chapter 16).
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root, as
it starts the proxy in examples/.

Why it exists: chapter 16 claims that disaggregated prefill protects decode latency. On one
server a long prompt's prefill shares steps with the running decodes (chunked prefill),
so every decode stream stalls while it runs; with prefill on another server, the decode
server loads the prompt's KV and only ever computes a few tokens per request. Here N
steady streaming decodes (short prompts, long outputs) run while long prompts arrive every
`long_prompt_interval_s` through the same front door (the one server, or the proxy), and
each decode stream's gaps between chunks are recorded.

The comparison is at equal CPU: "colocated" is one server with 2 torch threads,
"disaggregated" a prefill and a decode server with 1 each (set through OMP_NUM_THREADS, which
torch reads at start; the engine core takes the frontend's `torch.get_num_threads()`).
`running_pd` starts the trio (prefill server, decode server, proxy) for tests and notebooks.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from nano_v1.benchmarks.serve import running_server
from nano_v1.engine.arg_utils import EngineArgs

PROXY_MODULE = "examples.online_serving.disaggregated_serving.disagg_proxy"
SERVED_MODEL_NAME = "demo"
# The engine both modes run: the demo model at float32 (CPU), a KV cache for the workload.
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32", "max_model_len": 640, "block_size": 16, "num_gpu_blocks_override": 512,
}  # fmt: skip
FULL = {"num_decode_streams": 4, "decode_max_tokens": 256, "long_prompt_len": 256, "long_prompt_interval_s": 1.0}
SMOKE = {"num_decode_streams": 2, "decode_max_tokens": 64, "long_prompt_len": 128, "long_prompt_interval_s": 0.5}


def shared_storage_config(kv_role: str, storage: str) -> dict[str, Any]:
    """`--kv-transfer-config` of a server of the trio: SharedStorageConnector over `storage`."""
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }


def enter_all(stack: contextlib.ExitStack, managers: Sequence[contextlib.AbstractContextManager]) -> list[Any]:
    """Enter `managers` concurrently (servers start in parallel); `stack` exits the ones that entered."""
    with concurrent.futures.ThreadPoolExecutor(len(managers)) as pool:
        return list(pool.map(stack.enter_context, managers))


def server_env(torch_num_threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(torch_num_threads)}


def running_plain_server(
    engine_kwargs: dict[str, Any], torch_num_threads: int, extra_flags: Sequence[str] = ()
) -> contextlib.AbstractContextManager[str]:
    """One `nano-v1 serve` without a connector; yields its base URL."""
    return running_server(
        EngineArgs(**engine_kwargs), SERVED_MODEL_NAME, extra_flags, server_env(torch_num_threads)
    )


def running_proxy(prefill_url: str, decode_url: str) -> contextlib.AbstractContextManager[str]:
    """The example proxy (examples/online_serving/disaggregated_serving/disagg_proxy.py); yields its URL."""
    command = [sys.executable, "-m", PROXY_MODULE, "--prefiller-url", prefill_url, "--decoder-url", decode_url]
    # `examples` is found from the checkout's root, whatever the caller's directory (a notebook runs in notebooks/).
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return running_server(EngineArgs(), SERVED_MODEL_NAME, command=command, env=env)


@dataclass(slots=True)
class PDServers:
    prefill_url: str  # the kv_producer server
    decode_url: str  # the kv_consumer server
    proxy_url: str  # the front door


@contextlib.contextmanager
def running_pd(
    storage: str,
    engine_kwargs: dict[str, Any] | None = None,
    torch_num_threads: int = 1,
    extra_flags: Sequence[str] = (),
    also: Sequence[contextlib.AbstractContextManager] = (),
) -> Iterator[tuple[PDServers, list[Any]]]:
    """A prefill and a decode server sharing `storage` (started in parallel, each with
    `torch_num_threads` and `extra_flags`), then the proxy; yields their URLs, and the values of
    `also` (more servers to start alongside, e.g. a plain one as an oracle)."""
    engine_kwargs = ENGINE_KWARGS if engine_kwargs is None else engine_kwargs
    env = server_env(torch_num_threads)
    with contextlib.ExitStack() as stack:
        servers = [
            running_server(
                EngineArgs(**engine_kwargs, kv_transfer_config=shared_storage_config(role, storage)),
                SERVED_MODEL_NAME,
                extra_flags,
                env,
            )
            for role in ("kv_producer", "kv_consumer")
        ]
        prefill_url, decode_url, *others = enter_all(stack, [*servers, *also])
        proxy_url = stack.enter_context(running_proxy(prefill_url, decode_url))
        yield PDServers(prefill_url, decode_url, proxy_url), others


# ------------------------------------------------------------------------------- the workload
async def _decode_stream(client: Any, prompt: list[int], max_tokens: int) -> list[float]:
    """One streaming decode; the arrival time of each chunk that carries text or a token."""
    stream = await client.completions.create(
        model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    arrivals = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
    return arrivals


async def _long_prompts(client: Any, rng: np.random.Generator, length: int, interval_s: float, stop: asyncio.Event) -> int:
    """Send a fresh long prompt (one output token) every `interval_s` until `stop`; return how many.

    One at a time: a server slower than the arrivals gets the next prompt when it answers the
    last, so a queue of prompts never builds up (the decodes' stalls stay one prefill long).
    """
    num_sent = 0
    while not stop.is_set():
        start = time.perf_counter()
        prompt = rng.integers(1, 400, size=length).tolist()  # fresh: no prefix-cache hit
        await client.completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0.0)
        num_sent += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(interval_s - (time.perf_counter() - start), 0.0))
    return num_sent


async def _workload(base_url: str, size: dict[str, Any], seed: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    rng = np.random.default_rng(seed)
    stop = asyncio.Event()
    long_task = asyncio.create_task(
        _long_prompts(client, rng, size["long_prompt_len"], size["long_prompt_interval_s"], stop)
    )
    prompts = [rng.integers(1, 400, size=8).tolist() for _ in range(size["num_decode_streams"])]
    streams = await asyncio.gather(*(_decode_stream(client, p, size["decode_max_tokens"]) for p in prompts))
    stop.set()
    num_long_prompts = await long_task
    gaps = [float(g) for arrivals in streams for g in np.diff(arrivals)]  # the first chunk's wait is TTFT
    return {"gaps_s": gaps, "num_long_prompts": num_long_prompts}


def measure_itl(
    mode: Literal["colocated", "disaggregated"],
    smoke: bool = False,
    seed: int = 0,
    engine_kwargs: dict[str, Any] | None = None,
    **size_overrides: Any,
) -> dict[str, Any]:
    """Start the servers of `mode`, run the workload through its front door, stop them.

    Returns the raw inter-chunk gaps of every decode stream, their p50 and p99 (seconds),
    each server's torch thread count, how many long prompts arrived, and the sizes used
    (`FULL` or `SMOKE`, with `size_overrides`).
    """
    size = {**(SMOKE if smoke else FULL), **size_overrides}
    engine_kwargs = {**ENGINE_KWARGS, **(engine_kwargs or {})}
    with contextlib.ExitStack() as stack:
        if mode == "colocated":
            threads = {"server": 2}
            front_door = stack.enter_context(running_plain_server(engine_kwargs, threads["server"]))
        elif mode == "disaggregated":
            threads = {"prefill": 1, "decode": 1}
            storage = stack.enter_context(tempfile.TemporaryDirectory(prefix="nano_v1_kv_"))
            servers, _ = stack.enter_context(running_pd(storage, engine_kwargs, torch_num_threads=1))
            front_door = servers.proxy_url
        else:
            raise ValueError(f"mode must be 'colocated' or 'disaggregated', got {mode!r}.")
        # In a thread of its own: a notebook's kernel already runs an event loop in this one.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            result = pool.submit(asyncio.run, _workload(front_door, size, seed)).result()
    gaps = result["gaps_s"]
    return {
        "mode": mode,
        **result,
        "p50_s": float(np.percentile(gaps, 50)) if gaps else None,
        "p99_s": float(np.percentile(gaps, 99)) if gaps else None,
        "torch_num_threads": threads,
        "size": size,
        "engine_kwargs": engine_kwargs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: runs in well under a minute")
    parser.add_argument("--modes", nargs="+", default=["colocated", "disaggregated"])
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    report = {mode: measure_itl(mode, smoke=args.smoke) for mode in args.modes}
    for mode, r in report.items():
        print(f"{mode:>14}: p50 {r['p50_s'] * 1e3:7.1f} ms  p99 {r['p99_s'] * 1e3:7.1f} ms  "
              f"({len(r['gaps_s'])} gaps, {r['num_long_prompts']} long prompts, threads {r['torch_num_threads']})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
