"""The logits processors every engine has.

Mirrors vllm/v1/sample/logits_processor/builtin.py (`MinTokensLogitsProcessor`) (chapter 05).
"""

from __future__ import annotations

import torch

from nano_v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor


class MinTokensLogitsProcessor(LogitsProcessor):
    """Forbids stop tokens (EOS included) to requests that have not yet sampled `min_tokens`.

    State: row -> (min_tokens, the request's output token list, its stop token ids), only for
    rows still short of their minimum. That set is usually empty and shrinks as requests pass
    their minimum, so keeping it sparse costs nothing in the common case.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.min_toks: dict[int, tuple[int, list[int], frozenset[int]]] = {}
        # (rows, token ids) to set to -inf: one indexed write per step.
        self.logits_slice: tuple[torch.Tensor, torch.Tensor] | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # a forbidden EOS can be the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = False
        if batch_update is not None:
            for row in batch_update.removed:
                changed |= self.min_toks.pop(row, None) is not None
            for row, params, output_token_ids in batch_update.added:
                changed |= self.min_toks.pop(row, None) is not None
                if len(output_token_ids) < params.min_tokens and params.all_stop_token_ids:
                    self.min_toks[row] = (
                        params.min_tokens,
                        output_token_ids,
                        frozenset(params.all_stop_token_ids),
                    )
                    changed = True
            for src, tgt in batch_update.moved:
                entry = self.min_toks.pop(src, None)
                if entry is not None:
                    self.min_toks[tgt] = entry
                    changed = True
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
