"""The reference paged attention ops against naive float64 attention on contiguous K/V.

Oracle: for each request, keys and values laid out contiguously, an explicit causal mask,
and softmax in float64. The ops under test see the same data scattered across shuffled
cache blocks, in a ragged batch mixing prefills, prefill chunks in the middle of a context
and decodes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nano_v1.attention.ops.reference import plan_batch_split, reshape_and_cache_flash, unified_attention

pytestmark = pytest.mark.ch01

NUM_KV_HEADS = 2
BLOCK_SIZE = 8


def _random_batch(rng: np.random.Generator, num_reqs: int) -> tuple[list[int], list[int]]:
    """(context_lens, query_lens): tokens already cached and this step's new tokens, per request."""
    kinds = rng.choice(["decode", "prefill", "chunk"], size=num_reqs)
    kinds[:4] = ["decode", "decode", "prefill", "chunk"]  # all three kinds, decodes of unequal length
    rng.shuffle(kinds)
    context_lens, query_lens = [], []
    for kind in kinds:
        if kind == "decode":
            context_lens.append(int(rng.integers(0, 60)))
            query_lens.append(1)
        elif kind == "prefill":
            context_lens.append(0)
            query_lens.append(int(rng.integers(2, 40)))
        else:  # a chunk in the middle of a longer prompt
            context_lens.append(int(rng.integers(1, 50)))
            query_lens.append(int(rng.integers(2, 30)))
    return context_lens, query_lens


def _naive_attention(q, k, v, context_len: int, scale: float, causal: bool):
    """float64 attention of one request: q [Lq, Hq, D] over contiguous k, v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Lq, L]
    if causal:
        q_pos = context_len + torch.arange(q.shape[0])
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Lq]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("return_lse", [True, False], ids=["explicit+lse", "sdpa"])
def test_paged_attention_matches_naive(seed, group, head_size, causal, return_lse):
    rng = np.random.default_rng(seed * 100 + group * 10 + head_size)
    torch.manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    context_lens, query_lens = _random_batch(rng, num_reqs=int(rng.integers(4, 9)))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_reqs = len(seq_lens)

    # Shuffled, non-contiguous blocks; a few never used, and table rows padded with those.
    blocks_needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 4
    ids = rng.permutation(num_blocks)
    unused = ids[sum(blocks_needed) :]
    max_blocks = max(blocks_needed) + 1
    block_table = torch.tensor(rng.choice(unused, size=(num_reqs, max_blocks)), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks_needed):
        block_table[r, :n] = torch.from_numpy(ids[start : start + n])
        start += n

    # Unwritten cache slots are NaN: any read of one would poison the output.
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    key_cache = torch.full(cache_shape, float("nan"))
    value_cache = torch.full(cache_shape, float("nan"))
    keys = [torch.randn(s, NUM_KV_HEADS, head_size) for s in seq_lens]
    values = [torch.randn(s, NUM_KV_HEADS, head_size) for s in seq_lens]

    def slot(r: int, pos: int) -> int:
        return int(block_table[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE

    # The context from earlier steps, written slot by slot; this step's tokens go through the op.
    for r, c in enumerate(context_lens):
        for pos in range(c):
            key_cache.view(-1, NUM_KV_HEADS, head_size)[slot(r, pos)] = keys[r][pos]
            value_cache.view(-1, NUM_KV_HEADS, head_size)[slot(r, pos)] = values[r][pos]
    slot_mapping = torch.tensor(
        [slot(r, p) for r in range(num_reqs) for p in range(context_lens[r], seq_lens[r])]
    )
    new_k = torch.cat([keys[r][context_lens[r] :] for r in range(num_reqs)])
    new_v = torch.cat([values[r][context_lens[r] :] for r in range(num_reqs)])
    padding = torch.randn(3, NUM_KV_HEADS, head_size)  # rows past the slot mapping: never written
    reshape_and_cache_flash(
        torch.cat([new_k, padding]), torch.cat([new_v, padding]), key_cache, value_cache, slot_mapping
    )
    torch.testing.assert_close(
        key_cache.view(-1, NUM_KV_HEADS, head_size)[slot_mapping], new_k, rtol=0, atol=0
    )
    torch.testing.assert_close(
        value_cache.view(-1, NUM_KV_HEADS, head_size)[slot_mapping], new_v, rtol=0, atol=0
    )
    written = ~key_cache.isnan().any(-1).any(-1).flatten()
    assert int(written.sum()) == sum(seq_lens), "the op wrote slots outside the slot mapping"

    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_size)
    out = torch.full_like(q, float("nan"))
    cu_seqlens_q = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    seqused_k = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_size**-0.5
    lse = unified_attention(
        q,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        max(query_lens),
        seqused_k,
        max(seq_lens),
        scale,
        causal,
        block_table,
        return_lse=return_lse,
    )

    for r in range(num_reqs):
        rows = slice(int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1]))
        ref_out, ref_lse = _naive_attention(q[rows], keys[r], values[r], context_lens[r], scale, causal)
        torch.testing.assert_close(out[rows].double(), ref_out, atol=1e-5, rtol=1e-5)
        if return_lse:
            torch.testing.assert_close(lse[:, rows].double(), ref_lse, atol=1e-5, rtol=1e-5)


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
