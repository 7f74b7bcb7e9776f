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
# # 13 · Tensor parallelism: what the ranks say to each other, and when it pays
#
# Chapter 13 cuts every layer over `tp` ranks (each in its own worker process) and joins
# the pieces with two all-reduces per decoder layer. This notebook
#
# 1. counts the bytes those all-reduces move per token and per decode step;
# 2. **predicts** (from datasheet numbers, nothing measured) the time of a decode step on
#    1, 2, 4 and 8 H200s: each rank's roofline floor plus its collectives over NVLink, and
#    from that, where tensor parallelism pays;
# 3. **measures**, on this CPU, the latency and bandwidth of gloo's all-reduce at the sizes a
#    decode step sends, and a decode step with TP=1 and TP=2 on two cores.

# %%
import os
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import torch

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from benchmarks import tensor_parallel as tpb
from nano_v1.benchmarks.roofline import H200_DATASHEET
from nano_v1.benchmarks.utils import TINY_QWEN3_SHAPE

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
nb.set_threads()
TP_SIZES = [1, 2, 4, 8]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXT_LEN = 2048  # tokens of context per request in the predicted decode steps
AR_SIZES = nb.pick(cpu=[2**k for k in range(8, 27, 2)], gpu=[2**k for k in range(8, 27, 2)], smoke=[1024, 65536])
AR_REPEATS = nb.pick(cpu=50, gpu=50, smoke=3)
STEP_BATCHES = nb.pick(cpu=[1, 4, 16], gpu=[1, 4, 16], smoke=[2])
ROUNDS = nb.pick(cpu=3, gpu=3, smoke=1)
INPUT_LEN, OUTPUT_LEN = nb.pick(cpu=(16, 24), gpu=(16, 24), smoke=(8, 3))
print(nb.device_label(), f"· torch threads: {torch.get_num_threads()}")

# %% [markdown]
# ## Predict first: bytes on the wire
#
# A decoder layer split Megatron-style needs the full hidden state twice: after `o_proj`
# (each rank has summed over its own heads) and after `down_proj` (each rank has summed
# over its slice of the MLP). Each is an all-reduce of `hidden_size` values per token, so
#
#     bytes all-reduced per token per layer = 2 x hidden_size x 2 bytes (bf16)
#
# whatever the number of ranks: 16 KiB for a hidden size of 4096, 32 KiB for 8192. A decode
# step of batch B adds one all-reduce for the embedding and one all-gather of the logits.
# A ring all-reduce of S bytes over p ranks sends and receives 2(p-1)/p x S per rank; at
# NVLink's 450 GB/s per direction, 64 tokens of Llama-3.1-70B (64 x 16 KiB = 1 MiB per
# all-reduce) take about 4 µs of bandwidth at p = 8, less than the fixed cost of
# launching a collective. Prediction: decode-step communication is latency, not bandwidth,
# and TP pays where each rank's share of the weights takes long to read: big models,
# small batches.

# %%
print(f"{'model':<15}{'hidden':>8}{'layers':>8}{'bytes/token/layer':>19}{'all-reduces/step':>18}"
      f"{'MiB all-reduced per step at B=64':>34}")
for name, shape in tpb.PREDICTION_SHAPES.items():
    per_step = tpb.predict_decode_step(shape, 2, 64, CONTEXT_LEN)["all_reduce_bytes_per_step"]
    print(f"{name:<15}{shape.hidden_size:>8}{shape.num_layers:>8}"
          f"{tpb.all_reduce_bytes_per_token_per_layer(shape):>19,}{2 * shape.num_layers + 1:>18}{per_step / 2**20:>34.1f}")
link = tpb.H200_NVLINK
print(f"\nlink: {link.name}; per direction {link.bandwidth_per_direction / 1e9:.0f} GB/s; "
      f"assumed fixed cost per collective {link.latency_s * 1e6:.0f} µs")
print(f"device: {H200_DATASHEET.device}: {H200_DATASHEET.memory_bandwidth / 1e12:.1f} TB/s HBM, "
      f"{H200_DATASHEET.matmul_flops / 1e12:.0f} TFLOP/s bf16 dense; {tpb.H200_MEMORY_BYTES / 1e9:.0f} GB each")

# %% [markdown]
# ## Predicted: a decode step on 1, 2, 4 and 8 H200s
#
# For each model, tensor-parallel size and batch (context 2048 tokens per request), the
# step is each rank's roofline floor (its 1/p of the weights, its KV heads, its FLOPs)
# plus the collectives, assumed not to overlap the compute (vLLM does not overlap them
# either). A configuration whose weights and KV cache do not fit in 90% of 141 GB per GPU
# is left out. Left: what a step is made of at batch 64. Right: the speed-up of a step over
# TP=2, the smallest TP all three models fit at (Llama-3.1-70B does not fit one GPU), while
# that still fits; the dotted lines are the ideal, the ratio of the GPUs.

