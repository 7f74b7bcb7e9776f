"""The scheduler's decision for one step, as the model runner receives it.

Mirrors vllm/v1/core/sched/output.py (chapter 04).

Why it is shaped this way: the model runner keeps every running request's state
between steps (chapter 05), so the scheduler sends a *diff*. A request seen for the
first time travels in full (`NewRequestData`); a request the runner already holds
travels as a few columns (`CachedRequestData`): its new blocks and its progress.
Tokens the runner sampled itself never travel back to it.

Chapter 15 adds the grammar bitmask of the step's structured requests, built in the
scheduler process; the runner only applies it.

Chapter 16 adds the KV connector's metadata: what the workers load and save this step.

Chapter 11 adds the encoder's part of the step: which images the runner encodes now
(`scheduled_encoder_inputs`) and which cached encoder outputs it may drop
(`free_encoder_mm_hashes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from nano_v1.multimodal.inputs import MultiModalFeatureSpec
from nano_v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nano_v1.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from nano_v1.request import Request


@dataclass(slots=True)
class NewRequestData:
    """Everything the runner needs about a request it has never seen."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one list per KV cache group (chapter 12)
    num_computed_tokens: int
    # The prompt's images (chapter 11); vLLM lists this field after prompt_token_ids.
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: "Request", block_ids: tuple[list[int], ...]) -> "NewRequestData":
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            mm_features=request.mm_features,
        )


@dataclass(slots=True)
class CachedRequestData:
    """Columns for requests the runner already holds (one entry per request).

    `new_block_ids[i]` are blocks appended since the last step, one list per KV cache
    group, None if there are none (most decode steps); or, when
    `resumed_from_preemption[i]`, the request's whole new block lists (the old ones were
    freed when it was preempted).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: which requests run, and how many tokens each."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # {request_id: number of tokens to compute this step}; the one token budget.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # {request_id: draft token ids to verify this step} (chapter 10).
    scheduled_spec_decode_tokens: dict[str, list[int]]
    # Per KV cache group, leading blocks shared by every running request (chapter 07).
    num_common_prefix_blocks: list[int]
    # Requests finished since the last step: the runner drops their state.
    finished_req_ids: set[str]
    # {request_id: indices into its mm_features} of the images to encode this step (chapter 11).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # mm_hashes evicted from the encoder cache since the last step: the runner drops their outputs.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # {request_id: its index among the step's requests} for requests under a grammar (chapter 15) ...
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # ... and their packed bitmask, [rows, ceil(vocab / 32)] int32, a row per token to sample
    # (1 + drafts per request, in that index order); None when no request is structured.
    grammar_bitmask: np.ndarray | None = None
    # What the workers' KV connectors load and save this step (chapter 16); None without a connector.
    kv_connector_metadata: KVConnectorMetadata | None = None
