# ---
# jupyter:
#   jupytext:
#     formats: py:percent,ipynb
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · The attention backend: metadata, a paged Triton kernel, and what it must beat
#
# Chapter 06 claims that an attention kernel over a paged, ragged batch needs only a
# handful of small tensors per step, and that reading pages straight from the cache (one
# pass, online softmax) beats gathering them into a contiguous copy first. This notebook
# prints the metadata of one real engine step, counts the bytes a batch must move, checks
# the Triton kernel against float64 attention (on a CPU, in Triton's interpreter), times
# the two PyTorch paths a CPU can time, and shows the GPU measurements when a run of the
# GPU suite is recorded.

# %%
import dataclasses
import os
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import torch

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/

if not nb.ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined: before its import
# The engine core in this process (vLLM's switch, read when an `LLM` is built): the notebook
# hands its worker a function through `collective_rpc`, which cannot cross to another process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks.attention_kernels import (
    QWEN3_0_6B,
    Workload,
    gather_sdpa_attention,
    make_inputs,
    run_attention_kernels,
    workload_bytes_and_flops,
    workloads,
)
from nano_v1 import LLM, SamplingParams
from nano_v1.attention.ops import reference
from nano_v1.attention.ops.triton_unified_attention import unified_attention as triton_unified_attention
from nano_v1.benchmarks.roofline import H200_DATASHEET, ModelShape, measure_device_ceilings
from nano_v1.benchmarks.utils import write_tiny_qwen3
from tools.ledger import latest_gpu_results

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
nb.set_threads()
print(nb.device_label())

# %% [markdown]
# ## The metadata of one step
#
# A tiny engine (random weights, block size 4 so that requests span several blocks) runs
# three requests. After a first step, a third request arrives with a prompt longer than
# the step's token budget, so the second step mixes two decodes with a chunk of a
# prefill. We catch the `FlashAttentionMetadata` the runner builds for that step (a
# function run in the worker through `collective_rpc` keeps everything its builder
# returns): every attention layer of the model reads these same few tensors.

