"""Paged attention in plain PyTorch: the reference every faster kernel is tested against.

Mirrors vllm/_custom_ops.py::reshape_and_cache_flash,
vllm/attention/ops/merge_attn_states.py::merge_attn_states and
vllm/attention/ops/triton_unified_attention.py::unified_attention (chapters 01 and 06).

Why it exists: the KV cache is a pool of fixed-size blocks, and one step's batch is ragged:
full prefills, chunks of long prompts and single-token decodes side by side, with no batch
dimension and no padding. These two functions are the whole contract between the model
and the cache: write this step's keys and values to their slots, then attend each query
to its request's context through the block table. A Triton kernel with the same signature
replaces `unified_attention` on a GPU; this version stays as the readable definition and is
the CPU path.

Layout: `key_cache`/`value_cache` are `[num_blocks, block_size, num_kv_heads, head_size]`;
token `t` of a request lives in block `block_table[req, t // block_size]` at offset
`t % block_size`, i.e. at slot `block_id * block_size + offset` of the flattened cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def reshape_and_cache_flash(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_actual_tokens] int64
) -> None:
    """Write each new token's key and value to its cache slot.

    Only the first `len(slot_mapping)` tokens are written: `key`/`value` may carry padding
    rows after them (as with CUDA graphs later), and those have no slot. A slot of -1 also
    means "no slot" (vLLM's mark for a padding token inside the mapping): it is skipped.
    """
    # BEGIN TASK ch01_t1: write each token's key and value to its slot; padding rows and -1 slots have none
    num_tokens = slot_mapping.shape[0]
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    has_slot = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[has_slot]
    # The cache seen as one long array of slots: [num_blocks * block_size, num_kv_heads, head_size].
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, key[:num_tokens][has_slot])
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, value[:num_tokens][has_slot])
    # END TASK


@dataclass(slots=True)
class BatchSplit:
    """Which requests of a step are decodes (one query) and which have several queries.

    Built on the host from CPU copies of the metadata, once per step, and shared by every
    layer: deciding the split from device tensors would stall the GPU in every layer.
    """

    decode_req_ids: torch.Tensor  # [num_decodes] int64, on the device
    decode_seq_lens_cpu: torch.Tensor  # [num_decodes] int64, on the host
    decode_token_ids: torch.Tensor  # [num_decodes] int64, on the device: each decode's query row
    max_decode_seq_len: int
    # (request index, first query row, one past the last query row, context length), on the host.
    prefills: list[tuple[int, int, int, int]]


def plan_batch_split(
    cu_seqlens_q_cpu: torch.Tensor, seqused_k_cpu: torch.Tensor, device: torch.device
) -> BatchSplit:
    """Split a ragged batch into vectorised decodes and looped multi-query requests."""
    cu = cu_seqlens_q_cpu.to(torch.int64)
    seq_lens = seqused_k_cpu.to(torch.int64)
    query_lens = cu[1:] - cu[:-1]  # [num_reqs]
    is_decode = query_lens == 1
    decode_req_ids = is_decode.nonzero().flatten()
    prefill_req_ids = (query_lens > 1).nonzero().flatten()
    prefills = list(
        zip(
            prefill_req_ids.tolist(),
            cu[prefill_req_ids].tolist(),
            cu[prefill_req_ids + 1].tolist(),
            seq_lens[prefill_req_ids].tolist(),
        )
    )
    return BatchSplit(
        decode_req_ids=decode_req_ids.to(device, non_blocking=True),
        decode_seq_lens_cpu=seq_lens[decode_req_ids],
        decode_token_ids=cu[decode_req_ids].to(device, non_blocking=True),
        max_decode_seq_len=int(seq_lens[decode_req_ids].max()) if len(decode_req_ids) else 0,
        prefills=prefills,
    )


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_ids: torch.Tensor,  # [..., num_pages]: one request's pages per row
    length: int,
    padding_rows: torch.Tensor | None = None,  # rows of the flat copy to zero (see below)
) -> torch.Tensor:
    """Copy `length` context tokens out of the pages listed in `block_ids`, as float32.

    When rows are padded to a common length, positions past a row's own context may hold
    anything (stale values of a freed block, or NaN if never written). `padding_rows`
    indexes them in the flat copy `[num_rows * num_pages * block_size]`; they are zeroed
    (written, never read: cheap), and the caller masks them out of the softmax too.
    """
    pages = cache.index_select(0, block_ids.flatten().long())  # [n, block_size, num_kv_heads, head_size]
    if padding_rows is not None:
        pages.view(-1, cache.shape[2] * cache.shape[3]).index_fill_(0, padding_rows, 0.0)
    pages = pages.view(*block_ids.shape, *cache.shape[1:])  # [..., num_pages, block_size, Hkv, D]
    flat = pages.flatten(-4, -3)  # [..., num_pages * block_size, num_kv_heads, head_size]
    return flat[..., :length, :, :].float()


def _attend(
    q: torch.Tensor,  # [..., num_kv_heads, group, num_q, head_size] float32
    k: torch.Tensor,  # [..., num_kv_heads, num_k, head_size] float32
    v: torch.Tensor,  # [..., num_kv_heads, num_k, head_size] float32
    masked: torch.Tensor,  # broadcastable to [..., num_kv_heads, group, num_q, num_k]; True = hidden
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with grouped KV heads; returns (output, log-sum-exp of the scores).

    The `group` query heads that share a KV head are stacked as extra query rows, so each
    KV head is multiplied once, never copied `group` times.
    """
    *batch, num_kv_heads, group, num_q, head_size = q.shape
    rows = q.reshape(*batch, num_kv_heads, group * num_q, head_size)
    scores = (rows @ k.transpose(-1, -2)) * softmax_scale  # [..., num_kv_heads, group * num_q, num_k]
    scores = scores.view(*batch, num_kv_heads, group, num_q, -1).masked_fill_(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [..., num_kv_heads, group, num_q, 1]
    probs = torch.exp(scores - lse).view(*batch, num_kv_heads, group * num_q, -1)
    out = probs @ v  # [..., num_kv_heads, group * num_q, head_size]
    return out.view(*batch, num_kv_heads, group, num_q, head_size), lse.squeeze(-1)


def _sdpa(
    q: torch.Tensor,  # [..., num_kv_heads, group, num_q, head_size] float32
    k: torch.Tensor,  # [..., num_kv_heads, num_k, head_size] float32
    v: torch.Tensor,  # [..., num_kv_heads, num_k, head_size] float32
    masked: torch.Tensor | None,  # broadcastable to [..., 1, num_q, num_k]; True = hidden
    softmax_scale: float,
) -> torch.Tensor:
    """The same attention as `_attend`, through PyTorch's fused kernel, without the LSE.

    On a CPU this is several times faster than the explicit softmax (one pass, no
    materialised probabilities), and it is what transformers itself runs.
    """
    *batch, num_kv_heads, group, num_q, head_size = q.shape
    o = F.scaled_dot_product_attention(
        q.reshape(*batch, num_kv_heads * group, num_q, head_size),
        k,
        v,
        attn_mask=None if masked is None else ~masked,
        scale=softmax_scale,
        enable_gqa=group > 1,
    )
    return o.view(*batch, num_kv_heads, group, num_q, head_size)


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32: query rows of each request
    max_seqlen_q: int,
    seqused_k: torch.Tensor,  # [num_reqs] int32: context length of each request, this step included
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req] int32
    *,
    return_lse: bool = False,
    split: BatchSplit | None = None,
) -> torch.Tensor | None:
    """Attention of a ragged batch of queries over a paged KV cache.

    Request r owns query rows `cu_seqlens_q[r]:cu_seqlens_q[r+1]`, the last `query_len`
    positions of its `seqused_k[r]`-token context, so with `causal` query i sits at position
    `seqused_k[r] - query_len + i` and sees keys 0..that position. A decode (query_len 1)
    sees its whole context either way.

    `split` is the host-side plan from `plan_batch_split`; without it one is made here
    (a device sync on a GPU). With `return_lse`, returns the log-sum-exp of the scaled
    scores, `[num_heads, num_tokens]` float32, which cascade attention needs to merge two
    partial attentions; rows of requests with no query are left unwritten.
    """
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    if split is None:
        split = plan_batch_split(cu_seqlens_q.cpu(), seqused_k.cpu(), q.device)
    lse = torch.empty(num_heads, q.shape[0], dtype=torch.float32, device=q.device) if return_lse else None

    # Decodes, all at once: gather every decode's pages, padded to the longest decode context.
    num_decodes = split.decode_req_ids.shape[0]
    if num_decodes:
        length = split.max_decode_seq_len
        num_pages = -(-length // block_size)
        block_ids = block_table[split.decode_req_ids, :num_pages]  # [num_decodes, num_pages]
        # Rows are padded to the longest context: the padding is zeroed and masked out.
        # Which rows of the gathered copy are padding is worked out on the host (no sync).
        padded = torch.arange(num_pages * block_size) >= split.decode_seq_lens_cpu[:, None]
        padding_rows = padded.flatten().nonzero().squeeze(1).to(q.device, non_blocking=True)
        seq_lens = seqused_k[split.decode_req_ids]
        padding = torch.arange(length, device=q.device) >= seq_lens[:, None]  # [num_decodes, length]
        k = _gather_context(k_cache, block_ids, length, padding_rows).transpose(1, 2)  # [num_decodes, Hkv, length, D]
        v = _gather_context(v_cache, block_ids, length, padding_rows).transpose(1, 2)
        q_dec = q[split.decode_token_ids].float()  # [num_decodes, num_heads, head_size]
        q_dec = q_dec.view(num_decodes, num_kv_heads, group, 1, head_size)
        if lse is None:
            o = _sdpa(q_dec, k, v, padding.view(num_decodes, 1, 1, length), softmax_scale)
        else:
            o, l = _attend(q_dec, k, v, padding.view(num_decodes, 1, 1, 1, length), softmax_scale)
            lse[:, split.decode_token_ids] = l.view(num_decodes, num_heads).T
        out[split.decode_token_ids] = o.view(num_decodes, num_heads, head_size).to(out.dtype)

    # Requests with several queries (prefills and prefill chunks), one at a time.
    # BEGIN TASK ch01_t2: attend each multi-query request over its paged context, query i at its own position
    for req, start, end, seq_len in split.prefills:
        query_len = end - start
        num_pages = -(-seq_len // block_size)
        k = _gather_context(k_cache, block_table[req, :num_pages], seq_len).transpose(0, 1)  # [Hkv, L, D]
        v = _gather_context(v_cache, block_table[req, :num_pages], seq_len).transpose(0, 1)
        q_req = q[start:end].float().view(query_len, num_kv_heads, group, head_size)
        q_req = q_req.permute(1, 2, 0, 3)  # [num_kv_heads, group, query_len, head_size]
        masked = None
        if causal:
            # Query i sits at position seq_len - query_len + i and sees keys up to it.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            masked = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]  # [query_len, L]
        if lse is None:
            o = _sdpa(q_req, k, v, masked, softmax_scale)
        else:
            no_mask = torch.zeros(1, 1, dtype=torch.bool, device=q.device)
            o, l = _attend(q_req, k, v, no_mask if masked is None else masked, softmax_scale)
            lse[:, start:end] = l.reshape(num_heads, query_len)
        out[start:end] = o.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_size).to(out.dtype)
    # END TASK
    return lse


def merge_attn_states(
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    prefix_output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    prefix_lse: torch.Tensor,  # [num_heads, num_tokens]
    suffix_output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    suffix_lse: torch.Tensor,  # [num_heads, num_tokens]
    output_lse: torch.Tensor | None = None,  # [num_heads, num_tokens], written in place if given
) -> None:
    """Combine two attentions over disjoint key sets into the attention over their union.

    Each part is softmax-normalised over its own keys; its log-sum-exp says how much
    probability mass it would hold in the joint softmax. So the union's output is the two
    outputs weighted by exp(lse) and renormalised. A part with no keys has an infinite LSE
    (+inf from some kernels, -inf from others); it gets weight 0, and if both parts are
    empty the output is 0 rather than NaN.
    """
    # BEGIN TASK ch07_t1: weight each part by its share exp(lse) of the joint softmax; an empty part weighs 0
    p_lse = prefix_lse.float().clone()
    s_lse = suffix_lse.float().clone()
    p_lse[p_lse == float("inf")] = float("-inf")
    s_lse[s_lse == float("inf")] = float("-inf")
    max_lse = torch.maximum(p_lse, s_lse)
    max_lse[max_lse == float("-inf")] = 0.0  # both empty: any finite shift will do
    p_weight = torch.exp(p_lse - max_lse)  # [num_heads, num_tokens]
    s_weight = torch.exp(s_lse - max_lse)
    total = p_weight + s_weight
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    p_scale = (p_weight / safe_total).T.unsqueeze(-1)  # [num_tokens, num_heads, 1]
    s_scale = (s_weight / safe_total).T.unsqueeze(-1)
    merged = prefix_output.float() * p_scale + suffix_output.float() * s_scale
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.log(total) + max_lse)
    # END TASK
