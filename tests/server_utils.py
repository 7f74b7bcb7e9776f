"""A test harness: the OpenAI-compatible server in a background thread of the test process.

Not part of nano_v1: `nano-v1 bench serve` measures a real `nano-v1 serve` process. Here
the HTTP server runs in a thread of the test process (its engine core still in a process
of its own), so that a test can call the engine core's utilities directly, e.g. to check
that every KV block is free again after a request is aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from typing import Any

from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.async_llm import AsyncLLM
from nano_v1.entrypoints.openai.api_server import build_server


class BackgroundServer:
    """`nano_v1/entrypoints/openai/api_server.py::run_server` in a background thread of this process.

    Unlike a server in another process, this one lets the caller reach the engine
    (`call_utility`, `engine.engine_core`), which is what the tests check the KV blocks with.
    """

    def __init__(
        self, engine_args: EngineArgs, served_model_name: str = "demo", start_timeout_s: float = 300
    ) -> None:
        with socket.socket() as s:  # a free loopback port
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.served_model_name = served_model_name
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
            self.engine = AsyncLLM.from_engine_args(engine_args)
            self.server = build_server(self.engine, self.served_model_name, "127.0.0.1", self.port, "warning")
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
