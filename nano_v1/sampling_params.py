"""Sampling parameters: how one request turns logits into tokens, and when it stops.

Mirrors vllm/sampling_params.py (chapter 01; `StructuredOutputsParams`, chapter 15).

This is a user-facing boundary, so every field is checked here, once, with a
`ValueError` that names the field; nothing downstream re-validates. What needs the model
is checked where the model is known, in `Processor` (chapter 01): token ids against the
vocabulary, `bad_words`, which it tokenizes (`update_from_tokenizer`), and
`truncate_prompt_tokens` against `max_model_len`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is treated as greedy (vLLM uses the same cut-off).
_SAMPLING_EPS = 1e-5
# Integers travel to the engine core as msgpack ints and end up in int64 tensors: vLLM's
# server bounds `seed` so (torch.iinfo(torch.long)); we bound every integer field.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (bool excluded): NaN would pass every range check unnoticed."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The constraints a StructuredOutputsParams may carry, exactly one at a time.
STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (chapter 15): exactly one of `json` (a JSON
    schema, as a dict or its text), `json_object` (any JSON object), `regex`, `choice` (one of
    these strings) or `grammar` (an EBNF grammar in xgrammar's dialect, GBNF).

    Checked here for shape only; whether a schema, regex or grammar compiles is checked
    where the grammar engine lives, in `Processor` (`validate_xgrammar_grammar`).

    The options, as in v0.11.0: `disable_any_whitespace` compiles a JSON grammar without
    free whitespace between tokens; `whitespace_pattern` (a regex) replaces that free
    whitespace with what it matches; `disable_additional_properties` forbids properties a
    schema does not list, which xgrammar does anyway (it reads a schema strictly).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in STRUCTURED_OUTPUTS_KINDS if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar or json_object, "
                f"got {kinds or 'none'}."
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured outputs' json must be a schema (a dict or its JSON text), got {self.json!r}.")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured outputs' {name} must be a non-empty string, got {value!r}.")
        if self.choice is not None and not (
            isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured outputs' choice must be a non-empty list of strings, got {self.choice!r}.")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured outputs' json_object must be True when given, got {self.json_object!r}.")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured outputs' {name} must be True or False, got {getattr(self, name)!r}.")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError("structured outputs: give disable_any_whitespace or whitespace_pattern, not both.")


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a running request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # nothing until the request finishes (offline `LLM.generate`)


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM.

    `top_k=0` (or -1) and `top_p=1.0` mean "no truncation"; `temperature=0` means greedy.
    The penalties' neutral values (0, 0, 1), `min_p=0` and empty `logit_bias`,
    `allowed_token_ids` and `bad_words` leave the logits untouched.
    """

    n: int = 1
    # OpenAI's: subtract `presence_penalty` from every token already in the output, and
    # `frequency_penalty` times its count there. In [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL's: a token in the prompt or the output has its logit divided by this when
    # positive, multiplied when negative. > 0; 1 is off.
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Drop tokens whose probability is below `min_p` times the most likely one's. In [0, 1].
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens and the top `prompt_logprobs` at each prompt position;
    # -1 asks for the whole vocabulary.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: no text at all, token ids only (then no stop strings either: they match text).
    detokenize: bool = True
    # With special tokens kept in the text: False glues adjacent added tokens together where
    # the tokenizer's decoder would put a space between them.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Keep only the prompt's last k tokens (left truncation); -1 means max_model_len.
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Token id -> added to its logit before sampling (OpenAI's `logit_bias`).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled; None allows every token.
    allowed_token_ids: list[int] | None = None
    # Words the output must not contain: the token sequence that would finish one is forbidden.
    bad_words: list[str] | None = None
    # Anything a custom logits processor reads (e.g. {"target_token": 7}); the engine never does.
    extra_args: dict[str, Any] | None = None
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (chapter 15).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the tokenizer; not user settings.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.top_k == -1:
            self.top_k = 0
        self._verify_args()
        # `|=`, not `=`: a decoder that rebuilds params sent to the engine-core process
        # (chapter 09) calls this again, and must keep the EOS ids the engine added.
        self.all_stop_token_ids |= set(self.stop_token_ids)

    def _verify_args(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}.")
        check(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0.0,
            f"temperature must be a number >= 0, got {self.temperature!r}.",
        )
        check(
            _is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}.",
        )
        check(
            _is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}.",
        )
        check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty!r}.",
        )
        check(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            f"min_p must be in [0, 1], got {self.min_p!r}.",
        )
        check(
            isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1], got {self.top_p!r}.",
        )
        check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}.",
        )
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).",
        )
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}.")
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            f"logprobs must be an integer >= 0, got {self.logprobs!r}.",
        )
        check(
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= -1),
            f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs!r}.",
        )
        check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a non-empty string or a list of them, got {self.stop!r}.",
        )
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.",
        )
        check(
            self.logit_bias is None
            or (
                isinstance(self.logit_bias, dict)
                and all(_is_int(t) and _is_number(b) for t, b in self.logit_bias.items())
            ),
            f"logit_bias must map integer token ids to finite numbers, got {self.logit_bias!r}.",
        )
        check(
            self.allowed_token_ids is None
            or (isinstance(self.allowed_token_ids, list) and all(map(_is_int, self.allowed_token_ids))),
            f"allowed_token_ids must be a list of integers, got {self.allowed_token_ids!r}.",
        )
        check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids is not None and empty: it would allow no token at all.",
        )
        check(
            isinstance(self.bad_words, list)
            and all(isinstance(w, str) and w.strip() for w in self.bad_words),
            f"bad_words must be a list of non-blank strings, got {self.bad_words!r}.",
        )
        for name in ("detokenize", "spaces_between_special_tokens"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name} must be True or False, got {value!r}.")
        truncate = self.truncate_prompt_tokens
        check(
            truncate is None or (_is_int(truncate) and (truncate >= 1 or truncate == -1)),
            f"truncate_prompt_tokens must be an integer >= 1 or -1, got {truncate!r}",
        )
        check(
            not (self.stop and not self.detokenize),
            "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
        )
        check(
            self.extra_args is None
            or (isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args)),
            f"extra_args must be a dict with string keys, got {self.extra_args!r}.",
        )
        check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}.",
        )
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            value = getattr(self, name)
            check(
                value is None or _INT64_MIN <= value <= _INT64_MAX,
                f"{name} must fit in a signed 64-bit integer, got {value}.",
            )
        check(
            all(t <= _INT64_MAX for t in self.stop_token_ids),
            f"stop_token_ids must fit in a signed 64-bit integer, got {self.stop_token_ids!r}.",
        )

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize `bad_words` into `bad_words_token_ids`, each word as it would start the text and,
        when that differs, as it would follow a space (a word token with the space folded in)."""
        if not self.bad_words:
            return
        self._bad_words_token_ids = []
        for bad_word in self.bad_words:
            word = bad_word.lstrip()
            bare = tokenizer.encode(word, add_special_tokens=False)
            self._bad_words_token_ids.append(bare)
            spaced = tokenizer.encode(" " + word, add_special_tokens=False)
            # Kept only when the space merged into the first token rather than adding one.
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                self._bad_words_token_ids.append(spaced)

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """`bad_words` as token id sequences; set by the engine (`update_from_tokenizer`)."""
        return self._bad_words_token_ids

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~ 0)."""
        return self.temperature < _SAMPLING_EPS
