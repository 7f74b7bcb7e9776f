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
# # 00 · Why v1: where a step's time goes
#
# An inference engine runs in steps. One step of `nano_v1` (and of vLLM v1) is
#
# 1. **schedule**: `Scheduler.schedule()` decides how many tokens each request computes;
# 2. **prepare inputs**: the model runner applies the scheduler's diff to its persistent
#    batch and builds flat input ids, positions, slot mapping and attention metadata;
# 3. **forward**: the model, then the LM head on one row per request;
# 4. **sample**: the sampler, and writing the sampled tokens back into the batch;
# 5. **update**: `Scheduler.update_from_output()` appends tokens and finishes requests;
# 6. **outputs**: the frontend turns core outputs into `RequestOutput`s.
#
# Only step 3 is the model. Everything else is Python on the host, and while it runs a
# GPU waits. This notebook measures each stage for a small model as the batch grows,
# and shows why vLLM's v1 rewrite was about that host work: batching makes the forward
# cheaper *per token*, but not the bookkeeping.
#
# The order is the one every notebook follows: predict with arithmetic, check
# correctness, measure, plot in derived units, explain the gap.

# %%
import dataclasses
import statistics
import time
from collections import defaultdict

import matplotlib.pyplot as plt
import numpy as np
import torch

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from benchmarks.context import CONFIGS_DIR
from nano_v1 import SamplingParams
from nano_v1.benchmarks.roofline import H200_DATASHEET, ModelShape, decode_step_cost, measure_device_ceilings
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine.core import EngineCore
from nano_v1.engine.output_processor import OutputProcessor
from nano_v1.engine.processor import load_tokenizer

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
BATCH_SIZES = nb.pick(cpu=[1, 2, 4, 8, 16, 32, 64], gpu=[1, 2, 4, 8, 16, 32, 64, 128, 256], smoke=[1, 4])
CONTEXT = nb.pick(cpu=128, gpu=512, smoke=16)  # prompt tokens per request
NUM_STEPS = nb.pick(cpu=40, gpu=30, smoke=2)  # timed decode steps per batch size

# A model small for its device, so that the forward is as cheap as it gets there.
# On a CPU: the bundled demo model in float32. On a GPU: the Qwen3-0.6B shape in bfloat16
# with random ("dummy") weights: timing needs the shape, not the values.
if nb.ON_GPU and not SMOKE:
    model_dir, dtype, load_format, model_name = (
        str(CONFIGS_DIR / "qwen3-0.6b"),
        "bfloat16",
        "dummy",
        "Qwen3-0.6B shape",
    )
else:
    model_dir, dtype, load_format, model_name = str(DEMO_MODEL_PATH), "float32", "auto", "demo model"
shape = ModelShape.from_pretrained(model_dir)
nb.set_threads()  # one torch thread on a CPU: steadier timings on a shared machine
print(f"{nb.device_label()}; model: {shape.num_params / 1e6:.1f}M parameters, {shape.num_layers} layers")

# %% [markdown]
# ## Predict
#
# A decode step of B requests reads every weight once and does 2 FLOPs per weight per
# token. `nano_v1/benchmarks/roofline.py::decode_step_cost` counts those bytes and FLOPs
# (plus the KV cache read by attention); dividing by the device's measured memory
# bandwidth and matmul rate gives the time no implementation can beat. At small B the
# step is memory bound, its floor flat in B; per token it falls as 1/B.
#
# The host stages have no such floor: each costs a fixed amount of Python per step plus
# something per request. If it is a + b·B, then per token it tends to b, while the
# forward per token keeps falling until it turns compute bound.
#
# The host stages hardly depend on the model, so we can set them against the GPU case
# that motivated v1: the floor of a Qwen3-0.6B decode step on an H200 (datasheet
# bandwidth and bf16 rate), a few hundred microseconds.