# %%
model_dir = write_tiny_qwen3(tempfile.mkdtemp(prefix="nano_v1_nb06_"), weights=False)
llm = LLM(model=model_dir, load_format="dummy", dtype="float32", device=nb.DEVICE, seed=0, block_size=4,
          max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
engine = llm.llm_engine
built = []


def keep_built_metadata(worker, built: list) -> None:
    """In the worker: append every attention metadata its runner builds to `built`."""
    builder = worker.model_runner.attn_metadata_builder
    build = builder.build
    builder.build = lambda *a, **k: built.append(build(*a, **k)) or built[-1]


llm.collective_rpc(keep_built_metadata, args=(built,))

params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
engine.add_request("a", {"prompt_token_ids": list(range(1, 6))}, params)  # 5-token prompt
engine.add_request("b", {"prompt_token_ids": list(range(1, 8))}, params)  # 7-token prompt
engine.step()  # prefills a and b
engine.add_request("c", {"prompt_token_ids": list(range(1, 31))}, params)  # 30 tokens: more than the budget
engine.step()  # a, b decode; c gets the rest of the 16-token budget
m = built[-1]
for name in ("num_actual_tokens", "max_query_len", "query_start_loc", "max_seq_len", "seq_lens",
             "block_table", "slot_mapping", "causal"):
    value = getattr(m, name)
    if name == "block_table":  # one row per request, max_model_len / block_size columns; the used ones:
        value = value[:, : -(-m.max_seq_len // 4)]
    print(f"{name:>17} = {value.tolist() if isinstance(value, torch.Tensor) else value}")
engine.abort_request(["a", "b", "c"])

# %% [markdown]
# Read it as the kernel does. `query_start_loc` cuts the 16 flat tokens into requests:
# one query for a, one for b, fourteen for c. `seq_lens` is each context *after* this
# step: a and b decode their 6th and 8th token, c computes tokens 0-13 of its prompt.
# Request r's key at position p lives in block `block_table[r, p // 4]`, slot offset
# `p % 4`; `slot_mapping` is where each new token's key and value are written, block id x
# 4 + offset. Nothing else is needed: the queries sit at the last `query_len` positions of
# each context, so the causal mask follows from the two lengths.

# %% [markdown]
# ## Count the bytes first
#
# The rest of the notebook uses Qwen3-0.6B's attention shape: 16 query heads sharing 8 KV
# heads (GQA group of 2), head size 128, blocks of 16 tokens, bfloat16 on a GPU. A layer's
# attention must read each request's K and V once (2 x 8 x 128 x 2 bytes = 4 KiB per
# context token), read q and write the output; it does 4 x 16 x 128 FLOPs per
# (query, visible key) pair. Against the H200's datasheet (4.8 TB/s, 989 TFLOP/s bf16):

# %%
shape = ModelShape.from_pretrained(QWEN3_0_6B)
for w in workloads(on_cuda=True, smoke=False):
    num_bytes, flops = workload_bytes_and_flops(w, shape, dtype_bytes=2)
    t_mem, t_flop = num_bytes / H200_DATASHEET.memory_bandwidth, flops / H200_DATASHEET.matmul_flops
    print(f"{w.name:<36} {num_bytes / 2**20:8.1f} MiB {flops / 1e9:8.1f} GFLOP   floor {1e6 * max(t_mem, t_flop):7.1f} µs "
          f"({'memory' if t_mem >= t_flop else 'compute'} bound, {flops / num_bytes:6.1f} FLOP/byte)")

# %% [markdown]
# Decode does 2 FLOPs per byte of KV per query head it serves (16 / 8 heads share each
# byte): far below the ~200 FLOP/byte at which the H200 turns compute bound, so a decode
# kernel is a memory copy in disguise and its yardstick is the copy bandwidth. A 2,048-token
# prefill reuses each key for up to 2,048 queries and is compute bound.
#
# ## Check: the Triton kernel against float64
#
# On a CPU the kernel runs in Triton's interpreter (numpy, one program after another):
# the same code, slow, so only a small batch. Keys and values are rounded to each dtype
# first; the oracle is float64 attention over each request's contiguous keys. The
# reference and the gather-then-SDPA baseline are checked the same way.

# %%
small = dataclasses.replace(shape, num_heads=4, num_kv_heads=2, head_dim=64)
check = Workload("check", (1, 1, 9, 1, 5), (23, 40, 9, 1, 37))  # decodes, a prefill, a chunk


def float64_attention(inputs, w):
    """Each request's context gathered page by page, causal softmax in float64."""
    group, device = small.num_heads // small.num_kv_heads, inputs.q.device
    outs = []
    for r, (q_len, seq_len) in enumerate(zip(w.query_lens, w.seq_lens)):
        pages = inputs.block_table[r, : -(-seq_len // 16)].long()
        k = inputs.k_cache[pages].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)  # [L, H, D]
        v = inputs.v_cache[pages].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        q = inputs.q[inputs.cu_seqlens_q[r] : inputs.cu_seqlens_q[r + 1]].double()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
        key_pos, q_pos = torch.arange(seq_len, device=device), torch.arange(seq_len - q_len, seq_len, device=device)
        hidden = key_pos[None, :] > q_pos[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


impls = {"triton": triton_unified_attention, "reference": reference.unified_attention,
         "gather_sdpa": gather_sdpa_attention}
errors = {}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    inputs = make_inputs(check, small, dtype, torch.device(nb.DEVICE))
    expected = float64_attention(inputs, check)
    for name, fn in impls.items():
        out = torch.full_like(inputs.q, float("nan"))
        fn(*inputs.args(out))
        # Relative to the largest exact output, so that it compares with the unit roundoff.
        errors[(name, str(dtype)[6:])] = float((out.double() - expected).abs().max() / expected.abs().max())
print(f"max |error| / max |exact| vs float64 over {sum(check.query_lens)} query rows x 4 heads x 64:")
print(f"{'':>12}" + "".join(f"{d:>12}" for d in ("float32", "float16", "bfloat16")))
for name in impls:
    print(f"{name:>12}" + "".join(f"{errors[(name, d)]:12.2e}" for d in ("float32", "float16", "bfloat16")))
unit_roundoff = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
print("unit roundoff" + "".join(f"{u:12.2e}" for u in unit_roundoff.values()))

# %% [markdown]
# The errors are divided by the largest exact output, so each compares with its dtype's
# unit roundoff (the black marks): in float16 and bfloat16 every path stays under one
# unit, the error of rounding the output once; in float32 the accumulated sums cost a
# few units, still 10⁻⁷ of the output. The kernel accumulates in float32 and rounds once
# when it stores (compiled, it also rounds the probabilities it feeds to the P·V product
# to 16 bits, as FlashAttention does); the reference computes in float32 whatever the
# input. One interpreter detail: its float32 -> bfloat16 conversion truncates where
# compiled Triton rounds to nearest, so an interpreted bfloat16 error can reach two
# units. The tests (`tests/test_attention_triton.py`) check the same on random batches
# for every GQA group, head size, dtype and mask.
#
# ## Time what a CPU can time
#
# The two PyTorch paths side by side on small batches (the interpreter is far too slow to
# time). The reference batches its decodes and loops over multi-query requests; the
# baseline pads every request to the longest query and context and makes one SDPA call.

# %%
ceilings = measure_device_ceilings(nb.DEVICE, smoke=True)
cpu = run_attention_kernels(torch.device(nb.DEVICE), ceilings, smoke=True, repeats=nb.pick(20, 20, 3),
                            check_triton=False)
print(f"{'workload':<36} {'reference ms':>13} {'gather_sdpa ms':>15} {'gather_sdpa / reference':>24}")
for row in cpu["rows"]:
    print(f"{row['workload']:<36} {row['reference']['time_ms']:13.3f} {row['gather_sdpa']['time_ms']:15.3f} "
          f"{row['speedup_vs_gather_sdpa']['reference']:23.2f}x")

# %% [markdown]
# ## The GPU numbers
#
# On a GPU the Triton kernel is timed against the baseline on an H200 by the GPU suite
# (`python -m benchmarks.gpu_suite --only attention_kernels`, or the whole suite),
# whose results are committed under figures/data/.

# %%
record = nb.recorded_gpu_results("attention_kernels")
if record is None and (standalone := latest_gpu_results("attention_kernels")) is not None:
    record = standalone, f"recorded: {nb.device_label(standalone['environment'])} ({standalone['ledger_file']})"
gpu = record[0] if record else None
if gpu is None:
    print("No GPU run of attention_kernels is recorded yet (figures/data/ has none): "
          "the plot below shows the CPU measurements only.")
else:
    print(record[1])
    print(f"{'workload':<36} {'triton ms':>10} {'GB/s':>8} {'of copy bw':>10} {'of roofline':>11} "
          f"{'gather_sdpa ms':>15} {'speed-up':>9}")
    for row in gpu["rows"]:
        t = row["triton"]
        print(f"{row['workload']:<36} {t['time_ms']:10.3f} {t['GBps']:8.0f} {t['fraction_of_copy_bandwidth']:10.1%} "
              f"{t['fraction_of_roofline']:11.1%} {row['gather_sdpa']['time_ms']:15.3f} "
              f"{row['speedup_vs_gather_sdpa']['triton']:8.2f}x")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
x = np.arange(3)
for i, name in enumerate(impls):
    axes[0].bar(x + (i - 1) * 0.27, [errors[(name, d)] for d in ("float32", "float16", "bfloat16")], 0.27,
                label=name)
axes[0].plot(x, list(unit_roundoff.values()), "k_", markersize=30, label="unit roundoff")
axes[0].set(yscale="log", xticks=x, xticklabels=["float32", "float16", "bfloat16"],
            ylabel="max |error| / max |exact output| (float64)",
            title="all three err by a few roundings of their dtype at most\n(Triton run in the interpreter)")
shown = gpu or cpu
names = ["triton", "gather_sdpa"] if gpu else ["reference", "gather_sdpa"]
labels = [row["workload"] for row in shown["rows"]]
y = np.arange(len(labels))
for i, name in enumerate(names):
    axes[1].barh(y + (i - 0.5) * 0.4, [row[name]["fraction_of_roofline"] for row in shown["rows"]], 0.4, label=name)
axes[1].set(yticks=y, yticklabels=labels, xlabel="fraction of the roofline (time floor / time)",
            title=("NVIDIA H200, recorded: the Triton kernel against the padded baseline" if gpu
                   else "this CPU: the two PyTorch paths, far below the roofline"))
if not gpu:
    axes[1].set_xlim(0, 1.9 * axes[1].get_xlim()[1])  # room for the note on the right
    axes[1].text(0.98, 0.5, "Triton is not timed here:\non a CPU it runs in the\ninterpreter, one Python\n"
                 "call per program. Its speed\nneeds a GPU run (none is\nrecorded in figures/data/).",
                 transform=axes[1].transAxes, ha="right", va="center", fontsize=8,
                 bbox={"facecolor": "white", "edgecolor": "0.7"})
axes[1].invert_yaxis()
nb.finish_figure(fig, "paged attention, Qwen3-0.6B attention shape")
plt.show()

# %% [markdown]
# ## Explain the gap
#
# The baseline writes a padded copy of every context and reads it again, and pads every
# request's queries to the longest: in the mixed batch, 96 one-token decodes are padded to
# 512 query rows each. The reference avoids the padding of queries by looping over
# multi-query requests, at one set of kernel launches per request. The Triton kernel does
# neither: each program reads only its request's pages, once, for all the query heads
# that share them. Its decode fraction of the copy bandwidth is the number to watch; a
# small decode batch leaves most of the GPU's SMs idle (one program per request per KV
# head), which is why vLLM adds a second kernel that splits long contexts across programs.

# %%
print(nb.save_figure(fig, "06_attention_backend"))
print(nb.save_data("06_attention_backend", {
    "step_metadata": {name: (v.tolist() if isinstance(v, torch.Tensor) else v)
                      for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
                      for v in [getattr(m, name)]},
    "errors_vs_float64": {f"{name}/{dtype}": e for (name, dtype), e in errors.items()},
    "cpu_timing": cpu,
    "gpu_recorded": record[1] if record else None,
}))
