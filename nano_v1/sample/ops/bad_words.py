"""Bad words: forbid the token that would complete a banned token sequence.

Mirrors vllm/v1/sample/ops/bad_words.py (chapter 01).
"""

from __future__ import annotations

import torch


def apply_bad_words(
    logits: torch.Tensor,
    bad_words_token_ids: dict[int, list[list[int]]],
    past_tokens_ids: list[list[int]],
) -> None:
    """For each row with bad words: set to -inf the last token of every bad word whose other
    tokens are the row's latest output tokens (all of a one-token word, always).

    Only the output counts as the past, as in vLLM: a word begun in the prompt is not completed.
    """
    for row, bad_words in bad_words_token_ids.items():
        past = past_tokens_ids[row]
        for word in bad_words:
            prefix_length = len(word) - 1
            if prefix_length > len(past):
                continue
            if prefix_length == 0 or past[-prefix_length:] == word[:-1]:
                logits[row, word[-1]] = float("-inf")
