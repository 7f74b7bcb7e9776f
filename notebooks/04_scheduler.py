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
# # 04 · The scheduler: one token budget, and what it trades
#
# Chapter 04's scheduler has no prefill phase and no decode phase. Each step it hands out
# up to `max_num_batched_tokens` tokens: first to running requests (a decode wants 1, a
# prompt being chunked wants the rest of its prompt), then to waiting requests in queue
# order. With chunked prefill a long prompt takes whatever budget is left and continues
# next step; without it, a prompt waits until it fits into one step whole.
#
# The budget is a latency knob. A large budget lets a long prompt through in one step,
# so its first token comes sooner (time to first token, TTFT), but that step is long, and
# every request that was decoding waits for it (inter-token latency, ITL). This notebook
# draws the schedule, then measures both latencies against the budget.

# %%
import statistics
import time

import matplotlib.pyplot as plt
import numpy as np

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from nano_v1 import SamplingParams

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
nb.set_threads()
model_dir, dtype, model_name = nb.dummy_model()  # Qwen3-0.6B shape on a GPU, tiny Qwen3 on a CPU
# The latency workload: decoders that start at once, long prompts arriving every ARRIVAL_EVERY steps.
NUM_DECODERS = nb.pick(cpu=8, gpu=32, smoke=2)
NUM_LONG = nb.pick(cpu=4, gpu=8, smoke=1)
LONG_PROMPT = nb.pick(cpu=512, gpu=4096, smoke=64)
ARRIVAL_EVERY = nb.pick(cpu=12, gpu=12, smoke=2)
DECODE_LEN = ARRIVAL_EVERY * (NUM_LONG + 1)  # decoders outlive the last arrival
BUDGETS = nb.pick(cpu=[32, 64, 128, 256, 512], gpu=[256, 512, 1024, 2048, 4096, 8192], smoke=[16, 64])
MAX_MODEL_LEN = max(LONG_PROMPT, 64) + DECODE_LEN
print(f"{model_name}; {nb.device_label()}")

# %% [markdown]
# ## One driver for everything
#
# `run()` adds requests at given steps (an arrival schedule, as a server would see it)
# and steps the engine until all are done. It records, per step, the scheduler's
# `num_scheduled_tokens` (by wrapping `Scheduler.schedule` on this instance) and the
# wall time, and per request the time of every token it receives (each step's outputs
# carry the tokens it added). The notebook builds the engine core itself (`nb.engine_core`:
# the scheduler and the worker, in this process) so that the scheduler it wraps is its
# own object; `LLM` would hide it, by default in another process (chapter 09).


# %%
def run(arrivals: list[tuple[int, list[int], int]], budget: int, chunked: bool) -> dict:
    """arrivals: (step, prompt token ids, output length) per request, request id = its index."""
    core = nb.engine_core(
        model=model_dir, load_format="dummy", dtype=dtype, max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, seed=0,
    )
    scheduler = core.scheduler
    core.add_request(nb.core_request("warm-up", [1, 2, 3], SamplingParams(max_tokens=2)))
    while scheduler.has_unfinished_requests():
        core.step()
    schedule, scheduled = scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        scheduled.append(dict(out.num_scheduled_tokens))
        return out

    scheduler.schedule = recording_schedule
    arrival_time, token_times, step_end = {}, {}, []
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    step = 0
    start = time.perf_counter()
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, output_len) = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            core.add_request(nb.core_request(str(i), prompt, params))
            arrival_time[i] = time.perf_counter() - start
        num_scheduled_before = len(scheduled)
        outputs = core.step().outputs
        now = time.perf_counter() - start
        step_end.append(now)
        if len(scheduled) == num_scheduled_before:  # nothing was waiting or running: an idle step
            scheduled.append({})
        for out in outputs:
            token_times.setdefault(int(out.request_id), []).extend([now] * len(out.new_token_ids))
        step += 1
    del scheduler.schedule
    return {"scheduled": scheduled, "step_end": step_end, "arrival": arrival_time, "token_times": token_times}


