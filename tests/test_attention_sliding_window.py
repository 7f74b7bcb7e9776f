"""Sliding-window attention (chapter 12): the reference and the Triton kernel against float64.

The oracle is tests/helpers/attention.py's float64 attention with a window mask (query at p
sees keys p - w + 1 .. p). The batches mix decodes, prefills and chunks, with windows
shorter and longer than the contexts and than a block. Everything older than each
request's first query's window is made unreadable, as a sliding-window KV cache manager
leaves it: NaN in the slots, and whole blocks swapped for a NaN block in the block table,
so a kernel that reads outside the window poisons its output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.attention import assert_matches_naive, make_paged_batch, poison_outside_windows, random_batch

from nano_v1.attention.ops import reference
from nano_v1.attention.ops.triton_unified_attention import unified_attention as triton_unified_attention

pytestmark = pytest.mark.ch12

NUM_KV_HEADS = 2


def windowed_batch(seed: int, group: int, head_size: int, block_size: int, window: int, dtype=torch.float32):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    lens = random_batch(rng, int(rng.integers(4, 8)), max_context=48, max_prefill=24)
    batch = make_paged_batch(rng, *lens, NUM_KV_HEADS, group, head_size, block_size, dtype)
    batch.write_new_tokens()
    poison_outside_windows(batch, window)
    return batch


@pytest.mark.parametrize("return_lse", [True, False], ids=["explicit+lse", "sdpa"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 3, 8, 20, 200])
def test_reference_with_a_window_matches_float64(window, block_size, group, return_lse):
    batch = windowed_batch(window * 10 + block_size + group, group, 64, block_size, window)
    out = torch.full_like(batch.q, float("nan"))
    lse = reference.unified_attention(
        *batch.attention_args(batch.q, out, causal=True), window_size=(window - 1, 0), return_lse=return_lse
    )
    assert_matches_naive(batch, out, lse, causal=True, atol=1e-5, rtol=1e-5, window=window)


def test_the_window_changes_the_answer():
    """A window shorter than the contexts must matter, or the tests above test nothing."""
    batch = windowed_batch(1, 2, 64, 4, window=200)  # nothing poisoned: every context is shorter
    windowed, full = torch.full_like(batch.q, float("nan")), torch.full_like(batch.q, float("nan"))
    reference.unified_attention(*batch.attention_args(batch.q, windowed, True), window_size=(5, 0))
    reference.unified_attention(*batch.attention_args(batch.q, full, True))
    assert not torch.allclose(windowed, full)


# (dtype, GQA group, head size, block size, window): both tile sizes, windows inside one tile
# and across several, a window beyond every context.
TRITON_CASES = [
    (torch.float32, 2, 64, 16, 5),
    (torch.float32, 1, 64, 4, 13),
    (torch.float16, 4, 64, 16, 40),
    (torch.bfloat16, 2, 128, 16, 1),
    (torch.float32, 2, 64, 16, 500),
]
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "case", TRITON_CASES, ids=[f"{str(d)[6:]}-g{g}-d{h}-b{b}-w{w}" for d, g, h, b, w in TRITON_CASES]
)
def test_triton_with_a_window_matches_float64(case):
    dtype, group, head_size, block_size, window = case
    batch = windowed_batch(TRITON_CASES.index(case), group, head_size, block_size, window, dtype)
    out = torch.full_like(batch.q, float("nan"))
    lse = triton_unified_attention(
        *batch.attention_args(batch.q, out, causal=True), window_size=(window - 1, 0), return_lse=True
    )
    tol = TOLERANCES[dtype]
    assert_matches_naive(batch, out, lse, causal=True, atol=tol, rtol=tol, window=window)


def test_triton_decodes_with_a_window_match_the_reference():
    """A pure decode batch (the 16-key tile) over long contexts, window off the block grid."""
    rng = np.random.default_rng(5)
    context_lens = rng.integers(0, 90, size=6).tolist()
    batch = make_paged_batch(rng, context_lens, [1] * 6, NUM_KV_HEADS, 2, 64, 16)
    batch.write_new_tokens()
    poison_outside_windows(batch, 21)
    out, ref = torch.full_like(batch.q, float("nan")), torch.full_like(batch.q, float("nan"))
    triton_unified_attention(*batch.attention_args(batch.q, out, True), window_size=(20, 0))
    reference.unified_attention(*batch.attention_args(batch.q, ref, True), window_size=(20, 0))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_matches_naive(batch, out, None, causal=True, atol=1e-5, rtol=1e-5, window=21)
