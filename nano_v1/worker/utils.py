"""The worker's helper that hands each attention layer its KV cache view.

Mirrors vllm/v1/worker/utils.py (chapter 12).

Why it exists: the model runner allocates the KV cache tensors and views them in each
group's format (`GPUModelRunner.initialize_kv_cache_tensors`); binding a view to its layer
is the one step that is not the runner's, as the layers find theirs by name.

What differs from v0.11.0: only `bind_kv_cache` is here. The rest of vLLM's module has
nothing to do in nano_v1: `MultiModalBudget` (the scheduler sizes the encoder cache from
the config), `AttentionGroup` (one metadata builder serves every group), the placeholder
helpers `scatter_mm_placeholders` and `gather_mm_placeholders` (nano_v1's images are all
embedding, no placeholder token is text, so they would be the identity),
`sanity_check_mm_encoder_outputs` (one model, one encoder output shape), cross-layer KV
sharing and sequence-parallel residuals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nano_v1.attention.layer import Attention


def bind_kv_cache(kv_caches: dict[str, torch.Tensor], forward_context: dict[str, Attention]) -> None:
    """Give each attention layer (by name, as the forward context holds them) its KV cache view.

    vLLM's also fills a list of the runner's caches in layer order and wraps each view in a
    list (one per virtual engine of its pipeline parallelism); nano_v1 keeps neither.
    """
    assert kv_caches.keys() == forward_context.keys(), "every attention layer needs a KV cache"
    for layer_name, kv_cache in kv_caches.items():
        forward_context[layer_name].kv_cache = kv_cache
