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
# # 08 · Piecewise CUDA graphs: split at attention, graph the rest
#
# Chapter 08 claims three things this notebook checks: (1) a decode step of a small model
# costs the host more to *launch* than the GPU to *run*, so recording the launches once
# (a CUDA graph) and replaying them pays; (2) the model's graph can be cut at attention
# into pieces whose shapes depend only on the token count, which is what a graph needs;
# (3) padding each step up to a captured size wastes little. On a CPU there are no
# graphs, but the split-and-compile path runs the same way, so (2) and (3) are measured
# here and (1) is predicted, then read from a recorded GPU run when there is one.

# %%
import os
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from benchmarks.context import CONFIGS_DIR
from benchmarks.cuda_graphs import CPU_MODES, measure_mode
from nano_v1 import LLM
from nano_v1.benchmarks.roofline import ModelShape
from nano_v1.benchmarks.utils import release_engines, write_tiny_qwen3
from nano_v1.compilation.counter import compilation_counter
from nano_v1.config import CompilationConfig

# The engine core in this process (vLLM's switch, read when an `LLM` is built): the notebook
# asks its worker for the split model through `collective_rpc` with a function, which cannot
# cross to another process, and times its steps there (chapter 09).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
nb.set_threads()
BATCH_SIZES = nb.pick(cpu=[1, 4, 16, 64], gpu=[1, 4, 16, 64], smoke=[1])
CONTEXT = nb.pick(cpu=64, gpu=64, smoke=16)  # prompt tokens before the timed decode steps
STEPS = nb.pick(cpu=10, gpu=10, smoke=2)
print(nb.device_label())

# %% [markdown]
# ## The split of a real model
#
# With `compilation_config={"level": 3}`, Dynamo traces the model once, the token count a
# symbol, and `nano_v1/compilation/backends.py::split_graph` cuts the graph at each
# attention op: for L layers, L attention pieces and L + 1 dense pieces. The model is
# the benchmarks' tiny Qwen3 (4 layers, hidden 256), random weights.

# %%
model_dir = write_tiny_qwen3(tempfile.mkdtemp(prefix="nano_v1_nb08_"))
engine_kwargs = {
    "model": model_dir,
    "dtype": "float32",
    "device": nb.DEVICE,
    "max_model_len": 512,
    "max_num_seqs": max(BATCH_SIZES),
    "enable_prefix_caching": False,
}
if not nb.ON_GPU:
    engine_kwargs["kv_cache_memory_bytes"] = 64 << 20
engine_kwargs.update(nb.gpu_memory_share(2))  # two engines alive at once
eager_llm = LLM(**engine_kwargs, **CPU_MODES["eager"])
traced_before = compilation_counter.num_graphs_seen
start = time.perf_counter()
split_llm = LLM(**engine_kwargs, **CPU_MODES["split"])
startup_split = time.perf_counter() - start


def split_model(worker) -> tuple[list, int]:
    """In the worker: the pieces its compile backend cut the model into, and its number of attention layers."""
    runner = worker.model_runner
    return runner.compile_backend.piecewise_graphs, len(runner.attn_layers)


pieces, num_layers = split_llm.collective_rpc(split_model)[0]
print(
    f"engine start-up with the trace: {startup_split:.1f} s; Dynamo traces: "
    f"{compilation_counter.num_graphs_seen - traced_before}"
)

# Ops that only relabel memory (views, splits, tuple indexing) launch nothing on a GPU.
SHAPE_ONLY = {"view", "reshape", "split", "chunk", "getitem", "unsqueeze", "empty_like", "size"}


def computing_ops(graph_module) -> list[str]:
    """Names of the ops in a piece that compute (about one GPU kernel each when run eagerly)."""
    names = [
        getattr(n.target, "__name__", str(n.target))
        for n in graph_module.graph.nodes
        if n.op in ("call_function", "call_method")
    ]
    return [name for name in names if name not in SHAPE_ONLY]


for item in pieces:
    ops = computing_ops(item.graph)
    kind = "attention" if item.is_splitting_graph else "dense"
    print(f"{item.submod_name:>9}  {kind:<9} {len(ops):>3} computing ops: {', '.join(ops[:7])} ...")
