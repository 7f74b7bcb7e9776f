"""The forward context: per-step data that attention layers read without it being threaded
through every module's `forward` signature.

Mirrors vllm/forward_context.py (chapter 06).

Why it exists: a model's `forward(input_ids, positions)` stays the same as in Hugging
Face; the attention metadata for the step is set here by the model runner around the
forward call, and each `Attention` layer picks it up. This is the one piece of global
mutable state in nano_v1, owned by this module.

With piecewise compilation (chapter 08) it also carries what a compiled graph cannot take
as an argument: the attention layers by name (the attention custom op receives a layer's
name, a string, and looks the layer up here), and which CUDA graph this step replays
(`cudagraph_runtime_mode`, `batch_descriptor`), read by every `CUDAGraphWrapper`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nano_v1.config import CUDAGraphMode


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The key of a captured CUDA graph: the (padded) token count, and whether the batch is
    all single-token decodes (only those run as one FULL graph)."""

    num_tokens: int
    uniform_decode: bool = False


@dataclass
class ForwardContext:
    # The backend's metadata for this step: {layer name: FlashAttentionMetadata} from the
    # runner (layers of one KV cache group share one), or one metadata for every layer;
    # None during a profiling or warm-up run that has no KV cache to read or write.
    attn_metadata: Any
    # Attention layers by `layer_name`, for the attention custom op of a compiled graph.
    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "an attention layer ran outside set_forward_context()"
    return _forward_context


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    no_compile_layers: dict[str, Any] | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
) -> Iterator[None]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(
        attn_metadata=attn_metadata,
        no_compile_layers=no_compile_layers or {},
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
    )
    try:
        yield
    finally:
        _forward_context = previous
