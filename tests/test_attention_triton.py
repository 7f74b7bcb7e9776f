"""The Triton attention kernels against float64 attention, in Triton's interpreter on a CPU.

Each kernel sees fresh random ragged batches (tests/helpers/attention.py): prefills, prefill
chunks and decodes together over shuffled cache blocks, GQA groups 1/2/4, head sizes 64
and 128, causal or not, float32/float16/bfloat16. Outputs start as NaN, so an element the
kernel should write and does not fails the comparison; padding rows must stay NaN.
Sizes are small because the interpreter runs each program in Python.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.attention import (
    assert_matches_naive,
    check_reshape_and_cache,
    make_paged_batch,
    naive_attention,
    random_batch,
)

from nano_v1.attention.ops import reference
from nano_v1.attention.ops.triton_merge_attn_states import merge_attn_states
from nano_v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
from nano_v1.attention.ops.triton_unified_attention import unified_attention

pytestmark = pytest.mark.ch06

NUM_KV_HEADS = 2
BLOCK_SIZE = 16
# (atol, rtol) against float64: the inputs are rounded to the dtype, the kernel accumulates
# in float32, and the output is rounded to the dtype (and P to it before the PV product).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _decode_only(rng: np.random.Generator, num_reqs: int) -> tuple[list[int], list[int]]:
    """A pure decode batch: contexts of several 16-key tiles, one query each."""
    return rng.integers(0, 70, size=num_reqs).tolist(), [1] * num_reqs


def _with_padding(batch, num_padding_reqs: int, num_padding_rows: int) -> dict:
    """The batch as a CUDA graph would launch it: empty requests and spare query rows appended.

    A padding request has no query (`cu_seqlens_q` repeats its last entry) and no context;
    the spare rows of `q` and `out` belong to no request.
    """
    cu = torch.cat([batch.cu_seqlens_q, batch.cu_seqlens_q[-1:].repeat(num_padding_reqs)])
    seqused_k = torch.cat([batch.seqused_k, torch.zeros(num_padding_reqs, dtype=torch.int32)])
    block_table = torch.cat([batch.block_table, batch.block_table[:1].repeat(num_padding_reqs, 1)])
    q = torch.cat([batch.q, torch.randn(num_padding_rows, *batch.q.shape[1:]).to(batch.q.dtype)])
    return {"q": q, "cu_seqlens_q": cu, "seqused_k": seqused_k, "block_table": block_table}


# (dtype, GQA group, head size, causal, pure decode): every dtype, group and head size, and
# both tile sizes (32 keys when some request has several queries, 16 for pure decode).
CASES = [
    (torch.float32, 1, 64, True, False),
    (torch.float32, 4, 128, False, False),
    (torch.float32, 2, 128, True, True),
    (torch.float16, 2, 64, True, False),
    (torch.float16, 1, 128, False, False),
    (torch.bfloat16, 4, 64, True, False),
    (torch.bfloat16, 2, 128, True, False),
    (torch.bfloat16, 4, 128, True, True),
]


@pytest.mark.ch06_t2
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        f"{DTYPE_IDS[d]}-g{g}-d{h}-{'causal' if c else 'noncausal'}{'-decode' if dec else ''}"
        for d, g, h, c, dec in CASES
    ],
)
def test_unified_attention_matches_float64(case):
    """Rule: «fold the tile into the running max, sum and output, rescaling what came before»: the result is
    attention in float64, to float32's precision, with and without the LSE."""
    dtype, group, head_size, causal, decode_only = case
    rng = np.random.default_rng(CASES.index(case))
    torch.manual_seed(CASES.index(case))
    lens = _decode_only(rng, 6) if decode_only else random_batch(rng, 5, max_context=48, max_prefill=24)
    batch = make_paged_batch(rng, *lens, NUM_KV_HEADS, group, head_size, BLOCK_SIZE, dtype)
    batch.write_new_tokens()
    padded = _with_padding(batch, num_padding_reqs=2, num_padding_rows=3)
    out = torch.full_like(padded["q"], float("nan"))

    lse = unified_attention(
        padded["q"],
        batch.key_cache,
        batch.value_cache,
        out,
        padded["cu_seqlens_q"],
        max(batch.query_lens),
        padded["seqused_k"],
        max(batch.seq_lens),
        head_size**-0.5,
        causal,
        padded["block_table"],
        return_lse=True,
    )

    atol, rtol = TOLERANCES[dtype]
    assert_matches_naive(batch, out, lse, causal, atol=atol, rtol=rtol)
    assert out[batch.num_tokens :].isnan().all(), "the kernel wrote padding rows"


