"""The attention backend: KV cache layout, per-step metadata, and the attention call itself.

Mirrors vllm/v1/attention/backends/flash_attn.py (chapters 01 and 06).

Why it exists: vLLM separates *what* the model asks for (an `Attention` layer with heads
and a scale) from *how* a backend computes it over a paged cache. A backend is three
pieces: a static description (`FlashAttentionBackend`: the cache shape), a builder that
turns the runner's `CommonAttentionMetadata` into the backend's own metadata once per step
(`FlashAttentionMetadataBuilder`), and the per-layer implementation
(`FlashAttentionImpl.forward`). Here the kernels are the plain-PyTorch ops of
`nano_v1/attention/ops/reference.py`, called by name so that a Triton kernel and cascade
attention slot in later without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nano_v1.attention.backends.utils import CommonAttentionMetadata
from nano_v1.attention.ops import reference as ops


@dataclass(slots=True)
class FlashAttentionMetadata:
    """One step's attention metadata, shared by every layer.

    A request's context (`seq_len`) is what was computed before (`context_len`) plus this
    step's queries (`query_len`); the queries are the last `query_len` positions.
    """

    num_actual_tokens: int  # tokens in the batch, before any padding
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    max_seq_len: int
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    # Cascade attention over a shared prefix arrives in chapter 07; until then always off.
    use_cascade: bool
    common_prefix_len: int
    # The reference kernel's host-side plan (which requests are decodes), made once per step.
    batch_split: ops.BatchSplit
    causal: bool = True


class FlashAttentionMetadataBuilder:
    """Turns the runner's `CommonAttentionMetadata` into `FlashAttentionMetadata`, once per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashAttentionMetadata:
        m = common_attn_metadata
        assert common_prefix_len == 0, "cascade attention is not implemented yet (chapter 07)"
        num_reqs = m.num_reqs
        return FlashAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc[: num_reqs + 1],
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens[:num_reqs],
            block_table=m.block_table_tensor[:num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            use_cascade=False,
            common_prefix_len=0,
            batch_split=ops.plan_batch_split(
                m.query_start_loc_cpu[: num_reqs + 1], m.seq_lens_cpu[:num_reqs], self.device
            ),
            causal=m.causal,
        )


class FlashAttentionImpl:
    """The per-layer attention computation: cache the new K/V, then attend through the cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: FlashAttentionMetadata | None,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    ) -> torch.Tensor:
        if attn_metadata is None:
            # A profiling or warm-up run: no cache exists yet, so attend within the batch,
            # taken as one causal sequence. Only the cost matters, not the values.
            return self._forward_without_cache(query, key, value, output)
        key_cache, value_cache = kv_cache.unbind(0)
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        n = attn_metadata.num_actual_tokens
        ops.unified_attention(
            q=query[:n],
            k_cache=key_cache,
            v_cache=value_cache,
            out=output[:n],
            cu_seqlens_q=attn_metadata.query_start_loc,
            max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=attn_metadata.causal,
            block_table=attn_metadata.block_table,
            split=attn_metadata.batch_split,
        )
        return output

    def _forward_without_cache(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        q = query.transpose(0, 1)  # [num_heads, num_tokens, head_size]
        k = key.transpose(0, 1).repeat_interleave(group, dim=0)  # [num_heads, num_tokens, head_size]
        v = value.transpose(0, 1).repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        output.copy_(o.transpose(0, 1))  # [num_tokens, num_heads, head_size]
        return output


class FlashAttentionBackend:
    """Static facts about the backend: its cache layout and its classes."""

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, int, int, int, int]:
        # Keys and values of one layer in one tensor; a block is `block_size` consecutive tokens.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[FlashAttentionMetadata]:
        return FlashAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder
