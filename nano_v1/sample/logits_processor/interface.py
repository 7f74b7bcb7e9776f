"""What a logits processor sees of the persistent batch, and what it must do.

Mirrors vllm/v1/sample/logits_processor/interface.py (`BatchUpdate`, `LogitsProcessor`,
`MoveDirectionality`) (chapter 05).

Why a batch update: a processor keeps per-row state (which rows may not stop yet), and
the rows move between steps as requests join, leave and are condensed. Rather than
rebuilding its state from the whole batch every step, it is told what changed, in the
order the persistent batch did it: rows removed, rows added, rows moved. The tuples are
v0.11.0's, so a processor written for vLLM runs here unchanged (chapter 01).

What differs from v0.11.0: nano_v1's persistent batch only ever moves a row one way
(`condense` fills holes), so `MoveDirectionality.SWAP` never occurs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from nano_v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at i1 moves to i2, whose row it replaces
    SWAP = auto()  # i1 and i2 exchange rows (vLLM's batch reordering; never here)


# The row of a request that left the batch.
RemovedRequest = int
# (row, the request's sampling params, its prompt token ids, its output token ids). The
# output list is the request's own, extended in place as it samples, so a processor always
# sees the latest tokens.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
# (from row, to row, direction): condense moves a request from the end into a hole.
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """The persistent batch's changes since the last update; apply removed, then added, then moved.

    An added or moved request may land on a row that still holds state: it replaces it.
    """

    batch_size: int
    removed: list[RemovedRequest]
    added: list[AddedRequest]
    moved: list[MovedRequest]


class LogitsProcessor(ABC):
    """Changes the logits of some rows before sampling, e.g. forbids tokens.

    One instance per engine (per worker), built by `build_logitsprocs` from its class; a
    request says what it wants through its `SamplingParams` (`extra_args` for a custom one).
    """

    @abstractmethod
    def __init__(self, vllm_config: VllmConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        """Every processor is built with these three, whether it needs them or not."""

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
