"""Cascade attention against plain paged attention: a bytes-read model, and the measured speed-up.

Mirrors no single vLLM file: the benchmark behind vllm/v1/attention/backends/flash_attn.py's
`use_cascade_attention` (chapter 07).
Needs a source checkout (`pip install .` installs only nano_v1): run from its root,
`python -m benchmarks.cascade`.

Why it exists: cascade attention is worth its extra launches only when the traffic it saves
is large. Decoding with a shared prefix of P tokens, batch B and suffixes of S tokens, plain
attention reads B x (P + S) tokens of K and V, cascade P + B x S (`kv_tokens_read`). Both do
the same FLOPs, so the saving is bounded twice: by that ratio, and by how far the plain
kernel is from being compute bound (`AttentionTraffic.time`). With grouped KV heads the plain
kernel already does `group` query heads' work per KV byte, so it is `group` times nearer to
that second bound than multi-head attention: less is left to win.

    python -m benchmarks.cascade --out cascade.json          # GPU grid (Triton), ~1 min
    python -m benchmarks.cascade --out cascade.json --smoke  # anywhere, seconds

The GPU grid runs in the one-shot suite as `cascade_attention` (`benchmarks/gpu_suite.py`).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from benchmarks import NEEDS_CHECKOUT
from nano_v1.attention.backends.flash_attn import get_num_sms, use_cascade_attention
from nano_v1.attention.backends.utils import CommonAttentionMetadata
from nano_v1.attention.selector import get_attn_backend
from nano_v1.benchmarks.roofline import H200_DATASHEET, DeviceCeilings, best_time
from nano_v1.benchmarks.utils import write_json

NAME = "cascade"


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention layer's heads and cache layout."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int = 2
    block_size: int = 16

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V in this layer."""
        return 2 * self.num_kv_heads * self.head_size * self.dtype_bytes


# Qwen3-0.6B's attention: 16 query heads over 8 KV heads of 128, bf16 (GQA, group 2).
QWEN3_0_6B_ATTENTION = AttentionShape(num_heads=16, num_kv_heads=8, head_size=128)
# Multi-head attention of a Llama-2-7B layer: 32 query heads, 32 KV heads of 128 (group 1).
MHA_32_HEADS = AttentionShape(num_heads=32, num_kv_heads=32, head_size=128)

# The measured grid on a GPU: shared prefix x requests x suffix, one query per request.
PREFIX_LENS = (1024, 4096, 16384, 32768)
BATCH_SIZES = (8, 32, 128, 256)
SUFFIX_LENS = (128, 1024)
# The goal: at prefix 16k, 128 requests, suffix 128, cascade at least 5x faster than plain paged
# attention; and over the measured grid, the performance model (`use_cascade_attention`) picks
# the faster path in at least 90% of the points.
GOAL_POINT = (16384, 128, 128)
GOAL = {"min_speedup_at_goal_point": 5.0, "min_model_agreement": 0.9}


def kv_tokens_read(prefix_len: int, num_reqs: int, suffix_len: int, cascade: bool) -> int:
    """Tokens of K/V read: each request's whole context, or the shared prefix once plus each suffix."""
    if cascade:
        return prefix_len + num_reqs * suffix_len
    return num_reqs * (prefix_len + suffix_len)


@dataclass(frozen=True, slots=True)
class AttentionTraffic:
    """Bytes and FLOPs of one layer's attention for a batch sharing a prefix."""

    kv_bytes: int  # K and V read from the cache
    query_output_bytes: int  # queries read, outputs written (and cascade's partial outputs and LSEs)
    flops: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.query_output_bytes

    def time(self, ceilings: DeviceCeilings) -> float:
        """The roofline floor: max(bytes / bandwidth, FLOPs / matmul rate), in seconds."""
        return max(self.total_bytes / ceilings.memory_bandwidth, self.flops / ceilings.matmul_flops)


