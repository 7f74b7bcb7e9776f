"""Paged attention in plain PyTorch: the reference every faster kernel is tested against.

Mirrors vllm/_custom_ops.py::reshape_and_cache_flash,
vllm/attention/ops/merge_attn_states.py::merge_attn_states and
vllm/attention/ops/triton_unified_attention.py::unified_attention (chapters 01, 06 and 12).

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

    Positions a row's query must not see may hold anything: past its own context when rows
    are padded to a common length (stale values of a freed block, or NaN if never
    written), or before its sliding window (a freed block). `padding_rows` indexes them in
    the flat copy `[num_rows * num_pages * block_size]`; they are zeroed (written, never
    read: cheap), and the caller masks them out of the softmax too.
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


def _hidden_keys(
    key_pos: torch.Tensor, q_pos: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor | None:
    """True where the query at `q_pos` must not see the key at `key_pos` (the two broadcast);
    None when every query sees every key.

    Causal: no key after the query. A window of w: no key more than w - 1 before it (the
    query sees w keys, its own included: vLLM's `window_size = (w - 1, 0)`).
    """
    hidden = key_pos > q_pos if causal else None
    if window is not None:
        outside = key_pos <= q_pos - window
        hidden = outside if hidden is None else hidden | outside
    return hidden


def _decode_pages(
    seq_lens_cpu: torch.Tensor, max_seq_len: int, block_size: int, window: int | None
) -> tuple[torch.Tensor, int]:
    """(first page each decode reads [num_decodes] int64, pages per decode), on the host.

    Without a window, every page from the first. With one, the w keys ending at the query
    start in page (seq_len - w) // block_size and span at most ceil((w - 1) / block_size) + 1
    pages; older pages are never read (a sliding-window manager has freed them).
    """
    num_pages = -(-max_seq_len // block_size)
    if window is None:
        return torch.zeros_like(seq_lens_cpu), num_pages
    first_pages = (seq_lens_cpu - window).clamp(min=0) // block_size
    return first_pages, min(num_pages, -(-(window - 1) // block_size) + 1)


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
    window_size: tuple[int, int] | None = None,
    return_lse: bool = False,
    split: BatchSplit | None = None,
) -> torch.Tensor | None:
    """Attention of a ragged batch of queries over a paged KV cache.

    Request r owns query rows `cu_seqlens_q[r]:cu_seqlens_q[r+1]`, the last `query_len`
    positions of its `seqused_k[r]`-token context, so with `causal` query i sits at position
    `seqused_k[r] - query_len + i` and sees keys 0..that position. A decode (query_len 1)
    sees its whole context either way.

    `window_size = (w - 1, 0)` (vLLM's convention; None: no window) limits each query to
    its last w keys, itself included. Keys older than the window of a request's first
    query are never read, and may hold anything: their blocks may be another request's by now.

    `split` is the host-side plan from `plan_batch_split`; without it one is made here
    (a device sync on a GPU). With `return_lse`, returns the log-sum-exp of the scaled
    scores, `[num_heads, num_tokens]` float32, which cascade attention needs to merge two
    partial attentions; rows of requests with no query are left unwritten.
    """
    window = None
    if window_size is not None:
        assert window_size[1] == 0, "a window reaches back only: the right edge is the query itself"
        window = window_size[0] + 1
    if split is None:
        split = plan_batch_split(cu_seqlens_q.cpu(), seqused_k.cpu(), q.device)
    num_heads = q.shape[1]
    lse = torch.empty(num_heads, q.shape[0], dtype=torch.float32, device=q.device) if return_lse else None
    if split.decode_req_ids.shape[0]:
        _attend_decodes(q, k_cache, v_cache, out, lse, softmax_scale, block_table, window, split)
    for req, start, end, seq_len in split.prefills:
        _attend_prefill(
            q, k_cache, v_cache, out, lse, softmax_scale, causal, block_table[req], window, start, end, seq_len
        )
    return lse


def _attend_decodes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    softmax_scale: float, block_table: torch.Tensor, window: int | None, split: BatchSplit,
) -> None:
    """Every decode at once: gather each one's pages, padded to the longest, and attend.

    Tensors as in `unified_attention` (`lse` None unless it is returned).

    The gathered positions a decode must not see (past its context, or before its window)
    are zeroed and masked out; which they are is worked out on the host (no sync).
    """
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_decodes = split.decode_req_ids.shape[0]
    seq_lens_cpu = split.decode_seq_lens_cpu
    first_pages, num_pages = _decode_pages(seq_lens_cpu, split.max_decode_seq_len, block_size, window)
    # Pages past a short decode's last one are clamped into the table; they are all hidden.
    page_ids = (first_pages[:, None] + torch.arange(num_pages)).clamp(max=block_table.shape[1] - 1)
    key_pos = first_pages[:, None] * block_size + torch.arange(num_pages * block_size)  # [num_decodes, P*B]
    hidden_cpu = _hidden_keys(key_pos, seq_lens_cpu[:, None] - 1, True, window)  # [num_decodes, P*B]
    padding_rows = hidden_cpu.flatten().nonzero().squeeze(1).to(q.device, non_blocking=True)
    length = split.max_decode_seq_len if window is None else num_pages * block_size
    hidden = hidden_cpu[:, :length].to(q.device, non_blocking=True)  # [num_decodes, length]
    block_ids = block_table[split.decode_req_ids[:, None], page_ids.to(q.device, non_blocking=True)]
    k = _gather_context(k_cache, block_ids, length, padding_rows).transpose(1, 2)  # [num_decodes, Hkv, length, D]
    v = _gather_context(v_cache, block_ids, length, padding_rows).transpose(1, 2)
    q_dec = q[split.decode_token_ids].float()  # [num_decodes, num_heads, head_size]
    q_dec = q_dec.view(num_decodes, num_kv_heads, group, 1, head_size)
    if lse is None:
        o = _sdpa(q_dec, k, v, hidden.view(num_decodes, 1, 1, length), softmax_scale)
    else:
        o, l = _attend(q_dec, k, v, hidden.view(num_decodes, 1, 1, 1, length), softmax_scale)
        lse[:, split.decode_token_ids] = l.view(num_decodes, num_heads).T
    out[split.decode_token_ids] = o.view(num_decodes, num_heads, head_size).to(out.dtype)


def _attend_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    softmax_scale: float, causal: bool, block_row: torch.Tensor, window: int | None,
    start: int, end: int, seq_len: int,
) -> None:
    """One request with several queries (a prefill or a chunk of one): query rows start..end.

    Tensors as in `unified_attention`; `block_row` is this request's row of the block table.
    Its keys are gathered from the page of the first query's oldest visible key; rows of
    that page before the key are zeroed (they may be stale) and hidden like the rest.
    """
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    query_len = end - start
    first_key = 0 if window is None else max(0, seq_len - query_len - window + 1)
    first_page = first_key // block_size
    key_start = first_page * block_size  # position of the first gathered key
    stale_rows = torch.arange(first_key - key_start, device=q.device) if first_key > key_start else None
    pages = block_row[first_page : -(-seq_len // block_size)]
    k = _gather_context(k_cache, pages, seq_len - key_start, stale_rows).transpose(0, 1)  # [Hkv, L, D]
    v = _gather_context(v_cache, pages, seq_len - key_start, stale_rows).transpose(0, 1)
    # BEGIN TASK ch01_t2: attend the request's queries over its gathered keys, query i at its own position
    q_req = q[start:end].float().view(query_len, num_kv_heads, num_heads // num_kv_heads, head_size)
    q_req = q_req.permute(1, 2, 0, 3)  # [num_kv_heads, group, query_len, head_size]
    # Query i sits at position seq_len - query_len + i.
    q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
    key_pos = torch.arange(key_start, seq_len, device=q.device)
    masked = _hidden_keys(key_pos[None, :], q_pos[:, None], causal, window)  # [query_len, L] or None
    if lse is None:
        o = _sdpa(q_req, k, v, masked, softmax_scale)
    else:
        no_mask = torch.zeros(1, 1, dtype=torch.bool, device=q.device)
        o, l = _attend(q_req, k, v, no_mask if masked is None else masked, softmax_scale)
        lse[:, start:end] = l.reshape(num_heads, query_len)
    out[start:end] = o.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_size).to(out.dtype)
    # END TASK


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
