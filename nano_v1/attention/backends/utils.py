"""Attention metadata shared by every backend, built once per step by the model runner.

Mirrors vllm/v1/attention/backends/utils.py (`CommonAttentionMetadata`, `AttentionCGSupport`)
(chapters 06 and 08).

Why it exists: an attention kernel over a ragged, paged batch needs only a handful of
tensors: where each request's queries start, how long each request's context is, which
KV blocks hold it, and where to write the new keys and values. The model runner builds
these once per step; each backend's builder turns them into its own metadata.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """Per-step metadata for a batch of `num_reqs` requests and `num_actual_tokens` tokens.

    Request i's queries are tokens `query_start_loc[i]:query_start_loc[i+1]` of the batch;
    they sit at the last `query_len_i` positions of its `seq_lens[i]`-token context, whose
    KV lives in blocks `block_table_tensor[i, :ceil(seq_lens[i] / block_size)]`.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    query_start_loc_cpu: torch.Tensor  # the same on the CPU, for host-side decisions
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step's tokens
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32: context before this step
    num_reqs: int
    num_actual_tokens: int  # tokens in the batch, before any padding
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64: cache slot of each new token
    causal: bool = True


class AttentionCGSupport(enum.Enum):
    """How much of an attention backend a CUDA graph can capture (vLLM's enum of the same name).

    A graph replays fixed kernels on fixed addresses, so a backend qualifies only if it
    reads every per-step fact from device buffers, with no host-side planning per step.
    nano_v1's FULL graphs are pure decode steps, so UNIFORM_SINGLE_TOKEN_DECODE suffices.
    """

    NEVER = 0  # plans on the host every step (the reference)
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # batches of one-token decodes only
    UNIFORM_BATCH = 2  # batches whose requests all have the same query length
    ALWAYS = 3  # any batch, prefills and decodes mixed
