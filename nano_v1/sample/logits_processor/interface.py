"""What a logits processor sees of the persistent batch, and what it must do.

Mirrors vllm/v1/sample/logits_processor/interface.py (`BatchUpdate`, `LogitsProcessor`)
(chapter 05).

Why a batch update: a processor keeps per-row state (which rows may not stop yet), and
the rows move between steps as requests join, leave and are condensed. Rather than
rebuilding its state from the whole batch every step, it is told what changed, in the
order the persistent batch did it: rows removed, rows added, rows moved.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from nano_v1.sampling_params import SamplingParams

# (row, the request's sampling params, its output token ids). The list is the request's own,
# extended in place as it samples, so a processor always sees the latest tokens.
AddedRequest = tuple[int, SamplingParams, list[int]]
# (from row, to row): condense moves a request from the end into a hole.
MovedRequest = tuple[int, int]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """The persistent batch's changes since the last update; apply removed, then added, then moved."""

    batch_size: int
    removed: list[int]
    added: list[AddedRequest]
    moved: list[MovedRequest]


class LogitsProcessor(ABC):
    """Changes the logits of some rows before sampling, e.g. forbids tokens."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor never changes a row's argmax (min-p, say).

        The sampler then applies it after the greedy rows have taken their argmax, to the
        temperature-scaled logits, and skips it in an all-greedy batch; otherwise it edits
        the raw logits before any row is sampled.
        """

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch's changes (None: no change) before this step's `apply`; called every step."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Change `logits` [num_reqs, vocab] (in place is fine) and return them."""
