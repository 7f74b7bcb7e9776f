"""`/v1/completions`: a prompt (text or token ids) in, OpenAI's legacy completion out, whole or streamed.

Mirrors vllm/entrypoints/openai/serving_completion.py (`OpenAIServingCompletion`,
`create_completion`, `request_output_to_completion_response`, `_create_completion_logprobs`)
(chapter 09).

Why it exists: the completions endpoint's own part of serving: its prompt, its ids
("cmpl-..."), and how a `RequestOutput` is spelled as `CompletionResponse`, logprobs
included. The rest (model check, sampling params, streaming loop) is `OpenAIServing`'s.

What differs from v0.11.0: no `suffix` or `best_of`, and a batch of prompts asks for at
most `MAX_N` completions in all (protocol.py); no streaming loop of its own:
`OpenAIServing._stream_generator` streams, and this class gives its chunks
(`_stream_chunk`, `_usage_chunk`, and `_echo` for a choice's first), where v0.11.0 has
`completion_stream_generator`. With `echo`, a streamed choice's `text_offset`s count the
echoed prompt in every chunk, as the whole response's do (v0.11.0's later chunks do not).
"""

from __future__ import annotations

import dataclasses
import itertools

from fastapi import Request
from fastapi.responses import Response

from nano_v1.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from nano_v1.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    OpenAIServing,
    _clamp_prompt_logprobs,
    _numbered,
)
from nano_v1.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        return await self._serve(request, raw_request, request.prompts())

    def request_output_to_completion_response(
        self, outputs: list[RequestOutput], request: CompletionRequest, usage: UsageInfo, request_id: str
    ) -> CompletionResponse:
        choices = []
        for i, output in enumerate(outputs):
            prompt_logprobs = _clamp_prompt_logprobs(output.prompt_logprobs)
            for c in _numbered(output, i, request.n):
                c = self._echo(output, c, request)
                choices.append(
                    CompletionResponseChoice(
                        index=c.index,
                        text=c.text,
                        logprobs=self._create_completion_logprobs(c, request.logprobs, 0),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=outputs[0].kv_transfer_params,
        )

    _full_response = request_output_to_completion_response  # what `_serve` answers a whole request with

    def _stream_chunk(
        self, c: CompletionOutput, request_id: str, num_logprobs: int | None, first: bool, text_offset: int
    ) -> CompletionResponse:
        choice = CompletionResponseChoice(
            index=c.index,
            text=c.text,
            logprobs=self._create_completion_logprobs(c, num_logprobs, text_offset),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=[choice])

    def _usage_chunk(self, request_id: str, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=[], usage=usage)

    def _echo(self, output: RequestOutput, c: CompletionOutput, request: CompletionRequest) -> CompletionOutput:
        """With `echo`: the prompt's text and tokens before `c`'s and, with logprobs, the prompt
        tokens' (None for the first, then the token and its top `logprobs`) before `c`'s."""
        if not request.echo:
            return c
        prompt = output.prompt
        if prompt is None:  # given as token ids
            prompt = self.engine_client.tokenizer.decode(output.prompt_token_ids)
        logprobs = c.logprobs
        if logprobs is not None:
            # As a sampled position's: the position's own token first, then the top ones.
            prompt_logprobs = [
                None if p is None else {t: lp.logprob for t, lp in itertools.islice(p.items(), 1 + request.logprobs)}
                for p in output.prompt_logprobs
            ]
            logprobs = prompt_logprobs + logprobs
        return dataclasses.replace(
            c, text=prompt + c.text, token_ids=[*output.prompt_token_ids, *c.token_ids], logprobs=logprobs
        )

    def _create_completion_logprobs(
        self, c: CompletionOutput, num_logprobs: int | None, text_offset: int
    ) -> CompletionLogProbs | None:
        """Legacy completions' shape: `top_logprobs` maps text to logprob, the sampled token included;
        both are null at a position without logprobs (an echoed prompt's first token)."""
        if num_logprobs is None:
            return None
        tokens = [self._get_decoded_token(t) for t in c.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=[None if p is None else max(p[t], MIN_LOGPROB) for t, p in zip(c.token_ids, c.logprobs)],
            tokens=tokens,
            top_logprobs=[None if p is None else dict(self._ranked(p)) for p in c.logprobs],
        )
