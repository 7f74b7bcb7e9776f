"""Run the HTTP server, and stop it when the engine behind it dies.

Mirrors vllm/entrypoints/launcher.py (`serve_http`, `watchdog_loop`, `terminate_if_errored`)
(chapter 09).

Why it exists: a server whose engine core is dead can only answer 503s. Kept running,
it looks alive to a load balancer's TCP check and to a supervisor, so nothing replaces
it. vLLM's answer, and ours: a watchdog notices the dead engine and asks uvicorn to exit;
`run_server` then exits non-zero, and whoever supervises the process (systemd,
Kubernetes) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from nano_v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# How often the watchdog looks at the engine (vLLM's VLLM_WATCHDOG_TIME_S is 5 s).
VLLM_WATCHDOG_TIME_S = 1.0


class IdleTimeoutH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with the keep-alive timeout armed from the first moment.

    uvicorn closes a connection that stays idle `timeout_keep_alive` seconds after a
    response, but not one that never sends a request at all: enough of those exhaust the
    server's file descriptors. Arming the same timer when the connection opens closes them
    too (uvicorn cancels it when the first bytes arrive).
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


def create_server_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads, so a taken port fails at once.

    SO_REUSEADDR lets a restarted server bind while old connections linger in TIME_WAIT.
    vLLM also sets SO_REUSEPORT; we do not, because with it a second server on the same
    port binds too and the kernel splits connections between the two.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
    waits for the open ones to finish, so in-flight streams complete. Afterwards it hands
    the signal to the handler that was installed before (`nano-v1 serve`'s turns it into
    KeyboardInterrupt, which ends the process after the engine core is shut down).
    """
    config = uvicorn.Config(app, http=IdleTimeoutH11Protocol, **uvicorn_kwargs)
    server = uvicorn.Server(config)
    watchdog = asyncio.create_task(watchdog_loop(server, app.state.engine_client), name="Watchdog")
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
