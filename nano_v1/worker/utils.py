"""The model runner's helpers: images into the flat batch, the KV cache, the cascade prefix.

Mirrors vllm/v1/worker/utils.py (v0.11.0) (chapters 07, 11 and 12).

Why it exists: these are jobs the runner calls from its step or its start-up whose inputs
can be named, so each takes what it reads as arguments and returns what it makes, and the
runner's own file reads as the step. vLLM's module holds `bind_kv_cache` and the
multimodal placeholder helpers; the others are methods of v0.11.0's runner,
vllm/v1/worker/gpu_model_runner.py (`GPUModelRunner._execute_mm_encoder`,
`GPUModelRunner._gather_mm_embeddings`, `GPUModelRunner.get_kv_cache_spec`,
`GPUModelRunner._allocate_kv_cache_tensors`, `GPUModelRunner._reshape_kv_cache_tensors`,
`GPUModelRunner._compute_cascade_attn_prefix_len`), here functions under the same names,
less the leading underscore. The runner keeps `get_kv_cache_spec` and
`initialize_kv_cache_tensors` as methods, as the worker calls them, and they call these.

Chapter 11: a multimodal model's step first runs the vision encoder on the images the
scheduler chose (`execute_mm_encoder`), keeps their outputs in the runner's
`encoder_cache` until the scheduler frees them, and gathers the rows of this step's image
positions (`gather_mm_embeddings`) into the token embeddings. nano_v1's images are all
embedding (no placeholder token is text), so vLLM's `scatter_mm_placeholders` and
`gather_mm_placeholders` would be the identity and are left out, as is
`sanity_check_mm_encoder_outputs` (one model, one encoder output shape).

Chapter 12: each attention layer states its KV cache format (`get_kv_cache_spec`); the
KV cache config built from those says which layers share a tensor (`KVCacheTensor`) and
which form a group (`KVCacheGroupSpec`); the tensors are allocated as raw bytes
(`allocate_kv_cache_tensors`), viewed in each group's format
(`reshape_kv_cache_tensors`), and handed to the layers (`bind_kv_cache`). Layers of
different groups may share a tensor: the block pool never gives one block to two groups.

Chapter 07: `compute_cascade_attn_prefix_len` turns the blocks every running request
shares into the prefix one KV cache group's cascade attention may use this step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from nano_v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder
    from nano_v1.attention.layer import Attention
    from nano_v1.core.sched.output import SchedulerOutput
    from nano_v1.worker.gpu_input_batch import CachedRequestState


# ------------------------------------------------------------------ multimodal (chapter 11)
def execute_mm_encoder(
    model: nn.Module,
    scheduler_output: SchedulerOutput,
    requests: dict[str, CachedRequestState],
    encoder_cache: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Encode this step's scheduled images, in one batch, into `encoder_cache`; return their tokens.

    The scheduler never schedules one mm_hash twice in a step, and a request preempted
    after its images were scheduled still has them here: the encoder cache counts them.
    """
    mm_hashes: list[str] = []
    pixel_values: list[torch.Tensor] = []
    for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
        mm_features = requests[req_id].mm_features
        for input_id in input_ids:
            mm_hashes.append(mm_features[input_id].identifier)
            pixel_values.append(mm_features[input_id].data["pixel_values"])
    if not mm_hashes:
        return 0
    batch = torch.stack(pixel_values).to(device, dtype)  # [num_images, 3, H, W]
    # [num_images, num_image_tokens, hidden_size]
    encoder_outputs = model.get_multimodal_embeddings(batch)
    for mm_hash, output in zip(mm_hashes, encoder_outputs):
        encoder_cache[mm_hash] = output
    return encoder_outputs.shape[0] * encoder_outputs.shape[1]