@pytest.mark.ch06_t2
def test_unified_attention_without_lse_matches_reference():
    """Rule: «fold the tile into the running max, sum and output»: without the LSE too.

    `return_lse=False` compiles a kernel without the LSE store; same output as the reference."""
    rng = np.random.default_rng(7)
    batch = make_paged_batch(rng, *random_batch(rng, 4, 40, 20), NUM_KV_HEADS, 2, 64, BLOCK_SIZE)
    batch.write_new_tokens()
    out, ref = torch.full_like(batch.q, float("nan")), torch.full_like(batch.q, float("nan"))
    assert unified_attention(*batch.attention_args(batch.q, out, True)) is None
    reference.unified_attention(*batch.attention_args(batch.q, ref, True))
    torch.testing.assert_close(
        out, ref, atol=1e-5, rtol=1e-5,
        msg=lambda m: f"without the LSE the kernel's output must still equal the reference attention; {m}",
    )  # fmt: skip


@pytest.mark.ch06_t1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_reshape_and_cache_flash_writes_exactly_the_mapped_slots(dtype):
    """Rule: «program t copies token t's keys and values to its slot»; «a slot of -1 is not written», nor is
    any slot no token maps to."""
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    batch = make_paged_batch(rng, *random_batch(rng, 5), NUM_KV_HEADS, 2, 64, BLOCK_SIZE, dtype)
    check_reshape_and_cache(triton_reshape_and_cache_flash, batch, num_padding_slots=3)


# ------------------------------------------------------------------------ merge_attn_states
def _split_attention(q, k, v, context_len: int, split: int, scale: float):
    """float64 causal attention of one request over keys [0, split) and over [split, L), separately.

    Returns (prefix_out, prefix_lse, suffix_out, suffix_lse). A query that sees no key of a
    part (every query when the part is empty; early queries for the suffix) gets LSE -inf
    and an arbitrary finite output, which the merge must ignore.
    """
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Lq, L]
    key_pos = torch.arange(k.shape[0])
    hidden = key_pos[None, :] > (context_len + torch.arange(q.shape[0]))[:, None]  # [Lq, L]
    parts = []
    for in_part in (key_pos < split, key_pos >= split):
        s = scores.masked_fill(hidden | ~in_part, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]
        out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v)
        empty = (lse == float("-inf")).T  # [Lq, Hq]
        out[empty] = torch.randn(int(empty.sum()), q.shape[2], dtype=torch.float64)
        parts += [out, lse]
    return parts


# The reference merge is task ch07_t1 (chapter 07 explains the merge; chapter 06 its kernel).
MERGE_IMPLS = [pytest.param("reference", marks=[pytest.mark.ch07, pytest.mark.ch07_t1]), "triton"]


