"""Cascade attention: the decision rule, the two-pass computation, the prefix length, end to end.

Oracles: the rule as vLLM states it, written out again independently; float64 attention of
each request over its contiguous context; hand-computed prefix lengths; transformers'
greedy tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.checkpoints import make_vllm_config
from helpers.generation import MAX_NEW, hf_greedy, make_prompts

from nano_v1 import LLM, SamplingParams
from nano_v1.attention.backends import flash_attn
from nano_v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder, use_cascade_attention
from nano_v1.attention.backends.torch_reference import TorchReferenceImpl, TorchReferenceMetadataBuilder
from nano_v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
from nano_v1.attention.backends.utils import CommonAttentionMetadata
from nano_v1.attention.selector import get_attn_backend
from nano_v1.kv_cache_interface import FullAttentionSpec

pytestmark = pytest.mark.ch07


# ---------------------------------------------------------------- the rule
def vllm_rule(prefix: int, query_lens: list[int], heads: int, kv_heads: int, variant: bool, sms: int) -> bool:
    """vLLM's rule in its own words: thresholds, then a tile-wave cost model for flash-decoding."""
    if prefix < 256 or variant or len(query_lens) < 8:
        return False
    group = heads // kv_heads
    flash_decoding = group > 1 and all(q == 1 for q in query_lens)
    if not flash_decoding:
        return True
    tiles = math.ceil(prefix / 128)
    # Cascade: one CTA per (query head, 128 queries); each wave walks all prefix tiles.
    cascade = math.ceil(heads * math.ceil(len(query_lens) / 128) / sms) * tiles
    # Flash-decoding: one CTA per (request, KV head, prefix tile), in waves of `sms`.
    flash = math.ceil(len(query_lens) * kv_heads * math.ceil(group / 128) * tiles / sms)
    return cascade < flash


GRID = list(
    itertools.product(
        [0, 255, 256, 300, 1024, 16384],  # prefix
        [1, 7, 8, 33, 128, 1000],  # requests
        ["decode", "chunk"],  # all decodes, or one request with several queries
        [(16, 8), (32, 32), (64, 8), (64, 4)],  # (query heads, KV heads)
        [None, "alibi", "sliding_window", "local_attention"],
        [16, 132],  # SMs
    )
)


@pytest.mark.ch07_t2
def test_rule_on_a_grid():
    """Rule: «First the cheap refusals: a prefix under 256 tokens, attention variants the two-pass split does
    not handle, or fewer than 8 requests»; then «the faster one wins», on a grid of every case."""
    outcomes = []
    for prefix, num_reqs, kind, (heads, kv_heads), variant, sms in GRID:
        query_lens = np.ones(num_reqs, dtype=np.int32)
        if kind == "chunk":
            query_lens[-1] = 17
        got = use_cascade_attention(
            common_prefix_len=prefix,
            query_lens=query_lens,
            num_query_heads=heads,
            num_kv_heads=kv_heads,
            use_alibi=variant == "alibi",
            use_sliding_window=variant == "sliding_window",
            use_local_attention=variant == "local_attention",
            num_sms=sms,
        )
        expected = vllm_rule(prefix, query_lens.tolist(), heads, kv_heads, variant is not None, sms)
        assert got == expected, (
            f"{num_reqs} requests ({'all decodes' if kind == 'decode' else 'one with 17 queries'}) on a "
            f"{prefix}-token prefix, {heads} query heads over {kv_heads} KV heads, "
            f"{variant or 'plain attention'}, {sms} SMs: vLLM's rule says cascade={expected}, got {got}"
        )
        if variant is None and kind == "decode" and heads != kv_heads and prefix >= 256 and num_reqs >= 8:
            outcomes.append(got)
    # The cost model itself must go both ways on this grid, or the grid tests only the thresholds.
    assert True in outcomes and False in outcomes, "the grid must exercise both outcomes of the cost model"