def attention_traffic(
    prefix_len: int, num_reqs: int, suffix_len: int, shape: AttentionShape, cascade: bool, query_len: int = 1
) -> AttentionTraffic:
    """What one layer's attention must move and compute; each request's context is prefix + suffix.

    `suffix_len` includes the request's `query_len` new tokens. Plain attention reads the
    queries and writes the outputs once. Cascade reads the queries in both passes, writes
    two partial outputs and their log-sum-exps, and the merge reads those back and writes
    the output. The FLOPs (QK^T and PV, 4 x head_size per query head per key) are the same.
    """
    num_tokens = num_reqs * query_len
    row = shape.num_heads * shape.head_size * shape.dtype_bytes  # one token's queries, or its output
    lse = shape.num_heads * 4  # one token's float32 log-sum-exps
    if cascade:
        query_output = num_tokens * (7 * row + 4 * lse)
    else:
        query_output = num_tokens * 2 * row
    kv_bytes = kv_tokens_read(prefix_len, num_reqs, suffix_len, cascade) * shape.kv_bytes_per_token
    flops = 4 * num_tokens * shape.num_heads * shape.head_size * (prefix_len + suffix_len)
    return AttentionTraffic(kv_bytes=kv_bytes, query_output_bytes=query_output, flops=flops)


def predicted_speedup(
    prefix_len: int,
    num_reqs: int,
    suffix_len: int,
    shape: AttentionShape,
    ceilings: DeviceCeilings = H200_DATASHEET,
    query_len: int = 1,
) -> float:
    """Plain over cascade roofline time: the speed-up if both kernels ran at the device's limits."""
    plain = attention_traffic(prefix_len, num_reqs, suffix_len, shape, False, query_len)
    cascade = attention_traffic(prefix_len, num_reqs, suffix_len, shape, True, query_len)
    return plain.time(ceilings) / cascade.time(ceilings)


# ---------------------------------------------------------------------------- measurement
def shared_prefix_metadata(
    prefix_len: int,
    num_reqs: int,
    suffix_len: int,
    query_len: int,
    shape: AttentionShape,
    device: torch.device,
) -> CommonAttentionMetadata:
    """A decode (or chunk) step of `num_reqs` requests whose first `prefix_len` tokens are the same blocks.

    Blocks 0 .. prefix_len / block_size - 1 are the prefix, in every row of the block table;
    each request's suffix has blocks of its own after them. The step's `query_len` tokens
    are the last ones of each suffix.
    """
    bs = shape.block_size
    prefix_blocks, suffix_blocks = prefix_len // bs, -(-suffix_len // bs)
    own = prefix_blocks + np.arange(num_reqs * suffix_blocks).reshape(num_reqs, suffix_blocks)
    block_table = np.concatenate(
        [np.broadcast_to(np.arange(prefix_blocks), (num_reqs, prefix_blocks)), own], axis=1
    )
    seq_len = prefix_len + suffix_len
    positions = np.arange(seq_len - query_len, seq_len)  # [query_len], the same in every request
    slot_mapping = (block_table[:, positions // bs] * bs + positions % bs).reshape(
        -1
    )  # [num_reqs * query_len]
    query_start_loc = torch.arange(0, num_reqs * query_len + 1, query_len, dtype=torch.int32)
    seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=seq_lens - query_len,
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs * query_len,
        max_query_len=query_len,
        max_seq_len=seq_len,
        # Row-major, as the runner's: a kernel steps from row to row by stride(0).
        block_table_tensor=torch.from_numpy(np.ascontiguousarray(block_table, dtype=np.int32)).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
    )


def check_against_float64(
    prefix_len: int,
    num_reqs: int,
    suffix_len: int,
    shape: AttentionShape,
    attention_backends: Iterable[str],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Largest error of plain and cascade attention, per backend, against float64 attention.

    One decode step of the shared-prefix layout of `shared_prefix_metadata`. Every request
    has the same context length, so the oracle is one batched float64 attention over the
    contexts gathered through the block table. Returns {"<backend> <path>": max abs error}.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    common = shared_prefix_metadata(prefix_len, num_reqs, suffix_len, 1, shape, device)
    num_blocks = int(common.block_table_tensor.max()) + 1
    kv_cache = torch.randn(
        2,
        num_blocks,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_size,
        generator=generator,
        device=device,
    ).to(dtype)
    q = torch.randn(num_reqs, shape.num_heads, shape.head_size, generator=generator, device=device).to(dtype)
    k, v = torch.randn(
        2, num_reqs, shape.num_kv_heads, shape.head_size, generator=generator, device=device
    ).to(dtype)
    scale = shape.head_size**-0.5
    outputs: dict[str, torch.Tensor] = {}
    for attention_backend in attention_backends:
        backend = get_attn_backend(attention_backend)
        builder = backend.get_builder_cls()(device)
        impl = backend.get_impl_cls()(shape.num_heads, shape.head_size, scale, shape.num_kv_heads)
        for path, common_prefix_len in (("plain", 0), ("cascade", prefix_len)):
            out = torch.empty_like(q)
            impl.forward(None, q, k, v, kv_cache, builder.build(common_prefix_len, common), out)
            outputs[f"{attention_backend} {path}"] = out
    # The oracle reads the cache after the forward passes wrote this step's keys and values.
    seq_len = prefix_len + suffix_len
    pages = kv_cache.double()[:, common.block_table_tensor.long()]  # [2, num_reqs, pages, block_size, Hkv, D]
    context = pages.flatten(2, 3)[:, :, :seq_len].transpose(2, 3)  # [2, num_reqs, Hkv, seq_len, D]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double().unsqueeze(2), context[0], context[1], scale=scale, enable_gqa=True
    ).squeeze(2)  # [num_reqs, num_heads, head_size]
    return {name: float((out.double() - expected).abs().max()) for name, out in outputs.items()}