# %%
predictions = {
    name: [tpb.predict_decode_step(shape, tp, b, CONTEXT_LEN) for tp in TP_SIZES for b in BATCHES]
    for name, shape in tpb.PREDICTION_SHAPES.items()
}
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
ax = axes[0]
labels, floors, bandwidths, latencies = [], [], [], []
for name, rows in predictions.items():
    for row in rows:
        if row["batch_size"] == 64 and row["fits"]:
            labels.append(f"{name}\nTP={row['tp_size']}")
            floors.append(row["floor_s"] * 1e3)
            bandwidths.append(row["comm_bandwidth_s"] * 1e3)
            latencies.append(row["comm_latency_s"] * 1e3)
x = np.arange(len(labels))
ax.bar(x, floors, label="rank's roofline floor (HBM reads)")
ax.bar(x, bandwidths, bottom=floors, label="collectives: NVLink bandwidth")
ax.bar(x, latencies, bottom=np.add(floors, bandwidths), label=f"collectives: {link.latency_s * 1e6:.0f} µs each")
ax.set_xticks(x, labels, fontsize=6, rotation=90)
ax.set_ylabel("predicted ms per decode step (batch 64)")
ax.set_title("PREDICTION (datasheet constants)", fontsize=9)
ax.legend(fontsize=7)
ax = axes[1]
BASE_TP = 2  # one baseline for every model: the smallest TP at which all of them fit at batch 1
assert all(any(r["tp_size"] == BASE_TP and r["batch_size"] == 1 and r["fits"] for r in rows)
           for rows in predictions.values())
for (name, rows), color in zip(predictions.items(), ("C0", "C1", "C2")):
    base = {r["batch_size"]: r for r in rows if r["tp_size"] == BASE_TP and r["fits"]}
    for tp, style in zip([t for t in TP_SIZES if t > BASE_TP], ("--", "-")):
        points = [(r["batch_size"], base[r["batch_size"]]["step_s"] / r["step_s"])
                  for r in rows if r["tp_size"] == tp and r["fits"] and r["batch_size"] in base]
        ax.plot(*zip(*points), style, marker="o", color=color, label=f"{name}: TP={tp}")
for tp in [t for t in TP_SIZES if t > BASE_TP]:
    ax.axhline(tp / BASE_TP, color="grey", lw=0.8, ls=":")
    ax.text(BATCHES[0], tp / BASE_TP, f"ideal TP={tp}", color="grey", fontsize=7, va="bottom")
ax.axhline(1.0, color="k", lw=0.8)
ax.set_xscale("log", base=2)
nb.tick_at([ax], BATCHES)
ax.set_xlabel("batch size (requests decoding together)")
ax.set_ylabel(f"predicted speed-up of a decode step over TP={BASE_TP}")
ax.set_title("PREDICTION (datasheet constants)", fontsize=9)
ax.legend(fontsize=6)
fig.suptitle(f"Predicted decode step on H200s (NVLink {link.bandwidth_per_direction / 1e9:.0f} GB/s per direction, "
             f"context {CONTEXT_LEN}); not measured", fontsize=10)
fig.tight_layout()
print(nb.save_figure(fig, "13_tensor_parallel_predicted"))

# %%
for name, rows in predictions.items():
    print(name)
    for b in (1, 64, 256):
        line = "  ".join(
            f"TP={r['tp_size']}: {r['step_s'] * 1e3:6.2f} ms ({r['comm_latency_s'] / r['step_s']:4.0%} latency)"
            if r["fits"] else f"TP={r['tp_size']}:  does not fit"
            for r in rows if r["batch_size"] == b
        )
        print(f"  B={b:<4} {line}")

# %% [markdown]
# How sensitive is this to the assumed 10 µs per collective? The same prediction for
# Llama-3.1-8B at batch 1 with 3 µs and with 30 µs:

# %%
sensitivity = {}
for latency_s in (3e-6, 10e-6, 30e-6):
    variant = tpb.Interconnect(link.name, link.bandwidth_per_direction, latency_s)
    steps = {tp: tpb.predict_decode_step(tpb.PREDICTION_SHAPES["Llama-3.1-8B"], tp, 1, CONTEXT_LEN, link=variant)
             for tp in TP_SIZES}
    sensitivity[f"{latency_s * 1e6:.0f}us"] = {tp: s["step_s"] for tp, s in steps.items()}
    print(f"{latency_s * 1e6:>4.0f} µs: " + "  ".join(f"TP={tp} {s['step_s'] * 1e3:.2f} ms" for tp, s in steps.items()))