@pytest.mark.parametrize(
    "prefix, num_reqs, heads, kv_heads, sms, expected",
    [
        # Qwen3-0.6B, 128 decodes on a 16k prefix: cascade 1 wave x 128 tiles = 128;
        # flash-decoding 128 x 8 x 128 = 131,072 CTAs / 132 = 993 waves.
        (16384, 128, 16, 8, 132, True),
        # 8 decodes on 256 tokens, 64 heads over 8 KV heads: cascade 2 tiles in 1 wave = 2;
        # flash-decoding 8 x 8 x 2 = 128 CTAs fit in 1 wave. Flash-decoding wins.
        (256, 8, 64, 8, 132, False),
        # Multi-head attention never uses flash-decoding: cascade whenever the thresholds pass.
        (256, 8, 32, 32, 132, True),
        # Even where flash-decoding's estimate would win (1 head: 8 x 1 x 2 = 16 CTAs in 1 wave,
        # against cascade's 1 wave x 2 tiles), without grouped heads it is not used: cascade.
        (256, 8, 1, 1, 132, True),
    ],
)
@pytest.mark.ch07_t2
def test_rule_by_hand(prefix, num_reqs, heads, kv_heads, sms, expected):
    """Rule: «if the plain kernel would not run as flash-decoding (which needs grouped KV heads and a batch of
    pure decodes)», cascade; else «the faster one wins», in «waves of 128 x 128 tiles over the SMs»."""
    query_lens = np.ones(num_reqs, dtype=np.int32)
    got = use_cascade_attention(prefix, query_lens, heads, kv_heads, False, False, False, sms)
    assert got is expected, (
        f"{num_reqs} decodes on a {prefix}-token prefix, {heads} query heads over {kv_heads} KV heads, "
        f"{sms} SMs: the tile-wave estimate says cascade={expected}, got {got}"
    )


# ---------------------------------------------------------------- the computation
NUM_KV_HEADS = 2
BLOCK_SIZE = 8
HEAD_SIZE = 32
SCALE = HEAD_SIZE**-0.5


