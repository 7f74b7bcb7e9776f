"""Token embedding and the language-model head.

Mirrors vllm/model_executor/layers/vocab_parallel_embedding.py (chapter 01).

Why it exists: both hold a `[vocab_size, hidden_size]` matrix; vLLM splits it by vocabulary
rows across tensor-parallel ranks (chapter 13). Here the tensor-parallel size is 1, so the
embedding is a plain lookup and the head's matrix is used by `LogitsProcessor`. With tied
embeddings the head simply shares the embedding's parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_v1.model_executor.model_loader import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    """`input_ids [num_tokens] -> [num_tokens, embedding_dim]`."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection's weight; `LogitsProcessor` applies it, never `forward`."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the input embedding's matrix (`tie_word_embeddings`)."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead holds weights only; call LogitsProcessor(lm_head, hidden_states).")
