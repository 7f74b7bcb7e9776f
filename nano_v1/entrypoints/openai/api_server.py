"""An OpenAI-compatible HTTP server over `AsyncLLM`: `nano-v1 serve [MODEL] --port N`.

Mirrors vllm/entrypoints/openai/api_server.py, serving_completion.py, serving_chat.py and
serving_tokenization.py (chapter 09).

Why it is thin: everything that costs time per token (tokenize, detokenize, stop
strings, `n` fan-out) is already in `AsyncLLM`'s frontend, and the model runs in the
engine-core process. This module only turns HTTP into `AsyncLLM.generate()` calls and
`RequestOutput`s back into OpenAI's JSON, or into server-sent events when streaming.

Every error, whoever raises it, leaves in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (what pydantic,
`SamplingParams` or `Processor` reject), 401 without the API key, 404 for an unknown
model or path, 405 for a wrong method, 413 for a body over the limit, 500 for a bug
(logged; the connection stays usable), 503 once the engine core is dead. A request that
fails leaves nothing behind in the frontend or the core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import secrets
import signal
from collections.abc import AsyncGenerator, Awaitable
from http import HTTPStatus
from typing import Any

import prometheus_client
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import nano_v1
from nano_v1 import envs
from nano_v1.config import ModelConfig, VllmConfig
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.async_llm import AsyncLLM
from nano_v1.engine.processor import PromptType
from nano_v1.entrypoints.chat_utils import parse_chat_messages
from nano_v1.entrypoints.launcher import create_server_socket, serve_http
from nano_v1.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UsageInfo,
    random_id,
)
from nano_v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerBase
from nano_v1.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

router = APIRouter()

# Bodies above this many bytes get a 413 before they are read; a prompt that fits in the
# model is far smaller (nano_v1/engine/processor.py::max_prompt_chars).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
# The logprob JSON reports for -inf (JSON has no infinity); OpenAI and vLLM use the same.
MIN_LOGPROB = -9999.0


# ---------------------------------------------------------------------------------- errors
def error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; its type is the status's name ("BadRequestError", "ServiceUnavailableError")."""
    name = status.phrase.title().replace(" ", "")
    error_type = name if name.endswith("Error") else name + "Error"
    return ErrorResponse(
        error=ErrorInfo(message=message, type=error_type, param=param, code=status.value)
    ).model_dump()


