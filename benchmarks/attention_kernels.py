"""Attention kernels: the Triton paged kernel against gather-then-SDPA, for prefill, decode and mixed batches.

Mirrors no vLLM module: vLLM's kernel benchmarks are scripts in its repository's
benchmarks/kernels/ (chapter 06).
Needs a source checkout (`pip install .` installs only nano_v1): run from its root,
`python -m benchmarks.attention_kernels`.

Why it exists: a paged kernel must earn its complexity. The obvious PyTorch way to attend
over a paged cache is to gather every request's pages into one padded, contiguous K/V
batch and call `F.scaled_dot_product_attention`: it reads the context, writes a copy,
reads the copy again, and pads every request to the longest. Each implementation here
runs the same batch, and its time is set against the least the batch must cost: the K/V
of every context read once plus q and out (bytes, over the measured copy bandwidth) or the
attention FLOPs (over the measured matmul rate), whichever is larger.

    python -m benchmarks.attention_kernels --out OUT.json           # CUDA: Qwen3-0.6B attention
    python -m benchmarks.attention_kernels --out OUT.json --smoke   # anywhere, tiny

Implementations (all with `unified_attention`'s signature):
  - `triton`: `nano_v1/attention/ops/triton_unified_attention.py` (on a CPU only in
    Triton's interpreter, so there it is checked, never timed);
  - `gather_sdpa`: `gather_sdpa_attention` below, the baseline;
  - `reference`: `nano_v1/attention/ops/reference.py`, float32 math, decodes batched and
    multi-query requests looped.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import NEEDS_CHECKOUT
from benchmarks.context import CONFIGS_DIR
from nano_v1.attention.ops import reference
from nano_v1.benchmarks.roofline import (
    DeviceCeilings,
    ModelShape,
    best_time,
    measure_device_ceilings,
    step_cost,
)
from nano_v1.benchmarks.utils import write_json

NAME = "attention_kernels"
QWEN3_0_6B = CONFIGS_DIR / "qwen3-0.6b"
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Workload:
    """One step's batch: request r computes `query_lens[r]` new tokens, ending at context `seq_lens[r]`."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


def workloads(on_cuda: bool, smoke: bool) -> list[Workload]:
    """Prefill, decode and mixed batches: sized for an H200 (KV reads of 0.1-1 GiB, far past its
    50 MB L2 cache), or tiny for a CPU check."""
    if on_cuda and not smoke:
        return [
            Workload("prefill 4x2048", (2048,) * 4, (2048,) * 4),
            Workload("decode 16 x ctx 4096", (1,) * 16, (4096,) * 16),
            Workload("decode 128 x ctx 2048", (1,) * 128, (2048,) * 128),
            Workload("mixed 96 decodes + 2 chunks of 512", (1,) * 96 + (512,) * 2, (2048,) * 96 + (2048,) * 2),
        ]
    return [
        Workload("prefill 2x16", (16,) * 2, (16,) * 2),
        Workload("decode 4 x ctx 40", (1,) * 4, (40,) * 4),
        Workload("mixed 3 decodes + 1 chunk of 8", (1,) * 3 + (8,), (40,) * 3 + (24,)),
    ]


@dataclass
class PagedInputs:
    """A workload's tensors: random q and cache, pages in shuffled order, as the engine would pass them."""

    q: torch.Tensor  # [num_tokens, num_heads, head_size]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    seqused_k: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_pages] int32
    max_seqlen_q: int
    max_seqlen_k: int

    def args(self, out: torch.Tensor) -> tuple:
        """`unified_attention`'s positional arguments, causal."""
        return (self.q, self.k_cache, self.v_cache, out, self.cu_seqlens_q, self.max_seqlen_q,
                self.seqused_k, self.max_seqlen_k, self.q.shape[2] ** -0.5, True, self.block_table)


