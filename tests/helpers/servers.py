"""A test harness: the OpenAI-compatible server in a background thread of the test process.

Not part of nano_v1: `nano-v1 bench serve` measures a real `nano-v1 serve` process, and
tests/test_serve_reliability.py tests one. Here the HTTP server runs in a thread of the
test process (its engine core still in a process of its own), so that a test can call
the engine core's utilities directly, e.g. to check that every KV block is free again
after a request is aborted. It has no watchdog: when its engine core dies it keeps
answering 503s (what `nano-v1 serve` does until it exits), so a test can look at them.
`ServerThread` builds one from engine arguments and hands out `openai` clients.

Importing this module skips the importing test (or module) where the serving stack is
missing: the GPU image has none of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

for _package in ("openai", "fastapi", "uvicorn", "zmq", "msgspec"):
    pytest.importorskip(_package)

import openai  # noqa: E402
import prometheus_client  # noqa: E402
import uvicorn  # noqa: E402

from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.async_llm import AsyncLLM
from nano_v1.entrypoints.openai.api_server import build_app, make_stat_loggers

# Every client call's limit: a hang fails the test instead of stalling the suite.
TIMEOUT_S = 60


class BackgroundServer:
    """`nano_v1/entrypoints/openai/api_server.py::run_server` in a background thread of this process.

    Unlike a server in another process, this one lets the caller reach the engine
    (`call_utility`, `engine.engine_core`), which is what the tests check the KV blocks with.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        served_model_name: str = "demo",
        start_timeout_s: float = 300,
        api_keys: list[str] | None = None,
    ) -> None:
        with socket.socket() as s:  # a free loopback port
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.served_model_name = served_model_name
        self.api_keys = api_keys
        self.loop = asyncio.new_event_loop()
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete,
            args=(self._main(engine_args),),
            daemon=True,
            name="APIServer",
        )
        self.thread.start()
        self._started.result(timeout=start_timeout_s)  # re-raises a startup error

    async def _main(self, engine_args: EngineArgs) -> None:
        try:
            vllm_config = engine_args.create_engine_config()
            registry = prometheus_client.CollectorRegistry()
            self.engine = AsyncLLM(
                vllm_config, make_stat_loggers(vllm_config, self.served_model_name, registry, log_stats=False)
            )
            app = build_app(self.engine, self.served_model_name, registry, self.api_keys)
            self.server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
            )
            serve = asyncio.ensure_future(self.server.serve())
            while not self.server.started and not serve.done():
                await asyncio.sleep(0.02)
        except BaseException as e:
            self._started.set_exception(e)
            return
        self._started.set_result(None)
        try:
            await serve
        finally:
            self.engine.shutdown()

    def call_utility(self, method: str, *args: Any) -> Any:
        """`EngineCore.<method>(*args)` in the engine-core process, from any thread."""
        coro = self.engine.engine_core.call_utility_async(method, *args)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServerThread(BackgroundServer):
    def __init__(self, **engine_kwargs) -> None:
        super().__init__(EngineArgs(**engine_kwargs))

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


def wait_until_healthy(
    base_url: str, proc: subprocess.Popen, timeout_s: float, exit_detail: Callable[[], str]
) -> None:
    """Poll `base_url`/health until a `nano-v1 serve` process answers 200; fail if it exits
    first (with `exit_detail()`, its output) or takes longer than `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{exit_detail()}"
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "nano-v1 serve did not come up"
        time.sleep(0.2)


def wait_until_idle(server: ServerThread, within_s: float) -> None:
    """All requests gone from the core and every KV block free again, within `within_s`."""
    deadline = time.monotonic() + within_s
    while server.call_utility("get_num_unfinished_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.call_utility("get_num_unfinished_requests") == 0
    assert server.call_utility("get_kv_cache_usage") == 0.0


def stream_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str]]:
    """Concatenate the streamed text per choice; also return each choice's finish reason."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(model="demo", stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "finish_reason sent twice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons
