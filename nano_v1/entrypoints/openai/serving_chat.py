"""`/v1/chat/completions`: messages in, OpenAI's chat completion out, whole or streamed.

Mirrors vllm/entrypoints/openai/serving_chat.py (`OpenAIServingChat`,
`create_chat_completion`, `_create_chat_logprobs`) (chapter 09).

Why it exists: the chat endpoint's own part of serving: its prompt (the messages through
the tokenizer's chat template, `OpenAIServing._preprocess_chat`), its ids
("chatcmpl-..."), and how a `RequestOutput` is spelled as a chat response: a `message`
when whole, a `delta` (the role in each choice's first) when streamed, and logprobs per
token with their top alternatives. The rest is `OpenAIServing`'s.

What differs from v0.11.0: no tools, reasoning parsers or harmony; the template is
rendered in the tokenizer thread. No streaming loop of its own: where v0.11.0 has
`chat_completion_stream_generator` and `chat_completion_full_generator`,
`OpenAIServing._stream_generator` and `_serve` call this class's `_stream_chunk`,
`_usage_chunk` and `_full_response`.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import Request
from fastapi.responses import Response

from nano_v1.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    UsageInfo,
)
from nano_v1.entrypoints.openai.serving_engine import MIN_LOGPROB, OpenAIServing, _clamp_prompt_logprobs
from nano_v1.outputs import CompletionOutput, RequestOutput


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        try:
            prompt = await self.engine_client.run_in_tokenizer_thread(self._preprocess_chat, request.messages)
        except ValueError as e:
            return self.create_error_response(HTTPStatus.BAD_REQUEST, str(e), "messages")
        return await self._serve(request, raw_request, [prompt])

    def _full_response(
        self, outputs: list[RequestOutput], request: ChatCompletionRequest, usage: UsageInfo, request_id: str
    ) -> ChatCompletionResponse:
        (output,) = outputs  # a chat has one prompt
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatResponseMessage(role="assistant", content=c.text),
                logprobs=self._create_chat_logprobs(c, request.num_logprobs()),
                finish_reason=c.finish_reason,
            )
            for c in output.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=_clamp_prompt_logprobs(output.prompt_logprobs),
            kv_transfer_params=output.kv_transfer_params,
        )

    def _stream_chunk(
        self, c: CompletionOutput, request_id: str, num_logprobs: int | None, first: bool, text_offset: int
    ) -> ChatCompletionStreamResponse:
        choice = ChatCompletionResponseStreamChoice(
            index=c.index,
            delta=ChatResponseMessage(role="assistant" if first else None, content=c.text),
            logprobs=self._create_chat_logprobs(c, num_logprobs),
            finish_reason=c.finish_reason,
        )
        return ChatCompletionStreamResponse(id=request_id, model=self.served_model_name, choices=[choice])

    def _usage_chunk(self, request_id: str, usage: UsageInfo) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=request_id, model=self.served_model_name, choices=[], usage=usage
        )

    def _create_chat_logprobs(
        self, c: CompletionOutput, num_logprobs: int | None
    ) -> ChatCompletionLogProbs | None:
        """Chat's shape: per token its own logprob, and the `top_logprobs` most likely tokens in order."""
        if num_logprobs is None:
            return None
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs):
            token = self._get_decoded_token(token_id)
            # The sampled token, if not among the top ones, ranks below all of them.
            top = self._ranked(position)[:num_logprobs]
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
