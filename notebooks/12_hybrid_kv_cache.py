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
# # 12 · Hybrid KV cache groups: what a sliding window gives back
#
# Gemma 3 attends to the whole context in one layer of every six; the other five see only
# their last 512 (1B) or 1,024 (4B, 27B) tokens. A KV cache that keeps every token in every
# layer stores, at a 16k-token context, keys and values that 5 layers in 6 will never read
# again. The hybrid allocator (chapter 12) splits the layers into KV cache groups, gives
# the sliding-window groups only their window's blocks, and hands the rest back to the
# pool, which all groups share.
#
# This notebook predicts from the layers' specs how many bytes a token of context costs,
# both ways, for Gemma 3's real shapes; then measures (1) the blocks one request holds over
# a long generation, through the real engine, (2) how many requests fit at once in a fixed
# cache for contexts of 1k-16k tokens, through the real scheduler, and (3) throughput at a
# fixed cache on this CPU.

# %%
import logging
import os
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from benchmarks import hybrid_kv as hk
from benchmarks.context import CONFIGS_DIR
from nano_v1 import LLM, SamplingParams
from nano_v1.core.kv_cache_utils import get_kv_cache_configs, get_max_concurrency_for_kv_cache_config
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
# Each layout below logs its padding layers and, hybrid off, that windows keep every token:
# said once here instead of at every call.
logging.getLogger("nano_v1.core.kv_cache_utils").setLevel(logging.ERROR)
threads = nb.set_threads()
GiB = 2**30
BLOCK_SIZE = 16
MODELS = nb.pick(cpu=["gemma-3-1b", "gemma-3-4b", "gemma-3-27b"], gpu=["gemma-3-1b", "gemma-3-4b", "gemma-3-27b"],
                 smoke=["gemma-3-1b"])
CONTEXTS = nb.pick(cpu=[1024, 2048, 4096, 8192, 16384], gpu=[1024, 2048, 4096, 8192, 16384], smoke=[1024, 4096])
KV_CACHE_BYTES = 16 * GiB  # the fixed cache of the concurrency measurement
BUDGET = 8192  # max_num_batched_tokens: a 16k prompt prefills in two steps
load_before = os.getloadavg()  # other jobs on this machine compete for its cores and skew the timings
print(f"{nb.device_label()}, torch threads {threads}, load average (1, 5, 15 min) {load_before}")

# %% [markdown]
# ## The layers' specs
#
# Each model's modules are built on the meta device (no weights, no memory) from its
# `config.json` (`benchmarks/configs/gemma-3-*`, the public shapes), and the
# model runner names every attention layer's spec, exactly as at start-up
# (`GPUModelRunner.get_kv_cache_spec`). `get_kv_cache_configs` then groups the layers.

# %%
def layout(model: str, max_model_len: int, disable_hybrid: bool, kv_cache_bytes: int = KV_CACHE_BYTES):
    vllm_config = hk.engine_config(
        str(CONFIGS_DIR / model), max_model_len, disable_hybrid, dtype="bfloat16", block_size=BLOCK_SIZE,
        max_num_batched_tokens=BUDGET, max_num_seqs=4096,
    )
    return vllm_config, hk.kv_cache_config_for(vllm_config, kv_cache_bytes)


shapes = {}
for model in MODELS:
    vllm_config, hybrid = layout(model, max(CONTEXTS), disable_hybrid=False)
    _, full = layout(model, max(CONTEXTS), disable_hybrid=True)
    hf = vllm_config.model_config.hf_config
    groups = hybrid.kv_cache_groups
    spec = groups[0].kv_cache_spec
    shapes[model] = {
        "layers": hf.num_hidden_layers,
        "full_layers": hf.layer_types.count("full_attention"),
        "sliding_window": hf.sliding_window,
        "kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "num_groups": len(groups),
        "layers_per_group": len(groups[-1].layer_names),
        "padding_layers": sum(len(groups[-1].layer_names) - len(g.layer_names) for g in groups),
        "bytes_per_block": {"hybrid": hk.bytes_per_block(hybrid), "full": hk.bytes_per_block(full)},
        "num_blocks": {"hybrid": hybrid.num_blocks, "full": full.num_blocks},
    }
    s = shapes[model]
    print(
        f"{model:>12}: {s['layers']} layers ({s['full_layers']} full, window {s['sliding_window']}), "
        f"{s['kv_heads']} KV heads x {s['head_size']}: {s['num_groups']} groups of {s['layers_per_group']} layers "
        f"({s['padding_layers']} padding); a block is {s['bytes_per_block']['hybrid'] / 2**20:.2f} MiB hybrid, "
        f"{s['bytes_per_block']['full'] / 2**20:.2f} MiB full-only"
    )

