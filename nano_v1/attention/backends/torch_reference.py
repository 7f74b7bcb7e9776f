"""The TORCH_REFERENCE backend: FLASH_ATTN's logic over the plain-PyTorch reference kernels.

nano_v1's own backend, not one of vLLM's (chapter 06); vLLM's closest is TORCH_SDPA
(vllm/v1/attention/backends/cpu_attn.py), a CPU backend without cascade attention.

Why it exists: it is the readable definition every faster kernel is tested against, and
the CPU path. It keeps FLASH_ATTN's metadata and cascade rule, and swaps the kernels for
those of `nano_v1/attention/ops/reference.py`, which need one host-side plan per step
(which requests are decodes), made by the builder. That plan is why no CUDA graph can
hold this backend.
"""

from __future__ import annotations

from nano_v1.attention.backends.flash_attn import (
    AttentionOps,
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from nano_v1.attention.backends.utils import AttentionCGSupport
from nano_v1.attention.ops import reference

REFERENCE_OPS = AttentionOps(
    reference.reshape_and_cache_flash, reference.unified_attention, reference.merge_attn_states
)


class TorchReferenceMetadataBuilder(FlashAttentionMetadataBuilder):
    cudagraph_support = AttentionCGSupport.NEVER
    plan_batch_split = staticmethod(reference.plan_batch_split)


class TorchReferenceImpl(FlashAttentionImpl):
    @staticmethod
    def get_attention_ops() -> AttentionOps:
        return REFERENCE_OPS


class TorchReferenceBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_REFERENCE"

    @staticmethod
    def get_impl_cls() -> type[TorchReferenceImpl]:
        return TorchReferenceImpl

    @staticmethod
    def get_builder_cls() -> type[TorchReferenceMetadataBuilder]:
        return TorchReferenceMetadataBuilder
