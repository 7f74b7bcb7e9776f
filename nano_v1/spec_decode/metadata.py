"""Where the drafts sit in a step's flat batch, and which logits rows verify them.

Mirrors vllm/v1/spec_decode/metadata.py (chapter 10); built by
`GPUModelRunner._calc_spec_decode_metadata`.

Why it exists: without drafts the runner takes one logits row per request (its last
scheduled token). A request verifying k drafts needs k + 1 rows: the logits after its
last real token check draft 1, the logits after draft i check draft i + 1, and the
logits after the last draft give the "bonus" token, used if every draft is accepted.
These index arrays say which rows are which, for the whole batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class SpecDecodeMetadata:
    """E.g. 3 requests with [2, 0, 1] drafts, scheduled for [3, 1, 2] tokens."""

    # [num_draft_tokens_total] the drafts, request after request: [d00, d01, d20]
    draft_token_ids: torch.Tensor
    # [num_reqs] drafts per request: [2, 0, 1] (host side, for per-request slicing)
    num_draft_tokens: np.ndarray
    # [num_reqs] cumulative drafts: [2, 2, 3]
    cu_num_draft_tokens: np.ndarray
    # [num_draft_tokens_total] rows of `logits` that verify each draft: [0, 1, 4]
    target_logits_indices: torch.Tensor
    # [num_reqs] rows of `logits` that give each request's bonus token: [2, 3, 5]
    bonus_logits_indices: torch.Tensor
    # [num_draft_tokens_total + num_reqs] flat token index of every logits row: [0, 1, 2, 3, 4, 5]
    logits_indices: torch.Tensor

    @property
    def max_spec_len(self) -> int:
        return int(self.num_draft_tokens.max())


def segment_arange(counts: np.ndarray) -> np.ndarray:
    """Each element's offset within its segment: counts [2, 0, 3] -> [0, 1, 0, 1, 2]."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts, counts)
