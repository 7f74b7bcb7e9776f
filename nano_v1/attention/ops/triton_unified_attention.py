"""Paged attention of a ragged batch (prefills, prefill chunks and decodes together) in one Triton kernel.

Mirrors vllm/attention/ops/triton_unified_attention.py (chapters 06 and 12).

Why it exists: the reference (`nano_v1/attention/ops/reference.py::unified_attention`)
gathers each request's pages into a contiguous copy, then attends: every byte of context
is read, written and read again, and decodes and prefills need a host-side plan to be
batched. This kernel reads each page straight from the cache through the block table,
once per KV head, and keeps the softmax running in registers (online softmax), so a
request of any length costs one pass over its KV and no temporary copy. One launch
serves the whole ragged batch: each program finds its request by a binary search over
`cu_seqlens_q` on the device, so the launch grid depends only on shapes, never on the
values of device tensors. That is what lets a CUDA graph capture it (chapter 08).

Work split: one program per (block of query rows of one request, KV head). The query
heads that share a KV head (GQA) are packed into the rows of the same program, so the
program loads each K/V tile once for all of them. `BLOCK_M` rows = `BLOCK_Q` query
positions x `group` heads; `tl.dot` wants at least 16 rows, hence `BLOCK_M >= 16`.

Sliding window (chapter 12): a query at position p sees keys p - w + 1 .. p. A program
starts its loop at the tile of its first row's oldest visible key, so a window costs
O(w) per query however long the context, and never loads a key older than that: those
blocks may already belong to another request.
"""

from __future__ import annotations

import torch

from nano_v1.triton_utils import tl, triton