def float64_attention(q, k, v, num_computed: int, scale: float) -> torch.Tensor:
    """Causal attention of one request in float64: q [Lq, Hq, D] at positions num_computed.., k, v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.double().transpose(0, 1) for x in (q, k, v))  # [heads, tokens, head_size]
    visible = torch.arange(k.shape[1])[None, :] <= num_computed + torch.arange(q.shape[1])[:, None]
    o = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), attn_mask=visible, scale=scale
    )
    return o.transpose(0, 1)  # [Lq, Hq, D]


def _shared_prefix_batch(rng: np.random.Generator, num_reqs: int) -> tuple[list[str], list[int], list[int]]:
    """Requests behind a shared prefix: (kind, tokens computed beyond the prefix, queries) of each."""
    kinds, own_computed, query_lens = [], [], []
    for r in range(num_reqs):
        kind = (
            ["decode", "chunk", "first_chunk_after_prefix"][r]
            if r < 3
            else str(rng.choice(["decode", "chunk"]))
        )
        kinds.append(kind)
        if kind == "decode":
            own_computed.append(int(rng.integers(0, 30)))
            query_lens.append(1)
        elif kind == "chunk":
            own_computed.append(int(rng.integers(1, 30)))
            query_lens.append(int(rng.integers(2, 20)))
        else:  # num_computed_tokens equals the prefix exactly: the suffix is this step's queries
            own_computed.append(0)
            query_lens.append(int(rng.integers(2, 20)))
    return kinds, own_computed, query_lens


@dataclass
class SharedPrefixStep:
    """One step of requests whose block tables start with the same blocks.

    The cache holds every request's earlier context (unwritten slots are NaN, so reading
    one poisons the output); this step's keys and values (`new_k`, `new_v`) go through the
    backend. `keys` and `values` keep each request's whole context contiguous, for the oracle.
    """

    prefix_len: int
    kinds: list[str]
    computed: list[int]  # num_computed_tokens, prefix included
    query_lens: list[int]
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_size]
    values: list[torch.Tensor]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    new_k: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    new_v: torch.Tensor
    q: torch.Tensor  # [num_tokens, num_heads, head_size]
    common: CommonAttentionMetadata

    def rows(self, r: int) -> slice:
        start = sum(self.query_lens[:r])
        return slice(start, start + self.query_lens[r])

    def describe(self, r: int) -> str:
        own = self.computed[r] - self.prefix_len
        what = "a decode" if self.kinds[r] == "decode" else f"{self.query_lens[r]} queries"
        after = "right after the prefix" if own == 0 else f"after {own} tokens of its own"
        return f"request {r} ({what} {after}, behind the shared {self.prefix_len}-token prefix)"


def make_shared_prefix_step(prefix_blocks: int, group: int, seed: int) -> SharedPrefixStep:
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    prefix_len = prefix_blocks * BLOCK_SIZE
    kinds, own_computed, query_lens = _shared_prefix_batch(rng, num_reqs=int(rng.integers(5, 10)))
    num_reqs = len(query_lens)
    computed = [prefix_len + c for c in own_computed]
    seq_lens = [c + q for c, q in zip(computed, query_lens)]

    # Block table: the same prefix blocks in every row, then each request's own shuffled blocks.
    # Rows are padded with a spare block that is never written, as wide as the runner's are:
    # a pass that reads past a request's context reads NaN (and stays in the table).
    own_blocks = [-(-(s - prefix_len) // BLOCK_SIZE) for s in seq_lens]
    num_blocks = prefix_blocks + sum(own_blocks) + 3
    ids = rng.permutation(num_blocks)
    max_blocks = 2 * prefix_blocks + max(own_blocks) + 1
    block_table = torch.full((num_reqs, max_blocks), int(ids[-1]), dtype=torch.int32)
    block_table[:, :prefix_blocks] = torch.from_numpy(ids[:prefix_blocks])
    start = prefix_blocks
    for r, n in enumerate(own_blocks):
        block_table[r, prefix_blocks : prefix_blocks + n] = torch.from_numpy(ids[start : start + n])
        start += n

    # The context: the prefix once, then each request's own tokens.
    prefix_k, prefix_v = torch.randn(2, prefix_len, NUM_KV_HEADS, HEAD_SIZE)
    keys = [torch.cat([prefix_k, torch.randn(s - prefix_len, NUM_KV_HEADS, HEAD_SIZE)]) for s in seq_lens]
    values = [torch.cat([prefix_v, torch.randn(s - prefix_len, NUM_KV_HEADS, HEAD_SIZE)]) for s in seq_lens]
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), float("nan"))
    flat = kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)  # [2, num_slots, num_kv_heads, head_size]

    def slots(r: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.int64)
        return block_table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE

    for r in range(num_reqs):  # the earlier steps' context; this step's tokens go through the backend
        flat[0, slots(r, range(computed[r]))] = keys[r][: computed[r]]
        flat[1, slots(r, range(computed[r]))] = values[r][: computed[r]]
    num_tokens = sum(query_lens)
    query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.cat([slots(r, range(computed[r], seq_lens[r])) for r in range(num_reqs)]),
    )
    return SharedPrefixStep(
        prefix_len=prefix_len,
        kinds=kinds,
        computed=computed,
        query_lens=query_lens,
        keys=keys,
        values=values,
        kv_cache=kv_cache,
        new_k=torch.cat([keys[r][computed[r] :] for r in range(num_reqs)]),
        new_v=torch.cat([values[r][computed[r] :] for r in range(num_reqs)]),
        q=torch.randn(num_tokens, NUM_KV_HEADS * group, HEAD_SIZE),
        common=common,
    )


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(torch.isclose(got, expected, atol=1e-5, rtol=1e-5).all())


def _what_it_is_instead(got: torch.Tensor, step: SharedPrefixStep, r: int) -> str:
    """What a wrong output of request r is, where it is a likely mistake's; else ''."""
    q, k, v = step.q[step.rows(r)], step.keys[r], step.values[r]
    computed, p = step.computed[r], step.prefix_len
    if _close(got, float64_attention(q, k[p:], v[p:], computed - p, SCALE)):
        return "; it is attention over the request's own blocks alone: the prefix is left out or masked"
    if _close(got, float64_attention(q, k[:p], v[:p], computed, SCALE)):
        return "; it is attention over the shared prefix alone: the request's own blocks are left out"
    if step.query_lens[r] > 1 and _close(got, float64_attention(q, k, v, len(k), SCALE)):
        return "; its queries see the keys after their own positions: the suffix pass must be causal"
    return ""


