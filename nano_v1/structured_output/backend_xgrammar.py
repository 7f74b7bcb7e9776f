"""The xgrammar backend: grammars compiled against the model's vocabulary, one matcher per request.

Mirrors vllm/v1/structured_output/backend_xgrammar.py (chapter 15).

Why xgrammar: a grammar constrains characters, the model emits tokens. xgrammar compiles
a grammar once against the whole vocabulary (which tokens can follow which parser
states; most are decided ahead, "context-independent"), so that filling one request's
bitmask for a step is a lookup plus a check of the few tokens that depend on the stack.

`validate_xgrammar_grammar` runs in the front end (`Processor`), before a request
reaches the engine: what does not convert (a bad schema, regex or grammar, a schema
feature xgrammar ignores) is a `ValueError` naming the problem, and the request never
enters the scheduler. As in v0.11.0 it also rewrites `choice` as a grammar; beyond
v0.11.0 (whose xgrammar backend reads only the engine-wide `disable_any_whitespace` and
ignores `whitespace_pattern`), it honours a request's own whitespace options by rewriting
its JSON schema as the grammar xgrammar would build, with the whitespace replaced.

xgrammar is imported on first use: the engine runs without it until a request asks for
structured output (the GPU image of chapter 08 has none).

What differs from v0.11.0: v0.11.0 pins xgrammar 0.1.25; nano_v1 runs on what installs
here, 0.2.9, with the same calls (but for a matcher's rollback depth, unbounded in 0.2).
`disable_any_whitespace` gives xgrammar's fixed layout, one space after ":" and ",". No Mistral tokenizer branch, no structural tags, and a
Lark grammar is refused rather than converted to EBNF.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nano_v1.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from nano_v1.structured_output.utils import choice_as_grammar

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from nano_v1.sampling_params import SamplingParams

# xgrammar's compiled-grammar cache, shared by every request (v0.11.0's VLLM_XGRAMMAR_CACHE_MB default).
XGRAMMAR_CACHE_MB = 512
# The free whitespace xgrammar's JSON grammars allow between tokens, as it prints them.
_ANY_WHITESPACE = "[ \\n\\r\\t]*"


def _xgr():
    import xgrammar

    return xgrammar


@dataclass
class XgrammarBackend(StructuredOutputBackend):
    def __post_init__(self) -> None:
        xgr = _xgr()
        # The vocabulary as the tokenizer decodes it (byte-level BPE for the demo model) and
        # its EOS as the grammar's stop token: a complete grammar allows only that token.
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        self.compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=8, cache_enabled=True, cache_limit_bytes=XGRAMMAR_CACHE_MB * 2**20
        )

    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str) -> StructuredOutputGrammar:
        if request_type == StructuredOutputOptions.JSON:
            ctx = self.compiler.compile_json_schema(grammar_spec, any_whitespace=True)
        elif request_type == StructuredOutputOptions.JSON_OBJECT:
            ctx = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
        elif request_type == StructuredOutputOptions.GRAMMAR:
            ctx = self.compiler.compile_grammar(grammar_spec)
        elif request_type == StructuredOutputOptions.REGEX:
            ctx = self.compiler.compile_regex(grammar_spec)
        else:
            raise ValueError(f"grammar is not of a supported kind ({request_type!s}).")
        # A matcher can take back any number of tokens (a step's rejected drafts) in xgrammar 0.2;
        # v0.11.0 sizes that history, max_rollback_tokens, to the number of speculative tokens.
        matcher = _xgr().GrammarMatcher(ctx)
        return XgrammarGrammar(vocab_size=self.vocab_size, matcher=matcher, ctx=ctx)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return _xgr().allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        del self.compiler


@dataclass
class XgrammarGrammar(StructuredOutputGrammar):
    vocab_size: int
    matcher: xgr.GrammarMatcher = field(hash=False)
    ctx: xgr.CompiledGrammar = field(hash=False)
    num_processed_tokens: int = field(default=0, repr=False, hash=False, init=False)
    _is_terminated: bool = field(default=False, repr=False, hash=False)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self._is_terminated:
            return False
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        self._is_terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens
        self._is_terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return self._is_terminated

    def reset(self) -> None:
        self.num_processed_tokens = 0
        self._is_terminated = False  # v0.11.0 forgets this one: a reset grammar would accept nothing
        self.matcher.reset()


def has_xgrammar_unsupported_json_features(schema: dict[str, Any]) -> bool:
    """True if the schema uses a keyword xgrammar would not enforce (v0.11.0's list): the
    output could then break the schema, so the request is refused instead."""

    def check_object(obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        kind = obj.get("type")
        if kind in ("integer", "number") and "multipleOf" in obj:
            return True
        if kind == "array" and any(k in obj for k in ("uniqueItems", "contains", "minContains", "maxContains")):
            return True
        if kind == "string" and "format" in obj:
            return True
        if kind == "object" and any(
            k in obj for k in ("minProperties", "maxProperties", "propertyNames", "patternProperties")
        ):
            return True
        for value in obj.values():
            items = value if isinstance(value, list) else [value]
            if any(check_object(item) for item in items):
                return True
        return False

    return check_object(schema)


def _xgrammar_error(err: Exception) -> str:
    """xgrammar's message without the C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err)).strip()


def _json_as_grammar(schema: str, disable_any_whitespace: bool, whitespace_pattern: str | None) -> str:
    """The EBNF grammar xgrammar builds for `schema`, with a request's own whitespace rule:
    none at all, or every run of free whitespace replaced by what `whitespace_pattern` matches."""
    xgr = _xgr()
    if disable_any_whitespace:
        return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True))
    try:
        whitespace = str(xgr.Grammar.from_regex(whitespace_pattern))
    except RuntimeError as err:
        raise ValueError(f"whitespace_pattern {whitespace_pattern!r} is not a regex xgrammar accepts: "
                         f"{_xgrammar_error(err)}") from err
    # The pattern's rules renamed into their own namespace (root, root_1, ... -> ws_root, ...).
    whitespace = re.sub(r"\broot(_\d+)?\b", lambda m: "ws_" + m.group(0), whitespace)
    return ebnf.replace(_ANY_WHITESPACE, "ws_root") + "\n" + whitespace


