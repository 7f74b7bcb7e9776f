"""What every OpenAI endpoint handler shares: errors in OpenAI's shape, the model check, and the
plumbing from an HTTP request to `AsyncLLM.generate()` and back.

Mirrors vllm/entrypoints/openai/serving_engine.py (`OpenAIServing`, `create_error_response`,
`create_streaming_error_response`, `_check_model`, `_preprocess_chat`,
`_get_decoded_token`) and vllm/utils/__init__.py (`merge_async_iterators`) (chapter 09).

Why it exists: completions and chat differ only in how the prompt is built and how each
`RequestOutput` is spelled in JSON. Everything between (sampling params, the first output
awaited before the response starts, the race with the client's disconnect, the streaming
loop and its error event) is written once here, and `OpenAIServingCompletion` and
`OpenAIServingChat` supply the prompt and the spelling.

What differs from v0.11.0: `create_error_response` is a static method that returns the
HTTP response itself, with the error type named after the status ("BadRequestError"), so
that the middlewares and exception handlers, which run outside any handler, answer with it
too and every error has one shape. v0.11.0's completion and chat handlers each have a
streaming loop of their own; here the loop is `OpenAIServing._stream_generator` and each
endpoint gives only its chunks (`_stream_chunk`, `_usage_chunk`) and its whole response
(`_full_response`). `_preprocess_chat` renders the template to text and leaves
tokenizing to `Processor`; there are no tools, LoRA adapters or request logging.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nano_v1.engine.async_llm import AsyncLLM, EngineShutdownError
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.engine.processor import PromptType
from nano_v1.entrypoints.chat_utils import parse_chat_messages
from nano_v1.entrypoints.openai.protocol import (
    ChatMessage,
    ErrorInfo,
    ErrorResponse,
    PromptTokenUsageInfo,
    ResponseBase,
    SamplingRequest,
    UsageInfo,
    random_id,
)
from nano_v1.logprobs import PromptLogprobs
from nano_v1.outputs import CompletionOutput, RequestOutput
from nano_v1.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The logprob JSON reports for -inf (JSON has no infinity); OpenAI and vLLM use the same.
MIN_LOGPROB = -9999.0


def _error_response(status: HTTPStatus, message: str, param: str | None = None) -> ErrorResponse:
    """OpenAI's error object; its type is the status's name ("BadRequestError", "ServiceUnavailableError")."""
    name = status.phrase.title().replace(" ", "")
    error_type = name if name.endswith("Error") else name + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status.value))


class OpenAIServing:
    """The base of the handlers that serve one model: the engine, the model's name, and what they share."""

    # The prefix of the ids of this endpoint's responses ("cmpl-...", "chatcmpl-...").
    request_id_prefix: str

    def __init__(
        self, engine_client: AsyncLLM, served_model_name: str, enable_prompt_tokens_details: bool = False
    ) -> None:
        self.engine_client = engine_client
        self.served_model_name = served_model_name
        # Whether usage reports the cached prompt tokens (`prompt_tokens_details.cached_tokens`).
        self.enable_prompt_tokens_details = enable_prompt_tokens_details

    @staticmethod
    def create_error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(_error_response(status, message, param).model_dump(), status_code=status.value)

    @staticmethod
    def create_streaming_error_response(status: HTTPStatus, message: str) -> str:
        """The error as a stream's last event, the status line having gone out long before."""
        return f"data: {_error_response(status, message).model_dump_json()}\n\n"

    def _check_model(self, model: str | None) -> JSONResponse | None:
        if model is not None and model != self.served_model_name:
            message = f"The model {model!r} does not exist."
            return self.create_error_response(HTTPStatus.NOT_FOUND, message, "model")
        return None

    def _preprocess_chat(self, messages: list[ChatMessage]) -> PromptType:
        """The prompt of a chat: its templated text and, if it has images (chapter 11), their
        multi_modal_data. Raises ValueError if the model has no template, the template fails or an
        image cannot be used."""
        from jinja2 import TemplateError

        tokenizer = self.engine_client.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions.")
        # Images become placeholders in the text and the prompt's multi_modal_data.
        conversation, images = parse_chat_messages(
            messages, self.engine_client.vllm_config.model_config, self.served_model_name
        )
        try:
            prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:
            raise ValueError(f"the chat template could not render these messages: {e}") from e
        return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt

    # ------------------------------------------------------------------------ generating
    async def _serve(self, request: SamplingRequest, raw_request: Request, prompts: list[Any]) -> Response:
        """Check the model, build sampling params, then answer in one JSON or as a stream.

        Each prompt of a batch is a request of its own in the engine; its `n` completions are
        the response's choices `i * n` to `i * n + n - 1` (prompt `i`), as vLLM numbers them.
        """
        if (error := self._check_model(request.model)) is not None:
            return error
        request_id = random_id(self.request_id_prefix)
        try:
            params = request.to_sampling_params(default_max_tokens=None)
            generators = [
                self.engine_client.generate(
                    prompt, params, request_id if len(prompts) == 1 else f"{request_id}-{i}"
                )
                for i, prompt in enumerate(prompts)
            ]
            # The first `anext` validates and queues a request: a bad prompt is a 400 before any
            # stream starts. Without streaming (FINAL_ONLY) the first output is the finished one.
            if request.stream:
                firsts = await _first_outputs(generators)
            else:
                firsts = await _run_until_disconnect(raw_request, _first_outputs(generators))
                if firsts is None:
                    return Response(status_code=499)  # the client left; its requests were aborted
                for generator in generators:
                    await generator.aclose()
        except ValueError as e:
            return self.create_error_response(HTTPStatus.BAD_REQUEST, str(e))
        except (EngineDeadError, EngineShutdownError) as e:
            return self.create_error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
        if not request.stream:
            num_completion_tokens = sum(len(c.token_ids) for output in firsts for c in output.outputs)
            usage = usage_info(firsts, num_completion_tokens, self.enable_prompt_tokens_details)
            return JSONResponse(self._full_response(firsts, request, usage, request_id).model_dump())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        return StreamingResponse(
            self._stream_generator(generators, firsts, request_id, request, params, include_usage),
            media_type="text/event-stream",
        )

    async def _stream_generator(
        self,
        generators: list[AsyncGenerator[RequestOutput, None]],
        firsts: list[RequestOutput],
        request_id: str,
        request: SamplingRequest,
        params: SamplingParams,
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events: one chunk per new piece of a completion, then `data: [DONE]`.

        `generators` are the prompts' outputs, `firsts` the first of each, already taken: the
        ones that carry the prompt logprobs a completion's first chunk may echo (`_echo`). If
        the client disconnects, Starlette stops iterating this; closing the generators then
        aborts their requests in the engine core (`AsyncLLM.generate`).
        """
        finished: set[int] = set()  # completions whose finish_reason was sent
        sent_role: set[int] = set()
        num_chars_sent: dict[int, int] = {}  # per completion: where the next chunk's text starts
        num_completion_tokens = 0
        async with contextlib.AsyncExitStack() as stack:
            # Each generator closed explicitly: the merge closes only the ones it got to start.
            for generator in generators:
                await stack.enter_async_context(contextlib.aclosing(generator))
            streams = [_prepend(first, generator) for first, generator in zip(firsts, generators)]
            outputs = await stack.enter_async_context(contextlib.aclosing(merge_async_iterators(*streams)))
            try:
                async for i, output in outputs:
                    for c in _numbered(output, i, params.n):
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
                        first_chunk = c.index not in sent_role
                        if first_chunk:
                            c = self._echo(firsts[i], c, request)
                        text_offset = num_chars_sent.get(c.index, 0)
                        num_chars_sent[c.index] = text_offset + len(c.text)
                        chunk = self._stream_chunk(c, request_id, params.logprobs, first_chunk, text_offset)
                        yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                        sent_role.add(c.index)
                if include_usage:
                    usage = usage_info(firsts, num_completion_tokens, self.enable_prompt_tokens_details)
                    usage_chunk = self._usage_chunk(request_id, usage)
                    yield f"data: {usage_chunk.model_dump_json(exclude_none=True)}\n\n"
            except Exception as e:
                if isinstance(e, (EngineDeadError, EngineShutdownError)):
                    yield self.create_streaming_error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
                else:
                    logger.exception("internal error in stream %s", request_id)
                    yield self.create_streaming_error_response(
                        HTTPStatus.INTERNAL_SERVER_ERROR, f"internal server error ({type(e).__name__})"
                    )
        yield "data: [DONE]\n\n"

    # What each endpoint spells its own way.
    def _full_response(
        self, outputs: list[RequestOutput], request: SamplingRequest, usage: UsageInfo, request_id: str
    ) -> ResponseBase:
        """The whole response to the finished requests of `request`'s prompts: their completions,
        numbered as choices (`_numbered`), each with what the request asked for."""
        raise NotImplementedError

    def _echo(self, output: RequestOutput, c: CompletionOutput, request: SamplingRequest) -> CompletionOutput:
        """Completion `c` as its first chunk sends it: with the prompt before it if the endpoint
        and the request echo it (`output`: the prompt's request output that has its logprobs)."""
        return c

    def _stream_chunk(
        self, c: CompletionOutput, request_id: str, num_logprobs: int | None, first: bool, text_offset: int
    ) -> ResponseBase:
        """A stream's chunk for completion `c`'s new piece; `first`: its first chunk, `text_offset`:
        where the piece starts in the completion's text."""
        raise NotImplementedError

    def _usage_chunk(self, request_id: str, usage: UsageInfo) -> ResponseBase:
        """The stream's last chunk when `stream_options.include_usage`: no choices, the token counts."""
        raise NotImplementedError

    # ------------------------------------------------------------------------ logprobs
    # Each token's logprobs arrive as {token id: logprob} for the sampled token and the top
    # `num_logprobs` (the sampled one first; it may be among the top ones too).
    def _ranked(self, position: dict[int, float]) -> list[tuple[str, float]]:
        """(token text, logprob) of a position's tokens, most likely first."""
        ranked = sorted(position.items(), key=lambda item: -item[1])
        return [(self._get_decoded_token(token_id), max(lp, MIN_LOGPROB)) for token_id, lp in ranked]

    def _get_decoded_token(self, token_id: int) -> str:
        return self.engine_client.tokenizer.decode([token_id])


def _clamp_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobs | None:
    """`prompt_logprobs` with -inf as `MIN_LOGPROB`, which JSON can carry."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {t: dataclasses.replace(lp, logprob=max(lp.logprob, MIN_LOGPROB)) for t, lp in position.items()}
        for position in prompt_logprobs
    ]


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


def usage_info(
    outputs: list[RequestOutput], num_completion_tokens: int, enable_prompt_tokens_details: bool = False
) -> UsageInfo:
    """The token counts; with `enable_prompt_tokens_details`, the last prompt's cached tokens too, if
    any (as v0.11.0 reports them: the prompt tokens the prefix cache or a KV connector supplied)."""
    num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    usage = UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )
    if enable_prompt_tokens_details and outputs[-1].num_cached_tokens:
        usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=outputs[-1].num_cached_tokens)
    return usage


def _numbered(output: RequestOutput, i: int, n: int) -> list[CompletionOutput]:
    """Prompt `i`'s completions, numbered as the response's choices: `i * n + index`."""
    return [dataclasses.replace(c, index=i * n + c.index) for c in output.outputs]


async def _first_outputs(generators: list[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput]:
    """Each generator's first output, awaited together. If one fails (or this is cancelled), the
    others are cancelled and every generator closed, so none of their requests stays in the engine."""
    tasks = [asyncio.ensure_future(anext(generator)) for generator in generators]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for generator in generators:
            await generator.aclose()
        raise


async def _prepend(
    first: RequestOutput, generator: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    """`first`, then the rest of `generator`."""
    yield first
    async for output in generator:
        yield output


async def merge_async_iterators(
    *iterators: AsyncGenerator[T, None],
) -> AsyncGenerator[tuple[int, T], None]:
    """(i, item) as each iterator yields, until all are exhausted; closing this closes them all."""
    if len(iterators) == 1:  # no task per item
        async with contextlib.aclosing(iterators[0]) as iterator:
            async for item in iterator:
                yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()
