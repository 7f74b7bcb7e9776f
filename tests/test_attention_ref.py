"""The reference paged attention ops against naive float64 attention on contiguous K/V.

The batches and the oracle are in tests/helpers/attention.py: ragged batches mixing
prefills, prefill chunks in the middle of a context and decodes, scattered over shuffled
cache blocks, against float64 attention on each request's contiguous keys and values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.attention import assert_matches_naive, check_reshape_and_cache, make_paged_batch, random_batch

from nano_v1.attention.ops.reference import plan_batch_split, reshape_and_cache_flash, unified_attention

pytestmark = pytest.mark.ch01

NUM_KV_HEADS = 2
BLOCK_SIZE = 8


@pytest.mark.ch01_t1
@pytest.mark.parametrize("num_padding_slots", [0, 3])
def test_reshape_and_cache_flash_writes_exactly_the_mapped_slots(num_padding_slots):
    """Rule: «Only the first `len(slot_mapping)` tokens are written», each to its slot, and «A slot of -1 also
    means "no slot"»: every other slot of the cache keeps what it held."""
    rng = np.random.default_rng(num_padding_slots)
    torch.manual_seed(num_padding_slots)
    batch = make_paged_batch(rng, *random_batch(rng, num_reqs=6), NUM_KV_HEADS, 2, 64, BLOCK_SIZE)
    check_reshape_and_cache(reshape_and_cache_flash, batch, num_padding_slots=num_padding_slots)


@pytest.mark.ch01_t2
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("return_lse", [True, False], ids=["explicit+lse", "sdpa"])
def test_paged_attention_matches_naive(seed, group, head_size, causal, return_lse):
    """Rule: each request's queries attend over its keys gathered from its pages, «query i at its own
    position» (causal), as naive attention over the contiguous context does."""
    rng = np.random.default_rng(seed * 100 + group * 10 + head_size)
    torch.manual_seed(seed)
    context_lens, query_lens = random_batch(rng, num_reqs=int(rng.integers(4, 9)))
    batch = make_paged_batch(rng, context_lens, query_lens, NUM_KV_HEADS, group, head_size, BLOCK_SIZE)
    # This step's tokens go through the op, with padding rows that have no slot (-1 or none at all).
    check_reshape_and_cache(reshape_and_cache_flash, batch, num_padding_slots=seed)

    out = torch.full_like(batch.q, float("nan"))
    lse = unified_attention(*batch.attention_args(batch.q, out, causal), return_lse=return_lse)
    assert_matches_naive(batch, out, lse, causal, atol=1e-5, rtol=1e-5)


def test_batch_split_puts_decodes_together():
    # Requests: decode, prefill of 3, decode, a chunk of 2 after 5 cached tokens.
    split = plan_batch_split(
        torch.tensor([0, 1, 4, 5, 7], dtype=torch.int32),
        torch.tensor([9, 3, 1, 7], dtype=torch.int32),
        torch.device("cpu"),
    )
    assert split.decode_req_ids.tolist() == [0, 2]
    assert split.decode_token_ids.tolist() == [0, 4]
    assert split.max_decode_seq_len == 9
    assert split.prefills == [(1, 1, 4, 3), (3, 5, 7, 7)]