def create_error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status.value)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Malformed JSON, wrong types, unknown fields: one 400 listing each problem with its field."""
    problems, param = [], None
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"] if part != "body")
        param = param or where or None
        if err["type"] == "extra_forbidden":
            message = "unknown field, or one nano_v1 does not support"
        elif err["type"] == "value_error":
            message = str(err["ctx"]["error"])  # our own message, without pydantic's "Value error, " prefix
        elif err["type"] == "json_invalid":
            message = f"invalid JSON: {err['ctx']['error']}"
        else:
            message = err["msg"]
        problems.append(f"{where}: {message}" if where else message)
    return create_error_response(HTTPStatus.BAD_REQUEST, "; ".join(problems), param)


async def _http_exception(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (404 path, 405 method, a body that does not parse)."""
    message = str(exc.detail)
    if exc.__cause__ is not None:  # e.g. "There was an error parsing the body": say what the error was
        message += f": {exc.__cause__}"
    return create_error_response(HTTPStatus(exc.status_code), message)


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
            await create_error_response(HTTPStatus.INTERNAL_SERVER_ERROR, message)(scope, receive, send)


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
            await create_error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_large)(scope, receive, send)
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
            await create_error_response(HTTPStatus.UNAUTHORIZED, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------- routes
def engine_client(raw_request: Request) -> AsyncLLM:
    return raw_request.app.state.engine_client


@router.get("/health")
async def health(raw_request: Request) -> Response:
    try:
        await engine_client(raw_request).check_health()
    except EngineDeadError as e:
        return create_error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
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


def _check_model(raw_request: Request, model: str | None) -> JSONResponse | None:
    served = raw_request.app.state.served_model_name
    if model is not None and model != served:
        return create_error_response(HTTPStatus.NOT_FOUND, f"The model {model!r} does not exist.", "model")
    return None


def chat_prompt(tokenizer, messages: list[ChatMessage], model_config: ModelConfig) -> PromptType:
    """The prompt of a chat: its templated text and, if it has images (chapter 11), their
    multi_modal_data. Raises ValueError if the model has no template, the template fails or an
    image cannot be used."""
    from jinja2 import TemplateError

    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use /v1/completions.")
    # Images become placeholders in the text and the prompt's multi_modal_data.
    conversation, images = parse_chat_messages(messages, model_config)
    try:
        prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:
        raise ValueError(f"the chat template could not render these messages: {e}") from e
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


@router.post("/tokenize")
async def tokenize(
    request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request
) -> JSONResponse:
    """The token ids the engine would run a prompt (or the chat-templated messages) as."""
    if (error := _check_model(raw_request, request.model)) is not None:
        return error
    engine = engine_client(raw_request)

    def encode() -> list[int]:
        if isinstance(request, TokenizeChatRequest):
            prompt = chat_prompt(engine.tokenizer, request.messages, engine.vllm_config.model_config)
            return engine.processor.tokenize(prompt)[1]
        return engine.processor.tokenize(request.prompt)[1]

    try:
        token_ids = await engine.run_in_tokenizer_thread(encode)
    except ValueError as e:
        return create_error_response(HTTPStatus.BAD_REQUEST, str(e))
    token_strs = engine.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
    response = TokenizeResponse(
        count=len(token_ids),
        max_model_len=raw_request.app.state.max_model_len,
        tokens=token_ids,
        token_strs=token_strs,
    )
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    if (error := _check_model(raw_request, request.model)) is not None:
        return error
    engine = engine_client(raw_request)
    vocab_size = engine.processor.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if engine.tokenizer is None or bad:
        message = (
            "this model has no tokenizer"
            if engine.tokenizer is None
            else (f"token id {bad[0]} is out of vocabulary (vocab_size={vocab_size})")
        )
        return create_error_response(HTTPStatus.BAD_REQUEST, message, "tokens")
    text = await engine.run_in_tokenizer_thread(engine.tokenizer.decode, request.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    prompt = {"prompt_token_ids": request.prompt} if isinstance(request.prompt, list) else request.prompt
    return await _serve(request, raw_request, prompt, chat=False)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    engine = engine_client(raw_request)
    try:
        prompt = await engine.run_in_tokenizer_thread(
            chat_prompt, engine.tokenizer, request.messages, engine.vllm_config.model_config
        )
    except ValueError as e:
        return create_error_response(HTTPStatus.BAD_REQUEST, str(e), "messages")
    return await _serve(request, raw_request, prompt, chat=True)


async def _serve(request: SamplingRequest, raw_request: Request, prompt: Any, chat: bool) -> Response:
    """Check the model, build sampling params, then answer in one JSON or as a stream."""
    if (error := _check_model(raw_request, request.model)) is not None:
        return error
    state = raw_request.app.state
    engine = engine_client(raw_request)
    request_id = random_id("chatcmpl" if chat else "cmpl")
    try:
        params = request.to_sampling_params(default_max_tokens=None)
        # The first `anext` validates and queues the request: a bad prompt is a 400 before any
        # stream starts. Without streaming (FINAL_ONLY) the first output is the finished one.
        generator = engine.generate(prompt, params, request_id)
        if request.stream:
            first = await anext(generator)
        else:
            first = await _run_until_disconnect(raw_request, anext(generator))
            if first is None:
                return Response(status_code=499)  # the client left; its request was aborted
            await generator.aclose()
    except ValueError as e:
        return create_error_response(HTTPStatus.BAD_REQUEST, str(e))
    except EngineDeadError as e:
        return create_error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
    responder = _Responder(engine.tokenizer, request_id, state.served_model_name, chat, params.logprobs)
    if not request.stream:
        return JSONResponse(responder.full_response(first).model_dump())
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    return StreamingResponse(
        responder.stream(generator, first, include_usage), media_type="text/event-stream"
    )


async def _run_until_disconnect(raw_request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable`; if the client disconnects first, cancel it and return None (vLLM: with_cancellation)."""

    async def wait_for_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    work, disconnect = asyncio.ensure_future(awaitable), asyncio.ensure_future(wait_for_disconnect())
    await asyncio.wait([work, disconnect], return_when=asyncio.FIRST_COMPLETED)
    disconnect.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return None


def _usage(output: RequestOutput, num_completion_tokens: int) -> UsageInfo:
    num_prompt_tokens = len(output.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


class _Responder:
    """Turns one request's `RequestOutput`s into OpenAI responses: whole, or as server-sent events."""

    def __init__(self, tokenizer, request_id: str, model: str, chat: bool, num_logprobs: int | None) -> None:
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.num_logprobs = num_logprobs  # None: the request asked for no logprobs

    def full_response(self, output: RequestOutput) -> CompletionResponse | ChatCompletionResponse:
        usage = _usage(output, sum(len(c.token_ids) for c in output.outputs))
        if self.chat:
            choices = [
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatResponseMessage(role="assistant", content=c.text),
                    logprobs=self.chat_logprobs(c),
                    finish_reason=c.finish_reason,
                )
                for c in output.outputs
            ]
            return ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=usage)
        choices = [
            CompletionResponseChoice(
                index=c.index,
                text=c.text,
                logprobs=self.completion_logprobs(c, 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in output.outputs
        ]
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=usage)

    async def stream(
        self, generator: AsyncGenerator[RequestOutput, None], first: RequestOutput, include_usage: bool
    ) -> AsyncGenerator[str, None]:
        """Server-sent events: one chunk per new piece of a completion, then `data: [DONE]`.

        If the client disconnects, Starlette stops iterating this; closing `generator` then
        aborts the request in the engine core (`AsyncLLM.generate`).
        """
        finished: set[int] = set()  # completions whose finish_reason was sent
        sent_role: set[int] = set()
        num_chars_sent: dict[int, int] = {}  # per completion: where the next chunk's text starts
        num_completion_tokens = 0
        async with contextlib.aclosing(generator):
            try:
                output = first
                while True:
                    for c in output.outputs:
                        num_completion_tokens += len(c.token_ids)
                        # A chunk says something if it has text, tokens (their logprobs), an end, or the role.
                        if c.index in finished or (
                            not c.text
                            and not c.token_ids
                            and c.finish_reason is None
                            and c.index in sent_role
                        ):
                            continue
                        if c.finish_reason is not None:
                            finished.add(c.index)
                        text_offset = num_chars_sent.get(c.index, 0)
                        num_chars_sent[c.index] = text_offset + len(c.text)
                        chunk = self.stream_chunk(c, sent_role, text_offset)
                        yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                        sent_role.add(c.index)
                    if output.finished:
                        break
                    output = await anext(generator)
                if include_usage:
                    response_type = ChatCompletionStreamResponse if self.chat else CompletionResponse
                    usage_chunk = response_type(
                        id=self.request_id,
                        model=self.model,
                        choices=[],
                        usage=_usage(first, num_completion_tokens),
                    )
                    yield f"data: {usage_chunk.model_dump_json(exclude_none=True)}\n\n"
            except Exception as e:
                # The status line went out long ago: the error can only be the stream's last event.
                if isinstance(e, EngineDeadError):
                    error = error_body(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
                else:
                    logger.exception("internal error in stream %s", self.request_id)
                    error = error_body(
                        HTTPStatus.INTERNAL_SERVER_ERROR, f"internal server error ({type(e).__name__})"
                    )
                yield f"data: {ErrorResponse(**error).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    def stream_chunk(
        self, c: CompletionOutput, sent_role: set[int], text_offset: int
    ) -> CompletionResponse | ChatCompletionStreamResponse:
        if self.chat:
            choice = ChatCompletionResponseStreamChoice(
                index=c.index,
                delta=ChatResponseMessage(role=None if c.index in sent_role else "assistant", content=c.text),
                logprobs=self.chat_logprobs(c),
                finish_reason=c.finish_reason,
            )
            return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])
        choice = CompletionResponseChoice(
            index=c.index,
            text=c.text,
            logprobs=self.completion_logprobs(c, text_offset),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice])

    # Each token's logprobs arrive as {token id: logprob} for the sampled token and the top
    # `num_logprobs` (the sampled one first; it may be among the top ones too).
    def _ranked(self, position: dict[int, float]) -> list[tuple[str, float]]:
        """(token text, logprob) of a position's tokens, most likely first."""
        ranked = sorted(position.items(), key=lambda item: -item[1])
        return [(self.tokenizer.decode([token_id]), max(lp, MIN_LOGPROB)) for token_id, lp in ranked]

    def completion_logprobs(self, c: CompletionOutput, text_offset: int) -> CompletionLogProbs | None:
        """Legacy completions' shape: `top_logprobs` maps text to logprob, the sampled token included."""
        if self.num_logprobs is None:
            return None
        tokens = [self.tokenizer.decode([t]) for t in c.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=[max(p[t], MIN_LOGPROB) for t, p in zip(c.token_ids, c.logprobs)],
            tokens=tokens,
            top_logprobs=[dict(self._ranked(p)) for p in c.logprobs],
        )

    def chat_logprobs(self, c: CompletionOutput) -> ChatCompletionLogProbs | None:
        """Chat's shape: per token its own logprob, and the `top_logprobs` most likely tokens in order."""
        if self.num_logprobs is None:
            return None
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs):
            token = self.tokenizer.decode([token_id])
            # The sampled token, if not among the top ones, ranks below all of them.
            top = self._ranked(position)[: self.num_logprobs]
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=max(position[token_id], MIN_LOGPROB),
                    bytes=list(token.encode("utf-8", errors="replace")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=t, logprob=lp, bytes=list(t.encode("utf-8", errors="replace"))
                        )
                        for t, lp in top
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)


# ---------------------------------------------------------------------------------- the app
def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    registry: prometheus_client.CollectorRegistry,
    api_keys: list[str] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The routes over `engine`; `registry` holds the engine's metrics (see `make_stat_loggers`)."""
    app = FastAPI()
    app.include_router(router)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    # The last added runs first: authenticate, then bound the body, then catch what escapes.
    app.add_middleware(InternalServerErrorMiddleware)
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_keys:
        app.add_middleware(AuthenticationMiddleware, tokens=api_keys)
    app.state.engine_client = engine
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
