"""The logits processors every engine has.

Mirrors vllm/v1/sample/logits_processor/builtin.py (`MinPLogitsProcessor`,
`LogitBiasLogitsProcessor`, `MinTokensLogitsProcessor`, `process_dict_updates`) (chapter 05).

What differs from v0.11.0: the batch's moves are one-way (`condense` fills holes), never
swaps, so `process_dict_updates` has no swap case; and it applies removals before additions,
as nano_v1's `BatchUpdate` asks, since a row removed and refilled in one update appears in both.
The processors keep no vLLM config: their state is sized by the batch, not by `max_num_seqs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from nano_v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor
from nano_v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig

T = TypeVar("T")


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Apply a batch update to a sparse row -> state dict; True if the dict changed.

    `new_state(params, prompt_token_ids, output_token_ids)` is an added request's state, or
    None when the processor has nothing to do for it (its row then holds no entry).
    """
    if batch_update is None:
        return False
    changed = False
    for row in batch_update.removed:
        changed |= req_entries.pop(row, None) is not None
    for row, params, prompt_token_ids, output_token_ids in batch_update.added:
        changed |= req_entries.pop(row, None) is not None
        state = new_state(params, prompt_token_ids, output_token_ids)
        if state is not None:
            req_entries[row] = state
            changed = True
    for src, tgt, _ in batch_update.moved:  # always UNIDIRECTIONAL here
        if src in req_entries:
            req_entries[tgt] = req_entries.pop(src)
            changed = True
    return changed


class MinTokensLogitsProcessor(LogitsProcessor):
    """Forbids stop tokens (EOS included) to requests that have not yet sampled `min_tokens`.

    State: row -> (min_tokens, the request's output token list, its stop token ids), only for
    rows still short of their minimum. That set is usually empty and shrinks as requests pass
    their minimum, so keeping it sparse costs nothing in the common case.
    """

    def __init__(self, vllm_config: VllmConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.min_toks: dict[int, tuple[int, list[int], frozenset[int]]] = {}
        # (rows, token ids) to set to -inf: one indexed write per step.
        self.logits_slice: tuple[torch.Tensor, torch.Tensor] | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # a forbidden EOS can be the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, _: list[int] | None, output_token_ids: list[int]) -> tuple | None:
            if len(output_token_ids) < params.min_tokens and params.all_stop_token_ids:
                return params.min_tokens, output_token_ids, frozenset(params.all_stop_token_ids)
            return None

        changed = process_dict_updates(self.min_toks, batch_update, new_state)
        reached = [row for row, (min_tokens, output, _) in self.min_toks.items() if len(output) >= min_tokens]
        for row in reached:
            del self.min_toks[row]
        if changed or reached:
            rows = [row for row, (_, _, stop_ids) in self.min_toks.items() for _ in stop_ids]
            token_ids = [token_id for _, _, stop_ids in self.min_toks.values() for token_id in stop_ids]
            self.logits_slice = (
                (torch.tensor(rows, device=self.device), torch.tensor(token_ids, device=self.device))
                if rows
                else None
            )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logits_slice is not None:
            logits[self.logits_slice] = float("-inf")
        return logits


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens less likely than `min_p` times the row's most likely token.

    State: row -> min_p, only for rows with min_p > 0, and the [num_reqs, 1] column the
    sampler uses, rebuilt when the batch changes (rows without min-p get 0: nothing is below 0).
    """

    def __init__(self, vllm_config: VllmConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.min_p: dict[int, float] = {}
        self.min_p_column: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return True  # the most likely token is never below a fraction of itself

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        process_dict_updates(self.min_p, batch_update, lambda params, _, __: params.min_p or None)
        self.min_p_column = None
        if self.min_p:
            column = [0.0] * batch_update.batch_size
            for row, value in self.min_p.items():
                column[row] = value
            self.min_p_column = torch.tensor(column, device=self.device).unsqueeze(1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_p_column is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * self.min_p_column  # [num_reqs, 1]
            logits.masked_fill_(probs < threshold, float("-inf"))
        return logits


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds each request's `logit_bias` to its logits: one indexed add per step.

    State: row -> {token id: bias}, and the (rows, token ids) slice with its biases,
    rebuilt when a row with a bias joins, leaves or moves.
    """

    def __init__(self, vllm_config: VllmConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.biases: dict[int, dict[int, float]] = {}
        self.logits_slice: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bias_tensor: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # a bias can lift any token above the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(self.biases, batch_update, lambda params, _, __: params.logit_bias or None):
            return
        rows = [row for row, biases in self.biases.items() for _ in biases]
        token_ids = [token_id for biases in self.biases.values() for token_id in biases]
        values = [bias for biases in self.biases.values() for bias in biases.values()]
        self.logits_slice = None
        self.bias_tensor = None
        if rows:
            self.logits_slice = (
                torch.tensor(rows, device=self.device),
                torch.tensor(token_ids, device=self.device),
            )
            self.bias_tensor = torch.tensor(values, dtype=torch.float32, device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logits_slice is not None:
            logits[self.logits_slice] += self.bias_tensor
        return logits