def make_inputs(w: Workload, shape: ModelShape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> PagedInputs:
    """Random q and cache drawn on `device` (a GiB of cache is slow to draw on a CPU and copy over)."""
    gen = torch.Generator(device).manual_seed(seed)
    seq_lens = np.array(w.seq_lens)
    pages = -(-seq_lens // BLOCK_SIZE)
    num_blocks = int(pages.sum())
    block_ids = np.random.default_rng(seed).permutation(num_blocks)  # each request's pages scattered
    block_table = np.zeros((len(seq_lens), int(pages.max())), dtype=np.int32)
    starts = np.cumsum(pages) - pages
    for r, (start, n) in enumerate(zip(starts, pages)):
        block_table[r, :n] = block_ids[start : start + n]
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    on = {"device": device, "generator": gen}
    return PagedInputs(
        q=torch.randn(sum(w.query_lens), shape.num_heads, shape.head_dim, **on).to(dtype),
        k_cache=torch.randn(cache_shape, **on).to(dtype),
        v_cache=torch.randn(cache_shape, **on).to(dtype),
        cu_seqlens_q=torch.tensor(np.concatenate([[0], np.cumsum(w.query_lens)]), dtype=torch.int32, device=device),
        seqused_k=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.from_numpy(block_table).to(device),
        max_seqlen_q=max(w.query_lens),
        max_seqlen_k=int(seq_lens.max()),
    )


def gather_sdpa_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    max_seqlen_q: int,
    seqused_k: torch.Tensor,  # [num_reqs] int32
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req] int32
) -> None:
    """The baseline: pad the batch, gather every request's pages into contiguous K/V, one SDPA call.

    No loop and no host sync, in the input dtype; the cost is the copy (written, then read
    again) and the padding: every request is padded to the longest query and context.
    The query heads that share a KV head are stacked as extra query rows (as the Triton
    kernel does), so SDPA sees plain multi-head attention and may pick a fused kernel that
    takes a mask. `q` must have no padding rows past `cu_seqlens_q[-1]`, and cache slots
    past a context must hold finite values (they are read, then masked: 0 x NaN is NaN).
    """
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group, num_reqs = num_heads // num_kv_heads, seqused_k.shape[0]
    num_pages = -(-max_seqlen_k // block_size)
    pages = block_table[:, :num_pages].long()  # [num_reqs, num_pages]
    k = k_cache[pages].flatten(1, 2)[:, :max_seqlen_k]  # [num_reqs, max_seqlen_k, num_kv_heads, head_size]
    v = v_cache[pages].flatten(1, 2)[:, :max_seqlen_k]
    # Padded query i of request r is flat row cu_seqlens_q[r] + i (clamped: padding rows read anything).
    starts, query_lens = cu_seqlens_q[:-1].long(), (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    i = torch.arange(max_seqlen_q, device=q.device)
    rows = (starts[:, None] + i).clamp(max=num_tokens - 1)  # [num_reqs, max_seqlen_q]
    q_pad = q[rows].view(num_reqs, max_seqlen_q, num_kv_heads, group, head_size)
    q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group * max_seqlen_q, head_size)
    # Query i sits at position seq_len - query_len + i; it sees keys below seq_len (and, causal, up to itself).
    key_pos = torch.arange(max_seqlen_k, device=q.device)
    seq_lens = seqused_k.long()
    visible = key_pos[None, None, :] < seq_lens[:, None, None]  # [num_reqs, 1, max_seqlen_k]
    if causal:
        q_pos = (seq_lens - query_lens)[:, None] + i  # [num_reqs, max_seqlen_q]
        visible = visible & (key_pos[None, None, :] <= q_pos[:, :, None])  # [num_reqs, max_seqlen_q, max_seqlen_k]
    visible = visible.expand(num_reqs, max_seqlen_q, max_seqlen_k).repeat(1, group, 1)  # rows as in q_pad
    o = F.scaled_dot_product_attention(
        q_pad, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible[:, None], scale=softmax_scale
    )  # [num_reqs, num_kv_heads, group * max_seqlen_q, head_size]
    o = o.view(num_reqs, num_kv_heads, group, max_seqlen_q, head_size).permute(0, 3, 1, 2, 4)
    o = o.reshape(num_reqs, max_seqlen_q, num_heads, head_size)
    # Back to the flat batch: token t is query t - cu_seqlens_q[r] of its request r.
    token = torch.arange(num_tokens, device=q.device)
    req = torch.searchsorted(cu_seqlens_q[1:].long(), token, right=True)
    out.copy_(o[req, token - starts[req]])


IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    "gather_sdpa": gather_sdpa_attention,
    "reference": reference.unified_attention,
}