# %% [markdown]
# ## The schedule, drawn
#
# Eight requests of mixed lengths, two arriving later, under a budget of 128 tokens with
# chunked prefill, and without it (then the budget must hold the longest prompt whole,
# `max_model_len`). Each row is a request, each column a step; the colour is how many
# tokens the request computed in that step (a prefill chunk is many, a decode is one).

# %%
rng = np.random.default_rng(0)
gantt_prompts = nb.pick(
    cpu=[300, 40, 500, 80, 200, 24, 450, 60], gpu=[300, 40, 500, 80, 200, 24, 450, 60], smoke=[30, 8, 50, 8]
)
gantt_arrivals = [
    (
        0 if i < len(gantt_prompts) - 2 else 6 + 4 * (i % 2),
        rng.integers(0, 4096, p).tolist(),
        nb.pick(24, 24, 4),
    )
    for i, p in enumerate(gantt_prompts)
]
gantt_budget = nb.pick(128, 128, 32)
gantt = {
    "chunked prefill on": run(gantt_arrivals, gantt_budget, True),
    "chunked prefill off": run(gantt_arrivals, MAX_MODEL_LEN, False),
}

# %% [markdown]
# Check, before reading the picture: every request computed exactly its prompt plus its
# output minus one token (the last sampled token's KV is never needed), no step went
# over its budget, and the token times are in order.

# %%
for name, r in gantt.items():
    budget = gantt_budget if "on" in name else MAX_MODEL_LEN
    assert all(sum(s.values()) <= budget for s in r["scheduled"]), name
    for i, (_, prompt, out_len) in enumerate(gantt_arrivals):
        computed = sum(s.get(str(i), 0) for s in r["scheduled"])
        assert computed == len(prompt) + out_len - 1, (name, i, computed)
        assert len(r["token_times"][i]) == out_len
print("schedules consistent: every token computed once, budgets respected")

# %%
fig_gantt, axes = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True)
num_steps = max(len(r["scheduled"]) for r in gantt.values())
for ax, (name, r) in zip(axes, gantt.items()):
    grid = np.full((len(gantt_arrivals), num_steps), np.nan)
    for step, sched in enumerate(r["scheduled"]):
        for req_id, n in sched.items():
            grid[int(req_id), step] = n
    im = ax.imshow(
        grid,
        aspect="auto",
        cmap="viridis",
        norm=plt.matplotlib.colors.LogNorm(1, max(gantt_prompts)),
        interpolation="nearest",
    )
    for i, (arrive, prompt, _) in enumerate(gantt_arrivals):
        ax.plot(arrive - 0.5, i, ">", color="red", ms=5)
    ax.set(
        ylabel="request",
        yticks=range(len(gantt_arrivals)),
        yticklabels=[f"{i}: {len(p)} tok" for i, (_, p, _) in enumerate(gantt_arrivals)],
        title=f"{name}: {len(r['scheduled'])} steps, {r['step_end'][-1] * 1e3:.0f} ms",
    )
axes[-1].set_xlabel("engine step (red ▸: arrival)")
fig_gantt.colorbar(im, ax=axes, label="tokens computed in the step", shrink=0.8)
fig_gantt.suptitle(
    f"the schedule, budget {gantt_budget} (on) / {MAX_MODEL_LEN} (off), {model_name}: {nb.device_label()}",
    fontsize=10,
)
plt.show()

# %% [markdown]
# With chunking, a prompt larger than what is left of the budget is split across steps
# (a bar of several cells) and decodes run in every step beside it. Without it, a prompt
# enters only when it fits whole, so prompts queue behind each other and one step can
# carry hundreds of tokens while every decoding request waits for it.
#
# ## Predict: TTFT and ITL against the budget
#
# Model a step as costing a + b x (tokens in the step). A long prompt of P tokens, with
# D requests decoding, gets B - D tokens a step, so it takes ceil(P / (B - D)) steps to
# its first token: with n = ceil(P / (B - D)), TTFT ~ n x a + b x (P + n x D). Each step also holds
# up the decoders: their ITL during a prefill is a + b x B, against a + b x D otherwise.
# So TTFT falls with the budget until one step holds the whole prompt, and the ITL
# during a prefill rises in proportion to it. We fit a and b on the steps of the two
# runs above (a different workload: eight prompts of 24-500 tokens), and predict the sweep
# from them before running it.

