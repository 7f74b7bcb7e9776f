"""Hidden states to vocabulary logits.

Mirrors vllm/model_executor/layers/logits_processor.py (chapters 01 and 13).

Why it exists: the model runner asks for logits only at the rows it samples from (the last
token of each request), not at every prompt token; keeping this projection out of the
model's `forward` lets the runner select those rows first. Logits come back in float32 so
that sampling behaves the same whatever the model dtype. With tensor parallelism each
rank computes the logits of its vocabulary block and an all-gather joins them, so every
rank holds the whole row and samples the same token as the others (vLLM's TP ranks do
the same; chapter 13).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_v1.distributed import tensor_model_parallel_all_gather
from nano_v1.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    """`[num_rows, hidden_size] -> [num_rows, vocab_size]` float32 logits."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, lm_head.weight)  # [num_rows, padded_vocab / tp], this rank's block
        logits = tensor_model_parallel_all_gather(logits)  # [num_rows, padded_vocab], blocks in rank order
        return logits[..., : self.vocab_size].float()  # the padding rows' logits are dropped
