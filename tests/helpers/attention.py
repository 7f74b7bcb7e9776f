"""Random ragged, paged attention batches and the float64 oracle the attention ops are tested against.

Shared by the reference ops' tests (chapter 01) and the Triton kernels' tests (chapter 06).

Oracle: for each request, keys and values laid out contiguously, an explicit causal mask,
and softmax in float64. The ops under test see the same data scattered across shuffled
cache blocks, in a ragged batch mixing prefills, prefill chunks in the middle of a context
and decodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


def random_batch(
    rng: np.random.Generator, num_reqs: int, max_context: int = 60, max_prefill: int = 40
) -> tuple[list[int], list[int]]:
    """(context_lens, query_lens): tokens already cached and this step's new tokens, per request."""
    kinds = rng.choice(["decode", "prefill", "chunk"], size=num_reqs)
    kinds[:4] = ["decode", "decode", "prefill", "chunk"]  # all three kinds, decodes of unequal length
    rng.shuffle(kinds)
    context_lens, query_lens = [], []
    for kind in kinds:
        if kind == "decode":
            context_lens.append(int(rng.integers(0, max_context)))
            query_lens.append(1)
        elif kind == "prefill":
            context_lens.append(0)
            query_lens.append(int(rng.integers(2, max_prefill)))
        else:  # a chunk in the middle of a longer prompt
            context_lens.append(int(rng.integers(1, max_context - 10)))
            query_lens.append(int(rng.integers(2, max_prefill - 10)))
    return context_lens, query_lens


@dataclass
class PagedBatch:
    """One step's ragged batch over a paged cache, with each request's K/V also kept contiguous.

    The cache holds every request's earlier context; this step's keys and values
    (`new_key`, `new_value`, one row per query token) are left for the op under test to
    write at `slot_mapping`. Every other cache slot is NaN, so reading one poisons the output.
    """

    context_lens: list[int]
    query_lens: list[int]
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_size]
    values: list[torch.Tensor]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, shuffled, rows padded with unused blocks
    slot_mapping: torch.Tensor  # [num_tokens] int64
    new_key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    new_value: torch.Tensor
    q: torch.Tensor  # [num_tokens, num_heads, head_size]
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    seqused_k: torch.Tensor  # [num_reqs] int32

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def write_new_tokens(self) -> None:
        """Write this step's keys and values into the cache directly (when that is not under test)."""
        num_kv_heads, head_size = self.new_key.shape[1:]
        self.key_cache.view(-1, num_kv_heads, head_size)[self.slot_mapping] = self.new_key
        self.value_cache.view(-1, num_kv_heads, head_size)[self.slot_mapping] = self.new_value

    def to(self, device: str | torch.device) -> PagedBatch:
        """The same batch with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def attention_args(self, q: torch.Tensor, out: torch.Tensor, causal: bool) -> tuple:
        """The positional arguments of `unified_attention(...)` for this batch."""
        return (
            q,
            self.key_cache,
            self.value_cache,
            out,
            self.cu_seqlens_q,
            max(self.query_lens),
            self.seqused_k,
            max(self.seq_lens),
            q.shape[2] ** -0.5,
            causal,
            self.block_table,
        )


def make_paged_batch(
    rng: np.random.Generator,
    context_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> PagedBatch:
    """Random K/V/Q for the given lengths, the earlier context scattered over shuffled blocks."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_reqs = len(seq_lens)
    # Shuffled, non-contiguous blocks; a few never used, and table rows padded with those.
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 4
    ids = rng.permutation(num_blocks)
    unused = ids[sum(blocks_needed) :]
    block_table = torch.tensor(rng.choice(unused, size=(num_reqs, max(blocks_needed) + 1)), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks_needed):
        block_table[r, :n] = torch.from_numpy(ids[start : start + n])
        start += n

    def slots(r: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.int64)
        return block_table[r, pos // block_size].long() * block_size + pos % block_size

    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    keys = [torch.randn(s, num_kv_heads, head_size, generator=generator).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_size, generator=generator).to(dtype) for s in seq_lens]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    for r, c in enumerate(context_lens):
        context_slots = slots(r, range(c))
        key_cache.view(-1, num_kv_heads, head_size)[context_slots] = keys[r][:c]
        value_cache.view(-1, num_kv_heads, head_size)[context_slots] = values[r][:c]
    num_tokens = sum(query_lens)
    return PagedBatch(
        context_lens=list(context_lens),
        query_lens=list(query_lens),
        keys=keys,
        values=values,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        slot_mapping=torch.cat([slots(r, range(context_lens[r], seq_lens[r])) for r in range(num_reqs)]),
        new_key=torch.cat([keys[r][context_lens[r] :] for r in range(num_reqs)]),
        new_value=torch.cat([values[r][context_lens[r] :] for r in range(num_reqs)]),
        q=torch.randn(num_tokens, num_kv_heads * group, head_size, generator=generator).to(dtype),
        cu_seqlens_q=torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32),
        seqused_k=torch.tensor(seq_lens, dtype=torch.int32),
    )


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    causal: bool,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of one request: q [Lq, Hq, D] over contiguous k, v [L, Hkv, D]; (out, lse [Hq, Lq]).

    With `window`, the query at position p sees only keys p - window + 1 .. p (chapter 12).
    """
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Lq, L]
    q_pos = context_len + torch.arange(q.shape[0])
    key_pos = torch.arange(k.shape[0])
    if causal:
        scores = scores.masked_fill(key_pos[None, :] > q_pos[:, None], float("-inf"))
    if window is not None:
        scores = scores.masked_fill(key_pos[None, :] <= q_pos[:, None] - window, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Lq]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse


def assert_matches_naive(
    batch: PagedBatch,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    causal: bool,
    atol: float,
    rtol: float,
    window: int | None = None,
) -> None:
    """Each request's rows of `out` (and `lse`) against `naive_attention` on its contiguous K/V."""
    scale = batch.q.shape[2] ** -0.5
    for r in range(len(batch.query_lens)):
        rows = slice(int(batch.cu_seqlens_q[r]), int(batch.cu_seqlens_q[r + 1]))
        ref_out, ref_lse = naive_attention(
            batch.q[rows], batch.keys[r], batch.values[r], batch.context_lens[r], scale, causal, window
        )
        what = (
            f"request {r} ({batch.query_lens[r]} queries after {batch.context_lens[r]} context tokens, "
            f"{'causal' if causal else 'not causal'})"
        )
        torch.testing.assert_close(
            out[rows].double(), ref_out, atol=atol, rtol=rtol,
            msg=lambda m, what=what: f"{what}: the output is not softmax attention over its context; {m}",
        )  # fmt: skip
        if lse is not None:
            torch.testing.assert_close(
                lse[:, rows].double(), ref_lse, atol=atol, rtol=rtol,
                msg=lambda m, what=what: f"{what}: the LSE is not the log-sum-exp of its scaled scores; {m}",
            )  # fmt: skip