def assert_is_attention_over_the_whole_context(out: torch.Tensor, step: SharedPrefixStep, path: str) -> None:
    """Each request's rows of `out` against float64 attention over its contiguous context."""
    for r in range(len(step.query_lens)):
        got = out[step.rows(r)].double()
        where = f"{path}: {step.describe(r)}"
        assert not got.isnan().any(), (
            f"{where}: its output holds NaN: something it used was never written (a cache slot "
            "outside its context, rows a pass skipped, or `output` itself), or a pass hid every key "
            "from a query"
        )
        expected = float64_attention(
            step.q[step.rows(r)], step.keys[r], step.values[r], step.computed[r], SCALE
        )
        error = (got - expected).abs().max().item()
        assert _close(got, expected), (
            f"{where}: its output differs from float64 attention over prefix + suffix by {error:.2g} "
            f"(tolerance 1e-5){_what_it_is_instead(got, step, r)}"
        )


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("prefix_blocks", [1, 3, 8])
@pytest.mark.ch07_t3
def test_cascade_equals_plain_and_float64(prefix_blocks, group):
    """Rule: «the prefix is read once for the whole batch, and each request then attends to its own
    blocks after the prefix»; merged, the two passes are attention over each request's whole
    context. Through the TORCH_REFERENCE backend (builder, cache write, cascade), whose kernels
    plan each pass from the query ranges and key lengths it is given."""
    step = make_shared_prefix_step(prefix_blocks, group, seed=prefix_blocks * 10 + group)
    builder = TorchReferenceMetadataBuilder(torch.device("cpu"))
    impl = TorchReferenceImpl(step.q.shape[1], HEAD_SIZE, SCALE, NUM_KV_HEADS)
    cascade_metadata = builder.build(step.prefix_len, step.common)
    plain_metadata = builder.build(0, step.common)
    assert cascade_metadata.use_cascade, "given a common prefix, the builder must cascade"
    cascade_out = torch.full_like(step.q, float("nan"))
    impl.forward(None, step.q, step.new_k, step.new_v, step.kv_cache, cascade_metadata, cascade_out)
    assert_is_attention_over_the_whole_context(cascade_out, step, "cascade (reference kernels)")

    plain_out = torch.full_like(step.q, float("nan"))
    impl.forward(None, step.q, step.new_k, step.new_v, step.kv_cache, plain_metadata, plain_out)
    error = (cascade_out - plain_out).abs().max().item()
    assert _close(cascade_out, plain_out), (
        f"cascade and plain attention differ by {error:.2g} (tolerance 1e-5)"
    )


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.ch07_t3
def test_each_pass_gets_the_maxima_a_varlen_kernel_sizes_itself_by(group):
    """Rule: each pass's `max_seqlen_q` and `max_seqlen_k` equal «the longest query range and the
    longest key length of the pass it is given, no more and no less» (FlashAttention's varlen
    kernel sizes its grid and tiles by them; nano_v1's kernels hardly read them, so only this
    test sees a wrong one). The prefix pass reads no suffix key, and asks for its
    log-sum-exp, as the suffix pass does."""
    step = make_shared_prefix_step(prefix_blocks=3, group=group, seed=90 + group)
    impl = TorchReferenceImpl(step.q.shape[1], HEAD_SIZE, SCALE, NUM_KV_HEADS)
    calls: list[dict] = []
    attend = impl.ops.unified_attention

    def recording(**kwargs):
        calls.append(kwargs)
        return attend(**kwargs)

    impl.ops = dataclasses.replace(impl.ops, unified_attention=recording)
    metadata = TorchReferenceMetadataBuilder(torch.device("cpu")).build(step.prefix_len, step.common)
    impl.forward(None, step.q, step.new_k, step.new_v, step.kv_cache, metadata, torch.empty_like(step.q))
    assert len(calls) == 2, (
        f"cascade must call ops.unified_attention twice (prefix pass, suffix pass), not {len(calls)}"
    )
    for name, call in zip(("first", "second"), calls):
        query_lens = (call["cu_seqlens_q"][1:] - call["cu_seqlens_q"][:-1]).tolist()
        key_lens = call["seqused_k"].tolist()
        where = f"the {name} pass (query ranges {query_lens}, key lengths {key_lens})"
        assert call["max_seqlen_q"] == max(query_lens), (
            f"{where} is given max_seqlen_q={call['max_seqlen_q']}: it must be its longest query range, "
            f"{max(query_lens)}"
        )
        assert call["max_seqlen_k"] == max(key_lens), (
            f"{where} is given max_seqlen_k={call['max_seqlen_k']}: it must be its longest key length, "
            f"{max(key_lens)}"
        )
        assert call.get("return_lse"), (
            f"{where} must return its log-sum-exp (return_lse=True): the merge needs it"
        )
    unmasked = [call for call in calls if not call["causal"]]
    assert len(unmasked) == 1 and unmasked[0]["seqused_k"].tolist() == [step.prefix_len], (
        f"exactly one pass, the prefix pass, runs without a mask, over the {step.prefix_len} prefix keys alone"
    )


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.ch07_t3
def test_cascade_with_triton_kernels_equals_float64(group):
    """Rule: «the prefix is read once for the whole batch, and each request then attends to its own blocks
    after the prefix», through the FLASH_ATTN backend: the Triton kernels (chapter 06; Triton's
    interpreter on a CPU), which read every length and query range from the tensors cascade passes
    them.

    The FLASH_ATTN backend: the Triton kernels (chapter 06; Triton's interpreter on a CPU),
    which read every length and query range from the tensors cascade passes them."""
    pytest.importorskip(
        "nano_v1.attention.ops.triton_unified_attention", reason="the Triton kernels (chapter 06)"
    )
    step = make_shared_prefix_step(prefix_blocks=2, group=group, seed=70 + group)
    metadata = FlashAttentionMetadataBuilder(torch.device("cpu")).build(step.prefix_len, step.common)
    impl = flash_attn.FlashAttentionImpl(step.q.shape[1], HEAD_SIZE, SCALE, NUM_KV_HEADS)
    out = torch.full_like(step.q, float("nan"))
    impl.forward(None, step.q, step.new_k, step.new_v, step.kv_cache, metadata, out)
    assert_is_attention_over_the_whole_context(out, step, "cascade (Triton kernels)")


