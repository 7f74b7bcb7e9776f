"""The OpenAI API's request and response bodies, as pydantic models.

Mirrors vllm/entrypoints/openai/protocol.py (chapter 09).

Why pydantic: FastAPI checks every request body against these models before our code
runs, so a wrong type or a missing field becomes a 400 naming the field. The range
checks (max_tokens >= 1, top_p in (0, 1], ...) stay in `SamplingParams`, the one place
that validates them for `LLM` too; `to_sampling_params` hands the values over.

A request never silently gets less than it asked for: a field we do not implement is a
400 naming it, as OpenAI answers an unknown parameter and vLLM an unsupported one. The
OpenAI fields clients often send with their no-op value (`best_of: 1`) are declared, and
accepted only with that value.

What a request may cost is bounded before it is handled (issue 26: one body of a million
unknown keys held the event loop for 34 s): unknown fields are found by one set
difference and named a few at a time (`OpenAIRequestModel`), every list stops at its
first bad item (`fail_fast`), and a request has at most `MAX_STOP` stop strings,
`MAX_N` completions over all its prompts, and `MAX_CHAT_ITEMS` messages (and parts per message).

A request may constrain its output (chapter 15) in OpenAI's way, `response_format`
(`json_object`, or `json_schema` with a schema), or in vLLM's, `structured_outputs` (a JSON
schema, a regex, a choice or a grammar, as `StructuredOutputsParams`); not both, though
`structured_outputs` may add its options (`disable_any_whitespace`, ...) to a
`response_format`, as in vLLM. Here only their shape is checked; whether a schema, regex or
grammar compiles is checked by `Processor`, which the request reaches next, and is a 400 too.

What differs from v0.11.0: v0.11.0 ignores unknown fields (with a warning) and has no
bound on stop strings, prompts or messages per request; its token ids accept what pydantic
coerces to int (`"1"`, `true`), ours only JSON integers; it clamps a `logit_bias` value to
[-100, 100] where ours is a 400 outside it (OpenAI's range), and bounds neither
`bad_words` nor `logit_bias` in size. v0.11.0's completions read only `response_format`'s
`json_object`, and only with `structured_outputs` also given; here both endpoints read every
`response_format`. v0.11.0 lets `response_format` overwrite a constraint `structured_outputs`
gives (or adds a second one); here that is a 400. v0.11.0's `structural_tag` format and
deprecated `guided_*` fields are not served.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from nano_v1.logprobs import PromptLogprobs
from nano_v1.sampling_params import (
    STRUCTURED_OUTPUTS_KINDS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

# The most completions one request may ask for: OpenAI's limit for chat completions. Each is a
# request of its own in the engine core. A batch of prompts shares the bound: prompts * n <= MAX_N.
MAX_N = 128
# The most stop strings one request may have: every new piece of text is searched for each.
MAX_STOP = 64
# The most messages a chat may have, and content parts a message: validating each costs
# microseconds, on the event loop (300,000 messages held it for a second).
MAX_CHAT_ITEMS = 10_000
# The most bad words a request may have (each is tokenized twice, on the event loop), and
# logit_bias entries (each checked in Python); a wider restriction is `allowed_token_ids`.
MAX_BAD_WORDS = 64
MAX_LOGIT_BIAS = 1024
# The most `vllm_xargs` entries: they travel to the engine core with every request.
MAX_VLLM_XARGS = 64
# How many unknown fields an error names; it counts the rest.
MAX_NAMED_FIELDS = 3

# Token ids: JSON integers only (not "1" or true), and a list stops at its first bad item.
TokenIds = Annotated[list[StrictInt], Field(fail_fast=True)]


class OpenAIBaseModel(BaseModel):
    # Responses, and objects nested in requests (messages, stream options), keep extra fields.
    model_config = ConfigDict(extra="allow")


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body, or an object in one that constrains the output (`response_format`): an
    unknown field is an error (a 400 naming it), not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_fields(cls, data: Any) -> Any:
        """One error for all unknown fields, naming a few: pydantic's own would be one per field."""
        # The names a client sends: a field's alias where it has one ("schema" for `json_schema`).
        known = {field.alias or name for name, field in cls.model_fields.items()}
        if isinstance(data, dict) and (num_unknown := len(data.keys() - known)):
            named = list(itertools.islice((k for k in data if k not in known), MAX_NAMED_FIELDS))
            more = f" and {num_unknown - len(named)} more" if num_unknown > len(named) else ""
            raise ValueError(
                f"unknown fields, or ones nano_v1 does not support: {', '.join(map(repr, named))}{more}"
            )
        return data


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


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None  # prompt tokens not computed: prefix-cache and KV connector hits


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With `--enable-prompt-tokens-details` and a cache hit, as vLLM's.
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class JsonSchemaResponseFormat(OpenAIRequestModel):
    """OpenAI's `response_format.json_schema`: the output is JSON that `schema` accepts."""

    name: str
    description: str | None = None
    # "schema" in the API, which would shadow `BaseModel.schema`: the field takes it as alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    # OpenAI's opt-in to strict adherence; xgrammar reads every schema strictly anyway.
    strict: bool | None = None


