"""What a logprob is on the user's side: a token's log-probability, its rank and its text.

Mirrors vllm/logprobs.py (chapter 01).

Why it exists: `RequestOutput.prompt_logprobs` reports, per prompt position, the prompt's
actual token and the top-k alternatives; each needs its rank in the vocabulary (1 is the
most likely) and its text beside the number, which a bare float cannot carry.

What differs from v0.11.0: sample logprobs (`CompletionOutput.logprobs`) are still
`{token_id: logprob}` floats in nano_v1, so only `PromptLogprobs` uses `Logprob`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token at one position: its log-probability, rank (>= 1) and decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position: {token_id: Logprob} for the prompt's token there and the top
# `prompt_logprobs` tokens; None at position 0, which no earlier token predicts.
PromptLogprobs = list[dict[int, Logprob] | None]