# %% [markdown]
# ## Predict: KV bytes per token of context
#
# Full-only, every layer keeps every token: 2 (K, V) x layers x KV heads x head size x 2
# bytes, e.g. 2 x 62 x 16 x 128 x 2 = 507,904 bytes (496 KiB) per token for 27B, whatever
# the context. Hybrid, with c tokens: the full-attention group holds ceil(c / 16) blocks,
# each sliding-window group at most ceil((w - 1) / 16) + 1 (`hybrid_kv.py::predicted_blocks`),
# and a block is a page of every layer of a group (padding included). Per token of context
# that cost falls like 1/c towards the full layers' share alone: 1/6 of full-only for a
# perfect 5:1 pattern, 10/62 for 27B.

# %%
PREDICT_CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 131072]
predicted = {}
for model in MODELS:
    vllm_config, hybrid = layout(model, max(CONTEXTS), disable_hybrid=False)
    _, full = layout(model, max(CONTEXTS), disable_hybrid=True)
    rows = []
    for c in PREDICT_CONTEXTS:
        h = hk.predicted_blocks(hybrid, c) * hk.bytes_per_block(hybrid) / c
        f = hk.predicted_blocks(full, c) * hk.bytes_per_block(full) / c
        rows.append({"context": c, "hybrid_bytes_per_token": h, "full_bytes_per_token": f, "saving": 1 - h / f})
    predicted[model] = rows
    print(model, "  ".join(f"{r['context']:>6}: {r['hybrid_bytes_per_token'] / 1024:6.1f} vs "
                           f"{r['full_bytes_per_token'] / 1024:5.1f} KiB ({r['saving']:.0%} saved)" for r in rows[2::2]))

# %% [markdown]
# vLLM's RFC for the hybrid allocator (vllm-project/vllm#11382) put the memory that
# full-only allocation wastes at 25% for Gemma 2, whose layers alternate 1:1 with a
# 4,096-token window. The same arithmetic on Gemma-2-27B's attention shape (46 layers, 16
# KV heads of 128) at its 8,192-token context reproduces that number, and shows why Gemma
# 3's 5:1 pattern and shorter windows give back much more:

# %%
def saving(specs: dict, context: int) -> float:
    config = hk.engine_config(str(CONFIGS_DIR / MODELS[0]), context, False, block_size=BLOCK_SIZE,
                              max_num_batched_tokens=BUDGET)
    (hybrid,) = get_kv_cache_configs(config, [dict(specs)], [GiB])
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    (full,) = get_kv_cache_configs(config, [dict(specs)], [GiB])
    h = hk.predicted_blocks(hybrid, context) * hk.bytes_per_block(hybrid)
    return 1 - h / (hk.predicted_blocks(full, context) * hk.bytes_per_block(full))


heads = dict(block_size=BLOCK_SIZE, num_kv_heads=16, head_size=128, dtype=torch.bfloat16)
gemma2 = {f"layers.{i}": SlidingWindowSpec(**heads, sliding_window=4096) if i % 2 == 0 else FullAttentionSpec(**heads)
          for i in range(46)}
gemma2_saving = saving(gemma2, 8192)
print(f"Gemma 2 pattern (1:1, window 4096) at 8,192 tokens: {gemma2_saving:.1%} of full-only KV is not needed")