def check_reshape_and_cache(reshape_and_cache_flash, batch: PagedBatch, num_padding_slots: int) -> None:
    """Write the batch's new K/V with `reshape_and_cache_flash`, with padding, and check every slot.

    `num_padding_slots` tokens marked -1 are spliced into the slot mapping, and three more
    rows past its end are appended to `key`/`value`: neither kind may be written. Every
    mapped slot must then hold its token exactly, and only mapped slots may have changed
    from NaN (which, with the earlier context, makes one written slot per context token).
    """
    num_kv_heads, head_size = batch.new_key.shape[1:]
    n, device = batch.num_tokens, batch.new_key.device
    positions = torch.randperm(n + num_padding_slots, device=device)[:num_padding_slots]  # the padding tokens
    is_padding = torch.zeros(n + num_padding_slots, dtype=torch.bool, device=device)
    is_padding[positions] = True
    slot_mapping = torch.full((n + num_padding_slots,), -1, dtype=torch.int64, device=device)
    slot_mapping[~is_padding] = batch.slot_mapping

    def with_padding(x: torch.Tensor) -> torch.Tensor:
        rows = torch.randn(n + num_padding_slots + 3, num_kv_heads, head_size, device=device).to(x.dtype)
        rows[: n + num_padding_slots][~is_padding] = x
        return rows

    reshape_and_cache_flash(
        with_padding(batch.new_key),
        with_padding(batch.new_value),
        batch.key_cache,
        batch.value_cache,
        slot_mapping,
    )
    for name, cache, new in (
        ("key", batch.key_cache, batch.new_key),
        ("value", batch.value_cache, batch.new_value),
    ):
        torch.testing.assert_close(
            cache.view(-1, num_kv_heads, head_size)[batch.slot_mapping], new, rtol=0, atol=0,
            msg=lambda m, name=name: f"each token's {name}, every head of it, must land in its slot; {m}",
        )  # fmt: skip
        written = ~cache.isnan().any(-1).any(-1).flatten()
        assert int(written.sum()) == sum(batch.seq_lens), (
            f"the op wrote {name} slots outside the slot mapping (a -1 slot or a row past it has no slot)"
        )


def poison_outside_windows(batch: PagedBatch, window: int) -> None:
    """Make every key older than each request's first query's window unreadable, as a sliding-window
    manager leaves it: NaN in those slots, and the blocks wholly before the window replaced in
    the block table by a never-written (NaN) block, as the null block replaces them."""
    num_kv_heads, head_size = batch.new_key.shape[1:]
    block_size = batch.key_cache.shape[1]
    for r, context_len in enumerate(batch.context_lens):
        first_key = max(0, context_len - window + 1)
        pos = torch.arange(first_key)
        slots = batch.block_table[r, pos // block_size].long() * block_size + pos % block_size
        for cache in (batch.key_cache, batch.value_cache):
            cache.view(-1, num_kv_heads, head_size)[slots] = float("nan")
        batch.block_table[r, : first_key // block_size] = batch.block_table[r, -1]  # an unused block: all NaN
