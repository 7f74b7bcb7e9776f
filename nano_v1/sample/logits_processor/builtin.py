"""The logits processors every engine has.

Mirrors vllm/v1/sample/logits_processor/builtin.py (`MinPLogitsProcessor`,
`LogitBiasLogitsProcessor`, `MinTokensLogitsProcessor`) (chapter 05).
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


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens less likely than `min_p` times the row's most likely token.

    State: row -> min_p, only for rows with min_p > 0, and the [num_reqs, 1] column the
    sampler uses, rebuilt when the batch changes (rows without min-p get 0: nothing is below 0).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.min_p: dict[int, float] = {}
        self.min_p_column: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return True  # the most likely token is never below a fraction of itself

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.min_p.pop(row, None)
        for row, params, _ in batch_update.added:
            self.min_p.pop(row, None)
            if params.min_p > 0.0:
                self.min_p[row] = params.min_p
        for src, tgt in batch_update.moved:
            value = self.min_p.pop(src, None)
            if value is not None:
                self.min_p[tgt] = value
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

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.biases: dict[int, dict[int, float]] = {}
        self.logits_slice: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bias_tensor: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # a bias can lift any token above the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        changed = False
        for row in batch_update.removed:
            changed |= self.biases.pop(row, None) is not None
        for row, params, _ in batch_update.added:
            changed |= self.biases.pop(row, None) is not None
            if params.logit_bias:
                self.biases[row] = params.logit_bias
                changed = True
        for src, tgt in batch_update.moved:
            biases = self.biases.pop(src, None)
            if biases is not None:
                self.biases[tgt] = biases
                changed = True
        if not changed:
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
