"""Sampling metadata: the batch's sampling settings as device tensors, one row per request.

Mirrors vllm/v1/sample/metadata.py (chapter 01).

Why it exists: the sampler works on the whole batch at once, so per-request settings
(temperature, top-p, top-k, seeds, penalties) travel as columns aligned with the logits
rows. The persistent batch rebuilds this only when its membership changes, not every step.

What differs from v0.11.0: the penalties read the batch's token bins (`prompt_mask`,
`output_bin_counts`, kept up to date by `InputBatch`) where vLLM's carry `prompt_token_ids`
and count them every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    # True when every row's penalties are neutral; the four fields below are then None.
    no_penalties: bool = True
    # [num_reqs] float32 each: OpenAI's presence and frequency penalties, CTRL's repetition penalty.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [num_reqs, vocab]: bool, the token is in the row's prompt; int32, times the row sampled it.
    # Valid in the rows of requests with penalties (the others' penalties are neutral).
    prompt_mask: torch.Tensor | None = None
    output_bin_counts: torch.Tensor | None = None
    # Row -> the request's output token ids (its own list, extended as it samples); for bad words.
    output_token_ids: Sequence[list[int]] = ()
    # [num_reqs, vocab] bool, True where the row may NOT sample; None when no row restricts.
    allowed_token_ids_mask: torch.Tensor | None = None
    # Row -> its bad words as token id sequences, for rows that have any.
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