def validate_xgrammar_grammar(sampling_params: SamplingParams) -> None:
    """Check that xgrammar can build the request's grammar; raise ValueError naming what it cannot.

    Rewrites, as v0.11.0 does, a `choice` as the grammar of its alternatives, and (our own)
    a JSON schema or `json_object` with whitespace options as its grammar.
    """
    so_params = sampling_params.structured_outputs
    if so_params is None:
        return
    xgr = _xgr()

    if so_params.regex is not None:
        try:
            xgr.Grammar.from_regex(so_params.regex)
        except RuntimeError as err:
            raise ValueError(f"Failed to transform regex into a grammar: {_xgrammar_error(err)}") from err
        return

    if so_params.choice is not None:
        so_params.grammar = choice_as_grammar(so_params.choice)
        so_params.choice = None
        xgr.Grammar.from_ebnf(so_params.grammar)  # quoted literals: always parses
        return

    if so_params.json is not None or so_params.json_object:
        schema = so_params.json if so_params.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"Invalid JSON schema: not JSON ({err}).") from err
        if not isinstance(schema, dict):
            raise ValueError(f"Invalid JSON schema: a schema is a JSON object, got {type(schema).__name__}.")
        schema_text = json.dumps(schema)
        try:
            xgr.Grammar.from_json_schema(schema_text)
        except RuntimeError as err:
            raise ValueError(f"Failed to transform json schema into a grammar: {_xgrammar_error(err)}") from err
        if has_xgrammar_unsupported_json_features(schema):
            raise ValueError("The provided JSON schema contains features not supported by xgrammar.")
        if so_params.disable_any_whitespace or so_params.whitespace_pattern is not None:
            so_params.grammar = _json_as_grammar(
                schema_text, so_params.disable_any_whitespace, so_params.whitespace_pattern
            )
            so_params.json = so_params.json_object = None
        return

    if so_params.grammar is not None:
        try:
            xgr.Grammar.from_ebnf(so_params.grammar)
        except RuntimeError as err:
            raise ValueError(
                f"Invalid grammar specification (xgrammar's EBNF, rules `name ::= ...` from `root`): "
                f"{_xgrammar_error(err)}"
            ) from err