# %% [markdown]
# ## Measured on this CPU: gloo's all-reduce
#
# Two processes of one thread each, joined through `nano_v1/distributed/parallel_state.py`
# exactly as two workers are, time `tensor_model_parallel_all_reduce` on float32 tensors
# from 256 bytes to 64 MiB, `AR_REPEATS` times each after a barrier so that both start
# together: the median is what a step meets on this machine, the fastest what the
# mechanism costs when nothing else competes for the two cores. The marks are what a
# decode step of our two CPU models sends per all-reduce (batch x hidden x 4 bytes), each
# model's in a band of its own.

# %%
load_before = os.getloadavg()  # other processes on this machine compete for its two cores
all_reduce = tpb.measure_all_reduce(AR_SIZES, world_size=2, repeats=AR_REPEATS)
for row in all_reduce:
    print(f"{row['bytes']:>10,} B: {row['median_s'] * 1e6:9.1f} µs median, {row['min_s'] * 1e6:9.1f} µs fastest, "
          f"{row['bus_GBps']:6.2f} GB/s bus bandwidth (fastest)")

# %%
TINY = dict(TINY_QWEN3_SHAPE)
MEDIUM = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)
cpu_models = nb.pick(cpu={"tiny Qwen3 (5.2M)": TINY, "Qwen3, hidden 1024 (168M)": MEDIUM},
                     gpu={"tiny Qwen3 (5.2M)": TINY, "Qwen3, hidden 1024 (168M)": MEDIUM},
                     smoke={"tiny Qwen3 (5.2M)": TINY})
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
sizes = [r["bytes"] for r in all_reduce]
axes[0].loglog(sizes, [r["median_s"] * 1e6 for r in all_reduce], marker="o", label="median")
axes[0].loglog(sizes, [r["min_s"] * 1e6 for r in all_reduce], marker=".", ls=":", label="fastest")
axes[1].semilogx(sizes, [r["bus_GBps"] for r in all_reduce], marker="o")
# Each model's marks in a band of its own (the first model's on top): the two models share
# two of their sizes (tiny at batch 4 and 16 sends what the 168M one sends at batch 1 and 4).
for k, ((label, shape), color, style) in enumerate(zip(cpu_models.items(), ("tab:red", "tab:green"), (":", "--"))):
    low, high = 1 - (k + 1) / len(cpu_models), 1 - k / len(cpu_models)
    for b in STEP_BATCHES:
        for ax in axes:
            ax.axvline(b * shape["hidden_size"] * 4, ymin=low, ymax=high, color=color, lw=1.5, ls=style)
            ax.text(b * shape["hidden_size"] * 4, high - 0.02, f"B={b} ", transform=ax.get_xaxis_transform(),
                    color=color, fontsize=7, rotation=90, ha="right", va="top")
    axes[0].plot([], [], color=color, ls=style, label=f"{label}: decode at B={STEP_BATCHES}")
axes[0].set_xlabel("bytes all-reduced (float32)")
axes[0].set_ylabel("µs per all-reduce")
axes[1].set_xlabel("bytes all-reduced (float32)")
axes[1].set_ylabel("bus bandwidth, GB/s (fastest repeat)")
nb.finish_figure(fig, "gloo all-reduce, 2 processes x 1 thread, loopback; bus bandwidth = 2(p-1)/p x bytes / time")
axes[0].get_legend().remove()  # below the panels instead, clear of the data and the marks
fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, 0))
print(nb.save_figure(fig, "13_tensor_parallel_all_reduce"))

# %% [markdown]
# ## Measured on this CPU: a decode step with TP=1 and TP=2
#
# The same engine (random weights, float32, engine core in this process) with TP=1 on one
# thread, TP=1 on two threads, and TP=2: two worker processes of one thread each, which
# is what two cores allow. Each number is the median wall time of `LLMEngine.step` while
# `batch` requests decode together (`INPUT_LEN` prompt tokens, `OUTPUT_LEN` new ones); the
# configurations take turns for `ROUNDS` rounds, and we keep each one's best round, since
# this machine is shared and a round can land on a busy minute.

# %%
configs = [("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread per rank", 2, 2)]
model_dirs = {label: tpb.write_qwen3_config(tempfile.mkdtemp(prefix="nano_v1_nb13_"), shape)
              for label, shape in cpu_models.items()}
rounds: dict[tuple[str, str], list[list[dict]]] = {}
for _ in range(ROUNDS):  # the configurations take turns, so that a busy minute hits each of them
    for label, model_dir in model_dirs.items():
        for config_label, tp, threads in configs:
            torch.set_num_threads(threads)  # with TP=2 each worker gets threads // 2
            rounds.setdefault((label, config_label), []).append(
                tpb.measure_step_times(model_dir, tp, STEP_BATCHES, INPUT_LEN, OUTPUT_LEN))