assert len(pieces) == 2 * num_layers + 1

# %% [markdown]
# The first dense piece is the embedding and layer 0 up to its attention (norm, QKV
# projection, q/k norms, RoPE, and the empty output buffer attention writes into); each
# middle piece is the rest of one layer and the start of the next; the last ends with
# the final norm. Every op in a dense piece works row by row on `[num_tokens, ...]`
# tensors, so a graph of it, captured at some token count, is right for any batch of
# that many tokens.
#
# ## Predict: launches against work
#
# A middle dense piece is one layer's worth of dense ops. Run eagerly, each computing op
# is at least one kernel launch, at roughly 5 µs each from Python (the PyTorch dispatcher
# plus the CUDA launch call); attention adds two more per layer (cache write, attention).
# Against that, a decode step of the Qwen3-0.6B shape (28 layers) at batch 1 reads every
# weight once: about 1.2 GB in bfloat16, 0.25 ms at an H200's 4.8 TB/s.

# %%
per_layer = len(computing_ops(pieces[2].graph)) + 2
shape = ModelShape.from_pretrained(str(CONFIGS_DIR / "qwen3-0.6b"))
weight_bytes = 2 * shape.num_params
launches = 28 * per_layer
print(
    f"~{per_layer} launches per layer -> ~{launches} per decode step of 28 layers x 5 µs "
    f"= {launches * 5e-3:.1f} ms of launching"
)
print(
    f"Qwen3-0.6B shape: {shape.num_params / 1e6:.0f}M parameters, {weight_bytes / 1e9:.2f} GB in bf16 "
    f"-> {weight_bytes / 4.8e12 * 1e3:.2f} ms of GPU work per decode step at batch 1"
)
piecewise_launches = 28 + 1 + 2 * 28
print(
    f"piecewise graphs: {28 + 1} graph launches + {2 * 28} eager attention launches per step "
    f"= {piecewise_launches}, {launches / piecewise_launches:.0f}x fewer"
)

# %% [markdown]
# So eagerly the GPU would idle most of a small-batch step, waiting for launches. A FULL
# graph replays the whole step with one call; PIECEWISE still launches attention eagerly
# between 29 graph replays, an order of magnitude fewer launches than eager but not one:
# the prediction is that it recovers most, not all, of what FULL does.
#
# ## The capture-size ladder and the padding it costs
#
# A graph is captured per size: vLLM's ladder is 1, 2, 4, then every multiple of 8 up to
# twice `max_num_seqs` (512 at most). A step of n tokens runs the graph of the next size
# up; the padding rows compute garbage nobody reads.

# %%
ladder = CompilationConfig(level=3, cudagraph_mode="PIECEWISE")
ladder.resolve(
    "cuda", enforce_eager=False, max_num_seqs=256, max_num_batched_tokens=8192
)
sizes = ladder.cudagraph_capture_sizes
n = np.arange(1, ladder.max_capture_size + 1)
padded = np.array([ladder.pad_for_cudagraph(int(k)) for k in n])
waste = (padded - n) / padded
print(f"{len(sizes)} capture sizes: {sizes[:6]} ... {sizes[-2:]}")
print(
    f"padding waste, averaged over token counts 1..{n[-1]}: {waste.mean():.1%}; "
    f"worst {waste.max():.0%} (n={n[waste.argmax()]}); above 64 tokens at most {waste[n > 64].max():.1%}"
)

# %% [markdown]
# ## Measure on this machine: the split path's host cost
#
# No graphs on a CPU, so this is the cost of the path itself: the eager model against
# the traced, split one, per decode step (`LLMEngine.step()`), and the forward call alone.

# %%
results = {}
for mode, llm in (("eager", eager_llm), ("split", split_llm)):
    results[mode] = measure_mode(llm, BATCH_SIZES, CONTEXT, STEPS)
    for r in results[mode]["rows"]:
        print(
            f"{mode:>6} B={r['batch_size']:>3}: step {r['step_ms']:7.2f} ms, forward {r['forward_host_ms']:7.2f} ms"
        )

