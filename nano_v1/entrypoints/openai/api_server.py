"""An OpenAI-compatible HTTP server over `AsyncLLM`: `nano-v1 serve [MODEL] --port N`.

Mirrors vllm/entrypoints/openai/api_server.py, serving_completion.py and serving_chat.py
(chapter 09).

Why it is thin: everything that costs time per token (tokenize, detokenize, stop
strings, `n` fan-out) is already in `AsyncLLM`'s frontend, and the model runs in the
engine-core process. This module only turns HTTP into `AsyncLLM.generate()` calls and
`RequestOutput`s back into OpenAI's JSON, or into server-sent events when streaming.

Errors follow OpenAI's shape, `{"error": {"message", "type", "code"}}`: 400 for a bad
request (what pydantic or `SamplingParams`/`Processor` reject), 404 for an unknown
model (as vLLM and OpenAI answer), 503 once the engine core is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nano_v1.engine import EngineDeadError
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.async_llm import AsyncLLM
from nano_v1.entrypoints.chat_utils import parse_chat_messages
from nano_v1.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    UsageInfo,
    random_id,
)
from nano_v1.outputs import RequestOutput

router = APIRouter()


def error_response(status: HTTPStatus, message: str) -> JSONResponse:
    error_type = {400: "BadRequestError", 404: "NotFoundError"}.get(
        status.value, status.phrase.replace(" ", "")
    )
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type, code=status.value))
    return JSONResponse(body.model_dump(), status_code=status.value)


def engine_client(raw_request: Request) -> AsyncLLM:
    return raw_request.app.state.engine_client


@router.get("/health")
async def health(raw_request: Request) -> Response:
    try:
        await engine_client(raw_request).check_health()
    except EngineDeadError as e:
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
    return Response(status_code=200)


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    card = ModelCard(id=state.served_model_name, max_model_len=state.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    prompt = {"prompt_token_ids": request.prompt} if isinstance(request.prompt, list) else request.prompt
    return await _serve(request, raw_request, prompt, chat=False)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    engine = engine_client(raw_request)
    tokenizer = engine.get_tokenizer()
    if tokenizer is None or tokenizer.chat_template is None:
        return error_response(HTTPStatus.BAD_REQUEST, "this model has no chat template; use /v1/completions.")
    try:
        # Images (chapter 11) become placeholders in the text and the prompt's multi_modal_data.
        conversation, images = parse_chat_messages(request.messages, engine.vllm_config.model_config)
    except ValueError as e:
        return error_response(HTTPStatus.BAD_REQUEST, str(e))
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if images:
        prompt = {"prompt": prompt, "multi_modal_data": {"image": images}}
    return await _serve(request, raw_request, prompt, chat=True)


async def _serve(request: SamplingRequest, raw_request: Request, prompt: Any, chat: bool) -> Response:
    """Check the model, build sampling params, then answer in one JSON or as a stream."""
    state = raw_request.app.state
    if request.model is not None and request.model != state.served_model_name:
        return error_response(HTTPStatus.NOT_FOUND, f"The model `{request.model}` does not exist.")
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
        return error_response(HTTPStatus.BAD_REQUEST, str(e))
    except EngineDeadError as e:
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
    if not request.stream:
        return JSONResponse(_full_response(first, request_id, state.served_model_name, chat).model_dump())
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    events = _stream_events(generator, first, request_id, state.served_model_name, chat, include_usage)
    return StreamingResponse(events, media_type="text/event-stream")


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


def _full_response(
    output: RequestOutput, request_id: str, model: str, chat: bool
) -> CompletionResponse | ChatCompletionResponse:
    usage = _usage(output, sum(len(c.token_ids) for c in output.outputs))
    if chat:
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatResponseMessage(role="assistant", content=c.text),
                finish_reason=c.finish_reason,
            )
            for c in output.outputs
        ]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    choices = [
        CompletionResponseChoice(
            index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason
        )
        for c in output.outputs
    ]
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


async def _stream_events(
    generator: AsyncGenerator[RequestOutput, None],
    first: RequestOutput,
    request_id: str,
    model: str,
    chat: bool,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    """Server-sent events: one chunk per new piece of a completion, then `data: [DONE]`.

    If the client disconnects, Starlette stops iterating this; closing `generator` then
    aborts the request in the engine core (`AsyncLLM.generate`).
    """
    finished: set[int] = set()  # completions whose finish_reason was sent
    sent_role: set[int] = set()
    num_completion_tokens = 0
    async with contextlib.aclosing(generator):
        try:
            output = first
            while True:
                for c in output.outputs:
                    num_completion_tokens += len(c.token_ids)
                    if c.index in finished or (
                        not c.text and c.finish_reason is None and c.index in sent_role
                    ):
                        continue
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    if chat:
                        role = None if c.index in sent_role else "assistant"
                        sent_role.add(c.index)
                        choice = ChatCompletionResponseStreamChoice(
                            index=c.index,
                            delta=ChatResponseMessage(role=role, content=c.text),
                            finish_reason=c.finish_reason,
                        )
                        chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice])
                    else:
                        sent_role.add(c.index)
                        choice = CompletionResponseChoice(
                            index=c.index,
                            text=c.text,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        chunk = CompletionResponse(id=request_id, model=model, choices=[choice])
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                if output.finished:
                    break
                output = await anext(generator)
            if include_usage:
                response_type = ChatCompletionStreamResponse if chat else CompletionResponse
                usage_chunk = response_type(
                    id=request_id, model=model, choices=[], usage=_usage(first, num_completion_tokens)
                )
                yield f"data: {usage_chunk.model_dump_json(exclude_none=True)}\n\n"
        except EngineDeadError as e:
            error = ErrorResponse(error=ErrorInfo(message=str(e), type="ServiceUnavailableError", code=503))
            yield f"data: {error.model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Malformed JSON and wrong types: one 400 listing each problem with its field."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"] if part != "body")
        problems.append(f"{where}: {err['msg']}" if where else err["msg"])
    return error_response(HTTPStatus.BAD_REQUEST, "; ".join(problems))


def build_app(engine: AsyncLLM, served_model_name: str) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.state.engine_client = engine
    app.state.served_model_name = served_model_name
    app.state.max_model_len = engine.vllm_config.model_config.max_model_len
    return app


def build_server(
    engine: AsyncLLM, served_model_name: str, host: str, port: int, log_level: str = "info"
) -> uvicorn.Server:
    app = build_app(engine, served_model_name)
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))


async def run_server(
    engine_args: EngineArgs, host: str, port: int, served_model_name: str | None = None
) -> None:
    """Start the engine core, serve until interrupted, then stop the engine core."""
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        await build_server(engine, served_model_name or str(engine_args.model), host, port).serve()
    finally:
        engine.shutdown()
