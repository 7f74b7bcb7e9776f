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
# # 16 · KV connectors: what moving KV costs, and what it saves
#
# Chapter 16 lets a prompt's keys and values come from outside the engine: a prefill
# engine saves them and a decode engine loads them (`SharedStorageConnector`), or a CPU
# tier keeps blocks the device cache evicted (`OffloadingConnector`). This notebook checks
# the chapter's predictions on the demo model, on this machine:
#
# 1. **bytes per prompt token**, predicted from the KV cache's shape and measured on disk;
#    the decode side's **time to first token** with the prefill stored, against computing
#    the prompt again;
# 2. **offloading**: prefix hits and recomputed tokens against the CPU tier's size;
# 3. **why P/D exists**: a decode stream's inter-token latency while long prompts arrive,
#    one server against a prefill server plus a decode server, on the same cores.

# %%
import os
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import torch

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from benchmarks import kv_connectors as kvb

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
nb.set_threads()
SIZE = "SMOKE (tiny sizes, 1 repeat)" if SMOKE else "full size"
load_before = os.getloadavg()  # other jobs on this machine compete for its cores
print(nb.device_label(), f"· torch threads: {torch.get_num_threads()} · load average {load_before} · {SIZE}")

# %% [markdown]
# ## Count first
#
# A token's KV is a key and a value vector per layer and KV head. The demo model has 4
# layers and 2 KV heads of 64 dimensions, and runs here in float32:
#
#     2 x 4 x 2 x 64 x 4 bytes = 4,096 bytes per token
#
# Computing that token instead costs about 2 FLOPs per weight outside the embedding
# (3.1 M of them): 6.3 MFLOP, or about 1,500 FLOPs per byte of KV. This CPU computes a few
# tens of GFLOP/s and reads a few GB/s from the page cache, so loading a stored prefix
# should cost a small fraction of computing it: we predict a decode-side time to first
# token nearly flat in the prompt length when the prefill is stored, against a recompute
# time that grows with it.

# %%
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine.arg_utils import EngineArgs

demo_config = EngineArgs(model=str(DEMO_MODEL_PATH), dtype="float32").create_engine_config()
print("predicted bytes per token:", kvb.kv_bytes_per_token(demo_config))

# %% [markdown]
# ## 1 · Disaggregated prefill through files
#
# Each prompt length gets fresh random prompts (one per repeat), so no engine finds them in
# its own prefix cache. A plain engine times each one (recompute); a prefill engine
# (`kv_producer`) computes and saves them all; a fresh decode engine (`kv_consumer`) is
# given each prompt plus the prefill's first token, as v0.11.0's disaggregated-prefill
# example does, and loads the saved whole blocks. The benchmark checks before it reports:
# every decode request loaded exactly the predicted tokens, and the prefill's first token
# is the plain engine's.

# %%
STORAGE = nb.pick(cpu=dict(prompt_lens=(64, 256, 512, 1024, 1536, 2000), repeats=5),
                  gpu=dict(prompt_lens=(64, 256, 512, 1024, 1536, 2000), repeats=5),
                  smoke=dict(prompt_lens=(40, 100), repeats=1))
with tempfile.TemporaryDirectory() as storage_dir:
    storage = kvb.measure_shared_storage(STORAGE["prompt_lens"], STORAGE["repeats"], storage_dir)
print(f"bytes per token: predicted {storage['predicted_bytes_per_token']:,}, "
      f"on disk {storage['measured_bytes_per_token']:,.1f} ({storage['num_files']} files)")
for r in storage["rows"]:
    print(f"prompt {r['prompt_len']:>5} (saved {r['saved_tokens']:>5}): recompute "
          f"{r['recompute_ttft_ms']['median']:7.1f} ms, loaded {r['loaded_ttft_ms']['median']:6.1f} ms, "
          f"prefill + save {r['prefill_and_save_ms']['median']:7.1f} ms")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
lens = [r["prompt_len"] for r in storage["rows"]]
for key, label, color in (("recompute_ttft_ms", "decode engine computes the prompt (plain engine)", "tab:red"),
                          ("loaded_ttft_ms", "decode engine loads the stored prefill", "tab:blue"),
                          ("prefill_and_save_ms", "prefill engine: compute and save", "tab:gray")):
    med = np.array([r[key]["median"] for r in storage["rows"]])
    lo = med - np.array([r[key]["min"] for r in storage["rows"]])
    hi = np.array([r[key]["max"] for r in storage["rows"]]) - med
    ax.errorbar(lens, med, yerr=[lo, hi], marker="o", capsize=3, label=label, color=color)