@pytest.mark.parametrize("empty_lse", [float("-inf"), float("inf")], ids=["empty=-inf", "empty=+inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("impl", MERGE_IMPLS)
def test_merge_attn_states_of_random_splits_is_the_unsplit_attention(impl, dtype, empty_lse):
    """Rule: «the union's output is the two outputs weighted by exp(lse) and renormalised»: merging the two
    halves of any split of the keys gives the unsplit attention; «A part with no keys» «gets weight 0»."""
    merge = merge_attn_states if impl == "triton" else reference.merge_attn_states
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    batch = make_paged_batch(rng, *random_batch(rng, 6), NUM_KV_HEADS, 2, 64, BLOCK_SIZE)
    scale = 64**-0.5
    # Split points: an empty prefix, an empty suffix, then anywhere in the context.
    splits = [0, batch.seq_lens[1]] + [int(rng.integers(0, s + 1)) for s in batch.seq_lens[2:]]
    parts, unsplit = [], []
    for r, split in enumerate(splits):
        rows = slice(int(batch.cu_seqlens_q[r]), int(batch.cu_seqlens_q[r + 1]))
        args = (batch.q[rows], batch.keys[r], batch.values[r], batch.context_lens[r])
        parts.append(_split_attention(*args, split, scale))
        unsplit.append(naive_attention(*args, scale, causal=True))
    prefix_out, prefix_lse, suffix_out, suffix_lse = (
        torch.cat([p[i] for p in parts], dim=i % 2) for i in range(4)
    )
    ref_out, ref_lse = torch.cat([u[0] for u in unsplit]), torch.cat([u[1] for u in unsplit], dim=1)

    def as_given(lse: torch.Tensor) -> torch.Tensor:  # float32, empty parts marked by `empty_lse`
        return lse.float().masked_fill(lse == float("-inf"), empty_lse)

    output = torch.full(prefix_out.shape, float("nan"), dtype=dtype)
    output_lse = torch.full(prefix_lse.shape, float("nan"))
    merge(
        output,
        prefix_out.to(dtype),
        as_given(prefix_lse),
        suffix_out.to(dtype),
        as_given(suffix_lse),
        output_lse,
    )
    atol, rtol = TOLERANCES[dtype]
    empty = "an empty part's LSE is " + ("-inf" if empty_lse < 0 else "+inf")
    torch.testing.assert_close(
        output.double(), ref_out, atol=atol, rtol=rtol,
        msg=lambda m: f"the merged output is not the attention over the union of the keys ({empty}); {m}",
    )  # fmt: skip
    torch.testing.assert_close(
        output_lse.double(), ref_lse, atol=1e-5, rtol=1e-5,
        msg=lambda m: f"the merged LSE is not the log-sum-exp over the union of the keys ({empty}); {m}",
    )  # fmt: skip


@pytest.mark.parametrize("impl", MERGE_IMPLS)
def test_merge_attn_states_with_large_lse_does_not_overflow(impl):
    """Rule: «weighted by exp(lse) and renormalised»: the weights are ratios, so they may be taken as exp(lse
    - max lse), which LSEs of 1000 do not overflow (exp(1000) overflows float32).

    LSEs of 1000 (scores of that size occur without a scale, or in float32 accumulations):
    exp(1000) overflows float32, exp(lse - max lse) does not."""
    merge = merge_attn_states if impl == "triton" else reference.merge_attn_states
    num_tokens, num_heads, head_size = 4, 2, 16
    prefix_out, suffix_out = torch.randn(2, num_tokens, num_heads, head_size)
    prefix_lse = torch.full((num_heads, num_tokens), 1000.0)
    suffix_lse = prefix_lse + torch.tensor([0.0, math.log(3.0), -50.0, 50.0])  # weights 1:1, 1:3, ~1:0, ~0:1
    suffix_share = torch.tensor([0.5, 0.75, 0.0, 1.0]).double()
    expected = (
        prefix_out.double() * (1 - suffix_share)[:, None, None]
        + suffix_out.double() * suffix_share[:, None, None]
    )
    output = torch.full_like(prefix_out, float("nan"))
    output_lse = torch.full_like(prefix_lse, float("nan"))
    merge(output, prefix_out, prefix_lse, suffix_out, suffix_lse, output_lse)
    assert torch.isfinite(output).all(), (
        "LSEs near 1000 must merge to finite outputs: shift by the larger LSE first"
    )
    torch.testing.assert_close(
        output.double(), expected, atol=1e-4, rtol=1e-4,
        msg=lambda m: f"LSEs 1000 and 1000 + (0, ln 3, -50, 50) give the suffix shares (1/2, 3/4, 0, 1); {m}",
    )  # fmt: skip
    expected_lse = torch.logsumexp(torch.stack([prefix_lse, suffix_lse]).double(), dim=0)
    torch.testing.assert_close(
        output_lse.double(), expected_lse, atol=1e-4, rtol=1e-6,
        msg=lambda m: f"the merged LSE must be log(exp(prefix LSE) + exp(suffix LSE)), without overflow; {m}",
    )  # fmt: skip


@pytest.mark.parametrize("impl", MERGE_IMPLS)
def test_merge_attn_states_of_two_empty_parts_is_zero(impl):
    """Rule: «if both parts are empty the output is 0 rather than NaN»."""
    merge = merge_attn_states if impl == "triton" else reference.merge_attn_states
    num_tokens, num_heads, head_size = 3, 2, 64
    prefix_out, suffix_out = torch.randn(2, num_tokens, num_heads, head_size)
    prefix_lse = torch.tensor([[float("inf"), float("-inf"), 0.5]] * num_heads)
    suffix_lse = torch.tensor([[float("-inf"), float("inf"), float("-inf")]] * num_heads)
    output = torch.full_like(prefix_out, float("nan"))
    output_lse = torch.full_like(prefix_lse, float("nan"))
    merge(output, prefix_out, prefix_lse, suffix_out, suffix_lse, output_lse)
    assert (output[:2] == 0).all(), "two empty parts (LSE +inf or -inf each) must merge to 0, not NaN"
    assert (output_lse[:, :2] == float("-inf")).all(), "two empty parts must merge to an LSE of -inf"
    torch.testing.assert_close(
        output[2],
        prefix_out[2],
        msg=lambda m: f"only the prefix has keys: the output must be the prefix's; {m}",
    )
    torch.testing.assert_close(
        output_lse[:, 2],
        prefix_lse[:, 2],
        msg=lambda m: f"only the prefix has keys: the LSE must be the prefix's; {m}",
    )


# ------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DTYPE_IDS.get)
def test_unified_attention_on_cuda_at_qwen3_shape(dtype):
    """The compiled kernel (not the interpreter) at Qwen3-0.6B's shape: 16 query heads, 8 KV heads, head 128."""
    rng = np.random.default_rng(0)
    context_lens, query_lens = random_batch(rng, 24, max_context=1200, max_prefill=300)
    batch = make_paged_batch(rng, context_lens, query_lens, 8, 2, 128, BLOCK_SIZE, dtype)
    gpu = batch.to("cuda")
    check_reshape_and_cache(triton_reshape_and_cache_flash, gpu, num_padding_slots=5)
    out = torch.full_like(gpu.q, float("nan"))
    lse = unified_attention(*gpu.attention_args(gpu.q, out, True), return_lse=True)
    atol, rtol = TOLERANCES[dtype]
    assert_matches_naive(batch, out.cpu(), lse.cpu(), True, atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_unified_attention_replays_in_a_cuda_graph_for_other_decode_batches():
    """Captured once for 16 decode slots, replayed for batches of 16, 9 and 3 requests with
    other contexts: the grid comes from shapes and each program finds its request on the
    device, so one graph serves every composition (chapter 08 relies on this)."""
    rng = np.random.default_rng(2)
    batches = [
        make_paged_batch(rng, *_decode_only(rng, n), 8, 2, 128, BLOCK_SIZE, torch.bfloat16)
        for n in (16, 9, 3)
    ]
    num_slots = 16
    num_blocks = max(b.key_cache.shape[0] for b in batches)
    max_pages = max(b.block_table.shape[1] for b in batches)
    # The graph's static inputs, sized for the largest batch.
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    q = torch.zeros(num_slots, 16, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    cu_seqlens_q = torch.zeros(num_slots + 1, dtype=torch.int32, device="cuda")
    seqused_k = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
    block_table = torch.zeros(num_slots, max_pages, dtype=torch.int32, device="cuda")

    def load(b) -> int:
        n = len(b.query_lens)
        b.write_new_tokens()
        k_cache[: b.key_cache.shape[0]] = b.key_cache.cuda()
        v_cache[: b.value_cache.shape[0]] = b.value_cache.cuda()
        q.zero_()
        q[:n] = b.q.cuda()
        out.fill_(float("nan"))
        # Padding requests: no query (cu_seqlens_q repeats its last entry), no context.
        cu_seqlens_q.copy_(torch.cat([b.cu_seqlens_q, b.cu_seqlens_q[-1:].repeat(num_slots - n)]))
        seqused_k.zero_()
        seqused_k[:n] = b.seqused_k.cuda()
        block_table.zero_()
        block_table[:n, : b.block_table.shape[1]] = b.block_table.cuda()
        return n

    def attend() -> None:
        unified_attention(
            q, k_cache, v_cache, out, cu_seqlens_q, 1, seqused_k, 0, 128**-0.5, True, block_table
        )

    load(batches[0])
    attend()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend()
    atol, rtol = TOLERANCES[torch.bfloat16]
    for b in batches:
        n = load(b)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_naive(b, out[:n].cpu(), None, True, atol=atol, rtol=rtol)
        assert out[n:].isnan().all(), "the kernel wrote rows of padding requests"


@pytest.mark.gpu
def test_merge_attn_states_on_cuda_matches_reference():
    num_tokens, num_heads, head_size = 300, 16, 128
    gen = torch.Generator("cuda").manual_seed(0)
    prefix_out, suffix_out = torch.randn(2, num_tokens, num_heads, head_size, device="cuda", generator=gen)
    prefix_lse, suffix_lse = 3 * torch.randn(2, num_heads, num_tokens, device="cuda", generator=gen)
    prefix_lse[:, :20] = float("inf")  # empty prefixes (FlashAttention 2's mark)
    suffix_lse[:, 10:30] = float("-inf")  # empty suffixes; tokens 10-19 have neither part
    outputs = []
    for merge in (merge_attn_states, reference.merge_attn_states):
        output = torch.full_like(prefix_out, float("nan")).bfloat16()
        output_lse = torch.full_like(prefix_lse, float("nan"))
        merge(output, prefix_out.bfloat16(), prefix_lse, suffix_out.bfloat16(), suffix_lse, output_lse)
        outputs.append((output, output_lse))
    (out, lse), (ref_out, ref_lse) = outputs
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse)
    assert (out[10:20] == 0).all()


# ------------------------------------------------------------------------ the kernel benchmark
def test_benchmark_baseline_matches_float64():
    """gather_sdpa_attention, the benchmark's baseline, is a correct implementation too."""
    from benchmarks.attention_kernels import gather_sdpa_attention

    rng = np.random.default_rng(5)
    batch = make_paged_batch(rng, *random_batch(rng, 5), NUM_KV_HEADS, 2, 64, BLOCK_SIZE)
    batch.write_new_tokens()
    # The baseline reads whole pages and masks what lies past a context, so it needs finite
    # values there (as in a zero-initialised cache): large ones, which show if unmasked.
    batch.key_cache.nan_to_num_(100.0)
    batch.value_cache.nan_to_num_(100.0)
    for causal in (True, False):
        out = torch.full_like(batch.q, float("nan"))
        gather_sdpa_attention(*batch.attention_args(batch.q, out, causal))
        assert_matches_naive(batch, out, None, causal, atol=1e-5, rtol=1e-5)


def test_benchmark_runs_on_cpu_and_counts_bytes():
    from benchmarks.attention_kernels import run_attention_kernels
    from nano_v1.benchmarks.roofline import DeviceCeilings

    ceilings = DeviceCeilings("test", memory_bandwidth=1e10, matmul_flops=1e11, dtype="float32")
    result = run_attention_kernels(torch.device("cpu"), ceilings, repeats=1, check_triton=False)
    assert result["shape"] == {
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_size": 128,
        "block_size": 16,
        "dtype": "float32",
    }
    decode = next(r for r in result["rows"] if r["workload"].startswith("decode"))
    # Each context's K and V once (8 KV heads x 128 x 4 bytes each), plus q read and out written.
    kv = decode["context_tokens"] * 2 * 8 * 128 * 4
    assert decode["bytes"] == kv + 2 * decode["num_tokens"] * 16 * 128 * 4
    for row in result["rows"]:
        assert row["max_abs_err_vs_reference"]["gather_sdpa"] < 1e-4
        for name in ("gather_sdpa", "reference"):
            t = row[name]
            assert t["time_ms"] > 0
            assert t["fraction_of_copy_bandwidth"] == pytest.approx(
                row["bytes"] / 1e10 / (t["time_ms"] / 1e3)
            )
