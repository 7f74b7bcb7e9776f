"""An OpenAI-compatible HTTP server over `AsyncLLM`: `nano-v1 serve [MODEL] --port N`.

Mirrors vllm/entrypoints/openai/api_server.py (chapter 09).

Why it is thin: everything that costs time per token (tokenize, detokenize, stop
strings, `n` fan-out) is already in `AsyncLLM`'s frontend, and the model runs in the
engine-core process. This module assembles the app: its routes, each handing the request
to its endpoint's handler (serving_completion.py, serving_chat.py,
serving_tokenization.py, over serving_engine.py's `OpenAIServing`), the translation of
pydantic's and Starlette's errors, the middlewares, and `run_server`.

Every error, whoever raises it, leaves in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (what pydantic,
`SamplingParams` or `Processor` reject), 401 without the API key, 404 for an unknown
model or path, 405 for a wrong method, 413 for a body over the limit, 500 for a bug
(logged; the connection stays usable), 503 once the engine core is dead. A request that
fails leaves nothing behind in the frontend or the core.

What differs from v0.11.0: one model, built here (no lifespan, `init_app_state` or
`OpenAIServingModels`: `/v1/models` lists the one); the routes return the handlers'
responses as they are; the 401 is in OpenAI's error shape (v0.11.0's is
`{"error": "Unauthorized"}`); two middlewares of nano_v1's own, in hardening.py; and the
400 for a body that fails validation spells out at most `MAX_LISTED_PROBLEMS` problems and
counts the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import secrets
import signal
from http import HTTPStatus
from typing import Any

import prometheus_client
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import nano_v1
from nano_v1 import envs
from nano_v1.config import VllmConfig
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.async_llm import AsyncLLM
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.entrypoints.launcher import create_server_socket, serve_http
from nano_v1.entrypoints.openai.hardening import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    InternalServerErrorMiddleware,
    RequestSizeLimitMiddleware,
)
from nano_v1.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from nano_v1.entrypoints.openai.serving_chat import OpenAIServingChat
from nano_v1.entrypoints.openai.serving_completion import OpenAIServingCompletion
from nano_v1.entrypoints.openai.serving_engine import OpenAIServing
from nano_v1.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from nano_v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerBase

router = APIRouter()

# How many of a request's validation problems its 400 spells out; it counts the rest.
MAX_LISTED_PROBLEMS = 3


# ---------------------------------------------------------------------------------- errors
async def validation_exception_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Malformed JSON, wrong types, unknown fields: one 400 naming the first few problems and their count.

    Bounded, whatever the body: a message listing every problem of a body with a million
    of them was built on the event loop for seconds and ran to megabytes (issue 26).
    """
    errors = exc.errors()
    problems, param = [], None
    for err in errors[:MAX_LISTED_PROBLEMS]:
        where = ".".join(str(part) for part in err["loc"] if part != "body")
        param = param or where or None
        if err["type"] == "value_error":
            message = str(err["ctx"]["error"])  # our own message, without pydantic's "Value error, " prefix
        elif err["type"] == "json_invalid":
            message = f"invalid JSON: {err['ctx']['error']}"
        else:
            message = err["msg"]
        problems.append(f"{where}: {message}" if where else message)
    if len(errors) > MAX_LISTED_PROBLEMS:
        problems.append(f"and {len(errors) - MAX_LISTED_PROBLEMS} more problems")
    return OpenAIServing.create_error_response(HTTPStatus.BAD_REQUEST, "; ".join(problems), param)


