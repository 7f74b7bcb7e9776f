"""A request's structured-output state in the engine core: its grammar, compiled or on the way.

Mirrors vllm/v1/structured_output/request.py (chapter 15).

Why a future: compiling a grammar takes from microseconds (cached) to seconds (a large
schema, cold). `StructuredOutputManager.grammar_init` submits it to a thread pool and
stores the `Future` here; the request waits in `WAITING_FOR_FSM`, and each schedule()
asks `is_grammar_ready`, which never blocks the step for more than a poll.
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import Future
from dataclasses import dataclass

from nano_v1.sampling_params import SamplingParams
from nano_v1.structured_output.backend_types import (
    StructuredOutputGrammar,
    StructuredOutputKey,
    StructuredOutputOptions,
)


@dataclass
class StructuredOutputRequest:
    sampling_params: SamplingParams
    _grammar: Future[StructuredOutputGrammar] | StructuredOutputGrammar | None = None
    # Why the grammar could not be built, once its compilation failed (the request is then aborted).
    error: str | None = None

    def _check_grammar_completion(self) -> bool:
        if isinstance(self._grammar, Future):
            if not self._grammar.done():
                return False
            try:
                self._grammar = self._grammar.result()
            except Exception as err:  # the compile thread's error: the request fails, the engine goes on
                self._grammar, self.error = None, f"{type(err).__name__}: {err}"
        return True

    @property
    def is_grammar_ready(self) -> bool:
        """True once compilation has finished, with a grammar or with `error` set."""
        return self._check_grammar_completion()

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        return self._grammar if self._check_grammar_completion() else None  # type: ignore[return-value]

    @grammar.setter
    def grammar(self, grammar: StructuredOutputGrammar | Future[StructuredOutputGrammar]) -> None:
        self._grammar = grammar

    @functools.cached_property
    def structured_output_key(self) -> StructuredOutputKey:
        return get_structured_output_key(self.sampling_params)


def get_structured_output_key(sampling_params: SamplingParams) -> StructuredOutputKey:
    """(kind, spec text): what to compile, and the key xgrammar's cache finds it by."""
    params = sampling_params.structured_outputs
    assert params is not None
    if params.json is not None:
        return StructuredOutputOptions.JSON, params.json if isinstance(params.json, str) else json.dumps(params.json)
    if params.json_object:
        return StructuredOutputOptions.JSON_OBJECT, ""
    if params.regex is not None:
        return StructuredOutputOptions.REGEX, params.regex
    if params.choice is not None:
        return StructuredOutputOptions.CHOICE, json.dumps(params.choice)
    if params.grammar is not None:
        return StructuredOutputOptions.GRAMMAR, params.grammar
    raise ValueError("No valid structured output parameter found")
