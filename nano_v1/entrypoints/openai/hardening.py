"""The server's defences that vLLM v0.11.0 does not have: two ASGI middlewares.

nano_v1's own; vLLM v0.11.0 has no counterpart (its middlewares, `AuthenticationMiddleware`
included, are in vllm/entrypoints/openai/api_server.py, as ours are in
nano_v1/entrypoints/openai/api_server.py). Each fixes a defect a test found (chapter 09):

- `InternalServerErrorMiddleware`: a bug in a route was answered by Starlette's own 500
  handler, which re-raises after answering; uvicorn then closed the connection, so the
  client's next request on it (keep-alive) was reset, and the 500 was plain text, not
  OpenAI's error shape.
- `RequestSizeLimitMiddleware`: neither uvicorn nor Starlette bounds a request body, so a
  body of any size was read whole into memory and parsed before anything looked at it;
  now one over `--max-request-body-bytes` is a 413, before it is read (by its
  Content-Length) or as soon as it passes the limit (a chunked body).

The other defences, and whose they are:

- uvicorn's own, configured: `timeout_keep_alive` (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) closes a
  connection idle after a response; h11's `max_incomplete_event_size` (uvicorn's
  `h11_max_incomplete_event_size`, 16 KiB by default) bounds a request's headers;
  `lifespan="off"`, since the app has no startup or shutdown hooks and a forced exit left
  the lifespan task to be cancelled with a traceback (nano_v1/entrypoints/launcher.py).
- asyncio's own, switched on: TCP_NODELAY on every accepted connection, which asyncio sets
  only when the listening socket is created as IPPROTO_TCP
  (nano_v1/entrypoints/launcher.py::create_server_socket); it was protocol 0, and every
  small response waited ~40 ms for Nagle's algorithm.
- pydantic's own, switched on: `fail_fast` stops validating a list at its first bad item.
- hand-rolled, as uvicorn has nothing for them: the keep-alive timer armed when a
  connection opens, and the bound on how long a request may take to arrive
  (NANO_V1_HTTP_TIMEOUT_REQUEST), in nano_v1/entrypoints/launcher.py's
  `IdleTimeoutH11Protocol`; the bounded cost of a body (one error for all unknown fields,
  at most `MAX_STOP` stop strings and `MAX_N` completions per request) in
  nano_v1/entrypoints/openai/protocol.py, and the bounded 400 message
  (`validation_exception_handler`, api_server.py): a body of a million unknown keys held
  the event loop for 34 s; and `end_open_requests` (launcher.py), which ends the open
  streams with a clean error after a second Ctrl-C instead of a 500 ("ZMQError") each."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nano_v1.entrypoints.openai.serving_engine import OpenAIServing

logger = logging.getLogger(__name__)

# Bodies above this many bytes get a 413 before they are read; a prompt that fits in the
# model is far smaller (nano_v1/engine/processor.py::max_prompt_chars).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20


class InternalServerErrorMiddleware:
    """Whatever escapes a route becomes a logged 500 in OpenAI's shape, and the connection stays usable.

    Starlette's own handler re-raises after answering, and uvicorn then closes the
    connection, so the client's next request on it (keep-alive) would be reset. A
    response that had already started cannot be replaced: that exception still propagates.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as e:
            if started:
                raise
            logger.exception("internal error serving %s %s", scope["method"], scope["path"])
            message = f"internal server error ({type(e).__name__}); the server logged the details"
            response = OpenAIServing.create_error_response(HTTPStatus.INTERNAL_SERVER_ERROR, message)
            await response(scope, receive, send)


class RequestSizeLimitMiddleware:
    """413 for a body over `max_bytes`: by its Content-Length before reading it, or while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"the request body is larger than the server's limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            response = OpenAIServing.create_error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_large)
            await response(scope, receive, send)
            return
        received = 0

        async def receive_counting() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # a chunked body, which has no Content-Length
                raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE.value, too_large)
            return message

        await self.app(scope, receive_counting, send)
