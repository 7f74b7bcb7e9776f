"""Hidden states to vocabulary logits.

Mirrors vllm/model_executor/layers/logits_processor.py (chapter 01).

Why it exists: the model runner asks for logits only at the rows it samples from (the last
token of each request), not at every prompt token; keeping this projection out of the
model's `forward` lets the runner select those rows first. Logits come back in float32 so
that sampling behaves the same whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_v1.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    """`[num_rows, hidden_size] -> [num_rows, vocab_size]` float32 logits."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, lm_head.weight).float()