class ResponseFormat(OpenAIRequestModel):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object), or
    "json_schema" (JSON that `json_schema.schema` accepts)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    @model_validator(mode="after")
    def _check_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it.')
        return self

    def _constraint(self) -> dict[str, Any]:
        """The `StructuredOutputsParams` field this format sets: none for "text"."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.json_schema}
        return {}


def _reject_unless(no_op_values: tuple[Any, ...]):
    """A validator for an OpenAI field nano_v1 does not implement: only its no-op values pass."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value not in no_op_values:
            allowed = " or ".join(repr(v) for v in no_op_values)
            raise ValueError(
                f"{info.field_name} is not supported by nano_v1: leave it out (or set it to {allowed})."
            )
        return value

    return check


class SamplingRequest(OpenAIRequestModel):
    """The fields completions and chat share: OpenAI's, plus vLLM's extras (top_k, min_p,
    repetition_penalty, bad_words, allowed_token_ids, min_tokens, ignore_eos,
    spaces_between_special_tokens, truncate_prompt_tokens, vllm_xargs: a custom logits
    processor's per-request arguments, which become `SamplingParams.extra_args`, and
    kv_transfer_params: the KV connector's, chapter 16)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, le=MAX_N)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP, fail_fast=True)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # Accepted with any value: OpenAI uses it to monitor abuse; it has no effect on output.
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # OpenAI's: token ids, as JSON object keys (strings), to a bias in [-100, 100].
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS, fail_fast=True)] | None = None
    allowed_token_ids: TokenIds | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    vllm_xargs: Annotated[dict[str, str | int | float], Field(max_length=MAX_VLLM_XARGS)] | None = None
    # vLLM's, for disaggregated serving (chapter 16): what the engine's KV connector reads, e.g.
    # {"do_remote_decode": true} from a proxy to a prefill server; `Request.kv_transfer_params`.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the prompt's own logprobs and the top `prompt_logprobs` per prompt token, in the
    # response's `prompt_logprobs` (a whole response's only: not with stream, as vLLM).
    prompt_logprobs: StrictInt | None = None
    # A constraint on the output (chapter 15), in OpenAI's spelling or vLLM's (validated by
    # `StructuredOutputsParams` itself). Once validated, `structured_outputs` is the request's
    # whole constraint: its own, or `response_format`'s with its options.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = Field(None, validate_default=True)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token_id, bias in (value or {}).items():
            if not token_id.isdecimal():
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {token_id!r}.")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}."
                )
        return value

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> SamplingRequest:
        if self.stream and self.prompt_logprobs is not None and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return self

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _add_response_format(cls, value: Any, info: ValidationInfo) -> Any:
        """`structured_outputs` with `response_format`'s constraint added (validated before it:
        it is declared first); `structured_outputs` may then give only options."""
        response_format = info.data.get("response_format")
        constraint = {} if response_format is None else response_format._constraint()
        if not constraint:
            return value
        if value is None:
            return constraint
        if not isinstance(value, dict):
            return value  # not an object: pydantic's error names its type
        if given := [kind for kind in STRUCTURED_OUTPUTS_KINDS if value.get(kind) is not None]:
            raise ValueError(
                f"give response_format or structured_outputs' {given[0]}, not both: each constrains "
                "the output."
            )
        return {**value, **constraint}

    def num_logprobs(self) -> int | None:
        """Top logprobs per token (0: the sampled token's only), or None for no logprobs."""
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token, or None for no prompt logprobs."""
        return self.prompt_logprobs

    def _extra_args(self) -> dict[str, Any] | None:
        """`SamplingParams.extra_args`: `vllm_xargs`, and `kv_transfer_params` under its own key, as vLLM's."""
        extra_args = dict(self.vllm_xargs or {})
        if self.kv_transfer_params:
            extra_args["kv_transfer_params"] = self.kv_transfer_params
        return extra_args or None

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Raise ValueError (an HTTP 400) if a value is out of range."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=None if self.logit_bias is None else {int(t): b for t, b in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            seed=self.seed,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            extra_args=self._extra_args(),
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs,
        )


