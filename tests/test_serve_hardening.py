"""The HTTP layer of `nano-v1 serve` under a hostile or unlucky client, without a model.

`nano_v1/entrypoints/launcher.py::serve_http` serves a stub app (two routes, an engine that
is never dead) on `create_server_socket`'s socket in a thread of this process, so each
test takes about a second. What needs the engine is in tests/test_serve_reliability.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI

from nano_v1.entrypoints.launcher import create_server_socket, serve_http

pytestmark = pytest.mark.ch09


def stub_app() -> FastAPI:
    app = FastAPI()
    app.state.engine_client = SimpleNamespace(errored=False)  # what the watchdog looks at

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "stub"}

    @app.post("/echo")  # a JSON body, read as the real routes read theirs
    async def echo(payload: dict[str, int]) -> dict[str, int]:
        return payload

    return app


@contextlib.contextmanager
def stub_server() -> Iterator[int]:
    """`serve_http` on a free loopback port, in a thread; yields the port.

    The socket listens before uvicorn starts, so a connection made early waits in the backlog.
    Stopped as `nano-v1 serve` stops when its engine dies: the watchdog sees `errored`.
    """
    sock = create_server_socket("127.0.0.1", 0)
    sock.listen()
    app = stub_app()
    thread = threading.Thread(
        target=asyncio.run, args=(serve_http(app, sock, log_level="warning"),), daemon=True
    )
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        app.state.engine_client.errored = True
        thread.join(timeout=10)
        sock.close()


def closed_within(conn: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes `conn` (EOF or reset) within `timeout_s`, whatever it sends first."""
    conn.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not conn.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_accepted_connections_have_tcp_nodelay():
    """Regression: the listening socket had protocol 0, and asyncio sets TCP_NODELAY only on sockets
    whose protocol is IPPROTO_TCP: Nagle's algorithm added ~40 ms to every small response.

    Served the way uvicorn serves it (`loop.create_server(sock=...)`), the accepted
    connection must have the option set.
    """
    sock = create_server_socket("127.0.0.1", 0)
    nodelay: list[int] = []

    async def main() -> None:
        async def on_connect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nodelay.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            for _ in range(100):
                if nodelay:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert nodelay and nodelay[0] != 0


def test_half_open_requests_are_closed_in_bounded_time(monkeypatch):
    """Regression: a client that sent part of a request and stopped held its connection forever
    (uvicorn's keep-alive timeout covers only connections that sent nothing)."""
    monkeypatch.setenv("NANO_V1_HTTP_TIMEOUT_REQUEST", "1")
    post = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
    with stub_server() as port:
        partial = [
            b"P",  # one byte of a request line
            b"GET /version HTTP/1.1\r\nHost: x\r\n",  # headers without their end
            post + b"100\r\n\r\n0123456789",  # a tenth of a body
        ]
        conns = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in partial]
        start = time.monotonic()
        for conn, data in zip(conns, partial):
            conn.sendall(data)
        # A request that arrives whole is answered, however slowly its pieces came (within the bound).
        with socket.create_connection(("127.0.0.1", port), timeout=5) as good:
            good.sendall(post + b'8\r\n\r\n{"a"')
            time.sleep(0.3)
            good.sendall(b": 1}")
            assert good.recv(65536).startswith(b"HTTP/1.1 200")
        try:
            assert all(closed_within(conn, 5) for conn in conns)
            assert time.monotonic() - start < 5
        finally:
            for conn in conns:
                conn.close()