def gather_mm_embeddings(
    scheduler_output: SchedulerOutput,
    req_ids: list[str],
    requests: dict[str, CachedRequestState],
    query_start_loc: np.ndarray,
    encoder_cache: dict[str, torch.Tensor],
    device: torch.device,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The encoder output rows for exactly this step's image positions, and where they go.

    `req_ids` are the persistent batch's rows in order and `query_start_loc` where each
    row's tokens start in the flat batch. Returns the rows, one `[n, hidden_size]` piece
    per (request, image) in flat-batch order, and `is_mm_embed`, a `[num_tokens]` bool
    mask of the flat batch that is true at those positions (the same count, in the same
    order); None in a step without image positions (most steps: every decode). E.g. a
    chunk of positions 100..611 over an image at 100..675 takes rows 0..511 of its
    output; the next chunk takes rows 512..575, from the cache.
    """
    total_num_tokens = scheduler_output.total_num_scheduled_tokens
    is_mm_embed = np.zeros(total_num_tokens, dtype=bool)
    mm_embeds: list[torch.Tensor] = []
    for req_index, req_id in enumerate(req_ids):
        req_state = requests[req_id]
        num_computed_tokens = req_state.num_computed_tokens
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens[req_id]
        for mm_feature in req_state.mm_features:
            start_pos, num_encoder_tokens = mm_feature.mm_position.offset, mm_feature.mm_position.length
            if start_pos >= num_computed_tokens + num_scheduled_tokens:
                break  # this image and every later one lie beyond the chunk
            if start_pos + num_encoder_tokens <= num_computed_tokens:
                continue  # in the KV cache already
            # Rows [start_idx, end_idx) of the image's output fall in this chunk.
            start_idx = max(num_computed_tokens - start_pos, 0)
            end_idx = min(num_computed_tokens + num_scheduled_tokens - start_pos, num_encoder_tokens)
            encoder_output = encoder_cache.get(mm_feature.identifier)
            assert encoder_output is not None, f"encoder cache miss for {mm_feature.identifier} ({req_id})"
            mm_embeds.append(encoder_output[start_idx:end_idx])
            flat_start = query_start_loc[req_index] + start_pos + start_idx - num_computed_tokens
            is_mm_embed[flat_start : flat_start + end_idx - start_idx] = True
    if not mm_embeds:
        return [], None
    return mm_embeds, torch.from_numpy(is_mm_embed).to(device)


# ------------------------------------------------------------------ the KV cache (chapter 12)
def get_kv_cache_spec(
    attn_layers: dict[str, Attention], block_size: int, dtype: torch.dtype
) -> dict[str, KVCacheSpec]:
    """Each attention layer's KV cache format: a sliding window if the layer has one, else full attention."""
    kv_cache_spec: dict[str, KVCacheSpec] = {}
    for layer_name, layer in attn_layers.items():
        if layer.sliding_window is not None:
            kv_cache_spec[layer_name] = SlidingWindowSpec(
                block_size, layer.num_kv_heads, layer.head_size, dtype, layer.sliding_window
            )
        else:
            kv_cache_spec[layer_name] = FullAttentionSpec(
                block_size, layer.num_kv_heads, layer.head_size, dtype
            )
    return kv_cache_spec


def allocate_kv_cache_tensors(
    kv_cache_config: KVCacheConfig, device: torch.device
) -> dict[str, torch.Tensor]:
    """One zeroed byte buffer per `KVCacheTensor`, under the name of every layer that shares it.

    Zeros, not empty: a never-written slot must not hold NaNs that a masked attention
    weight of 0 could still turn into NaN (0 * NaN).
    """
    kv_cache_raw_tensors: dict[str, torch.Tensor] = {}
    for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
        tensor = torch.zeros(kv_cache_tensor.size, dtype=torch.int8, device=device)
        for layer_name in kv_cache_tensor.shared_by:
            kv_cache_raw_tensors[layer_name] = tensor
    return kv_cache_raw_tensors


def reshape_kv_cache_tensors(
    kv_cache_config: KVCacheConfig,
    kv_cache_raw_tensors: dict[str, torch.Tensor],
    attn_backend: type[FlashAttentionBackend],
) -> dict[str, torch.Tensor]:
    """Each layer's byte buffer seen in its group's format: `attn_backend.get_kv_cache_shape`
    (`[2, num_blocks, block_size, num_kv_heads, head_size]`) of the group's dtype."""
    kv_caches: dict[str, torch.Tensor] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for layer_name in group.layer_names:
            raw = kv_cache_raw_tensors[layer_name]
            num_blocks = raw.numel() // spec.page_size_bytes
            shape = attn_backend.get_kv_cache_shape(
                num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
            )
            kv_caches[layer_name] = raw.view(spec.dtype).view(shape)
    return kv_caches


def bind_kv_cache(kv_caches: dict[str, torch.Tensor], forward_context: dict[str, Attention]) -> None:
    """Give each attention layer (by name, as the forward context holds them) its KV cache view.

    vLLM's also fills a list of the runner's caches in layer order and wraps each view in a
    list (one per virtual engine of its pipeline parallelism); nano_v1 keeps neither.
    """
    assert kv_caches.keys() == forward_context.keys(), "every attention layer needs a KV cache"
    for layer_name, kv_cache in kv_caches.items():
        forward_context[layer_name].kv_cache = kv_cache


# ------------------------------------------------------------------ cascade attention (chapter 07)
def compute_cascade_attn_prefix_len(
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    num_common_prefix_blocks: int,
    kv_cache_spec: KVCacheSpec,
    attn_metadata_builder: FlashAttentionMetadataBuilder,
    num_query_heads: int,
    num_sms: int,
) -> int:
    """Tokens of shared prefix that cascade attention handles this step in one KV cache group; 0 for none.

    `num_scheduled_tokens` and `num_computed_tokens` are per row of the persistent batch
    (the first `len(num_scheduled_tokens)` rows are this step's requests).

    Not simply the shared blocks: the prefix pass attends without a mask, so no query
    may sit inside the prefix. If all requests share [A B C D E] and one has computed
    [A B C] and now queries [D E X], a five-token prefix would let its query D see E, its
    future. So the prefix is capped by the smallest `num_computed_tokens` (not one more,
    which would still be correct: this way every request keeps at least one suffix key
    and the suffix pass is never empty), then rounded down to whole blocks, since the
    prefix pass reads whole blocks of the block table's first row.

    The rule refuses windowed layers: a sliding-window group, or full attention that
    remembers a window (the hybrid allocator off); its prefix pass would see keys
    outside the window.
    """
    block_size = kv_cache_spec.block_size
    common_prefix_len = num_common_prefix_blocks * block_size
    if common_prefix_len == 0:
        return 0  # the common case: no block is shared by every running request
    num_reqs = len(num_scheduled_tokens)
    common_prefix_len = min(common_prefix_len, int(num_computed_tokens[:num_reqs].min()))
    common_prefix_len = common_prefix_len // block_size * block_size
    use_sliding_window = isinstance(kv_cache_spec, SlidingWindowSpec) or (
        isinstance(kv_cache_spec, FullAttentionSpec) and kv_cache_spec.sliding_window is not None
    )
    use_cascade = attn_metadata_builder.use_cascade_attention(
        common_prefix_len=common_prefix_len,
        query_lens=num_scheduled_tokens,
        num_query_heads=num_query_heads,
        num_kv_heads=kv_cache_spec.num_kv_heads,
        use_alibi=False,  # nano_v1's models have none of these variants
        use_sliding_window=use_sliding_window,
        use_local_attention=False,
        num_sms=num_sms,
    )
    return common_prefix_len if use_cascade else 0