# %% [markdown]
# ## Measure 1: the blocks one request holds over a long generation
#
# The real engine on this CPU, with Gemma 3's layer pattern and a 512-token window at tiny
# width (`hybrid_kv.py::write_mini_gemma3`: 12 layers, 2 of them global; random weights).
# One request: a 256-token prompt, then greedy decoding. After every step we count the real
# blocks it holds in every group (`hybrid_kv.py::blocks_held`), with the hybrid allocator
# and without it (`disable_hybrid_kv_cache_manager=True`).

# %%
PROMPT_LEN = nb.pick(cpu=256, gpu=256, smoke=32)
GEN_LEN = nb.pick(cpu=1280, gpu=1280, smoke=48)
WINDOW = nb.pick(cpu=512, gpu=512, smoke=24)
mini_dir = hk.write_mini_gemma3(tempfile.mkdtemp(prefix="nano_v1_nb12_"), sliding_window=WINDOW)


def long_generation(disable_hybrid: bool) -> dict:
    # The engine core in this process (`nb.engine_core`), so that its scheduler is ours to read.
    core = nb.engine_core(model=mini_dir, load_format="dummy", dtype="float32", block_size=BLOCK_SIZE,
                          max_model_len=PROMPT_LEN + GEN_LEN, enable_prefix_caching=False,
                          disable_hybrid_kv_cache_manager=disable_hybrid)
    scheduler = core.scheduler
    per_block = hk.bytes_per_block(scheduler.kv_cache_config)
    params = SamplingParams(temperature=0.0, max_tokens=GEN_LEN, ignore_eos=True)
    core.add_request(nb.core_request("r", list(range(3, 3 + PROMPT_LEN)), params))
    context, held, predicted_held = [], [], []
    start, computed_before = time.perf_counter(), 0
    while scheduler.has_unfinished_requests():
        core.step()
        if "r" in scheduler.requests:
            computed = scheduler.requests["r"].num_computed_tokens
            context.append(computed)
            held.append(hk.blocks_held(scheduler, "r"))
            predicted_held.append(hk.predicted_blocks(scheduler.kv_cache_config, computed, computed_before))
            computed_before = computed
    return {
        "context": context, "blocks": held, "predicted_blocks": predicted_held, "bytes_per_block": per_block,
        "seconds": time.perf_counter() - start, "num_groups": len(scheduler.kv_cache_config.kv_cache_groups),
    }


generation = {"hybrid": long_generation(False), "full": long_generation(True)}
for mode, g in generation.items():
    worst = max(abs(b - p) for b, p in zip(g["blocks"], g["predicted_blocks"]))
    print(f"{mode:>6}: {g['num_groups']} groups, {g['bytes_per_block'] / 1024:.0f} KiB per block; at "
          f"{g['context'][-1]} tokens it holds {g['blocks'][-1]} blocks = {g['blocks'][-1] * g['bytes_per_block'] / 2**20:.2f} MiB "
          f"(predicted {g['predicted_blocks'][-1]}; largest gap over the run {worst} blocks); {g['seconds']:.0f} s")
last = {m: g["blocks"][-1] * g["bytes_per_block"] for m, g in generation.items()}
print(f"KV held at the end: {last['hybrid'] / last['full']:.1%} of full-only")

# %% [markdown]
# ## Measure 2: requests that fit at once in 16 GiB, contexts 1k-16k
#
# The real scheduler and KV cache manager with each model's real specs and a 16 GiB cache
# (bf16), the model replaced by a stand-in that samples a fixed token
# (`hybrid_kv.py::admit_until_full`). All requests arrive at once with a prompt of
# c - 512 tokens and generate 512, so they end at c; the token budget is 8,192 per step.
# We count the most requests running at once. The prediction is the blocks that fit over
# the blocks one request holds at the end of its life (it may briefly hold more: a prefill
# chunk is first allocated whole in the sliding-window groups too, and freed a step later).

# %%
OUTPUT_LEN = nb.pick(cpu=512, gpu=512, smoke=64)
concurrency = []
for model in MODELS:
    for c in CONTEXTS:
        for mode in ("hybrid", "full"):
            vllm_config, config = layout(model, c, disable_hybrid=mode == "full")
            fit = (config.num_blocks - 1) // hk.predicted_blocks(config, c)
            start = time.perf_counter()
            admission = hk.admit_until_full(vllm_config, config, int(fit * 1.15) + 2, c - OUTPUT_LEN, OUTPUT_LEN)
            concurrency.append({
                "model": model, "context": c, "mode": mode, "predicted": fit,
                "vllm_logged_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, config),
                "measured": admission.peak_running, "preemptions": admission.preemptions,
                "steps": admission.steps, "seconds": time.perf_counter() - start,
            })