ax.set_xlabel("prompt length (tokens)")
ax.set_ylabel("time to first token (ms)")
ax.set_title("median of the repeats; bars: fastest to slowest", fontsize=8)
ax.set_ylim(bottom=0)
nb.finish_figure(fig, f"KV through files, demo model: {storage['predicted_bytes_per_token']:,} B/token predicted,\n"
                      f"{storage['measured_bytes_per_token']:,.0f} on disk [{SIZE}]")
print(nb.save_figure(fig, "16_shared_storage"))

# %% [markdown]
# ## 2 · Offloading: a CPU tier against the device cache's evictions
#
# Four prompts share a 32-token prefix and have 40 tokens of their own; they arrive one at
# a time, cycled twice, on a device cache of 8 usable blocks of 16 tokens: too small to
# keep them all, so each round evicts what the next needs. Only full blocks are stored:
# the working set is 2 shared blocks plus 4 x 2 full blocks of their own (each prompt's
# last 8 tokens fill no block), 10 blocks. A CPU tier that holds them should turn every
# evicted block into a load in the second round (4 x 2 blocks = 128 tokens; the shared
# prefix stays a device hit); under LRU, any smaller tier evicts each prompt just before
# it comes back (the order is cyclic), and should load nothing.

# %%
OFFLOAD_SIZES = [0, 4, 8, 12, 14, 16, 24]
offload = kvb.offload_sweep(OFFLOAD_SIZES)
for r in offload:
    print(f"CPU tier {r['num_cpu_blocks']:>3} blocks: computed {r['computed_prompt_tokens']:>4} of "
          f"{r['prompt_tokens']} prompt tokens, loaded {r['loaded_tokens']:>4}, device hits "
          f"{r['device_hit_tokens']:>4}, hit rate {r['prefix_hit_rate']:.2f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
sizes = [r["num_cpu_blocks"] for r in offload]
ax.bar(np.arange(len(sizes)) - 0.2, [r["computed_prompt_tokens"] for r in offload], 0.4,
       label="prompt tokens computed", color="tab:red")
ax.bar(np.arange(len(sizes)) + 0.2, [r["loaded_tokens"] for r in offload], 0.4,
       label="prompt tokens loaded from the CPU tier", color="tab:blue")
ax.set_xticks(np.arange(len(sizes)), [str(s) if s else "none" for s in sizes])
ax.set_xlabel("CPU tier size (blocks of 16 tokens)")
ax.set_ylabel("prompt tokens (8 requests, all rounds)")
nb.finish_figure(fig, "Offloading, demo model: 8 usable device blocks,\n4 prompts sharing 32 tokens, cycled twice")
print(nb.save_figure(fig, "16_offload"))

# %% [markdown]
# ## 3 · Why P/D exists: a decode stream while long prompts arrive
#
# `benchmarks/disagg_itl.py` starts real servers on this machine's 2 cores: either one
# server with 2 torch threads (co-located), or a prefill server and a decode server with 1
# thread each behind the proxy (disaggregated, `SharedStorageConnector`). Steady streaming
# decodes run while long prompts arrive one after another through the same front door;
# each decode stream's gaps between chunks are its inter-token latencies.

# %%
from benchmarks import disagg_itl

itl = {mode: disagg_itl.measure_itl(mode, smoke=SMOKE) for mode in ("colocated", "disaggregated")}
for mode, r in itl.items():
    print(f"{mode:>14}: p50 {1e3 * r['p50_s']:6.1f} ms, p99 {1e3 * r['p99_s']:7.1f} ms "
          f"({len(r['gaps_s'])} gaps, {r['num_long_prompts']} long prompts, threads {r['torch_num_threads']})")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for mode, color in (("colocated", "tab:red"), ("disaggregated", "tab:blue")):
    gaps = np.sort(1e3 * np.asarray(itl[mode]["gaps_s"]))
    ax.plot(gaps, np.arange(1, len(gaps) + 1) / len(gaps), label=f"{mode} (p99 {1e3 * itl[mode]['p99_s']:.0f} ms)",
            color=color)
ax.set_xscale("log")
ax.set_xlabel("decode inter-token latency (ms, log scale)")
ax.set_ylabel("fraction of gaps at or below")
nb.finish_figure(fig, f"Decode streams while long prompts arrive, demo model,\n2 cores in all [{SIZE}]")
print(nb.save_figure(fig, "16_disagg_itl"))

# %%
print(nb.save_data("16_kv_connectors", {
    "load_average_before": list(load_before),
    "load_average_after": list(os.getloadavg()),
    "shared_storage": storage,
    "offload": offload,
    "itl": itl,
}))
