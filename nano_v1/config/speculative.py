"""Speculative decoding with an n-gram (prompt lookup) proposer.

Mirrors vllm/config/speculative.py (`SpeculativeConfig`) (chapter 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nano_v1.config.utils import config_from_dict


@dataclass
class SpeculativeConfig:
    """Speculative decoding with an n-gram (prompt lookup) proposer (chapter 10).

    Mirrors vllm/config/speculative.py, which also knows draft models, EAGLE and MTP; we
    keep only `method="ngram"`. Each step a request verifies up to
    `num_speculative_tokens` drafts, copied from what followed the latest earlier
    occurrence of its last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(
                f"speculative_config method must be 'ngram' (the only proposer here), got {self.method!r}."
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value > 0):
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}.")
        # vLLM's defaults: one bound given means both; none means 5.
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any] | str) -> "SpeculativeConfig":
        """From `LLM(speculative_config={...})` or the CLI's JSON string."""
        return config_from_dict(cls, "speculative_config", config)