# ---------------------------------------------------------------- the prefix length
@pytest.fixture(scope="module")
def runner(tiny_qwen3):
    """A model runner without weights: what `_compute_cascade_attn_prefix_len` reads
    (its builder, query heads, SMs and persistent batch) needs no model."""
    from nano_v1.worker.gpu_model_runner import GPUModelRunner

    config = make_vllm_config(tiny_qwen3, device="auto", block_size=16, max_model_len=512)
    return GPUModelRunner(config, torch.device("cpu"))


def full_attention_spec(runner) -> FullAttentionSpec:
    """The tiny Qwen3's KV cache spec, every layer's (the runner has no model to ask)."""
    model_config = runner.model_config
    return FullAttentionSpec(
        runner.block_size, model_config.get_num_kv_heads(), model_config.get_head_size(), runner.dtype
    )


def prefix_len(runner, query_lens: np.ndarray, num_computed: np.ndarray, num_common_blocks: int, spec) -> int:
    """The prefix length the runner's `_build_attention_metadata` gets for one KV cache group,
    with `num_computed` the persistent batch's first rows of num_computed_tokens."""
    runner.input_batch.num_computed_tokens_cpu[: len(num_computed)] = num_computed
    return runner._compute_cascade_attn_prefix_len(query_lens, num_common_blocks, spec)


@pytest.mark.parametrize(
    "num_computed, num_common_blocks, expected",
    [
        ([100, 120, 300], 6, 96),  # 6 blocks = 96 tokens; every request computed more
        ([70, 120, 300], 6, 64),  # capped by the smallest num_computed_tokens (70), down to 4 blocks
        ([64, 120, 300], 6, 64),  # exactly whole blocks: kept
        ([0, 120, 300], 6, 0),  # a new request has computed nothing: no prefix pass possible
        ([15, 120, 300], 6, 0),  # less than one block computed: rounds down to 0
        ([100, 120, 300], 0, 0),  # nothing shared
    ],
)
def test_prefix_len(runner, monkeypatch, num_computed, num_common_blocks, expected):
    asked = []

    def always(**kwargs):
        asked.append(kwargs["common_prefix_len"])
        return True

    monkeypatch.setattr(runner.attn_metadata_builder, "use_cascade_attention", always)
    query_lens = np.ones(len(num_computed), dtype=np.int32)
    # Rows of the persistent batch beyond this step's requests are stale: their 0s must not cap the prefix.
    num_computed_tokens = np.array(num_computed + [0] * 5)
    spec = full_attention_spec(runner)
    assert prefix_len(runner, query_lens, num_computed_tokens, num_common_blocks, spec) == expected
    assert asked == ([] if num_common_blocks == 0 else [expected])


