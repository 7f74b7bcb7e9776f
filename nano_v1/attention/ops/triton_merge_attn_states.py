"""Merge two partial attentions by their log-sum-exp, one Triton program per (token, head).

Mirrors vllm/attention/ops/triton_merge_attn_states.py (chapters 06 and 07).

Why it exists: cascade attention (chapter 07) attends once to a shared prefix and once
to each request's own suffix, and must combine the two. The reference
(`nano_v1/attention/ops/reference.py::merge_attn_states`) does it in about ten PyTorch
ops, each a pass over the outputs; this kernel reads both outputs and LSEs once and
writes the result once. The arithmetic, and the handling of empty parts, is the
reference's: an infinite LSE (+inf or -inf) is a part with no keys, weight 0, and two
empty parts give 0, not NaN.
"""

from __future__ import annotations

import torch

from nano_v1.triton_utils import tl, triton


@triton.jit
def _merge_attn_states_kernel(
    output_ptr,  # [num_tokens, num_heads, head_size]
    output_lse_ptr,  # [num_heads, num_tokens] float32 (unused unless OUTPUT_LSE)
    prefix_output_ptr,  # [num_tokens, num_heads, head_size]
    prefix_lse_ptr,  # [num_heads, num_tokens]
    suffix_output_ptr,  # [num_tokens, num_heads, head_size]
    suffix_lse_ptr,  # [num_heads, num_tokens]
    stride_out_tok: tl.int64,
    stride_out_head: tl.int64,
    stride_prefix_tok: tl.int64,
    stride_prefix_head: tl.int64,
    stride_suffix_tok: tl.int64,
    stride_suffix_head: tl.int64,
    stride_prefix_lse_head: tl.int64,
    stride_suffix_lse_head: tl.int64,
    stride_out_lse_head: tl.int64,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # next power of two
    OUTPUT_LSE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    p_lse = tl.load(prefix_lse_ptr + head * stride_prefix_lse_head + token).to(tl.float32)
    s_lse = tl.load(suffix_lse_ptr + head * stride_suffix_lse_head + token).to(tl.float32)
    # Either infinity means "no keys": make it -inf, whose weight exp(-inf) is 0.
    p_lse = tl.where(p_lse == float("inf"), float("-inf"), p_lse)
    s_lse = tl.where(s_lse == float("inf"), float("-inf"), s_lse)
    max_lse = tl.maximum(p_lse, s_lse)
    max_lse = tl.where(max_lse == float("-inf"), 0.0, max_lse)  # both empty: any finite shift
    # Weights relative to the larger part, so the larger weight is exactly 1: no overflow.
    p_weight = tl.exp(p_lse - max_lse)
    s_weight = tl.exp(s_lse - max_lse)
    total = p_weight + s_weight
    safe_total = tl.where(total > 0.0, total, 1.0)
    if OUTPUT_LSE:
        out_lse = tl.where(total > 0.0, tl.log(safe_total) + max_lse, float("-inf"))
        tl.store(output_lse_ptr + head * stride_out_lse_head + token, out_lse)

    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    mask = offs_d < HEAD_SIZE
    p_out = tl.load(prefix_output_ptr + token * stride_prefix_tok + head * stride_prefix_head + offs_d, mask=mask)
    s_out = tl.load(suffix_output_ptr + token * stride_suffix_tok + head * stride_suffix_head + offs_d, mask=mask)
    # Scale factors first, then the outputs: exp(lse) itself could overflow.
    merged = p_out.to(tl.float32) * (p_weight / safe_total) + s_out.to(tl.float32) * (s_weight / safe_total)
    tl.store(output_ptr + token * stride_out_tok + head * stride_out_head + offs_d,
             merged.to(output_ptr.dtype.element_ty), mask=mask)


def merge_attn_states(
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    prefix_output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    prefix_lse: torch.Tensor,  # [num_heads, num_tokens]
    suffix_output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    suffix_lse: torch.Tensor,  # [num_heads, num_tokens]
    output_lse: torch.Tensor | None = None,  # [num_heads, num_tokens], written in place if given
) -> None:
    """Combine two attentions over disjoint key sets into the attention over their union; the reference's contract."""
    num_tokens, num_heads, head_size = output.shape
    if num_tokens == 0:
        return
    for t in (output, prefix_output, suffix_output):
        assert t.stride(2) == 1
    for t in (prefix_lse, suffix_lse) + ((output_lse,) if output_lse is not None else ()):
        assert t.stride(1) == 1
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse,
        output.stride(0), output.stride(1),
        prefix_output.stride(0), prefix_output.stride(1),
        suffix_output.stride(0), suffix_output.stride(1),
        prefix_lse.stride(0), suffix_lse.stride(0), output_lse.stride(0) if output_lse is not None else 0,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        OUTPUT_LSE=output_lse is not None,
    )