# %%
ceilings = measure_device_ceilings(nb.DEVICE, smoke=SMOKE)
dtype_bytes = 2 if dtype == "bfloat16" else 4
floor_ms = {
    b: 1e3 * decode_step_cost(shape, b, CONTEXT, dtype_bytes).time_floor(ceilings) for b in BATCH_SIZES
}
print(
    f"measured: {ceilings.memory_bandwidth / 1e9:.1f} GB/s, {ceilings.matmul_flops / 1e9:.0f} GFLOP/s ({ceilings.dtype})"
)
gpu_shape = ModelShape.from_pretrained(CONFIGS_DIR / "qwen3-0.6b")
h200_floor_us = {
    b: 1e6 * decode_step_cost(gpu_shape, b, CONTEXT, 2).time_floor(H200_DATASHEET) for b in BATCH_SIZES
}
for b in BATCH_SIZES:
    cost = decode_step_cost(shape, b, CONTEXT, dtype_bytes)
    print(
        f"B={b:>3}: {cost.total_bytes / 1e6:7.1f} MB, {cost.total_flops / 1e9:6.2f} GFLOP -> "
        f"floor {floor_ms[b]:7.3f} ms ({cost.bound(ceilings)} bound), {1e3 * floor_ms[b] / b:8.1f} µs/token; "
        f"Qwen3-0.6B on an H200: floor {h200_floor_us[b]:5.0f} µs"
    )

# %% [markdown]
# ## Time each stage without changing the engine
#
# `StageTimer` wraps, on one engine, the methods a step calls, and adds each call's time
# to its stage. It needs the objects a step runs through, which `LLM` keeps out of reach
# (by default its engine core runs in another process, chapter 09). So we assemble the
# same engine from its two halves, in this process: the engine core (`EngineCore`: the
# scheduler and the worker) and the frontend's `OutputProcessor`. A step is then what
# `LLMEngine.step()` does, `output_processor.process_outputs(core.step().outputs)`, and
# runs unchanged under the timers. On a GPU each wrapper synchronises before reading the
# clock, so the device time of a stage is charged to it rather than to the next
# synchronisation (this removes the little overlap a step has, and is said in the plot).

# %%
STAGES = ("schedule", "prepare inputs", "forward", "sample", "update", "outputs")