@triton.jit
def _find_seq_idx(cu_seqlens_q_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The request that owns global query block `q_block_idx` (binary search on the device).

    Request r's query blocks are numbered from `cu_seqlens_q[r] // BLOCK_Q + r`: that
    leaves each request at least `ceil(query_len / BLOCK_Q)` numbers, never fewer, so the
    search needs no per-request block counts from the host. Returns the last r whose first
    block number is <= `q_block_idx`.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    lse_ptr,  # [num_heads, num_tokens] float32 (unused unless RETURN_LSE)
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seqused_k_ptr,  # [num_seqs] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    num_seqs,
    softmax_scale,
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_out_tok: tl.int64,
    stride_out_head: tl.int64,
    stride_lse_head: tl.int64,
    stride_k_blk: tl.int64,
    stride_k_pos: tl.int64,
    stride_k_head: tl.int64,
    stride_v_blk: tl.int64,
    stride_v_pos: tl.int64,
    stride_v_head: tl.int64,
    stride_bt: tl.int64,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # next power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_SIZE: tl.constexpr,  # keys per loop step
    BLOCK_Q: tl.constexpr,  # query positions per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q positions x GROUP heads
    CAUSAL: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # keys a query sees, its own included; 0: no window (vLLM's encoding)
    RETURN_LSE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # q's dtype, except bfloat16 in the interpreter (`_dot_dtype`)
    DOT_PRECISION: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq_idx = _find_seq_idx(cu_seqlens_q_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    query_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    local_block = q_block_idx - (q_start // BLOCK_Q + seq_idx)
    if local_block * BLOCK_Q >= query_len:
        return  # a spare program of the upper-bound grid, or padding past the last request

    # Row m of this program is query position local_block * BLOCK_Q + m // GROUP of the
    # request, query head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    query_pos = local_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M]
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_mask = query_pos < query_len
    dim_mask = offs_d < HEAD_SIZE
    token = q_start + query_pos  # [BLOCK_M] row of q / out
    q_offs = token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    Q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, D]

    seq_len = tl.load(seqused_k_ptr + seq_idx)
    context_len = seq_len - query_len  # keys before this step's first query
    if CAUSAL:
        # The last query row here sees keys up to its own position; later tiles are all masked.
        last_pos = tl.minimum(local_block * BLOCK_Q + (BLOCK_M - 1) // GROUP, query_len - 1)
        num_keys = context_len + last_pos + 1
    else:
        num_keys = seq_len
    # The oldest key any row of this program sees: its first query's window start.
    first_key = 0
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(context_len + local_block * BLOCK_Q - SLIDING_WINDOW + 1, 0)

    # Online softmax: running max M, running sum L of exp(score - M), and the output
    # accumulated unnormalised, all in float32; each tile rescales them by exp(M_old - M_new).
    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    bt_row = block_table_ptr + seq_idx * stride_bt

    for tile_start in range(first_key // TILE_SIZE * TILE_SIZE, num_keys, TILE_SIZE):
        key_pos = tile_start + offs_t  # [TILE_SIZE]
        key_mask = key_pos < num_keys
        if SLIDING_WINDOW > 0:  # without a window, no lower bound: one mask fewer to hold in registers
            key_mask = key_mask & (key_pos >= first_key)
        block_id = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        k_offs = (block_id[None, :] * stride_k_blk + in_block[None, :] * stride_k_pos
                  + kv_head * stride_k_head + offs_d[:, None])
        K = tl.load(k_cache_ptr + k_offs, mask=dim_mask[:, None] & key_mask[None, :], other=0.0)  # [D, TILE]
        K = K.to(DOT_DTYPE)
        v_offs = (block_id[:, None] * stride_v_blk + in_block[:, None] * stride_v_pos
                  + kv_head * stride_v_head + offs_d[None, :])
        V = tl.load(v_cache_ptr + v_offs, mask=key_mask[:, None] & dim_mask[None, :], other=0.0)  # [TILE, D]
        V = V.to(DOT_DTYPE)

        S = tl.dot(Q, K, input_precision=DOT_PRECISION) * softmax_scale  # [BLOCK_M, TILE]
        visible = row_mask[:, None] & key_mask[None, :]
        if CAUSAL:
            visible = visible & (key_pos[None, :] <= context_len + query_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (context_len + query_pos[:, None] - key_pos[None, :] < SLIDING_WINDOW)
        S = tl.where(visible, S, float("-inf"))

        # BEGIN TASK ch06_t2: fold the tile into the running max, sum and output, rescaling what came before
        M_new = tl.maximum(M, tl.max(S, axis=1))
        # A row with no visible key yet (padding rows) keeps M = -inf; shift by 0 instead of NaN.
        M_safe = tl.where(M_new > float("-inf"), M_new, 0.0)
        P = tl.exp(S - M_safe[:, None])  # [BLOCK_M, TILE]
        alpha = tl.exp(M - M_safe)
        L = L * alpha + tl.sum(P, axis=1)
        acc = acc * alpha[:, None] + tl.dot(P.to(DOT_DTYPE), V, input_precision=DOT_PRECISION)
        M = M_new
        # END TASK

    # A row that saw no key at all (an empty context) gets output 0 and LSE -inf.
    safe_L = tl.where(L > 0.0, L, 1.0)
    out = acc / safe_L[:, None]
    out_offs = token[:, None] * stride_out_tok + head[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
    if RETURN_LSE:
        lse = tl.where(L > 0.0, M + tl.log(safe_L), float("-inf"))
        tl.store(lse_ptr + head * stride_lse_head + token, lse, mask=row_mask)


def _dot_dtype(q: torch.Tensor) -> tl.dtype:
    """The dtype the tiles are multiplied in: q's own (tensor cores take fp16/bf16 as they are).

    On a CPU the kernel runs in Triton's interpreter, whose numpy arithmetic has no
    bfloat16: there bf16 tiles are multiplied as float32 (loads and stores stay bf16).
    """
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[q.dtype]


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
) -> torch.Tensor | None:
    """Attention of a ragged batch over a paged KV cache; the reference's contract, in one launch.

    `window_size = (w - 1, 0)`: each query sees its last w keys (None: no window).

    Rows of `q` past `cu_seqlens_q[-1]` (CUDA-graph padding) are neither read nor written.
    With `return_lse`, returns the log-sum-exp of the scaled scores, `[num_heads,
    num_tokens]` float32 (rows past `cu_seqlens_q[-1]` unwritten). Nothing here reads a
    device tensor on the host: the grid is `num_tokens // BLOCK_Q + num_reqs` query
    blocks (an upper bound of the blocks the requests need; spare programs exit at once)
    times `num_kv_heads`.
    """
    num_tokens, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    # Rows may be views (cascade slices columns off the front); within a row, pages are contiguous.
    assert block_table.stride(1) == 1
    assert window_size is None or window_size[1] == 0, "a window reaches back only"
    group = num_heads // num_kv_heads
    num_seqs = cu_seqlens_q.shape[0] - 1
    block_m = max(16, triton.next_power_of_2(group))
    block_q = block_m // group
    # Keys per loop step, vLLM's defaults: 32 when some request has several queries, 16 (the
    # smallest tile `tl.dot` takes) for a pure decode batch. A host int: no device read.
    tile_size = 32 if max_seqlen_q > 1 else 16
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device) if return_lse else None

    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out, lse, q, k_cache, v_cache, block_table, seqused_k, cu_seqlens_q,
        num_seqs, softmax_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0) if return_lse else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        TILE_SIZE=tile_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        CAUSAL=causal,
        SLIDING_WINDOW=0 if window_size is None else window_size[0] + 1,
        RETURN_LSE=return_lse,
        DOT_DTYPE=_dot_dtype(q),
        # float32 tiles would be rounded to TF32 on tensor cores by default: ask for full precision.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return lse
