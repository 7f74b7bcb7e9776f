"""The OpenAI API's request and response bodies, as pydantic models.

Mirrors vllm/entrypoints/openai/protocol.py (chapter 09).

Why pydantic: FastAPI checks every request body against these models before our code
runs, so a wrong type or a missing field becomes a 400 naming the field. The range
checks (max_tokens >= 1, top_p in (0, 1], ...) stay in `SamplingParams`, the one place
that validates them for `LLM` too; `to_sampling_params` hands the values over.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from nano_v1.sampling_params import RequestOutputKind, SamplingParams


class OpenAIBaseModel(BaseModel):
    # Clients send fields we don't implement (user, presence_penalty, ...): accept and ignore them, as vLLM does.
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nano_v1"
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard]


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share (OpenAI's, plus vLLM's top_k, min_tokens, ignore_eos)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    ignore_eos: bool = False

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Raise ValueError (an HTTP 400) if a value is out of range."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions


class ImageURL(OpenAIBaseModel):
    url: str  # a data: URL; nano_v1 fetches nothing (chapter 11)


class ChatCompletionContentPartTextParam(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatCompletionContentPartImageParam(OpenAIBaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ChatCompletionContentPartParam = Annotated[
    ChatCompletionContentPartTextParam | ChatCompletionContentPartImageParam, Field(discriminator="type")
]


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ChatCompletionContentPartParam]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().to_sampling_params(default_max_tokens)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChoiceBase(OpenAIBaseModel):
    """What every completion choice has, whole or streamed."""

    index: int
    logprobs: None = None
    finish_reason: str | None = None


class ResponseBase(OpenAIBaseModel):
    """What every completion response has, whole or a streamed chunk."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = None


class CompletionResponseChoice(ChoiceBase):
    text: str
    stop_reason: int | str | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]


class ChatResponseMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseChoice(ChoiceBase):
    message: ChatResponseMessage


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]


class ChatCompletionResponseStreamChoice(ChoiceBase):
    """A streamed chunk's choice: the new piece of the message (`delta`), not the whole of it."""

    delta: ChatResponseMessage


class ChatCompletionStreamResponse(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