print(f"{'model':>12} {'context':>8} {'hybrid meas/pred':>17} {'full meas/pred':>15} {'ratio':>6}")
for model in MODELS:
    for c in CONTEXTS:
        h, f = (next(r for r in concurrency if (r["model"], r["context"], r["mode"]) == (model, c, m))
                for m in ("hybrid", "full"))
        print(f"{model:>12} {c:>8} {h['measured']:>9} / {h['predicted']:<5} {f['measured']:>8} / {f['predicted']:<5} "
              f"{h['measured'] / f['measured']:>5.1f}x")

# %% [markdown]
# ## Measure 3: throughput at a fixed cache, on this CPU
#
# The mini model again, through the real engine, with a cache that holds two requests of
# c tokens when every layer keeps every token: the same bytes both ways. Eight requests of
# c - 128 prompt tokens and 128 output tokens each. The hybrid allocator fits more of them
# at once into the same bytes, so its decode steps carry more requests: we record every
# step (`Worker.start_step_timing`) and report the mean decode batch of the steps that
# only decode, the device-independent half of throughput, beside tokens per CPU-second
# (this shared machine's wall clock is noise). Three rounds, each running both allocators
# at every context in turn, so that a burst of load from elsewhere hits both; the batches
# and step counts are the same every round, the times are not. Contexts stop at 4k: a
# CPU prefills 16k-token prompts too slowly for a notebook.

# %%
THROUGHPUT_CONTEXTS = nb.pick(cpu=[1024, 2048, 4096], gpu=[1024, 2048, 4096], smoke=[256])
NUM_REQUESTS = nb.pick(cpu=8, gpu=8, smoke=4)
TP_OUTPUT = nb.pick(cpu=128, gpu=128, smoke=8)
TP_ROUNDS = nb.pick(cpu=3, gpu=3, smoke=1)
tp_dir = hk.write_mini_gemma3(tempfile.mkdtemp(prefix="nano_v1_nb12_tp_"), sliding_window=WINDOW)
full_bytes_per_token = 2 * 12 * 1 * 64 * 4  # 12 layers, 1 KV head of 64, float32


