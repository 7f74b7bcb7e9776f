"""Where the drafts sit in a step's flat batch, and which logits rows verify them.

Mirrors vllm/v1/spec_decode/metadata.py (chapter 10); `calc_spec_decode_metadata` is
vLLM's `GPUModelRunner._calc_spec_decode_metadata`, here a pure function of the step's
arrays.

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


def calc_spec_decode_metadata(
    num_draft_tokens: np.ndarray,
    cu_num_scheduled_tokens: np.ndarray,
    input_ids: np.ndarray,
    device: torch.device,
) -> SpecDecodeMetadata:
    """Which logits rows verify which drafts, for the whole batch with numpy (no loop over requests).

    num_draft_tokens [num_reqs]: drafts each request verifies this step; cu_num_scheduled_tokens
    [num_reqs]: end of each request's tokens in the flat batch; input_ids: the flat batch's
    token ids (the drafts sit at the end of each request's tokens). E.g. requests scheduled
    for [3, 1, 2] tokens with [2, 0, 1] drafts: a request with k drafts needs logits at its
    last k + 1 tokens.
        cu_num_scheduled_tokens  [3, 4, 6]
        logits_indices           [0, 1, 2, 3, 4, 5]   (flat token of each logits row)
        target_logits_indices    [0, 1, 4]            (rows verifying a draft)
        bonus_logits_indices     [2, 3, 5]            (rows after the last draft)
        draft_token_ids          input_ids[[1, 2, 5]] (the token after each verifying row)
    """
    num_sampled_tokens = num_draft_tokens + 1
    cu_num_sampled_tokens = np.cumsum(num_sampled_tokens)
    logits_indices = np.repeat(
        cu_num_scheduled_tokens - num_sampled_tokens, num_sampled_tokens
    ) + segment_arange(num_sampled_tokens)
    target_logits_indices = np.repeat(
        cu_num_sampled_tokens - num_sampled_tokens, num_draft_tokens
    ) + segment_arange(num_draft_tokens)
    draft_token_ids = input_ids[logits_indices[target_logits_indices] + 1]

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return SpecDecodeMetadata(
        draft_token_ids=to_device(draft_token_ids),
        num_draft_tokens=num_draft_tokens,
        cu_num_draft_tokens=np.cumsum(num_draft_tokens),
        target_logits_indices=to_device(target_logits_indices),
        bonus_logits_indices=to_device(cu_num_sampled_tokens - 1),
        logits_indices=to_device(logits_indices),
    )
