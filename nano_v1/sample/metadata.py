"""Sampling metadata: the batch's sampling settings as device tensors, one row per request.

Mirrors vllm/v1/sample/metadata.py (chapter 01).

Why it exists: the sampler works on the whole batch at once, so per-request settings
(temperature, top-p, top-k, seeds) travel as columns aligned with the logits rows. The
persistent batch rebuilds this only when its membership changes, not every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nano_v1.sample.logits_processor import LogitsProcessor


@dataclass(slots=True)
class SamplingMetadata:
    """Row i describes request i of the persistent batch (and row i of the logits)."""

    # [num_reqs] float32; 0 for greedy rows. None when every row is greedy.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [num_reqs] float32 in (0, 1]; None when no row truncates by top-p.
    top_p: torch.Tensor | None
    # [num_reqs] int32 in [1, vocab_size]; None when no row truncates by top-k.
    top_k: torch.Tensor | None
    # {row: generator} for rows of seeded requests; other rows use the global RNG.
    generators: dict[int, torch.Generator]
    # Largest `logprobs` asked for in the batch; None when nobody asked.
    max_num_logprobs: int | None
    # In order: the non-argmax-invariant ones before sampling, the others to random rows only.
    logitsprocs: Sequence[LogitsProcessor] = ()
