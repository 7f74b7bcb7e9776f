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
# # 09 · Processes: the engine core on its own, and a server in front of it
#
# Chapter 09 moves the engine core (scheduler + model runner) into a child process and
# leaves the frontend (tokenizer, detokenizer, user API) in this one, so that the Python
# work on each side can run at the same time instead of one after the other. This
# notebook measures what that buys and what it costs:
#
# 1. per engine step, the CPU time spent on each side, with the core in this process
#    (`InprocClient`) and in its own (`SyncMPClient`), and the offline throughput of both,
#    on the bundled demo model at several batch sizes;
# 2. serving latency under load: time to first token and inter-token latency at several
#    request rates, measured by our load generator (`nano-v1 bench serve`) against the
#    OpenAI-compatible server.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from nano_v1.benchmarks import processes, serve
from nano_v1.engine.arg_utils import EngineArgs

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
threads = nb.set_threads()  # the engine-core process gets the same number of torch threads
BATCH_SIZES = nb.pick(cpu=[1, 8, 32, 64], gpu=[1, 8, 32, 64], smoke=[4])
INPUT_LEN, OUTPUT_LEN = nb.pick(cpu=(32, 64), gpu=(32, 64), smoke=(8, 4))
RATES = nb.pick(cpu=[2.0, 8.0, 32.0, math.inf], gpu=[2.0, 8.0, 32.0, math.inf], smoke=[])
NUM_PROMPTS = nb.pick(cpu=64, gpu=64, smoke=8)
engine_args = EngineArgs(  # the bundled demo model (the default), in float32 on the CPU
    dtype="float32" if not nb.ON_GPU else "auto", max_model_len=256, num_gpu_blocks_override=1024,
)
print(nb.device_label(), f"· torch threads per process: {threads}")

# %% [markdown]
# ## Predict first
#
# With the core in this process, one step costs core + frontend, one after the other. In
# its own process the two overlap, so a step costs about max(core, frontend + messages).
# The gain is therefore bounded by the frontend's share of a step: if detokenizing a batch
# costs 5% of a step, moving the core out can save at most 5%, and the messages (msgpack
# encode, a socket hop, decode) eat into that. The demo model is tiny (4.2M parameters),
# so its core is cheap and the frontend's share is as large as it will ever be; on a GPU
# running a real model the core's *Python* part (schedule, prepare inputs, launch) is what
# overlaps with the frontend, which is why vLLM made the split.

# %%
report = processes.run(BATCH_SIZES, INPUT_LEN, OUTPUT_LEN, engine_args)
processes.print_report(report)

# %% [markdown]
# Per step, the CPU milliseconds each side spent (in-process: the core's share is the time
# inside `get_output()`; multiprocess: the child's CPU time from /proc), next to the wall
# time per step. Bars above the wall-time marker mean the two processes ran in parallel.

# %%
rows = report["rows"]
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
width = 0.38
x = np.arange(len(BATCH_SIZES))
for offset, client in ((-width / 2, "InprocClient"), (width / 2, "SyncMPClient")):
    mine = [next(r for r in rows if r["client"] == client and r["batch_size"] == b) for b in BATCH_SIZES]
    core = [r["core_cpu_ms_per_step"] for r in mine]
    front = [r["frontend_cpu_ms_per_step"] for r in mine]
    axes[0].bar(x + offset, core, width, label=f"{client}: core CPU")
    axes[0].bar(x + offset, front, width, bottom=core, label=f"{client}: frontend CPU")
    axes[0].scatter(x + offset, [r["wall_ms_per_step"] for r in mine], color="k", marker="_", s=300, zorder=3)
    axes[1].plot(BATCH_SIZES, [r["output_throughput"] for r in mine], marker="o", label=client)
axes[0].set_xticks(x, [str(b) for b in BATCH_SIZES])
axes[0].set_xlabel("batch size")
axes[0].set_ylabel("ms per step (black: wall time)")
axes[0].set_title("the frontend's share of a step is small", fontsize=10)
axes[0].legend(fontsize=7)
axes[1].set_xscale("log", base=2)
nb.tick_at([axes[1]], BATCH_SIZES)
axes[1].set_xlabel("batch size")
axes[1].set_ylabel("output tokens / s")
axes[1].set_title("throughput: engine core in-process or in a process of its own", fontsize=10)
axes[1].legend()
nb.finish_figure(fig, f"demo model, {INPUT_LEN} prompt + {OUTPUT_LEN} output tokens per request")
print(nb.save_figure(fig, "09_processes_steps"))

# %%
for b in BATCH_SIZES:
    inproc = next(r for r in rows if r["client"] == "InprocClient" and r["batch_size"] == b)
    mp = next(r for r in rows if r["client"] == "SyncMPClient" and r["batch_size"] == b)
    share = inproc["frontend_cpu_ms_per_step"] / (inproc["frontend_cpu_ms_per_step"] + inproc["core_cpu_ms_per_step"])
    print(f"batch {b:>3}: frontend share of an in-process step {share:6.1%}; "
          f"multiprocess / in-process throughput {mp['output_throughput'] / inproc['output_throughput']:.2f}x")

# %% [markdown]
# ## Serving under load
#
# The server (`nano-v1 serve`, which `serve.run` starts in a process of its own and stops
# afterwards: `AsyncLLM` + FastAPI there, the engine core in a child of it) receives
# `NUM_PROMPTS` streaming requests arriving as a Poisson process at each rate; `inf` sends
# them all at once. TTFT includes the wait in the queue; ITL is the gap between streamed
# chunks, about one engine step when the engine keeps up.

# %%
serving = {"runs": []}
if RATES:
    import argparse

    args = argparse.Namespace(base_url=None, served_model_name="demo", num_prompts=NUM_PROMPTS,
                              request_rate=RATES, input_len=INPUT_LEN, output_len=OUTPUT_LEN, seed=0)
    serving = serve.run(args, engine_args)
    serve.print_report(serving)
else:
    print("smoke mode: the serving sweep is skipped (it starts a server process with its own engine core)")

# %%
if serving["runs"]:
    labels = [str(r["request_rate"]) for r in serving["runs"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("median_ttft_ms", "TTFT median"), ("p99_ttft_ms", "TTFT p99"),
                       ("median_itl_ms", "ITL median"), ("p99_itl_ms", "ITL p99")):
        ax.plot(labels, [r[key] for r in serving["runs"]], marker="o", label=label)
    ax.set_yscale("log")
    nb.log_ticks(ax)
    ax.set_xlabel("request rate (requests / s; inf: all sent at once)")
    ax.set_ylabel("ms (log scale)")
    ax.set_title("latency stays flat until the engine saturates", fontsize=10)
    ax.legend()
    nb.finish_figure(fig, f"{NUM_PROMPTS} streamed requests, {INPUT_LEN} in / {OUTPUT_LEN} out")
    print(nb.save_figure(fig, "09_processes_serving"))

# %%
print(nb.save_data("09_processes", {"processes": report, "serving": serving}))

# %% [markdown]
# ## On a GPU
#
# No GPU measurement of this chapter is recorded: the GPU image runs the in-process engine
# only (it has no pyzmq or msgspec), so the split is measured on the CPU here. On a GPU the
# core's Python work per step (schedule, prepare inputs, launch kernels) is a larger share
# of a step that the device finishes quickly, and the overlap matters more than it does for
# this CPU-bound tiny model.