def workload_bytes_and_flops(w: Workload, shape: ModelShape, dtype_bytes: int) -> tuple[int, int]:
    """Least bytes (each context's K/V read once, q read, out written) and attention FLOPs of one layer."""
    cost = step_cost(shape, w.query_lens, w.seq_lens, dtype_bytes)  # counts every layer of the model
    q_and_out = 2 * cost.num_tokens * shape.q_size * dtype_bytes
    return cost.kv_read_bytes // shape.num_layers + q_and_out, cost.attention_flops // shape.num_layers


def run_attention_kernels(
    device: torch.device, ceilings: DeviceCeilings, smoke: bool = False, repeats: int = 10,
    check_triton: bool = True,
) -> dict[str, Any]:
    """Time every implementation on every workload; check each against the reference.

    On CUDA the Triton kernel is timed; on a CPU it runs once in the interpreter (set
    before its import; seconds per workload) and only its error is recorded, unless
    `check_triton` is off.
    """
    on_cuda = device.type == "cuda"
    impls = dict(IMPLEMENTATIONS)
    if on_cuda or check_triton:
        if not on_cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from nano_v1.attention.ops.triton_unified_attention import unified_attention

        impls = {"triton": unified_attention, **impls}
    shape = ModelShape.from_pretrained(QWEN3_0_6B)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    timed = [name for name in impls if on_cuda or name != "triton"]
    rows = []
    for w in workloads(on_cuda, smoke):
        inputs = make_inputs(w, shape, dtype, device)
        num_bytes, flops = workload_bytes_and_flops(w, shape, dtype.itemsize)
        floor_s = max(num_bytes / ceilings.memory_bandwidth, flops / ceilings.matmul_flops)
        outs = {}
        for name, fn in impls.items():
            outs[name] = torch.full_like(inputs.q, float("nan"))
            fn(*inputs.args(outs[name]))
        row: dict[str, Any] = {
            "workload": w.name, "num_reqs": len(w.query_lens), "num_tokens": sum(w.query_lens),
            "context_tokens": sum(w.seq_lens), "bytes": num_bytes, "flops": flops, "floor_s": floor_s,
            "bound": "memory" if num_bytes / ceilings.memory_bandwidth >= flops / ceilings.matmul_flops else "compute",
            "max_abs_err_vs_reference": {
                name: float((outs[name].float() - outs["reference"].float()).abs().max())
                for name in impls if name != "reference"
            },
        }
        for name in timed:
            seconds = best_time(functools.partial(impls[name], *inputs.args(outs[name])), device, repeats)
            row[name] = {
                "time_ms": 1e3 * seconds,
                "GBps": num_bytes / seconds / 1e9,
                "fraction_of_copy_bandwidth": num_bytes / ceilings.memory_bandwidth / seconds,
                "TFLOPs": flops / seconds / 1e12,
                "fraction_of_roofline": floor_s / seconds,
            }
        # The ratio that matters, measured side by side: the baseline's time over each other's.
        row["speedup_vs_gather_sdpa"] = {
            name: row["gather_sdpa"]["time_ms"] / row[name]["time_ms"] for name in timed if name != "gather_sdpa"
        }
        print(f"  {w.name:<36} " + "  ".join(
            f"{name} {row[name]['time_ms']:8.3f} ms ({row[name]['fraction_of_roofline']:6.1%} of roofline)"
            for name in timed
        ) + "  speed-up over gather_sdpa: " + ", ".join(
            f"{name} {x:.2f}x" for name, x in row["speedup_vs_gather_sdpa"].items()
        ))
        rows.append(row)
        del inputs, outs
    return {
        "shape": {"num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads, "head_size": shape.head_dim,
                  "block_size": BLOCK_SIZE, "dtype": str(dtype).removeprefix("torch.")},
        "ceilings": ceilings.to_dict(),
        "triton_timed": on_cuda,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_kernels",
                                     description=__doc__.splitlines()[0], epilog=NEEDS_CHECKOUT)
    parser.add_argument("--out", required=True, help="write the results JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU sizes), on any device")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceilings = measure_device_ceilings(device, smoke=args.smoke or device.type == "cpu")
    results = run_attention_kernels(device, ceilings, smoke=args.smoke)
    write_json(args.out, {"benchmark": NAME, "smoke": args.smoke, **results})
    return results


if __name__ == "__main__":
    main()