def test_prefix_len_is_zero_when_the_rule_says_no(runner):
    # 8 decodes on a 992-token prefix, Qwen3 tiny's 4 query heads over 2 KV heads, on 132 SMs:
    # cascade 1 wave x 8 tiles = 8; flash-decoding 8 x 2 x 8 = 128 CTAs, 1 wave. No cascade.
    query_lens, num_computed = np.ones(8, dtype=np.int32), np.full(8, 1000)
    assert prefix_len(runner, query_lens, num_computed, 62, full_attention_spec(runner)) == 0


# ---------------------------------------------------------------- end to end
def _count_cascades(monkeypatch, force: bool = True) -> list[int]:
    """Record the prefix length of every cascade_attention call; with `force`, the rule always says yes."""
    calls: list[int] = []
    original = flash_attn.cascade_attention
    if force:
        monkeypatch.setattr(flash_attn, "use_cascade_attention", lambda **kwargs: True)
    monkeypatch.setattr(
        flash_attn,
        "cascade_attention",
        lambda *args, **kwargs: (calls.append(kwargs["common_prefix_len"]), original(*args, **kwargs))[1],
    )
    return calls


def _greedy_with_cascade(path: str, prompts: list[list[int]], max_new: int, **engine_args) -> list[list[int]]:
    llm = LLM(model=path, dtype="float32", block_size=16, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def shared_prefix_reference(tiny_qwen3):
    # Six prompts behind a 70-token shared prefix: 4 shared blocks of 16 once computed.
    prompts = make_prompts(5, shared_prefix=70)
    return tiny_qwen3, prompts, hf_greedy(tiny_qwen3, prompts)


def test_forced_cascade_matches_transformers(shared_prefix_reference, monkeypatch):
    path, prompts, expected = shared_prefix_reference
    calls = _count_cascades(monkeypatch)
    assert _greedy_with_cascade(path, prompts, MAX_NEW, attention_backend="TORCH_REFERENCE") == expected
    assert calls and set(calls) <= {16, 32, 48, 64} and 64 in calls


@pytest.mark.slow
def test_forced_cascade_matches_transformers_triton(shared_prefix_reference, monkeypatch):
    pytest.importorskip(
        "nano_v1.attention.ops.triton_unified_attention", reason="the Triton kernels (chapter 06)"
    )
    path, prompts, expected = shared_prefix_reference
    calls = _count_cascades(monkeypatch)
    # The interpreter is slow: the first three prompts, a few tokens each.
    got = _greedy_with_cascade(path, prompts[:3], 4, attention_backend="FLASH_ATTN")
    assert got == [e[:4] for e in expected[:3]]
    assert calls


@pytest.mark.ch07_t3
def test_rule_alone_cascades_and_matches_transformers(tmp_path, monkeypatch):
    """Rule: «combine the two with `ops.merge_attn_states` into `output`»: with no forcing (multi-head
    attention, so no flash-decoding; 8 requests, 256 shared tokens) the engine cascades, and its greedy
    tokens are transformers'.

    No forcing: multi-head attention (so no flash-decoding), 8 requests, 256 shared tokens."""
    from helpers.checkpoints import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path, "qwen3", num_key_value_heads=4)
    prefix = make_prompts(6, shared_prefix=256)[0][:256]
    prompts = [prefix + [3 + i] for i in range(8)]
    calls = _count_cascades(monkeypatch, force=False)
    got = _greedy_with_cascade(path, prompts, 4)
    # The prompts have one length, so transformers can run them as one batch without padding.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=4)[:, 257:].tolist()
    # The first step prefills (nothing computed yet: no cascade); every decode step cascades.
    assert calls and set(calls) == {256}, (
        f"every decode step of 8 requests behind 256 shared tokens must cascade over them; "
        f"cascade_attention ran with prefix lengths {calls}"
    )
    wrong = [r for r in range(8) if got[r] != expected[r]]
    assert not wrong, (
        f"with cascade on every decode step (the prefill, which gives the first token, does not cascade), "
        f"requests {wrong} generate other greedy tokens than transformers: request {wrong[0]} got "
        f"{got[wrong[0]]}, expected {expected[wrong[0]]}"
    )


