"""The n-gram (prompt lookup) proposer: draft tokens copied from the request's own past.

Mirrors vllm/v1/spec_decode/ngram_proposer.py (chapter 10).

Why it exists: speculative decoding needs a cheap guess of the next few tokens. Text
that repeats itself (code, quoted documents, a list being continued) often continues
the way it did the last time the same few tokens appeared. So: take the request's last
n tokens, find where that n-gram occurred before, and propose the k tokens that
followed it. No model, no GPU: a few numpy comparisons over the token table the
persistent batch already keeps, for every request of the batch at once.

vLLM finds the longest match with a KMP scan compiled by numba, one request per
thread, and takes the earliest occurrence. We take the *latest* occurrence that is
followed by k known tokens (the most recent context predicts code better: the current
loop, the current function), else the latest one, and find it with whole-array
comparisons instead of a per-token loop. Why "followed by k tokens": in a run such as
`) ) ) )` the very latest occurrence is followed by one token only, so it could never
propose more than one draft; an earlier occurrence of a repeating pattern continues
the same way for longer.
"""

from __future__ import annotations

import numpy as np

from nano_v1.config import SpeculativeConfig

# "No occurrence" in the position arrays of the vectorised search, where None cannot go
# (a numpy int array); -1 is no real position. It never leaves this module:
# `find_ngram_drafts` reports "nothing matched" as 0 drafts.
NO_MATCH = -1


def find_ngram_drafts(
    token_ids: np.ndarray, num_tokens: np.ndarray, min_n: int, max_n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the k tokens after the latest earlier occurrence of its last n tokens.

    token_ids: [num_rows, width], row r's tokens are token_ids[r, :num_tokens[r]].
    The longest n in [min_n, max_n] that occurs earlier wins; an occurrence counts if at
    least one known token follows it, and among those of that n the latest followed by
    k known tokens is preferred to the latest overall. Returns (drafts [num_rows, k], num_drafts
    [num_rows]); row r's drafts are drafts[r, :num_drafts[r]] (fewer than k when the
    occurrence is close to the end, 0 when nothing matches).

    E.g. tokens `a b c a b` (T = 5), n = 2: the last 2-gram `a b` also ends at
    position 1; tokens from position 2 on follow it: `c a b` (k = 3).
    """
    num_rows = token_ids.shape[0]
    width = int(num_tokens.max()) if num_rows else 0
    tokens = token_ids[:, :width]  # [num_rows, width]
    last = num_tokens[:, None].astype(np.int64)  # [num_rows, 1] = T
    rows = np.arange(num_rows)
    # match[r, e]: the last n tokens of row r also end at position e. Start with n = 0:
    # every e that leaves a known token after it (e <= T - 2) is a candidate.
    match = np.arange(width)[None, :] <= last - 2  # [num_rows, width]
    best_end = np.full(num_rows, NO_MATCH, dtype=np.int64)
    # An n-gram and a token after it need n + 1 positions: longer ones cannot occur earlier.
    for n in range(1, min(max_n, width - 1) + 1):
        # Grow the n-gram by one token to the left: position e - n + 1 must equal T - n.
        suffix_token = tokens[rows, np.maximum(last[:, 0] - n, 0)]  # [num_rows]
        match[:, n - 1 :] &= tokens[:, : width - n + 1] == suffix_token[:, None]
        match[:, : n - 1] = False  # an n-gram cannot end before position n - 1
        if n >= min_n:
            latest_end = _last_true(match)
            latest_full_end = _last_true(match & (np.arange(width)[None, :] <= last - 1 - k))
            latest_end = np.where(latest_full_end != NO_MATCH, latest_full_end, latest_end)
            best_end = np.where(latest_end != NO_MATCH, latest_end, best_end)  # a longer match overrides
    start = best_end + 1  # [num_rows] first drafted position (a NO_MATCH row's are never read)
    num_drafts = np.where(best_end != NO_MATCH, np.minimum(k, last[:, 0] - start), 0)
    positions = np.minimum(start[:, None] + np.arange(k)[None, :], max(width - 1, 0))  # [num_rows, k]
    drafts = tokens[rows[:, None], positions] if width else np.zeros((num_rows, k), dtype=token_ids.dtype)
    return drafts, num_drafts


def _last_true(mask: np.ndarray) -> np.ndarray:
    """Column of the last True in each row of a [rows, width] mask; NO_MATCH for none."""
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), last, NO_MATCH)


class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts per request from its own tokens."""

    def __init__(self, speculative_config: SpeculativeConfig) -> None:
        self.k = speculative_config.num_speculative_tokens
        self.min_n = speculative_config.prompt_lookup_min
        self.max_n = speculative_config.prompt_lookup_max

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        req_ids: list[str],
        num_tokens: np.ndarray,
        token_ids_cpu: np.ndarray,
        spec_decode_unsupported_reqs: set[str],
    ) -> list[list[int]]:
        """Drafts for every row of the persistent batch ([] for rows that get none).

        A row gets drafts only if it gained tokens this step (a prefill chunk that
        stopped short did not) and its sampling settings allow speculation.
        """
        num_reqs = len(sampled_token_ids)
        rows = np.array(
            [i for i, s in enumerate(sampled_token_ids) if s and req_ids[i] not in spec_decode_unsupported_reqs],
            dtype=np.int64,
        )
        draft_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        if rows.size == 0:
            return draft_token_ids
        lengths = num_tokens[rows]
        drafts, num_drafts = find_ngram_drafts(
            token_ids_cpu[rows, : int(lengths.max())], lengths, self.min_n, self.max_n, self.k
        )
        for row, row_drafts, n in zip(rows.tolist(), drafts.tolist(), num_drafts.tolist()):
            draft_token_ids[row] = row_drafts[:n]
        return draft_token_ids