# %%
calibration_tokens = np.concatenate([[sum(s.values()) for s in r["scheduled"]] for r in gantt.values()])
calibration_steps = np.concatenate([np.diff([0.0] + r["step_end"]) for r in gantt.values()])
busy = calibration_tokens > 0  # idle steps (waiting for an arrival) ran no model
b_s, a_s = np.polyfit(calibration_tokens[busy], calibration_steps[busy], 1)
print(f"fitted on {busy.sum()} steps of the runs above: "
      f"step ~ {a_s * 1e3:.2f} ms + {b_s * 1e6:.1f} µs x tokens")
predicted = {}
for budget in BUDGETS:
    n = -(-LONG_PROMPT // (budget - NUM_DECODERS))  # steps to the first token, with D decodes in each
    predicted[budget] = {
        "ttft_ms": 1e3 * (n * a_s + b_s * (LONG_PROMPT + n * NUM_DECODERS)),
        "itl_prefill_ms": 1e3 * (a_s + b_s * min(budget, LONG_PROMPT + NUM_DECODERS)),
    }
    print(f"budget {budget:>5}: predicted TTFT {predicted[budget]['ttft_ms']:8.1f} ms, "
          f"ITL in a prompt's largest chunk {predicted[budget]['itl_prefill_ms']:7.1f} ms")

# %% [markdown]
# Now the measurement.

# %%
decoders = [(0, rng.integers(0, 4096, 16).tolist(), DECODE_LEN) for _ in range(NUM_DECODERS)]
longs = [(ARRIVAL_EVERY * (k + 1), rng.integers(0, 4096, LONG_PROMPT).tolist(), 4) for k in range(NUM_LONG)]
latency_arrivals = decoders + longs


def latencies(r: dict) -> dict:
    ttft = [r["token_times"][i][0] - r["arrival"][i] for i in range(NUM_DECODERS, len(latency_arrivals))]
    gaps = np.concatenate([np.diff(r["token_times"][i]) for i in range(NUM_DECODERS)])
    steps = np.diff([0.0] + r["step_end"])
    tokens = np.array([sum(s.values()) for s in r["scheduled"]])
    # Every decoder gets a token every step, so its ITL in a step is that step's time. The
    # stall a long prompt inflicts: the step that carries its largest chunk (median over prompts).
    biggest_chunk_step = [
        max(range(len(r["scheduled"])), key=lambda k: r["scheduled"][k].get(str(i), 0))
        for i in range(NUM_DECODERS, len(latency_arrivals))
    ]
    return {
        "ttft_ms": 1e3 * statistics.mean(ttft),
        "itl_mean_ms": 1e3 * float(gaps.mean()),
        "itl_prefill_ms": 1e3 * float(np.median(steps[biggest_chunk_step])),
        "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
        "itl_max_ms": 1e3 * float(gaps.max()),
        "num_steps": len(steps),
        "step_s": steps.tolist(),
        "step_tokens": tokens.tolist(),
    }


results = {}
for budget in BUDGETS:
    results[f"on/{budget}"] = {
        "budget": budget,
        "chunked": True,
        **latencies(run(latency_arrivals, budget, True)),
    }
results["off"] = {
    "budget": MAX_MODEL_LEN,
    "chunked": False,
    **latencies(run(latency_arrivals, MAX_MODEL_LEN, False)),
}
for key, r in results.items():
    print(
        f"{key:>9}: TTFT {r['ttft_ms']:8.1f} ms, ITL mean {r['itl_mean_ms']:6.1f} ms, "
        f"in a prompt's largest chunk {r['itl_prefill_ms']:7.1f} ms, max {r['itl_max_ms']:7.1f} ms, {r['num_steps']} steps"
    )

# %% [markdown]
# ## Plot: the trade, in milliseconds

# %%
on = [results[f"on/{b}"] for b in BUDGETS]
off = results["off"]
fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
axes[0].plot(BUDGETS, [r["ttft_ms"] for r in on], "o-", label="chunked prefill on")
axes[0].plot(BUDGETS, [predicted[b]["ttft_ms"] for b in BUDGETS], "k--", label="a + b·tokens, predicted")
axes[0].axhline(off["ttft_ms"], color="C3", ls=":", label=f"chunked prefill off (budget {MAX_MODEL_LEN})")
axes[0].set(
    xscale="log",
    xlabel="token budget (max_num_batched_tokens)",
    ylabel="ms",
    title=f"time to first token, {LONG_PROMPT}-token prompts",
)
axes[1].plot(BUDGETS, [r["itl_mean_ms"] for r in on], "o-", label="mean, chunked on")
axes[1].plot(
    BUDGETS, [r["itl_prefill_ms"] for r in on], "s-", label="in a prompt's largest chunk (median), chunked on"
)
axes[1].plot(
    BUDGETS,
    [predicted[b]["itl_prefill_ms"] for b in BUDGETS],
    "k--",
    label="in a prompt's largest chunk, a + b·tokens, predicted",
)
axes[1].axhline(off["itl_prefill_ms"], color="C3", ls=":", label="in a prompt's step, chunked off")
axes[1].set(
    xscale="log",
    xlabel="token budget (max_num_batched_tokens)",
    ylabel="ms",
    title=f"inter-token latency of {NUM_DECODERS} decoding requests",
)
nb.tick_at(axes, BUDGETS)
nb.finish_figure(
    fig,
    f"{NUM_DECODERS} decoders + {NUM_LONG} long prompts arriving every {ARRIVAL_EVERY} steps, {model_name}",
)
plt.show()

# %% [markdown]
# ## Explain the gap
#
# The trade is the one predicted: a bigger budget lets a long prompt finish in fewer
# steps, so TTFT falls, while each of those steps is longer, so the gap between a
# decoding request's tokens during a prefill grows. The mean ITL moves less, because
# most steps hold only decodes whatever the budget. Where a step's fixed cost `a` is
# large (on a CPU it is most of a decode step, chapter 00), every extra step a chunked
# prompt needs costs a full `a`, so small budgets lose more TTFT than they win ITL. The model misses most at
# the smallest budget: there a prompt's chunks take more steps than the interval between
# arrivals, the next prompt queues behind it, and its TTFT includes that wait, which a
# model of one prompt on an idle queue leaves out.
#
# Turning chunked prefill off forces the budget up to `max_model_len`, and then a prompt
# runs whole in one step: TTFT as good as the largest budget, and the longest stall of
# the decoders too. vLLM v1 keeps chunked prefill always on and leaves the budget to the operator; its
# default (8192 on a GPU, where a step of a few thousand tokens takes milliseconds)
# favours throughput. No GPU run is recorded for this notebook.

# %% [markdown]
# ## Admission on a full cache: vLLM 0.33's full-prompt gate
#
# v0.11.0 admits a waiting request when the free blocks cover its *first chunk*. On a
# cache that cannot hold every admitted prompt whole, the chunks that follow run out of
# blocks, and the scheduler preempts the newest running request, whose computed chunks
# are thrown away and computed again later (prefix caching off, so nothing is kept).
# vLLM 0.33 admits a request only if the free blocks cover its whole prompt
# (`scheduler_reserve_full_isl`, on by default there); nano_v1 has it as an option, off by
# default as in v0.11.0.
#
# Predict first. A request needs its prompt plus all but its last output token computed
# once: the work is fixed, sum(prompt + output - 1) tokens. Everything the scheduler
# schedules beyond that is recomputation after a preemption. With the gate, a request runs
# only when all of its prompt fits, so preemption is left to decodes outgrowing the cache;
# at most a few requests should ever be preempted, and the waste should drop to near 0.

# %%
GATE_PROMPT = nb.pick(cpu=384, gpu=4096, smoke=48)
GATE_REQUESTS = nb.pick(cpu=12, gpu=32, smoke=6)
GATE_OUTPUT = nb.pick(cpu=64, gpu=256, smoke=16)
GATE_BUDGET = nb.pick(cpu=128, gpu=1024, smoke=16)
GATE_BLOCK = 16
# Room for about 2.5 requests' prompts and outputs: tight, but one request always fits.
GATE_BLOCKS = 1 + int(2.5 * (GATE_PROMPT + GATE_OUTPUT) / GATE_BLOCK)


def run_gate(gate: bool) -> dict:
    """All requests at once on a cache of GATE_BLOCKS blocks; tokens scheduled, resumes, wall time."""
    core = nb.engine_core(
        model=model_dir, load_format="dummy", dtype=dtype, max_num_batched_tokens=GATE_BUDGET,
        max_model_len=GATE_PROMPT + GATE_OUTPUT, enable_prefix_caching=False, seed=0,
        block_size=GATE_BLOCK, num_gpu_blocks_override=GATE_BLOCKS, scheduler_reserve_full_isl=gate,
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=GATE_OUTPUT, ignore_eos=True)
    for i in range(GATE_REQUESTS):
        core.add_request(nb.core_request(str(i), rng.integers(0, 1000, GATE_PROMPT).tolist(), params))
    scheduler = core.scheduler
    schedule, outputs = scheduler.schedule, []

    def recording_schedule():
        outputs.append(schedule())
        return outputs[-1]

    scheduler.schedule = recording_schedule
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        core.step()
    elapsed = time.perf_counter() - start
    del scheduler.schedule
    scheduled = sum(o.total_num_scheduled_tokens for o in outputs)
    needed = GATE_REQUESTS * (GATE_PROMPT + GATE_OUTPUT - 1)
    return {
        "scheduled_tokens": scheduled,
        "needed_tokens": needed,
        "wasted_tokens": scheduled - needed,
        "wasted_fraction": (scheduled - needed) / needed,
        "resumes": sum(sum(o.scheduled_cached_reqs.resumed_from_preemption) for o in outputs),
        "steps": len(outputs),
        "elapsed_s": elapsed,
    }


gate_results = {name: run_gate(gate) for name, gate in (("v0.11.0 (first chunk)", False), ("0.33 gate (whole prompt)", True))}
print(f"{GATE_REQUESTS} requests x ({GATE_PROMPT} prompt + {GATE_OUTPUT} output) tokens, budget {GATE_BUDGET}, "
      f"{GATE_BLOCKS - 1} usable blocks of {GATE_BLOCK}")
for name, r in gate_results.items():
    print(f"{name:<26} scheduled {r['scheduled_tokens']:>6} tokens, wasted {r['wasted_tokens']:>6} "
          f"({r['wasted_fraction']:.0%}), {r['resumes']:>3} resumes, {r['steps']:>4} steps, {r['elapsed_s']:.2f} s")

# %% [markdown]
# The gate pays where the first-chunk rule over-admits: each preempted request had
# computed some chunks of its prompt, which the scheduler computes again when it resumes.
# The cost of the gate is the other side of the same coin: a request that would have fit
# its first chunk waits, so the cache is less full while it waits; with many short prompts
# and a roomy cache the two rules admit the same requests and the gate costs nothing.

# %%
print(nb.save_figure(fig_gantt, "04_scheduler_gantt"))
print(nb.save_figure(fig, "04_scheduler"))
print(
    nb.save_data(
        "04_scheduler",
        {
            "model": model_name,
            "gantt": {
                "budget_on": gantt_budget,
                "budget_off": MAX_MODEL_LEN,
                "prompt_lens": gantt_prompts,
                "arrival_steps": [a for a, _, _ in gantt_arrivals],
                "scheduled": {name: r["scheduled"] for name, r in gantt.items()},
            },
            "latency_workload": {
                "num_decoders": NUM_DECODERS,
                "decode_len": DECODE_LEN,
                "num_long": NUM_LONG,
                "long_prompt": LONG_PROMPT,
                "arrival_every_steps": ARRIVAL_EVERY,
            },
            "step_model": {"a_ms": a_s * 1e3, "b_us_per_token": b_s * 1e6},
            "results": {
                k: {kk: vv for kk, vv in r.items() if kk not in ("step_s", "step_tokens")}
                for k, r in results.items()
            },
            "predicted": predicted,
            "admission_gate": {
                "workload": {
                    "num_requests": GATE_REQUESTS, "prompt_len": GATE_PROMPT, "output_len": GATE_OUTPUT,
                    "budget": GATE_BUDGET, "block_size": GATE_BLOCK, "usable_blocks": GATE_BLOCKS - 1,
                },
                "results": gate_results,
            },
        },
    )
)
