"""Token embedding and the language-model head, split over tensor-parallel ranks by vocabulary rows.

Mirrors vllm/model_executor/layers/vocab_parallel_embedding.py (chapters 01 and 13).

Why it exists: both hold a `[vocab_size, hidden_size]` matrix, often the model's largest
(151,936 x 1,024 for Qwen3-0.6B). With `tp` ranks each holds a contiguous block of
`padded_vocab / tp` rows, the vocabulary padded up to a multiple of 64 x tp so the
blocks are equal:

  - the embedding looks up the ids that fall in its block, writes zeros for the others,
    and an all-reduce adds the ranks' answers (each id is in exactly one block);
  - the head's matrix gives each rank the logits of its block, and `LogitsProcessor`
    all-gathers them into the whole vocabulary.

With tied embeddings the head shares the embedding's parameter, and so its shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_v1.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from nano_v1.distributed.utils import divide
from nano_v1.model_executor.model_loader import check_shape

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """The smallest multiple of `pad_to` that is at least `vocab_size`."""
    return (vocab_size + pad_to - 1) // pad_to * pad_to


class VocabParallelEmbedding(nn.Module):
    """`input_ids [num_tokens] -> [num_tokens, embedding_dim]`, this rank holding rows
    `[vocab_start_index, vocab_end_index)` of the padded vocabulary."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE
    ) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings  # the checkpoint's vocabulary
        self.embedding_dim = embedding_dim
        # vLLM pads to a multiple of 64 and requires tp to divide that; 64 x tp always does.
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's block of the checkpoint's `[vocab_size, dim]` rows; padding rows are zeros."""
        check_shape((self.num_embeddings, self.embedding_dim), loaded_weight)
        num_real_rows = max(0, min(self.vocab_end_index, self.num_embeddings) - self.vocab_start_index)
        param.data[num_real_rows:].zero_()
        param.data[:num_real_rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, num_real_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids outside this rank's block look up row 0 and are zeroed; the all-reduce adds the one real row.
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(embeddings)  # [num_tokens, embedding_dim]

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings_per_partition} of {self.num_embeddings_padded}, "
            f"embedding_dim={self.embedding_dim}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection's weight (this rank's vocabulary block); `LogitsProcessor` applies it, never `forward`."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the input embedding's matrix (`tie_word_embeddings`): the same rows on the same rank."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead holds weights only; call LogitsProcessor(lm_head, hidden_states).")
