"""Run the HTTP server, and stop it when the engine behind it dies.

Mirrors vllm/entrypoints/launcher.py (`serve_http`, `watchdog_loop`, `terminate_if_errored`)
(chapter 09).

Why it exists: a server whose engine core is dead can only answer 503s. Kept running,
it looks alive to a load balancer's TCP check and to a supervisor, so nothing replaces
it. vLLM's answer, and ours: a watchdog notices the dead engine and asks uvicorn to exit;
`run_server` then exits non-zero, and whoever supervises the process (systemd,
Kubernetes) starts a fresh one.

What differs from v0.11.0: nano_v1's own defences (nano_v1/entrypoints/openai/hardening.py
lists them all): `IdleTimeoutH11Protocol`'s two timeouts, the listening socket created as
IPPROTO_TCP (so asyncio sets TCP_NODELAY; v0.11.0's `create_server_socket`, in
vllm/entrypoints/openai/api_server.py, uses protocol 0), no lifespan, and
`end_open_requests` after a second Ctrl-C. vLLM's `serve_http` also refreshes SSL certificates.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from nano_v1 import envs
from nano_v1.engine.async_llm import AsyncLLM, EngineShutdownError

logger = logging.getLogger(__name__)

# How often the watchdog looks at the engine (vLLM's VLLM_WATCHDOG_TIME_S is 5 s).
VLLM_WATCHDOG_TIME_S = 1.0
# After a forced exit, how long the open responses get to send their error.
FORCED_SHUTDOWN_GRACE_S = 2.0


class IdleTimeoutH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with two timers uvicorn lacks: one from the first moment, and
    one on a request that has begun to arrive.

    uvicorn closes a connection that stays idle `timeout_keep_alive` seconds after a
    response, but not one that never sends a request at all: enough of those exhaust the
    server's file descriptors. Arming the same timer when the connection opens closes them
    too (uvicorn cancels it when the first bytes arrive).

    Nor does it bound how long a request may take to arrive: a client that sent one byte
    and stopped held its connection forever (issue 26). So from a request's first byte to
    its body's end, at most NANO_V1_HTTP_TIMEOUT_REQUEST seconds; then the connection is closed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_request = envs.http_timeout_request_s()
        self.timeout_request_task: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._request_arriving():
            self._unset_request_timeout()
        elif self.timeout_request_task is None:
            self.timeout_request_task = self.loop.call_later(self.timeout_request, self._request_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._unset_request_timeout()
        super().connection_lost(exc)

    def _request_arriving(self) -> bool:
        """Some of a request is in, not all: part of its headers, or its headers and part of its body."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _request_timed_out(self) -> None:
        self.timeout_request_task = None
        if self._request_arriving():
            self.transport.close()

    def _unset_request_timeout(self) -> None:
        if self.timeout_request_task is not None:
            self.timeout_request_task.cancel()
            self.timeout_request_task = None


def create_server_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads, so a taken port fails at once.

    SO_REUSEADDR lets a restarted server bind while old connections linger in TIME_WAIT.
    vLLM also sets SO_REUSEPORT; we do not, because with it a second server on the same
    port binds too and the kernel splits connections between the two.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP,
    # and without it Nagle's algorithm held back every small response ~40 ms (issue 26).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def terminate_if_errored(server: uvicorn.Server, engine: AsyncLLM) -> None:
    """Ask uvicorn to exit if the engine is dead: open streams end (with an error event), then it stops."""
    if engine.errored:
        server.should_exit = True


async def watchdog_loop(server: uvicorn.Server, engine: AsyncLLM) -> None:
    while True:
        await asyncio.sleep(VLLM_WATCHDOG_TIME_S)
        terminate_if_errored(server, engine)


async def serve_http(app: FastAPI, sock: socket.socket, **uvicorn_kwargs: Any) -> None:
    """Serve `app` on `sock` until uvicorn exits: on SIGINT or SIGTERM (open requests finish first), or
    once the engine is dead.

    uvicorn handles both signals while it serves: it stops accepting connections and
    waits for the open ones to finish, so in-flight streams complete; a second Ctrl-C
    stops the wait, and `end_open_requests` ends them with an error. Afterwards it hands
    the signal to the handler that was installed before (`nano-v1 serve`'s turns it into
    KeyboardInterrupt, which ends the process after the engine core is shut down).
    """
    # No lifespan: the app has no startup or shutdown hooks, and after a forced exit uvicorn
    # leaves the lifespan task for asyncio to cancel, which logged a traceback.
    config = uvicorn.Config(app, http=IdleTimeoutH11Protocol, lifespan="off", **uvicorn_kwargs)
    server = uvicorn.Server(config)
    engine = app.state.engine_client
    watchdog = asyncio.create_task(watchdog_loop(server, engine), name="Watchdog")
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
        if server.force_exit:
            await end_open_requests(server, engine)


async def end_open_requests(server: uvicorn.Server, engine: AsyncLLM) -> None:
    """After a forced exit (a second Ctrl-C): end every open request with a clean error, and wait
    (a little) for the responses to go out, before the engine shuts down.

    uvicorn stops waiting for them at once; the engine's shutdown then closed the sockets
    under the open streams, each of which became a 500 ("ZMQError") with a traceback (issue 26).
    """
    num_ended = engine.end_requests(EngineShutdownError())
    logger.warning("Forced shutdown: %d open request(s) ended with an error.", num_ended)
    deadline = asyncio.get_running_loop().time() + FORCED_SHUTDOWN_GRACE_S
    while server.server_state.tasks and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