class CompletionRequest(SamplingRequest):
    # A text, token ids, or a batch of either (each prompt gets its own n choices), as OpenAI's.
    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(fail_fast=True)]
        | Annotated[list[TokenIds], Field(fail_fast=True)]
    )
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the top `logprobs` tokens per position, and the sampled one
    # The prompt before each choice's text (and, with logprobs, its tokens' logprobs before the
    # choice's; the first prompt token's are null).
    echo: bool = False
    # Not implemented: accepted only at their no-op values.
    best_of: int | None = None
    suffix: str | None = None

    _check_best_of = field_validator("best_of")(_reject_unless((None, 1)))
    _check_suffix = field_validator("suffix")(_reject_unless((None,)))

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One message for a prompt of no accepted shape, not one per shape it failed."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings (a batch of prompts), a list of token "
                "ids (integers) or a list of lists of token ids."
            ) from None

    @model_validator(mode="after")
    def _check_batch_size(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_N:
            raise ValueError(f"prompts * n must be at most {MAX_N}: each completion is a request of its own.")
        return self

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """The prompts, each in `AsyncLLM.generate`'s form: a text or {"prompt_token_ids": [...]}."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt or isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs`, else with echo `logprobs`: the echoed prompt's logprobs."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


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
    content: (
        str
        | Annotated[list[ChatCompletionContentPartParam], Field(max_length=MAX_CHAT_ITEMS, fail_fast=True)]
    )


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_ITEMS, fail_fast=True)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False  # the sampled token's logprob, per position
    top_logprobs: int | None = None  # and the top ones (needs logprobs: true)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true.")
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().to_sampling_params(default_max_tokens)


class TokenizeCompletionRequest(OpenAIRequestModel):
    """`/tokenize` of a prompt: the token ids the engine would run it as."""

    model: str | None = None
    prompt: str
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequestModel):
    """`/tokenize` of messages, through the chat template as `/v1/chat/completions` renders them."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_ITEMS, fail_fast=True)
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChoiceBase(OpenAIBaseModel):
    """What every completion choice has, whole or streamed."""

    index: int
    finish_reason: str | None = None


class ResponseBase(OpenAIBaseModel):
    """What every completion response has, whole or a streamed chunk."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = None


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy completions' logprobs: per token its text, its offset in the choice's text, its
    logprob, and the top tokens' logprobs by their text (the sampled one included)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionResponseChoice(ChoiceBase):
    text: str
    logprobs: CompletionLogProbs | None = None
    stop_reason: int | str | None = None
    # vLLM's: the choice's prompt's `RequestOutput.prompt_logprobs`, when asked for.
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    # vLLM's: the first prompt's `RequestOutput.kv_transfer_params` (chapter 16); a whole response's only.
    kv_transfer_params: dict[str, Any] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """One generated token: its logprob, and the `top_logprobs` most likely tokens at its position."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(ChoiceBase):
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    # vLLM's: the prompt's `RequestOutput.prompt_logprobs`, when asked for.
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's: the `RequestOutput.kv_transfer_params` (chapter 16).
    kv_transfer_params: dict[str, Any] | None = None


class ChatCompletionResponseStreamChoice(ChoiceBase):
    """A streamed chunk's choice: the new piece of the message (`delta`), not the whole of it."""

    delta: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None


class ChatCompletionStreamResponse(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