def throughput(context: int, disable_hybrid: bool) -> dict:
    kv_bytes = (2 * -(-context // BLOCK_SIZE) + 1) * BLOCK_SIZE * full_bytes_per_token  # 2 requests + null block
    # The engine core in this process: the notebook counts the scheduler's running requests.
    engine_args = EngineArgs(model=tp_dir, load_format="dummy", dtype="float32", device=nb.DEVICE,
                             block_size=BLOCK_SIZE, max_model_len=context, enable_prefix_caching=False,
                             kv_cache_memory_bytes=kv_bytes, disable_hybrid_kv_cache_manager=disable_hybrid,
                             max_num_batched_tokens=2048)
    llm = LLM.from_engine_args(engine_args, enable_multiprocessing=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    prompts = [{"prompt_token_ids": [(i * 131 + j) % 4000 + 3 for j in range(context - TP_OUTPUT)]}
               for i in range(NUM_REQUESTS)]
    peak = 0
    schedule = scheduler.schedule

    def counting_schedule():
        nonlocal peak
        output = schedule()
        peak = max(peak, len(scheduler.running))
        return output

    scheduler.schedule = counting_schedule
    params = SamplingParams(temperature=0.0, max_tokens=TP_OUTPUT, ignore_eos=True)
    llm.collective_rpc("start_step_timing")
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    (steps,) = llm.collective_rpc("stop_step_timing")
    decode_batches = [s.num_sampled_reqs for s in steps if s.num_scheduled_tokens == s.num_sampled_reqs]
    return {"context": context, "mode": "full" if disable_hybrid else "hybrid", "kv_bytes": kv_bytes,
            "peak_running": peak, "mean_decode_batch": float(np.mean(decode_batches)),
            "num_steps": len(steps), "wall_s": wall, "cpu_s": cpu,
            "total_tokens_per_cpu_s": NUM_REQUESTS * context / cpu,
            "output_tokens_per_cpu_s": NUM_REQUESTS * TP_OUTPUT / cpu}


tp_rows = [dict(throughput(c, disable), round=k)
           for k in range(TP_ROUNDS) for c in THROUGHPUT_CONTEXTS for disable in (False, True)]


def tp_runs(context: int, mode: str) -> list[dict]:
    """The rounds' rows of one context and allocator, in round order."""
    return [r for r in tp_rows if (r["context"], r["mode"]) == (context, mode)]


for c in THROUGHPUT_CONTEXTS:
    h, f = tp_runs(c, "hybrid"), tp_runs(c, "full")
    h_rate, f_rate = (np.median([r["total_tokens_per_cpu_s"] for r in runs]) for runs in (h, f))
    ratios = [a["total_tokens_per_cpu_s"] / b["total_tokens_per_cpu_s"] for a, b in zip(h, f)]
    print(f"context {c}, hybrid vs full-only: running at once {h[0]['peak_running']} vs {f[0]['peak_running']}, "
          f"mean decode batch {h[0]['mean_decode_batch']:.2f} vs {f[0]['mean_decode_batch']:.2f}, steps "
          f"{h[0]['num_steps']} vs {f[0]['num_steps']}; tokens per CPU-second (median of {TP_ROUNDS}) "
          f"{h_rate:.0f} vs {f_rate:.0f}; ratio per round {min(ratios):.2f}x to {max(ratios):.2f}x "
          f"(median {np.median(ratios):.2f}x)")

# %% [markdown]
# ## Plot

# %%
fig = plt.figure(figsize=(14, 9.5))
grid = fig.add_gridspec(2, 4)
ax = fig.add_subplot(grid[0, :2])
for model, color in zip(MODELS, ("C0", "C1", "C2")):
    rows = predicted[model]
    ctx = [r["context"] for r in rows]
    ax.loglog(ctx, [r["full_bytes_per_token"] / 1024 for r in rows], "--", color=color, label=f"{model} full-only")
    ax.loglog(ctx, [r["hybrid_bytes_per_token"] / 1024 for r in rows], "-", color=color, label=f"{model} hybrid")
ax.set(xlabel="context (tokens)", ylabel="KV cache KiB per token of context (bf16)",
       title="predicted from the specs (vLLM's grouping, padding included)")
ax = fig.add_subplot(grid[0, 2:])
for mode, style in (("hybrid", "-"), ("full", "--")):
    g = generation[mode]
    ax.plot(g["context"], np.array(g["blocks"]) * g["bytes_per_block"] / 2**20, style,
            label=f"{'hybrid' if mode == 'hybrid' else 'full-only'}: measured")
    ax.plot(g["context"], np.array(g["predicted_blocks"]) * g["bytes_per_block"] / 2**20, "k:", lw=1)
ax.plot([], [], "k:", lw=1, label="predicted")
ax.axvline(WINDOW, color="grey", lw=0.8)
ax.set(xlabel="tokens computed (context)", ylabel="KV cache MiB held by the request",
       title=f"one request through the engine: mini Gemma 3, window {WINDOW}, float32")
nb.tick_at([ax], [WINDOW] + list(range(0, PROMPT_LEN + GEN_LEN + 1, 512))[1:])
ax = fig.add_subplot(grid[1, :2])
for model, color in zip(MODELS, ("C0", "C1", "C2")):
    for mode, style in (("hybrid", "o-"), ("full", "s--")):
        rows = [r for r in concurrency if r["model"] == model and r["mode"] == mode]
        ax.loglog([r["context"] for r in rows], [r["measured"] for r in rows], style, color=color,
                  label=f"{model} {'hybrid' if mode == 'hybrid' else 'full-only'}")
ax.set(xlabel="context (tokens)", ylabel="requests running at once (measured)",
       title="16 GiB of KV cache (bf16), the real scheduler")
nb.tick_at([ax], CONTEXTS)
# Throughput at a fixed cache, one quantity per panel: the decode batch (exact), then the rate (noisy).
batch_ax, rate_ax = fig.add_subplot(grid[1, 2]), fig.add_subplot(grid[1, 3])
x = np.arange(len(THROUGHPUT_CONTEXTS))
for k, (mode, label, marker) in enumerate((("hybrid", "hybrid", "o"), ("full", "full-only", "s"))):
    offset = (k - 0.5) * 0.38
    rows = [tp_runs(c, mode)[0] for c in THROUGHPUT_CONTEXTS]
    batch_ax.bar(x + offset, [r["mean_decode_batch"] for r in rows], 0.38, color=f"C{k}", label=label)
    # Each context on its own: a point at the rounds' median, a bar from the slowest round to the fastest.
    rates = [[r["total_tokens_per_cpu_s"] for r in tp_runs(c, mode)] for c in THROUGHPUT_CONTEXTS]
    median = np.array([np.median(v) for v in rates])
    rate_ax.errorbar(x + offset, median, yerr=[median - [min(v) for v in rates], [max(v) for v in rates] - median],
                     fmt=marker, color=f"C{k}", capsize=3, label=f"{label} (median, range of {TP_ROUNDS})")
for panel in (batch_ax, rate_ax):
    panel.set_xticks(x, [str(c) for c in THROUGHPUT_CONTEXTS])
    panel.set_xlabel("context (tokens)")
batch_ax.set(ylabel="mean requests per decode-only step", title="fixed cache: decode batch")
rate_ax.set(ylabel="prompt + output tokens per CPU-second", title="fixed cache: throughput")
rate_ax.set_ylim(0, 1.3 * max(r["total_tokens_per_cpu_s"] for r in tp_rows))
batch_ax.set_ylim(0, 1.3 * max(r["mean_decode_batch"] for r in tp_rows))
nb.finish_figure(fig, "Hybrid KV cache groups vs full-only allocation "
                 "(bottom right: mini Gemma 3, a cache of 2 full-only requests of c tokens)")
plt.show()

# %% [markdown]
# ## Explain the gap
#
# The long generation follows the specs block for block: both allocators hold exactly the
# predicted blocks between steps. With the hybrid allocator the sliding-window groups stop
# growing once the context passes the window and only the two global layers' group keeps
# growing, so the request's KV grows at 2/12 of the full-only slope.
#
# The concurrency measurement lands near the prediction, which assumes every request
# holds the blocks of all c tokens. Above it at short contexts: requests early in their
# lives are shorter than c. Just under it at long ones: when the cache is full the
# scheduler preempts (and later recomputes) the newest request, and a request being
# prefilled holds a whole chunk's blocks in every sliding-window group for one step. vLLM's own start-up
# log ("Maximum concurrency") is more pessimistic still for hybrid models: it charges each
# sliding-window group `w - 1 + max_num_batched_tokens` tokens for the whole life of the
# request, which at an 8,192-token budget is more than the window by far.
#
# Throughput on this CPU gains less than concurrency: the mini model's prefill is the
# same work either way, and the hybrid path pays for its groups with one attention
# metadata build and one block-table update per group per step.

# %%
print(nb.save_figure(fig, "12_hybrid_kv_cache"))
load_after = os.getloadavg()
print(f"load average (1, 5, 15 min) before the measurements {load_before}, after {load_after}")
print(nb.save_data("12_hybrid_kv_cache", {
    "load_average_before": load_before,
    "load_average_after": load_after,
    "block_size": BLOCK_SIZE, "kv_cache_bytes": KV_CACHE_BYTES, "max_num_batched_tokens": BUDGET,
    "shapes": shapes, "predicted": predicted, "gemma2_rfc_saving": gemma2_saving,
    "long_generation": {"prompt_len": PROMPT_LEN, "gen_len": GEN_LEN, "window": WINDOW, **generation},
    "concurrency": {"output_len": OUTPUT_LEN, "rows": concurrency},
    "throughput": {"num_requests": NUM_REQUESTS, "output_len": TP_OUTPUT, "rounds": TP_ROUNDS, "rows": tp_rows},
}))