# %%
fig, ax = plt.subplots(figsize=(6.5, 4.2))
for mode, marker, color in (("eager", "o", "C0"), ("split", "s", "C1")):
    rows = results[mode]["rows"]
    batch = [r["batch_size"] for r in rows]
    ax.semilogx(
        batch, [r["forward_host_ms"] for r in rows], marker + "-", color=color, label=f"{mode}: forward"
    )
    ax.semilogx(
        batch,
        [r["step_ms"] for r in rows],
        marker + "--",
        color=color,
        alpha=0.5,
        label=f"{mode}: engine step",
    )
ax.set(
    xlabel="decode batch size",
    ylabel="ms per step",
    ylim=(0, None),
    title=f"tiny Qwen3, context {CONTEXT}: host time, eager and split (no graphs)",
)
nb.tick_at([ax], BATCH_SIZES)
ax.text(
    0.5, -0.2,
    "A CPU has no CUDA graphs: this compares only the host cost of the split, compiled model with\n"
    "eager's. What graphs save, the launch of every kernel, needs a GPU run"
    + (" (below)." if nb.recorded_gpu_results("cuda_graphs") else " (none is recorded yet)."),
    transform=ax.transAxes, ha="center", va="top", fontsize=8,
)  # fmt: skip
nb.finish_figure(fig, "eager vs split-and-compiled model")
plt.show()
ratios = {
    r["batch_size"]: e["forward_host_ms"] / r["forward_host_ms"]
    for e, r in zip(results["eager"]["rows"], results["split"]["rows"])
}
print("forward time eager / split: " + ", ".join(f"B={b} {v:.2f}x" for b, v in ratios.items()))

# %% [markdown]
# The split path runs the same ops, through an FX graph instead of `nn.Module` calls
# (no module hooks, no Python attribute lookups per layer), so on its own it changes the
# host cost only by that; on this shared 2-core CPU the difference is within the noise
# of the ratios above, which is why they are measured side by side. Its point is that
# each dense piece is now a callable with fixed shapes per token count, ready to be
# captured. Exact equality of the two, and one trace for all sizes, are tested in
# `tests/test_compilation.py`.
#
# ## The GPU picture
#
# `gpu_suite`'s `cuda_graphs` measurement runs eager, piecewise and full graphs on the
# Qwen3-0.6B shape on an H200: step latency per batch size, host time per forward, and
# kernel launches per step under the profiler.

# %%
recorded = nb.recorded_gpu_results("cuda_graphs")
if recorded is None:
    print(
        "no recorded GPU run of cuda_graphs in figures/data/ yet "
        "(python -m benchmarks.gpu_suite --only cuda_graphs on a GPU, then ledger add)"
    )
else:
    gpu, gpu_label = recorded
    fig_gpu, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, data in gpu["modes"].items():
        rows = data["rows"]
        batch = [r["batch_size"] for r in rows]
        axes[0].loglog(batch, [r["step_ms"] for r in rows], "o-", label=f"{mode} ({data['cudagraph_mode']})")
        axes[1].loglog(batch, [r["forward_host_ms"] for r in rows], "o-", label=mode)
        if "launches" in data:
            print(f"{mode}: {data['launches']}")
    axes[0].set(xlabel="decode batch size", ylabel="ms per step", title="decode step")
    axes[1].set(xlabel="decode batch size", ylabel="ms", title="host time of the forward call")
    for ax in axes:
        ax.legend(fontsize=8)
    fig_gpu.suptitle(gpu_label, fontsize=9)
    plt.show()
    nb.save_figure(fig_gpu, "08_cuda_graphs_gpu")
    print({k: v for k, v in gpu["summary"].items()})

# %%
print(nb.save_figure(fig, "08_cuda_graphs"))
print(
    nb.save_data(
        "08_cuda_graphs",
        {
            "model": "tiny Qwen3 (nano_v1.benchmarks.utils.TINY_QWEN3_SHAPE)",
            "context_len": CONTEXT,
            "num_steps": STEPS,
            "pieces": [{"name": i.submod_name, "attention": i.is_splitting_graph} for i in pieces],
            "launches_per_layer_eager": per_layer,
            "capture_sizes": sizes,
            "padding_waste_mean": float(waste.mean()),
            "results": results,
        },
    )
)
del eager_llm, split_llm, pieces
release_engines()
