"""Write this step's keys and values into the paged KV cache, one Triton program per token.

Mirrors vllm/attention/ops/triton_reshape_and_cache_flash.py (chapter 06).

Why it exists: the reference (`nano_v1/attention/ops/reference.py::reshape_and_cache_flash`)
is one `index_copy_` per cache, but it must first drop the tokens without a slot (-1),
which on a GPU means a boolean index: a device-to-host sync to learn how many remain.
Here each program reads its own slot and returns early on -1, so the launch is the same
whatever the slots hold: grid = `len(slot_mapping)`, a host int from a shape, as a CUDA
graph needs.
"""

from __future__ import annotations

import torch

from nano_v1.triton_utils import tl, triton


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_actual_tokens] int64
    stride_key_tok: tl.int64,
    stride_key_head: tl.int64,
    stride_value_tok: tl.int64,
    stride_value_head: tl.int64,
    stride_cache_blk: tl.int64,
    stride_cache_pos: tl.int64,
    stride_cache_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,  # next power of two
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # next power of two
    BLOCK_SIZE: tl.constexpr,
):
    # BEGIN TASK ch06_t1: program t copies token t's keys and values to its slot; a slot of -1 is not written
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: it has no slot
    block_id = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]  # [H, D]
    cache_offs = (block_id * stride_cache_blk + in_block * stride_cache_pos
                  + offs_h[:, None] * stride_cache_head + offs_d[None, :])
    key = tl.load(key_ptr + token * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_offs, key, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :], mask=mask
    )
    tl.store(value_cache_ptr + cache_offs, value, mask=mask)
    # END TASK


def triton_reshape_and_cache_flash(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_actual_tokens] int64; -1 = no slot
) -> None:
    """Write token t's key and value to slot `slot_mapping[t]`; the reference's contract.

    Only the first `len(slot_mapping)` tokens are read; a slot of -1 is skipped.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_size = key_cache.shape
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride() == value_cache.stride()
    assert key_cache.stride(3) == 1
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
    )