async def http_exception_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (404 path, 405 method, a body that does not parse)."""
    message = str(exc.detail)
    if exc.__cause__ is not None:  # e.g. "There was an error parsing the body": say what the error was
        message += f": {exc.__cause__}"
    return OpenAIServing.create_error_response(HTTPStatus(exc.status_code), message)


class AuthenticationMiddleware:
    """Require `Authorization: Bearer <key>` on /v1 paths, as vLLM does (/health, /metrics stay open).

    Keys are compared as SHA-256 digests in constant time, so the time a wrong key takes
    to reject says nothing about the right one.
    """

    def __init__(self, app: ASGIApp, tokens: list[str]) -> None:
        self.app = app
        self.api_tokens = [hashlib.sha256(t.encode()).digest() for t in tokens]

    def verify_token(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, param = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode("latin-1")).digest()
        # A list, not a generator: every key is compared, so no early exit tells which one matched.
        return any([secrets.compare_digest(digest, token) for token in self.api_tokens])  # noqa: C419

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1")
        if guarded and not self.verify_token(dict(scope["headers"])):
            message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
            response = OpenAIServing.create_error_response(HTTPStatus.UNAUTHORIZED, message)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------- routes
def engine_client(raw_request: Request) -> AsyncLLM:
    return raw_request.app.state.engine_client


def completion(raw_request: Request) -> OpenAIServingCompletion:
    return raw_request.app.state.openai_serving_completion


def chat(raw_request: Request) -> OpenAIServingChat:
    return raw_request.app.state.openai_serving_chat


def tokenization(raw_request: Request) -> OpenAIServingTokenization:
    return raw_request.app.state.openai_serving_tokenization


@router.get("/health")
async def health(raw_request: Request) -> Response:
    try:
        await engine_client(raw_request).check_health()
    except EngineDeadError as e:
        return OpenAIServing.create_error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
    return Response(status_code=200)


@router.get("/version")
async def show_version() -> JSONResponse:
    return JSONResponse({"version": nano_v1.__version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    """The Prometheus text format (nano_v1/metrics/loggers.py::PrometheusStatLogger)."""
    registry = raw_request.app.state.registry
    return Response(
        prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST
    )


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    card = ModelCard(id=state.served_model_name, max_model_len=state.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


@router.post("/tokenize")
async def tokenize(
    request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request
) -> JSONResponse:
    return await tokenization(raw_request).create_tokenize(request)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    return await tokenization(raw_request).create_detokenize(request)


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await completion(raw_request).create_completion(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await chat(raw_request).create_chat_completion(request, raw_request)


# ---------------------------------------------------------------------------------- the app
def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    registry: prometheus_client.CollectorRegistry,
    api_keys: list[str] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    enable_prompt_tokens_details: bool = False,
) -> FastAPI:
    """The routes over `engine`; `registry` holds the engine's metrics (see `make_stat_loggers`);
    with `enable_prompt_tokens_details`, usage counts the cached prompt tokens."""
    app = FastAPI()
    app.include_router(router)
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    # The last added runs first: authenticate, then bound the body, then catch what escapes.
    app.add_middleware(InternalServerErrorMiddleware)
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_keys:
        app.add_middleware(AuthenticationMiddleware, tokens=api_keys)
    app.state.engine_client = engine
    app.state.openai_serving_completion = OpenAIServingCompletion(
        engine, served_model_name, enable_prompt_tokens_details
    )
    app.state.openai_serving_chat = OpenAIServingChat(engine, served_model_name, enable_prompt_tokens_details)
    app.state.openai_serving_tokenization = OpenAIServingTokenization(engine, served_model_name)
    app.state.served_model_name = served_model_name
    app.state.max_model_len = engine.vllm_config.model_config.max_model_len
    app.state.registry = registry
    # nano_v1's own, not vLLM's: requests the frontend still holds state for. Every finished,
    # failed or aborted request must bring it back down; a test's leak detector.
    prometheus_client.Gauge(
        "nano_v1:frontend_requests",
        "Requests the frontend holds state for (AsyncLLM, OutputProcessor).",
        registry=registry,
    ).set_function(engine.get_num_unfinished_requests)
    return app


def make_stat_loggers(
    vllm_config: VllmConfig,
    served_model_name: str,
    registry: prometheus_client.CollectorRegistry,
    log_stats: bool,
) -> list[StatLoggerBase]:
    """The engine's stat loggers: Prometheus metrics into `registry`, and the log line if `log_stats`."""
    stat_loggers: list[StatLoggerBase] = [PrometheusStatLogger(vllm_config, served_model_name, registry)]
    if log_stats:
        stat_loggers.append(LoggingStatLogger(vllm_config))
    return stat_loggers


def default_served_model_name(model: str | None) -> str:
    """The name clients pass as `model`: the model as given on the command line, or "demo".

    Never the absolute path the bundled checkpoint resolves to: that says where the
    server's files are, which is nobody's business but the operator's.
    """
    return model if model is not None else "demo"


async def _force_log(engine: AsyncLLM) -> None:
    """vLLM's periodic stats line, every VLLM_LOG_STATS_INTERVAL seconds."""
    while True:
        await asyncio.sleep(envs.log_stats_interval_s())
        engine.do_log_stats()


async def run_server(args: argparse.Namespace) -> None:
    """`nano-v1 serve`: bind the port, start the engine, serve until a signal or the engine's death.

    Raises ValueError if the port cannot be bound (before the model loads), and
    EngineDeadError once serving stopped because the engine core died (the CLI then exits
    non-zero, for a supervisor to restart the server).
    """
    try:
        sock = create_server_socket(args.host, args.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    with contextlib.closing(sock):
        served_model_name = args.served_model_name or default_served_model_name(args.model)
        registry = prometheus_client.CollectorRegistry()
        vllm_config = EngineArgs.from_cli_args(args).create_engine_config()
        engine = AsyncLLM(
            vllm_config,
            make_stat_loggers(vllm_config, served_model_name, registry, log_stats=not args.disable_log_stats),
        )
        log_task = (
            None if args.disable_log_stats else asyncio.create_task(_force_log(engine), name="ForceLog")
        )
        try:
            api_keys = args.api_key or ([envs.api_key()] if envs.api_key() else None)
            max_body = args.max_request_body_bytes
            app = build_app(
                engine,
                served_model_name,
                registry,
                api_keys,
                DEFAULT_MAX_REQUEST_BODY_BYTES if max_body is None else max_body,
                args.enable_prompt_tokens_details,
            )
            await serve_http(app, sock, log_level="info", timeout_keep_alive=envs.http_timeout_keep_alive_s())
        finally:
            if log_task is not None:
                log_task.cancel()
            engine.shutdown()
        if engine.errored:
            raise engine.dead_error or EngineDeadError()


def install_signal_handlers() -> None:
    """SIGTERM stops the server as Ctrl-C does: a KeyboardInterrupt, before serving or after uvicorn's
    graceful stop.

    While uvicorn serves, it takes both signals itself (and finishes open requests first);
    without this, SIGTERM's default action would kill the process before the engine core
    and the temporary files are cleaned up.
    """

    def raise_keyboard_interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, raise_keyboard_interrupt)
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
