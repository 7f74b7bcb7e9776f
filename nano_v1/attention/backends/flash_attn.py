"""The FLASH_ATTN backend: KV cache layout, per-step metadata, cascade attention, the attention call.

Mirrors vllm/v1/attention/backends/flash_attn.py (chapters 01, 06, 07 and 12).

Why it exists: vLLM separates *what* the model asks for (an `Attention` layer with heads
and a scale) from *how* a backend computes it over a paged cache. A backend is three
pieces: a static description (`FlashAttentionBackend`: its name, the cache shape, its
classes), a builder that turns the runner's `CommonAttentionMetadata` into the backend's
own metadata once per step (`FlashAttentionMetadataBuilder`), and the per-layer
implementation (`FlashAttentionImpl.forward`).

FLASH_ATTN is vLLM's default backend on CUDA, and its builder holds the cascade rule
(chapter 07). vLLM calls FlashAttention's varlen kernel here; nano_v1 has no binding to
it and calls its own Triton unified-attention kernel (chapter 06), which keeps the same
contract: a ragged batch over a paged cache, returning the log-sum-exp that cascade
needs. The two other backends reuse these classes and change only what differs:
TRITON_ATTN (`triton_attn.py`) never cascades, as in vLLM v0.11.0; TORCH_REFERENCE
(`torch_reference.py`) swaps in the plain-PyTorch kernels and is the CPU path.

Cascade attention (chapter 07): when every running request starts with the same cached
blocks (a shared system prompt), attention splits into a pass of all queries over the
shared prefix, which reads the prefix once for the whole batch instead of once per
request, and a pass of each request over its own suffix; the two are merged with their
log-sum-exps. `use_cascade_attention` is vLLM's rule for when that pays.

What differs from v0.11.0: vLLM's builder precomputes the cascade passes' query ranges
and key lengths (`cu_prefix_query_lens`, `prefix_kv_lens`, `suffix_kv_lens`) once per
step; here `cascade_attention` derives them from the step's own lengths (chapter 07's
task ch07_t3), and the reference kernel plans both passes itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from nano_v1.attention.backends.utils import AttentionCGSupport, CommonAttentionMetadata
from nano_v1.attention.ops import reference

# The SM count the cascade performance model assumes when there is no GPU to ask: an
# H100 SXM or H200 (132 SMs), the GPUs our measurements come from (chapter 07).
CPU_NUM_SMS = 132


@dataclass(frozen=True, slots=True)
class AttentionOps:
    """The kernels of one attention backend, all with the reference's signatures."""

    reshape_and_cache_flash: Callable[..., None]
    unified_attention: Callable[..., torch.Tensor | None]
    merge_attn_states: Callable[..., None]


def triton_attention_ops() -> AttentionOps:
    """nano_v1's Triton kernels (chapter 06), imported only when a backend that calls them is
    built, so nano_v1 runs without Triton."""
    from nano_v1.attention.ops.triton_merge_attn_states import merge_attn_states
    from nano_v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
    from nano_v1.attention.ops.triton_unified_attention import unified_attention

    return AttentionOps(triton_reshape_and_cache_flash, unified_attention, merge_attn_states)