nb.set_threads()
# Per configuration and batch: the best round's median decode step (the least disturbed), and the worst.
steps = {key: [{**min(by_batch, key=lambda r: r["median_decode_step_s"]),
                "worst_round_median_decode_step_s": max(r["median_decode_step_s"] for r in by_batch)}
               for by_batch in zip(*runs)] for key, runs in rounds.items()}
for (label, config_label), rows in steps.items():
    print(f"{label:<28}{config_label:<26}" + "  ".join(
        f"B={r['batch_size']}: {r['median_decode_step_s'] * 1e3:7.2f} ms (worst {r['worst_round_median_decode_step_s'] * 1e3:.0f})"
        for r in rows))

# %%
fig, axes = plt.subplots(1, len(cpu_models), figsize=(5.5 * len(cpu_models), 4), squeeze=False)
for ax, (label, shape) in zip(axes[0], cpu_models.items()):
    for config_label, _, _ in configs:
        rows = steps[(label, config_label)]
        best = np.array([r["median_decode_step_s"] * 1e3 for r in rows])
        worst = np.array([r["worst_round_median_decode_step_s"] * 1e3 for r in rows])
        ax.errorbar([r["batch_size"] for r in rows], best, yerr=[np.zeros_like(best), worst - best],
                    marker="o", capsize=3, label=config_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    nb.log_ticks(ax)
    nb.tick_at([ax], STEP_BATCHES)
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step")
    ax.set_title(label, fontsize=9)
nb.finish_figure(fig, f"decode step, TP=1 vs TP=2 on 2 CPU cores (best of {ROUNDS} rounds; bars up to the worst)")
print(nb.save_figure(fig, "13_tensor_parallel_cpu_steps"))

# %% [markdown]
# What the all-reduces alone should cost per step at TP=2: (2 x layers + 1) all-reduces at
# the fastest measured latency of that size, next to the best round's TP=2 step (both as
# undisturbed as this machine allows).

# %%
def measured_all_reduce_s(num_bytes: int) -> float:
    """Fastest all-reduce time, interpolated (log-log) at `num_bytes` from the sweep above."""
    return float(np.exp(np.interp(np.log(num_bytes), np.log(sizes), np.log([r["min_s"] for r in all_reduce]))))


comm_model = []
for label, shape in cpu_models.items():
    for row in steps[(label, "TP=2, 1 thread per rank")]:
        b = row["batch_size"]
        comm_s = (2 * shape["num_hidden_layers"] + 1) * measured_all_reduce_s(b * shape["hidden_size"] * 4)
        comm_model.append({"model": label, "batch_size": b, "predicted_all_reduce_s": comm_s,
                           "measured_step_s": row["median_decode_step_s"]})
        print(f"{label:<28} B={b:<3} all-reduces {comm_s * 1e3:6.2f} ms of a {row['median_decode_step_s'] * 1e3:7.2f} ms step "
              f"({comm_s / row['median_decode_step_s']:.0%})")

# %%
print(f"load average (1, 5, 15 min) before the measurements {load_before}, after {os.getloadavg()}")
print(nb.save_data("13_tensor_parallel", {
    "load_average_before": load_before,
    "load_average_after": os.getloadavg(),
    "link": {"name": link.name, "bandwidth_per_direction": link.bandwidth_per_direction, "latency_s": link.latency_s},
    "context_len": CONTEXT_LEN,
    "predictions": predictions,
    "latency_sensitivity_llama_8b_b1": sensitivity,
    "all_reduce": all_reduce,
    "cpu_models": cpu_models,
    "cpu_steps": [{"model": label, "config": config_label, **row}
                  for (label, config_label), rows in steps.items() for row in rows],
    "cpu_steps_every_round": [{"model": label, "config": config_label, "round": i, **row}
                              for (label, config_label), runs in rounds.items()
                              for i, rows in enumerate(runs) for row in rows],
    "cpu_comm_model": comm_model,
}))

# %% [markdown]
# ## Reading the results
#
# The H200 predictions say tensor parallelism pays most where a rank's slice of the
# weights still takes long to read: Llama-3.1-70B, which does not fit on one GPU at all,
# gains about 3x from 2 to 8 GPUs, while Qwen3-4B at batch 1 gains little from a second
# GPU, because its collectives' fixed cost is as large as the time saved. At decode sizes
# NVLink's bandwidth hardly matters; the assumed fixed cost per collective does.
#
# On this CPU (chapter 13 discusses the recorded run): gloo's all-reduce costs hundreds of
# microseconds, not ten; two single-threaded ranks can beat one process of two threads on
# a shared machine, because OpenMP's threads meet at a barrier in every op and ranks meet
# only at the all-reduces; a memory-bound model (the 168M one) can gain from the second
# core when it is free, and the tiny model, whose step is mostly Python, only pays the
# overhead. CPU cores are not GPUs: what TP buys on GPUs, the bandwidth of more devices
# for weights that do not fit one, is here only a second core.
