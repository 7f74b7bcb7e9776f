"""What a grammar engine must offer the engine: a backend that compiles, a grammar that matches.

Mirrors vllm/v1/structured_output/backend_types.py (chapter 15).

Why an interface: vLLM v0.11.0 has four engines behind it (xgrammar, guidance, outlines,
lm-format-enforcer) and the scheduler talks to none of them directly. nano_v1 has one,
xgrammar (`backend_xgrammar.py`); the interface stays, so that the scheduler's code reads
as vLLM's.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from nano_v1.config import VllmConfig


class StructuredOutputOptions(enum.Enum):
    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    GRAMMAR = enum.auto()
    CHOICE = enum.auto()


# (kind, spec): what a grammar is compiled from, and the key of the compiled-grammar cache.
StructuredOutputKey = tuple[StructuredOutputOptions, str]


class StructuredOutputGrammar(ABC):
    """One request's matcher: where it stands in its grammar, token by token."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance past `tokens`; False (and no further) at the first the grammar forbids."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar accepts from here, without advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write row `batch_index` of `bitmask`: bit t set iff token t may come next."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token accepted."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the grammar's start."""


@dataclass
class StructuredOutputBackend(ABC):
    """One grammar engine for the whole engine, built on the model's vocabulary."""

    vllm_config: VllmConfig
    tokenizer: object
    vocab_size: int

    @abstractmethod
    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str) -> StructuredOutputGrammar:
        """Compile `grammar_spec` and return a fresh matcher at its start."""

    @abstractmethod
    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """An int32 bitmask of `max_num_seqs` rows, 32 tokens per word."""

    @abstractmethod
    def destroy(self) -> None:
        """Release what the backend holds (its compiler and cache)."""