def get_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`, or `CPU_NUM_SMS` off the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


class FlashAttentionBackend:
    """Static facts about the backend: its name, its cache layout and its classes.

    The model runner builds its metadata builder from `get_builder_cls()`, and each
    `Attention` layer its implementation from `get_impl_cls()`, as in vLLM.
    """

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
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder


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
    # Cascade attention (chapter 07): the first `common_prefix_len` tokens (whole blocks) of
    # every request are the same blocks; `cascade_attention` derives each pass's arguments.
    use_cascade: bool
    common_prefix_len: int
    # The reference kernel's host-side plan of the plain pass (vLLM: FA3's scheduler_metadata),
    # made once per step. None with the Triton kernel, which plans on the device, and under
    # cascade, whose passes the reference kernel plans itself.
    batch_split: reference.BatchSplit | None
    causal: bool = True


class FlashAttentionMetadataBuilder:
    """Turns the runner's `CommonAttentionMetadata` into `FlashAttentionMetadata`, once per step."""

    # The Triton kernel reads every per-step fact from device tensors: a graph can hold it.
    cudagraph_support = AttentionCGSupport.ALWAYS
    # A host-side plan of each step's batch, for kernels that need one (the reference's).
    plan_batch_split: Callable[..., reference.BatchSplit] | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashAttentionMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        use_cascade = common_prefix_len > 0
        plan = self.plan_batch_split
        batch_split = None
        if plan is not None and not use_cascade:
            batch_split = plan(m.query_start_loc_cpu[: num_reqs + 1], m.seq_lens_cpu[:num_reqs], self.device)
        return FlashAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc[: num_reqs + 1],
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens[:num_reqs],
            block_table=m.block_table_tensor[:num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            use_cascade=use_cascade,
            common_prefix_len=common_prefix_len,
            batch_split=batch_split,
            causal=m.causal,
        )

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        """Whether this step should cascade: FLASH_ATTN asks vLLM's rule, `use_cascade_attention`."""
        return use_cascade_attention(*args, **kwargs)


def _unified_attention(
    ops: AttentionOps, split: reference.BatchSplit | None, **kwargs
) -> torch.Tensor | None:
    """Call the backend's `unified_attention`, handing the reference its host-side plan."""
    if split is not None:
        kwargs["split"] = split
    return ops.unified_attention(**kwargs)


class FlashAttentionImpl:
    """The per-layer attention computation: cache the new K/V, then attend through the cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # The kernels' `window_size` (vLLM's form): (w - 1 keys before the query, none after).
        self.sliding_window = None if sliding_window is None else (sliding_window - 1, 0)
        self.ops = self.get_attention_ops()

    @staticmethod
    def get_attention_ops() -> AttentionOps:
        """The kernels this backend calls: Triton's, where vLLM calls FlashAttention's."""
        return triton_attention_ops()

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
            # taken as one causal sequence (windowless). Only the cost matters, not the values.
            return self._forward_without_cache(query, key, value, output)
        key_cache, value_cache = kv_cache.unbind(0)
        ops = self.ops
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        n = attn_metadata.num_actual_tokens
        if not attn_metadata.use_cascade:
            _unified_attention(
                ops,
                attn_metadata.batch_split,
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
                window_size=self.sliding_window,
            )
            return output
        # The runner never cascades a windowed group (use_cascade_attention refuses it).
        assert self.sliding_window is None, "cascade attention has no sliding window"
        cascade_attention(
            output[:n],
            query[:n],
            key_cache,
            value_cache,
            cu_query_lens=attn_metadata.query_start_loc,
            max_query_len=attn_metadata.max_query_len,
            seq_lens=attn_metadata.seq_lens,
            max_kv_len=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            block_table=attn_metadata.block_table,
            common_prefix_len=attn_metadata.common_prefix_len,
            ops=ops,
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


def use_cascade_attention(
    common_prefix_len: int,
    query_lens: np.ndarray,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    use_local_attention: bool,
    num_sms: int,
) -> bool:
    """vLLM's rule for whether cascade attention should run this step.

    First the cheap refusals: a prefix under 256 tokens, attention variants the two-pass
    split does not handle, or fewer than 8 requests. Then, if the plain kernel would not
    run as flash-decoding (which needs grouped KV heads and a batch of pure decodes), the
    prefix pass saves memory traffic at no loss of parallelism: cascade. Otherwise both
    are estimated in waves of 128 x 128 tiles over the SMs, and the faster one wins:
    cascade gives each query head one program per 128 tokens, each looping over every
    prefix tile; flash-decoding gives every (request, KV head, prefix tile) its own program.
    """
    # BEGIN TASK ch07_t2: no short prefix, variant or small batch; then cascade unless flash-decoding wins
    if common_prefix_len < 256:
        return False
    if use_alibi or use_sliding_window or use_local_attention:
        return False
    num_reqs = len(query_lens)
    if num_reqs < 8:
        return False

    num_queries_per_kv = num_query_heads // num_kv_heads
    use_flash_decoding = num_queries_per_kv > 1 and bool(np.all(query_lens == 1))
    if not use_flash_decoding:
        return True

    q_tile_size = kv_tile_size = 128  # flash-attn's default tiles
    num_prefix_tiles = -(-common_prefix_len // kv_tile_size)
    # Decodes only, so one query token per request.
    cascade_ctas = num_query_heads * -(-num_reqs // q_tile_size)
    cascade_waves = -(-cascade_ctas // num_sms)
    cascade_time = cascade_waves * num_prefix_tiles  # each wave walks the whole prefix
    flash_decoding_ctas = num_reqs * num_kv_heads * -(-num_queries_per_kv // q_tile_size) * num_prefix_tiles
    flash_decoding_time = -(-flash_decoding_ctas // num_sms)  # each program handles one tile
    return cascade_time < flash_decoding_time
    # END TASK


def cascade_attention(
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    cu_query_lens: torch.Tensor,  # [num_reqs + 1] int32
    max_query_len: int,
    seq_lens: torch.Tensor,  # [num_reqs] int32: each request's whole context, prefix included
    max_kv_len: int,
    softmax_scale: float,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req] int32
    common_prefix_len: int,
    ops: AttentionOps,
) -> torch.Tensor:
    """Attention over a shared prefix plus per-request suffixes, in two passes and a merge.

    Every request's first `common_prefix_len` tokens (whole blocks) are the same blocks,
    and the prefix ends at or before every request's first query (the runner caps it by
    the smallest `num_computed_tokens`). Decide each pass's arguments to
    `ops.unified_attention` (query ranges `cu_seqlens_q`, key lengths `seqused_k`, block
    table, mask) so that the prefix is read once for the whole batch, and each request
    then attends to its own blocks after the prefix; ask each pass for its log-sum-exp
    (`return_lse=True`) and combine the two with `ops.merge_attn_states` into `output`.

    A varlen kernel (FlashAttention's, which vLLM calls here) sizes its grid and tiles by
    `max_seqlen_q` and `max_seqlen_k`: each must equal the longest query range and the
    longest key length of the pass it is given, no more and no less.
    """
    # BEGIN TASK ch07_t3: the prefix pass and the suffix pass, each with its own query ranges, key lengths and maxima; merge the two
    num_tokens = query.shape[0]
    block_size = key_cache.shape[1]
    assert common_prefix_len % block_size == 0, "the shared prefix is made of whole blocks"
    num_common_kv_blocks = common_prefix_len // block_size
    assert num_common_kv_blocks > 0
    common = {
        "q": query,
        "k_cache": key_cache,
        "v_cache": value_cache,
        "softmax_scale": softmax_scale,
        "return_lse": True,
    }
    # vLLM's builder makes these once per step; here every layer does, so they are filled on
    # the device: a copy from host memory would make the host wait for the GPU at every layer.
    cu_prefix_query_lens = torch.zeros(2, dtype=torch.int32, device=query.device)
    cu_prefix_query_lens[1] = num_tokens
    prefix_kv_lens = torch.full((1,), common_prefix_len, dtype=torch.int32, device=query.device)
    suffix_kv_lens = seq_lens - common_prefix_len

    prefix_output = torch.empty_like(query)
    prefix_lse = ops.unified_attention(
        out=prefix_output,
        cu_seqlens_q=cu_prefix_query_lens,
        max_seqlen_q=num_tokens,
        seqused_k=prefix_kv_lens,
        max_seqlen_k=common_prefix_len,
        causal=False,
        block_table=block_table[:1],
        **common,
    )
    suffix_output = torch.empty_like(query)
    suffix_lse = ops.unified_attention(
        out=suffix_output,
        cu_seqlens_q=cu_query_lens,
        max_seqlen_q=max_query_len,
        seqused_k=suffix_kv_lens,
        max_seqlen_k=max_kv_len - common_prefix_len,
        causal=True,
        block_table=block_table[:, num_common_kv_blocks:],  # a view: each row from its first suffix block
        **common,
    )
    ops.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)
    return output
    # END TASK