def measure_grid(
    points: Iterable[tuple[int, int, int]],
    device: torch.device,
    attention_backend: str,
    dtype: torch.dtype,
    shape: AttentionShape = QWEN3_0_6B_ATTENTION,
    query_len: int = 1,
    repeats: int = 10,
    rows: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Time one layer's attention (`FlashAttentionImpl.forward`, cache write included) plain and cascaded.

    `points` are (prefix_len, num_reqs, suffix_len). One random KV cache, sized for the
    largest point, serves all of them. Each row records both times, the bytes-read model,
    which path `use_cascade_attention` picks and which was faster, and the largest
    difference between the two outputs (they compute the same attention). Rows are
    appended to `rows` as they finish, so a caller cut short keeps them.
    """
    points = list(points)
    rows = [] if rows is None else rows
    bs = shape.block_size
    num_blocks = max(p // bs + n * -(-s // bs) for p, n, s in points)
    generator = torch.Generator(device=device).manual_seed(0)
    # [2, num_blocks, block_size, num_kv_heads, head_size]: keys and values of one layer.
    kv_cache = torch.randn(
        2, num_blocks, bs, shape.num_kv_heads, shape.head_size, generator=generator, device=device
    ).to(dtype)
    backend = get_attn_backend(attention_backend)
    builder = backend.get_builder_cls()(device)
    impl = backend.get_impl_cls()(shape.num_heads, shape.head_size, shape.head_size**-0.5, shape.num_kv_heads)
    num_sms = get_num_sms(device)

    for prefix_len, num_reqs, suffix_len in points:
        start = time.perf_counter()
        common = shared_prefix_metadata(prefix_len, num_reqs, suffix_len, query_len, shape, device)
        num_tokens = num_reqs * query_len
        q = torch.randn(num_tokens, shape.num_heads, shape.head_size, generator=generator, device=device).to(
            dtype
        )
        k, v = torch.randn(
            2, num_tokens, shape.num_kv_heads, shape.head_size, generator=generator, device=device
        ).to(dtype)
        outputs = {}
        seconds = {}
        for path, common_prefix_len in (("plain", 0), ("cascade", prefix_len)):
            metadata = builder.build(common_prefix_len, common)
            out = outputs[path] = torch.empty_like(q)
            forward = functools.partial(impl.forward, None, q, k, v, kv_cache, metadata, out)
            seconds[path] = best_time(forward, device, repeats)
        plain = attention_traffic(prefix_len, num_reqs, suffix_len, shape, False, query_len)
        cascade = attention_traffic(prefix_len, num_reqs, suffix_len, shape, True, query_len)
        model_picks_cascade = use_cascade_attention(
            common_prefix_len=prefix_len,
            query_lens=np.full(num_reqs, query_len),
            num_query_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            use_alibi=False,
            use_sliding_window=False,
            use_local_attention=False,
            num_sms=num_sms,
        )
        speedup = seconds["plain"] / seconds["cascade"]
        rows.append(
            {
                "prefix_len": prefix_len,
                "num_reqs": num_reqs,
                "suffix_len": suffix_len,
                "query_len": query_len,
                "plain_ms": 1e3 * seconds["plain"],
                "cascade_ms": 1e3 * seconds["cascade"],
                "speedup": speedup,
                "plain_kv_bytes": plain.kv_bytes,
                "cascade_kv_bytes": cascade.kv_bytes,
                "bytes_ratio": plain.total_bytes / cascade.total_bytes,
                "predicted_speedup_h200": predicted_speedup(
                    prefix_len, num_reqs, suffix_len, shape, query_len=query_len
                ),
                # Bytes the plain kernel is charged with, per second: above the HBM bandwidth, L2 served some.
                "plain_effective_GBps": plain.total_bytes / seconds["plain"] / 1e9,
                "cascade_effective_GBps": cascade.total_bytes / seconds["cascade"] / 1e9,
                # Attention FLOPs per second: how near the cascade path came to being compute bound.
                "cascade_TFLOPs": cascade.flops / seconds["cascade"] / 1e12,
                "model_picks_cascade": model_picks_cascade,
                "cascade_faster": speedup > 1.0,
                "model_agrees": model_picks_cascade == (speedup > 1.0),
                "max_abs_diff": float((outputs["plain"].float() - outputs["cascade"].float()).abs().max()),
                "wall_s": time.perf_counter() - start,
            }
        )
        print(
            f"  prefix {prefix_len:>6} x {num_reqs:>3} reqs x suffix {suffix_len:>5} (q {query_len:>2}): "
            f"plain {1e3 * seconds['plain']:8.3f} ms, cascade {1e3 * seconds['cascade']:8.3f} ms, "
            f"{speedup:6.2f}x (bytes {rows[-1]['bytes_ratio']:6.1f}x); "
            f"model: {'cascade' if model_picks_cascade else 'plain'}"
        )
    return rows


def run_grid(
    device: torch.device, smoke: bool = False, rows: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The grid for this device: the full one on a GPU (Triton, bf16), a small one on a CPU (reference, float32).

    On a GPU, besides the decode grid, a few points with 16-query chunks (no flash-decoding
    there, so vLLM's rule always picks cascade).
    """
    on_gpu = device.type == "cuda"
    rows = [] if rows is None else rows
    if smoke:
        decode = [(256, 8, 16)]
        chunk: list[tuple[int, int, int]] = []
    elif on_gpu:
        decode = [(p, b, s) for p in PREFIX_LENS for b in BATCH_SIZES for s in SUFFIX_LENS]
        chunk = [(p, b, 128) for p in (4096, 16384) for b in (8, 32)]
    else:
        decode = [(p, b, 32) for p in (256, 1024) for b in (8, 32)]
        chunk = []
    attention_backend = "FLASH_ATTN" if on_gpu else "TORCH_REFERENCE"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = QWEN3_0_6B_ATTENTION if on_gpu else AttentionShape(16, 8, 128, dtype_bytes=4)
    repeats = 3 if smoke or not on_gpu else 10
    measure_grid(decode, device, attention_backend, dtype, shape, query_len=1, repeats=repeats, rows=rows)
    if chunk:
        measure_grid(chunk, device, attention_backend, dtype, shape, query_len=16, repeats=repeats, rows=rows)
    return summarize(rows, shape, attention_backend, device, dtype)


def summarize(
    rows: list[dict[str, Any]],
    shape: AttentionShape,
    attention_backend: str,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """The rows, with the goal point's speed-up and how often the performance model picked the faster path."""
    goal = [
        r
        for r in rows
        if (r["prefix_len"], r["num_reqs"], r["suffix_len"]) == GOAL_POINT and r["query_len"] == 1
    ]
    return {
        "benchmark": NAME,
        "attention_backend": attention_backend,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": asdict(shape),
        "num_sms_assumed": get_num_sms(device),
        "rows": rows,
        "speedup_at_goal_point": goal[0]["speedup"] if goal else None,
        "goal_point": dict(zip(("prefix_len", "num_reqs", "suffix_len"), GOAL_POINT)),
        "goal": dict(GOAL),
        "model_agreement": float(np.mean([r["model_agrees"] for r in rows])) if rows else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cascade", description=__doc__.splitlines()[0], epilog=NEEDS_CHECKOUT
    )
    parser.add_argument("--out", required=True, help="write the results (JSON) here")
    parser.add_argument("--smoke", action="store_true", help="one tiny grid point, runs anywhere in seconds")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = run_grid(device, smoke=args.smoke)
    print(
        f"speed-up at prefix/batch/suffix {GOAL_POINT}: {report['speedup_at_goal_point']} "
        f"(goal: >= {GOAL['min_speedup_at_goal_point']:.0f}x); the model picked the faster path in "
        f"{report['model_agreement']:.0%} of the grid (goal: >= {GOAL['min_model_agreement']:.0%})"
    )
    write_json(args.out, {**report, "smoke": args.smoke})
    return report


if __name__ == "__main__":
    main()
