"""Acceptance statistics of speculative decoding.

Mirrors vllm/v1/spec_decode/metrics.py (chapter 10).

Why it exists: speculation pays only if drafts are accepted. The scheduler, which sees
how many of each request's drafts survived verification, counts them every step
(`SpecDecodingStats`); the frontend adds the steps up. Two numbers summarise them:
the acceptance rate (accepted drafts / proposed drafts) and the mean acceptance length
(tokens a request gains per verification step: 1 + accepted drafts per draft, the
1 being the token the target model always contributes).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Counts over some steps. A "draft" is one request's proposal in one step."""

    num_spec_tokens: int  # k: the longest a draft can be
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k] how many drafts had their i-th token accepted (position 0 first).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        assert 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def add(self, other: "SpecDecodingStats") -> None:
        """Accumulate another interval's counts into this one."""
        assert other.num_spec_tokens == self.num_spec_tokens
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for pos, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[pos] += count

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (NaN before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per verification step: 1 (the target's own token) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")
