"""The TRITON_ATTN backend: the Triton unified-attention kernel, without cascade attention.

Mirrors vllm/v1/attention/backends/triton_attn.py (chapter 06).

Why it exists: vLLM's Triton backend is the one that runs wherever Triton does (AMD and
older NVIDIA GPUs included), built around `triton_unified_attention.py`, the kernel
nano_v1's is modeled on. It shares FLASH_ATTN's metadata and implementation here (both
call the same kernel) and differs in one decision: in vLLM v0.11.0 it never takes the
cascade path, so neither does it here. Comparing the two backends on a shared-prefix
batch is comparing attention with and without cascade (chapter 07).
"""

from __future__ import annotations

from nano_v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from nano_v1.attention.backends.utils import AttentionCGSupport


class TritonAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    cudagraph_support = AttentionCGSupport.ALWAYS

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class TritonAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl  # the same kernel calls as FLASH_ATTN's

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder
