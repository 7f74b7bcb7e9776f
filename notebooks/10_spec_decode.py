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
# # 10 · Speculative decoding: n-gram drafts, verified exactly
#
# Chapter 10 adds speculative decoding to the unified scheduler: after each step the
# model runner guesses the next k tokens of every request by looking up its last few
# tokens earlier in its own text (the n-gram proposer), and the next step computes
# 1 + k tokens per request instead of 1 and keeps the longest run of guesses the model
# agrees with, plus one token of its own. This notebook
#
# 1. predicts what that can gain: tokens per step as a function of the acceptance rate;
# 2. checks the two promises: greedy output is unchanged, and sampled output still
#    follows the model's distribution;
# 3. measures acceptance, tokens per step and end-to-end speed-up on the bundled demo
#    model, on Python files it never saw, against k and the n-gram size;
# 4. measures what a step verifying 1 + k tokens costs against a plain decode step,
#    and from the ratio the acceptance rate above which speculation pays.

# %%
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from benchmarks.context import SuiteContext
from benchmarks.spec_decode_verify import expected_tokens_per_step, verify_cost_sweep
from nano_v1 import LLM, SamplingParams
from nano_v1.benchmarks.spec_decode import print_report, run_cpu_sweep
from nano_v1.benchmarks.utils import step_timing
from nano_v1.metrics.reader import spec_decoding_stats_from_metrics
from nano_v1.sample.metadata import SamplingMetadata
from nano_v1.sample.rejection_sampler import RejectionSampler
from nano_v1.spec_decode.metadata import SpecDecodeMetadata

# Every engine's core in this process (vLLM's switch, read when an `LLM` is built): its
# worker records each step (`step_timing`) and hands the records back as they are (chapter 09).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
nb.set_threads()
KS = nb.pick(cpu=[1, 2, 3, 5], gpu=[1, 2, 3, 5], smoke=[3])
LOOKUP_MAXES = nb.pick(cpu=[1, 2, 3, 4], gpu=[1, 2, 3, 4], smoke=[2])
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = nb.pick(cpu=(8, 256, 128), gpu=(8, 256, 128), smoke=(2, 64, 16))
print(nb.device_label())

# %% [markdown]
# ## Predict
#
# If each draft is accepted with probability a, independently, a request gains
# 1 + a + a² + … + a^k tokens per step: the run of accepted drafts, then the target's own
# token (the correction at the first rejection, or the bonus token after k acceptances).
# A plain decode step gains exactly 1. So with k = 3 and a = 0.5, a step yields 1.875
# tokens, and speculation pays if that step costs less than 1.875 plain steps.
#
# What does it cost? A decode step of a small model on a GPU is bound by reading the
# weights (chapter 00): 1.2 GB for Qwen3-0.6B in bf16, the same whether each request
# brings 1 token or 4, so verifying should be nearly free until the batch is large enough
# that the matmuls become compute-bound. On a CPU the model computes at a few hundred
# GFLOP/s, and a 4-token step of a 4M-parameter model is compute, not memory: expect a
# cost that grows with the tokens, and a smaller gain.

# %%
rates = [0.2, 0.4, 0.6, 0.8]
print("tokens per step    " + "".join(f"a={a:<6}" for a in rates))
for k in [1, 2, 3, 5]:
    print(f"  k={k}             " + "".join(f"{expected_tokens_per_step(a, k):<8.2f}" for a in rates))

# %% [markdown]
# ## Greedy output does not change
#
# The same Python prompt, with and without speculation (k = 3, n-grams of 1 to 3
# tokens). The outputs must be identical token for token; what changes is the number of
# steps. In float32: in the checkpoint's bfloat16 a 4-token verifying step rounds
# differently from a 1-token step, and a near-tie of the two top logits can flip
# (chapter 10 shows one). `LLM.get_metrics()` returns vLLM's counters; `spec_decoding_stats_from_metrics`
# turns them into the acceptance rate and the mean acceptance length (tokens per
# verifying step, the target's own token included).

# %%
PROMPT = (
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __repr__(self):\n        return f'Point({self.x}, {self.y})'\n\n    def"
)
params = SamplingParams(temperature=0.0, max_tokens=nb.pick(cpu=96, gpu=96, smoke=24))
texts, steps = {}, {}
for k in (0, 3):
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # The engine of k = 0 is still alive while that of k = 3 is built: two at once.
    llm = LLM(max_model_len=512, dtype="float32", speculative_config=spec if k else None,
              **nb.gpu_memory_share(2))
    with step_timing(llm) as timings:  # one StepTiming per engine step, recorded by the worker
        texts[k] = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    steps[k] = len(timings)
stats = spec_decoding_stats_from_metrics(llm.get_metrics())
assert texts[3] == texts[0], "speculation changed the greedy output"
print(PROMPT + texts[3])
print(f"\nsteps: {steps[0]} without speculation, {steps[3]} with k=3 ({steps[0] / steps[3]:.2f}x fewer); "
      f"acceptance rate {stats.acceptance_rate:.2f}, mean acceptance length {stats.mean_acceptance_length:.2f}")
del llm  # the sweeps below build their own engines

# %% [markdown]
# ## Sampled output keeps the model's distribution
#
# The rejection sampler keeps an n-gram draft x with probability p(x) (the draft
# "distribution" is one-hot at x), and on rejection draws from p with x removed. A
# quick check on a 6-token vocabulary: 100,000 requests verify the same draft (token
# 1, p = 0.4); the first token they output must be distributed as p. Next to it, a
# wrong variant that redraws from p itself on rejection over-produces the draft
# (0.4 + 0.6 x 0.4 = 0.64). `tests/test_spec_decode.py` holds both to a bound.

# %%
p = torch.tensor([0.12, 0.40, 0.20, 0.15, 0.08, 0.05])
num_trials = 100_000
torch.manual_seed(0)
metadata = SpecDecodeMetadata(
    draft_token_ids=torch.ones(num_trials, dtype=torch.int32),
    num_draft_tokens=np.ones(num_trials, dtype=np.int64),
    cu_num_draft_tokens=np.arange(1, num_trials + 1),
    target_logits_indices=torch.empty(0),
    bonus_logits_indices=torch.empty(0),
    logits_indices=torch.empty(0),
)
sampling = SamplingMetadata(
    temperature=torch.ones(num_trials), all_greedy=False, all_random=True, top_p=None, top_k=None,
    generators={}, max_num_logprobs=None,
)
bonus = torch.zeros(num_trials, 1, dtype=torch.int32)
first = RejectionSampler()(metadata, p.log().repeat(num_trials, 1), bonus, sampling)[:, 0].numpy()
empirical = np.bincount(first, minlength=6) / num_trials
wrong = np.where(np.arange(6) == 1, 0.4 + 0.6 * 0.4, 0.6 * p.numpy())  # redraw from p, analytically
print("token      " + "".join(f"{i:>7}" for i in range(6)))
print("target p   " + "".join(f"{x:>7.3f}" for x in p.tolist()))
print("sampled    " + "".join(f"{x:>7.3f}" for x in empirical))
print("wrong rule " + "".join(f"{x:>7.3f}" for x in wrong))
print(f"total variation from p: {0.5 * np.abs(empirical - p.numpy()).sum():.4f} "
      f"(the wrong rule: {0.5 * np.abs(wrong - p.numpy()).sum():.3f})")

# %% [markdown]
# ## Acceptance and speed-up on Python code
#
# `run_cpu_sweep` takes `NUM_PROMPTS` windows of `PROMPT_LEN` tokens from stdlib files
# held out of the demo model's training, generates `MAX_TOKENS` greedy tokens for all of
# them as one batch, with every (k, prompt_lookup_max) and prompt_lookup_min = 1, and
# times each configuration next to a run of the same engine without speculation.
# "tok/step" counts tokens per request per step, steps without drafts included; "steps x"
# is how many fewer engine steps the batch took; "same" says the greedy output equals
# the baseline's.

# %%
sweep = run_cpu_sweep(NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS, tuple(KS), tuple(LOOKUP_MAXES),
                      engine_overrides=nb.gpu_memory_share(2))
print_report(sweep)
assert all(r["identical_to_baseline"] for r in sweep["rows"]), "greedy output changed"

# %% [markdown]
# ## What verification costs, and where it pays
#
# `verify_cost_sweep` times steps that verify 1 + k tokens per request (its proposer always
# proposes k drafts the model rejects) against plain decode steps of the same engine; the
# ratio r is what a speculative step costs in plain steps, and speculation pays once
# 1 + a + … + a^k > r, i.e. above the break-even acceptance rate. On this CPU it runs on
# the benchmarks' tiny Qwen3 (random weights); the GPU suite runs it on the Qwen3-0.6B shape
# (`spec_decode_verify_cost`), shown below when a recorded GPU run exists.

# %%
# smoke=True: the suite's tiny Qwen3 (its config.json goes to a scratch directory), with our own sizes.
ctx = SuiteContext(device=torch.device(nb.DEVICE), smoke=True, work_dir=Path(tempfile.mkdtemp()), num_prompts=1)
cpu_cost = verify_cost_sweep(
    ctx,
    batch_sizes=nb.pick(cpu=[1, 8], gpu=[1, 8], smoke=[1]),
    ks=[0, *KS],
    context_len=nb.pick(cpu=256, gpu=256, smoke=32),
    num_steps=nb.pick(cpu=20, gpu=20, smoke=2),
)
recorded = nb.recorded_gpu_results("spec_decode_verify_cost")
if recorded is None:
    print("No recorded GPU run of spec_decode_verify_cost yet: run `python -m benchmarks.gpu_suite` on a GPU.")
else:
    gpu_cost, gpu_label = recorded
    print(gpu_label)
    for row in gpu_cost["rows"]:
        if row["k"]:
            print(f"  B={row['batch_size']:>3} k={row['k']}: {row['cost_ratio']:.2f}x a decode step, "
                  f"pays above acceptance {row['break_even_acceptance_rate']:.2f}")

# %%
best = max(sweep["rows"], key=lambda r: r["tokens_per_request_step"])
fig, axes = plt.subplots(1, 3, figsize=(14, 4))
for lookup_max in LOOKUP_MAXES:
    rows = [r for r in sweep["rows"] if r["prompt_lookup_max"] == lookup_max]
    ks = [r["k"] for r in rows]
    axes[0].plot(ks, [r["acceptance_rate"] for r in rows], "o-", label=f"n-gram 1..{lookup_max}")
    axes[1].plot(ks, [r["tokens_per_request_step"] for r in rows], "o-", label=f"n-gram 1..{lookup_max}")
    # One run per point: not joined. The four lookup settings give almost the same tokens per
    # step at each k, so their scatter shows how noisy one wall-clock run is.
    jitter = 0.06 * (LOOKUP_MAXES.index(lookup_max) - (len(LOOKUP_MAXES) - 1) / 2)
    axes[2].plot(np.array(ks) + jitter, [r["speedup"] for r in rows], "o", label=f"n-gram 1..{lookup_max}")
axes[0].set(xlabel="k (drafts per step)", ylabel="acceptance rate", title="drafts accepted", ylim=(0, 1))
axes[1].set(xlabel="k (drafts per step)", ylabel="tokens per request per step", title="tokens per step")
axes[1].axhline(1.0, color="grey", lw=0.8)
axes[2].plot(
    KS, [np.median([r["speedup"] for r in sweep["rows"] if r["k"] == k]) for k in KS], "k-", lw=1,
    label=f"median over the {len(LOOKUP_MAXES)}",
)  # fmt: skip
axes[2].set(
    xlabel="k (drafts per step)", ylabel="speed-up (wall clock)",
    title="end to end: one run per point, noisy",
)  # fmt: skip
axes[2].axhline(1.0, color="grey", lw=0.8)
nb.tick_at(axes, KS)
nb.finish_figure(fig, f"n-gram speculation on the demo model, {NUM_PROMPTS} held-out stdlib prompts")
nb.save_figure(fig, "10_spec_decode")

fig, axes = plt.subplots(1, 2, figsize=(11, 4))
costs = [("CPU, tiny Qwen3", cpu_cost)] + ([] if recorded is None else [("GPU, Qwen3-0.6B", recorded[0])])
for label, cost in costs:
    for batch_size in sorted({r["batch_size"] for r in cost["rows"]}):
        rows = [r for r in cost["rows"] if r["batch_size"] == batch_size]
        axes[0].plot([r["k"] for r in rows], [r["cost_ratio"] for r in rows], "o-", label=f"{label}, B={batch_size}")
        axes[1].plot([r["k"] for r in rows if r["k"]], [r["break_even_acceptance_rate"] for r in rows if r["k"]],
                     "o-", label=f"{label}, B={batch_size}")
axes[0].set(xlabel="k", ylabel="step time / decode step time", title="cost of verifying 1 + k tokens")
axes[1].set(xlabel="k", ylabel="acceptance rate", title="break-even acceptance rate", ylim=(0, 1))
axes[1].plot([r["k"] for r in sweep["rows"] if r["prompt_lookup_max"] == best["prompt_lookup_max"]],
             [r["acceptance_rate"] for r in sweep["rows"] if r["prompt_lookup_max"] == best["prompt_lookup_max"]],
             "k--", label="measured on the demo model")
nb.tick_at(axes, [0, *KS])
nb.finish_figure(fig, "verification cost")
nb.save_figure(fig, "10_spec_decode_verify_cost")
nb.save_data("10_spec_decode", {"sweep": sweep, "cpu_verify_cost": cpu_cost,
                                 "gpu_verify_cost": None if recorded is None else recorded[0]})
print(f"best: k={best['k']}, n-gram 1..{best['prompt_lookup_max']}: {best['tokens_per_request_step']:.2f} tokens "
      f"per step, {best['speedup']:.2f}x end to end")

# %% [markdown]
# ## What the numbers say
#
# Read the table above with the prediction in mind. Acceptance falls as k grows (the
# fourth guessed token is right less often than the first), while tokens per step keep
# rising slowly: each extra draft adds a^i. Longer n-grams propose less often but more
# accurately. On the CPU, where a step's cost grows with the tokens it computes, the
# wall-clock gain is smaller than the step gain; on a GPU, where a small batch's step is
# bound by reading the weights, verifying costs a few percent and the break-even
# acceptance rate is low. Chapter 10 discusses the numbers this notebook produced.