def test_triton_attn_never_cascades():
    """vLLM v0.11.0's TRITON_ATTN has no cascade path: its builder says no where FLASH_ATTN's says yes."""
    cascading_step = dict(
        common_prefix_len=1024,
        query_lens=np.ones(64, dtype=np.int32),
        num_query_heads=16,
        num_kv_heads=16,
        use_alibi=False,
        use_sliding_window=False,
        use_local_attention=False,
        num_sms=132,
    )
    device = torch.device("cpu")
    assert FlashAttentionMetadataBuilder(device).use_cascade_attention(**cascading_step)
    assert TorchReferenceMetadataBuilder(device).use_cascade_attention(**cascading_step)
    assert not TritonAttentionMetadataBuilder(device).use_cascade_attention(**cascading_step)


def test_disable_cascade_attn_never_cascades(tiny_qwen3, monkeypatch):
    calls = _count_cascades(monkeypatch)
    _greedy_with_cascade(tiny_qwen3, make_prompts(5, shared_prefix=70), 4, disable_cascade_attn=True)
    assert calls == []


# ---------------------------------------------------------------- the bytes-read model
def test_bytes_model():
    from benchmarks.cascade import QWEN3_0_6B_ATTENTION, attention_traffic, kv_tokens_read

    # The seed example: a 10,000-token system prompt and 10 chats of 100 tokens.
    assert kv_tokens_read(10_000, 10, 100, cascade=False) == (10_000 + 100) * 10
    assert kv_tokens_read(10_000, 10, 100, cascade=True) == 10_000 + 100 * 10
    # One Qwen3-0.6B layer: 2 x 8 KV heads x 128 x 2 bytes = 4 KiB per token; same FLOPs both ways.
    plain = attention_traffic(16384, 128, 128, QWEN3_0_6B_ATTENTION, cascade=False)
    cascade = attention_traffic(16384, 128, 128, QWEN3_0_6B_ATTENTION, cascade=True)
    assert plain.kv_bytes == 128 * (16384 + 128) * 4096 and cascade.kv_bytes == (16384 + 128 * 128) * 4096
    assert plain.flops == cascade.flops == 4 * 128 * 16 * 128 * (16384 + 128)


# ---------------------------------------------------------------- configuration
def test_attention_backend_config(tiny_qwen3, monkeypatch):
    def resolved(**kwargs):
        return make_vllm_config(tiny_qwen3, **kwargs).model_config

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    assert resolved().attention_backend == "TORCH_REFERENCE"  # the default on a CPU
    for name in ("FLASH_ATTN", "TRITON_ATTN", "TORCH_REFERENCE"):
        assert resolved(attention_backend=name).attention_backend == name
        assert get_attn_backend(name).get_name() == name
    assert resolved().disable_cascade_attn is False
    assert resolved(disable_cascade_attn=True).disable_cascade_attn is True
    for bad in ("flashinfer", "torch", "triton"):  # vLLM's names only
        with pytest.raises(ValueError, match="attention_backend"):
            resolved(attention_backend=bad)
    with pytest.raises(ValueError, match="attention_backend"):
        get_attn_backend("FLASHINFER")
    # As in vLLM v0.11.0, $VLLM_ATTENTION_BACKEND picks the backend when the argument does not.
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    assert resolved().attention_backend == "TRITON_ATTN"
    assert resolved(attention_backend="FLASH_ATTN").attention_backend == "FLASH_ATTN"
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "XFORMERS")
    with pytest.raises(ValueError, match="VLLM_ATTENTION_BACKEND"):
        resolved()
    if torch.cuda.is_available():
        monkeypatch.delenv("VLLM_ATTENTION_BACKEND")
        cuda = make_vllm_config(tiny_qwen3, device="cuda").model_config
        assert cuda.attention_backend == "FLASH_ATTN"
