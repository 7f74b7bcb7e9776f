"""`SamplingMetadata` as the persistent batch builds it, for sampler tests without a batch."""

from __future__ import annotations

import torch

from nano_v1.sample.metadata import SamplingMetadata


def make_sampling_metadata(
    temperature: list[float],
    top_p: list[float] | None = None,
    top_k: list[int] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    """Metadata as the persistent batch builds it: greedy rows carry temperature 0."""
    greedy = [t == 0.0 for t in temperature]
    return SamplingMetadata(
        temperature=None if all(greedy) else torch.tensor(temperature),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if top_p is None else torch.tensor(top_p),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
    )

