"""The `Attention` layer a model holds: heads and a scale in, attention over the paged cache out.

Mirrors vllm/attention/layer.py (chapters 01 and 06).

Why it exists: the model code says only "attend" (`self.attn(q, k, v)`), exactly as in a
Hugging Face model. Everything that depends on the step — which cache slots to write,
which blocks each request's context lives in — comes from the forward context that the
model runner sets around the forward call, and the KV cache tensor is bound to the layer
by the runner after it sizes the cache. So the model's `forward(input_ids, positions)`
needs no extra arguments, and the backend can change without touching any model.
"""

from __future__ import annotations

import torch
from torch import nn

from nano_v1.attention.backends.flash_attn import FlashAttentionBackend
from nano_v1.forward_context import get_forward_context


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads over the paged KV cache of one layer."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, prefix: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix  # e.g. "model.layers.0.self_attn.attn": the runner binds caches by it
        self.attn_backend = FlashAttentionBackend
        self.impl = self.attn_backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        # [2, num_blocks, block_size, num_kv_heads, head_size], bound by the model runner.
        # A plain attribute, not a buffer: the cache is not part of the model's state dict.
        self.kv_cache = torch.tensor([])

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        attn_metadata = get_forward_context().attn_metadata
        output = torch.empty_like(query)
        self.impl.forward(
            self,
            query.view(-1, self.num_heads, self.head_size),  # [num_tokens, num_heads, head_size]
            key.view(-1, self.num_kv_heads, self.head_size),  # [num_tokens, num_kv_heads, head_size]
            value.view(-1, self.num_kv_heads, self.head_size),
            self.kv_cache,
            attn_metadata,
            output.view(-1, self.num_heads, self.head_size),
        )
        return output

    def extra_repr(self) -> str:
        return (
            f"layer_name={self.layer_name!r}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}"
        )