class StageTimer:
    """Charge the time of every wrapped method call to its stage, while active."""

    def __init__(self, core: EngineCore, output_processor: OutputProcessor) -> None:
        runner = core.model_executor.driver_worker.model_runner
        self.targets = [
            (core.scheduler, "schedule", "schedule"),
            (runner, "_update_states", "prepare inputs"),
            (runner, "_prepare_inputs", "prepare inputs"),
            (runner.attn_metadata_builder, "build", "prepare inputs"),
            (runner.model, "forward", "forward"),
            (runner.model, "compute_logits", "forward"),
            (runner.sampler, "forward", "sample"),
            (runner, "_bookkeeping_sync", "sample"),  # holds the step's one device -> host sync
            (core.scheduler, "update_from_output", "update"),
            (output_processor, "process_outputs", "outputs"),
        ]
        self.seconds: dict[str, float] = defaultdict(float)

    def _wrap(self, fn, stage: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if nb.ON_GPU:
                torch.cuda.synchronize()
            self.seconds[stage] += time.perf_counter() - t0
            return out

        return timed

    def __enter__(self) -> None:
        for obj, name, stage in self.targets:
            setattr(
                obj, name, self._wrap(getattr(obj, name), stage)
            )  # an instance attribute shadows the method

    def __exit__(self, *exc) -> None:
        for obj, name, _ in self.targets:
            delattr(obj, name)


core = nb.engine_core(
    model=model_dir,
    max_model_len=CONTEXT + NUM_STEPS + 16,
    max_num_seqs=max(BATCH_SIZES),
    enable_prefix_caching=False,
    seed=0,
    load_format=load_format,
    dtype=dtype,
)
vllm_config = core.vllm_config
output_processor = OutputProcessor(load_tokenizer(vllm_config.model_config))


def add_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """What `LLMEngine.add_request` does with a prompt of token ids: hand it to both halves."""
    request = nb.core_request(request_id, prompt_token_ids, params)
    output_processor.add_request(request_id, None, [request])
    core.add_request(request)


def step() -> list:
    """One engine step: `LLMEngine.step()`, less the stop-string aborts and statistics (none here)."""
    return output_processor.process_outputs(core.step().outputs).request_outputs


def abort(request_ids: list[str]) -> None:
    core.abort_requests(output_processor.abort_requests(request_ids))


rng = np.random.default_rng(0)

# %% [markdown]
# ## Check: the timers change nothing
#
# The same prompts, greedy, once untimed and once under the timers: the tokens must be
# identical.


# %%
def run_to_completion(name: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        add_request(f"{name}-{i}", p, params)
    got: dict[str, list[int]] = {}
    while output_processor.has_unfinished_requests():
        for out in step():
            got[out.request_id] = out.outputs[0].token_ids
    return [got[f"{name}-{i}"] for i in range(len(prompts))]


check_prompts = [rng.integers(0, shape.vocab_size, CONTEXT).tolist() for _ in range(3)]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
expected = run_to_completion("untimed", check_prompts, params)
with StageTimer(core, output_processor):
    timed = run_to_completion("timed", check_prompts, params)
assert timed == expected, "the timed engine produced different tokens"
print("timed and untimed runs agree:", expected[0])

# %% [markdown]
# ## Measure
#
# For each batch size: B prompts of `CONTEXT` random tokens are prefilled untimed, then
# `NUM_STEPS` pure decode steps are timed, stage by stage (median over steps).


# %%
def measure(batch_size: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS + 8, ignore_eos=True)
    ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
    for request_id in ids:
        add_request(request_id, rng.integers(0, shape.vocab_size, CONTEXT).tolist(), params)
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    for _ in range(-(-batch_size * CONTEXT // budget) + 2):  # prefill, then every request is decoding
        step()
    per_stage = {s: [] for s in STAGES}
    step_s = []
    for _ in range(NUM_STEPS):
        timer = StageTimer(core, output_processor)
        with timer:
            t0 = time.perf_counter()
            step()
            step_s.append(time.perf_counter() - t0)
        for s in STAGES:
            per_stage[s].append(timer.seconds[s])
    abort(ids)
    # "other": the glue between stages (step(), EngineCore.step, execute_model's own lines).
    per_stage["other"] = [t - sum(parts) for t, parts in zip(step_s, zip(*(per_stage[s] for s in STAGES)))]
    row = {"batch_size": batch_size, "step_us": 1e6 * statistics.median(step_s)}
    row.update({f"{s}_us": 1e6 * statistics.median(v) for s, v in per_stage.items()})
    row["floor_us"] = 1e3 * floor_ms[batch_size]
    return row


measure(BATCH_SIZES[-1])  # warm-up: the first steps of a fresh engine are slower
start = time.perf_counter()
rows = [measure(b) for b in BATCH_SIZES]
print(f"measured in {time.perf_counter() - start:.0f} s")
print(f"{'B':>4}{'step µs':>10}" + "".join(f"{s:>16}" for s in STAGES) + f"{'host share':>12}{'tok/s':>8}")
for r in rows:
    host = 1 - r["forward_us"] / r["step_us"]
    print(
        f"{r['batch_size']:>4}{r['step_us']:>10.0f}"
        + "".join(f"{r[f'{s}_us']:>16.0f}" for s in STAGES)
        + f"{host:>12.0%}{r['batch_size'] / r['step_us'] * 1e6:>8.0f}"
    )

# %% [markdown]
# ## Plot in derived units
#
# Left: the host stages of a step, stacked (medians over the timed steps). Right:
# microseconds per generated token, the forward against its roofline floor, and the
# host stages together.

# %%
B = np.array(BATCH_SIZES)
stage_us = {s: np.array([r[f"{s}_us"] for r in rows]) for s in (*STAGES, "other")}
forward = stage_us["forward"]
host = sum(v for s, v in stage_us.items() if s != "forward")
fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
bottom = np.zeros(len(B))
for s, v in stage_us.items():
    if s != "forward":
        axes[0].bar(np.arange(len(B)), v, bottom=bottom, label=s)
        bottom += v
axes[0].set_xticks(np.arange(len(B)), [str(b) for b in B])
axes[0].set(xlabel="batch size (decode)", ylabel="µs per step", title="the host stages of a decode step")
axes[1].loglog(B, forward / B, "o-", label="forward (model + LM head)")
axes[1].loglog(B, host / B, "s-", label="host: every other stage")
axes[1].loglog(B, [1e3 * floor_ms[b] / b for b in B], "k--", label="roofline floor of the forward")
axes[1].loglog(
    B, [h200_floor_us[b] / b for b in B], "k:", label="floor of a Qwen3-0.6B forward on an H200 (datasheet)"
)
axes[1].set(xlabel="batch size (decode)", ylabel="µs per generated token", title="model vs host, per token")
nb.tick_at(axes[1:], BATCH_SIZES)
nb.finish_figure(fig, f"nano_v1 decode step, {model_name} ({shape.num_params / 1e6:.2g}M), context {CONTEXT}")
plt.show()

# %% [markdown]
# ### The GPU picture
#
# On a GPU the forward of a small model takes a few milliseconds whatever the batch, so
# the host stages matter more still. `gpu_suite`'s `decode_latency` measurement times the
# whole engine step and the model runner inside it on an H200; on a machine without a
# GPU we plot the latest recorded run from figures/data/, labelled with where and when it
# ran.

# %%
recorded = nb.recorded_gpu_results("decode_latency")
if recorded is None:
    print(
        "no recorded GPU run in figures/data/ yet (python -m benchmarks.gpu_suite on a GPU, then ledger add)"
    )
else:
    gpu, gpu_label = recorded
    gb = np.array([r["batch_size"] for r in gpu["rows"]])
    fig_gpu, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.loglog(
        gb, [r["execute_model_ms"] * 1e3 for r in gpu["rows"]], "o-", label="model runner (execute_model)"
    )
    ax.loglog(gb, [r["engine_overhead_ms"] * 1e3 for r in gpu["rows"]], "s-", label="rest of the engine step")
    ax.loglog(gb, [r["roofline_floor_ms"] * 1e3 for r in gpu["rows"]], "k--", label="roofline floor")
    ax.set(
        xlabel="batch size (decode)",
        ylabel="µs per step",
        title=f"{gpu['model']}, context {gpu['context_len']}",
    )
    ax.legend(fontsize=8)
    fig_gpu.suptitle(gpu_label, fontsize=9)
    plt.show()
    nb.save_figure(fig_gpu, "00_why_v1_gpu")

# %% [markdown]
# ## Explain the gap
#
# First the split of each host stage into a fixed cost per step and a cost per request
# (a straight-line fit over the batch sizes):

# %%
fits = {s: np.polyfit(B, stage_us[s], 1) for s in (*STAGES, "other")}  # [µs per request, µs per step]
for s, (per_request, fixed) in fits.items():
    print(f"{s:>15}: {fixed:7.0f} µs per step + {per_request:6.2f} µs per request")
host_share = {r["batch_size"]: 1 - r["forward_us"] / r["step_us"] for r in rows}  # as in the table above
print("host share of a decode step: " + ", ".join(f"B={b} {v:.0%}" for b, v in host_share.items()))
print(
    f"forward: {forward[-1] / B[-1]:.0f} µs per token at B={B[-1]}, "
    f"{forward[-1] / (1e3 * floor_ms[int(B[-1])]):.0f}x its roofline floor"
)
print(
    f"host stages at B={B[-1]}: {host[-1]:.0f} µs per step, against {h200_floor_us[int(B[-1])]:.0f} µs for the "
    f"floor of a Qwen3-0.6B decode step on an H200 ({host[-1] / h200_floor_us[int(B[-1])]:.1f}x)"
)

# %% [markdown]
# Read the two panels with those numbers. Per token, the forward falls steeply with the
# batch: the weights are read once per step whatever B is, which is why engines batch.
# On a CPU the forward stays far above its floor (small matmuls, a plain PyTorch
# attention, per-operation dispatch) and is most of the step. The dotted line is the
# point of v1: on a GPU the same step for a far larger model has a floor of a few
# hundred microseconds, less than the host stages measured here. Run as they are, the
# host stages would leave the GPU idle most of the time.
#
# Which host work grows with the batch is what v1's design targets:
# - **prepare inputs** stays nearly flat: the persistent batch applies a diff and derives
#   the inputs with a few numpy calls (chapter 05);
# - **schedule** and **update** cost a few µs per request: one pass over the running
#   requests under a token budget, with no per-token Python (chapter 04);
# - **outputs**, the frontend's detokenization and `RequestOutput`s, is the steepest per
#   request. vLLM v1 runs the engine core in its own process, so that this work overlaps
#   the next step instead of adding to it (chapter 09).

# %%
summary = {
    "host_share_of_step": host_share,
    "host_us_per_token": {int(b): float(h / b) for b, h in zip(B, host)},
    "forward_us_per_token": {int(b): float(f / b) for b, f in zip(B, forward)},
    "fit_us": {
        s: {"per_step": float(fixed), "per_request": float(per_request)}
        for s, (per_request, fixed) in fits.items()
    },
    "h200_qwen3_0.6b_floor_us": h200_floor_us,
}
print(nb.save_figure(fig, "00_why_v1"))
print(
    nb.save_data(
        "00_why_v1",
        {
            "model": model_name,
            "model_shape": dataclasses.asdict(shape),
            "context_len": CONTEXT,
            "num_timed_steps": NUM_STEPS,
            "ceilings": ceilings.to_dict(),
            "stages": list(STAGES),
            "rows": rows,
            "summary": summary,
        },
    )
)
