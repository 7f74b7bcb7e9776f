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
# # 02 · The paged KV cache: how full it is, and what it wastes
#
# Every token a request has computed keeps its keys and values in the KV cache until the
# request finishes. The cache is the engine's scarcest memory: it decides how many
# requests can run at once, and so the batch size and the throughput.
#
# A contiguous allocator must give each request one slab up front, big enough for the
# longest it could grow: `max_model_len` tokens (transformers' static cache, FasterTransformer),
# or at best `prompt + max_tokens` if it trusts the request's limit. The paged cache of
# chapter 02 hands out blocks of `block_size` tokens as the request grows, so a request
# holds at most one partly filled block.
#
# This notebook runs a workload through the engine with a deliberately small cache,
# records block usage after every step, and compares it with what the two contiguous
# schemes would have reserved for the same running requests.

# %%
import matplotlib.pyplot as plt
import numpy as np

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from nano_v1 import SamplingParams
from nano_v1.benchmarks.utils import sample_random_requests

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
nb.set_threads()
NUM_REQUESTS = nb.pick(cpu=40, gpu=256, smoke=6)
PROMPT_LEN_RANGE = nb.pick(cpu=(32, 512), gpu=(100, 1024), smoke=(8, 40))
OUTPUT_LEN_RANGE = nb.pick(cpu=(16, 256), gpu=(100, 1024), smoke=(4, 16))
MAX_MODEL_LEN = PROMPT_LEN_RANGE[1] + OUTPUT_LEN_RANGE[1]
BLOCK_SIZE = 16
# The cache holds this many max_model_len requests: a contiguous allocator could run no more at once.
CONTIGUOUS_SLOTS = nb.pick(cpu=6, gpu=32, smoke=2)
NUM_BLOCKS = 1 + CONTIGUOUS_SLOTS * MAX_MODEL_LEN // BLOCK_SIZE  # + the null block

workload = sample_random_requests(NUM_REQUESTS, PROMPT_LEN_RANGE, OUTPUT_LEN_RANGE, 4096, seed=0)
model_dir, dtype, _ = nb.dummy_model()  # a shape with random weights: allocation is all we watch
print(
    f"{NUM_REQUESTS} requests, prompts {PROMPT_LEN_RANGE}, outputs {OUTPUT_LEN_RANGE}; "
    f"cache {NUM_BLOCKS - 1} blocks x {BLOCK_SIZE} = {(NUM_BLOCKS - 1) * BLOCK_SIZE:,} tokens; {nb.device_label()}"
)

# %% [markdown]
# ## Predict
#
# A request of L tokens holds ceil(L / 16) blocks: its waste is under 16 slots, and for
# lengths spread over many blocks it averages (16 - 1) / 2 = 7.5. Its contiguous slab
# wastes `max_model_len - L`, or `prompt + max_tokens - L` in the kinder scheme; averaged
# over a request's life that is about half its output length, plus the slack of a limit
# it never reaches.

# %%
lengths = np.array([r.prompt_len + r.output_len for r in workload])
mid_life = np.array([r.prompt_len + r.output_len / 2 for r in workload])  # a request's average length
print(
    f"paged:       ~{(BLOCK_SIZE - 1) / 2:.1f} wasted slots per request "
    f"({(BLOCK_SIZE - 1) / 2 / mid_life.mean():.1%} of its average length)"
)
print(f"exact slab:  ~{(lengths - mid_life).mean():.0f} wasted slots per request")
print(f"max_model_len slab: ~{(MAX_MODEL_LEN - mid_life).mean():.0f} wasted slots per request")
print(
    f"concurrent requests the cache fits: contiguous {CONTIGUOUS_SLOTS}, "
    f"paged ~{(NUM_BLOCKS - 1) * BLOCK_SIZE / (mid_life.mean() + (BLOCK_SIZE - 1) / 2):.0f} (at average length)"
)

# %% [markdown]
# ## Run the workload, recording every step
#
# All requests arrive at once, the engine steps until done, and after each step we read
# the scheduler's state: the running requests, their computed tokens, the blocks each
# holds (`KVCacheManager.get_block_ids`), and the pool's usage. Prefix caching is off, so
# blocks are never shared and the counts are exact. The notebook builds the engine core
# itself (`nb.engine_core`: the scheduler and the worker, in this process) so that the
# scheduler it reads is its own object; `LLM` would hide it, by default in another
# process (chapter 09). Each step's outputs carry the new tokens of each request.


# %%
def run(num_blocks: int | None, record: bool) -> tuple[dict[int, list[int]], list[dict], int]:
    core = nb.engine_core(
        model=model_dir, load_format="dummy", dtype=dtype, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=num_blocks, enable_prefix_caching=False, max_num_seqs=NUM_REQUESTS,
    )
    scheduler = core.scheduler
    kv = scheduler.kv_cache_manager
    for i, r in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        core.add_request(nb.core_request(str(i), r.prompt_token_ids, params))
    seen, outputs, steps = {}, {}, []
    while scheduler.has_unfinished_requests():
        for out in core.step().outputs:
            outputs.setdefault(int(out.request_id), []).extend(out.new_token_ids)
        if not record:
            continue
        seen.update({r.request_id: r for r in scheduler.running})
        computed = np.array([r.num_computed_tokens for r in scheduler.running], dtype=np.int64)
        held = np.array([len(kv.get_block_ids(r.request_id)[0]) for r in scheduler.running], dtype=np.int64)
        # Check: each running request holds exactly the blocks its computed tokens need.
        assert (held == -(-computed // BLOCK_SIZE)).all(), (
            "a request holds more or fewer blocks than it needs"
        )
        assert held.sum() == round(kv.usage * (num_blocks - 1)), "usage disagrees with the blocks held"
        ids = [int(r.request_id) for r in scheduler.running]
        steps.append(
            {
                "num_running": len(ids),
                "num_waiting": len(scheduler.waiting),
                "tokens": int(computed.sum()),
                "blocks": int(held.sum()),
                "usage": kv.usage,
                "exact_slab": int(sum(workload[i].prompt_len + workload[i].output_len for i in ids)),
                "lengths": computed.tolist(),
            }
        )
    num_preemptions = sum(r.num_preemptions for r in seen.values())
    return outputs, steps, num_preemptions


outputs, steps, num_preemptions = run(NUM_BLOCKS, record=True)
print(
    f"{len(steps)} steps, peak {max(s['num_running'] for s in steps)} running at once, "
    f"peak usage {max(s['usage'] for s in steps):.0%}, {num_preemptions} preemptions"
)

# %% [markdown]
# ## Check: a small cache changes when, never what
#
# When the cache runs out the scheduler preempts a request and recomputes it later
# (chapter 04). Greedy outputs must be the same as with a cache large enough for
# everything.

# %%
roomy_outputs, _, _ = run(None, record=False)
assert roomy_outputs == outputs, "a small cache changed the generated tokens"
print(f"all {len(outputs)} outputs identical with a {NUM_BLOCKS - 1}-block cache and a roomy one")

# %% [markdown]
# ## Plot: the cache over time, and waste against block size
#
# Left: per step, the slots holding live KV (tokens), the slots the paged cache holds
# (blocks x 16), and what the contiguous schemes would reserve for the same running
# requests, against the cache's capacity. Right: average waste as a fraction of reserved
# memory, from the recorded lengths, if the block size had been different.

# %%
capacity = (NUM_BLOCKS - 1) * BLOCK_SIZE
t = np.arange(len(steps))
tokens = np.array([s["tokens"] for s in steps])
paged = np.array([s["blocks"] for s in steps]) * BLOCK_SIZE
exact = np.array([s["exact_slab"] for s in steps])
slab = np.array([s["num_running"] for s in steps]) * MAX_MODEL_LEN
fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
axes[0].plot(t, slab / capacity, label="contiguous, max_model_len each")
axes[0].plot(t, exact / capacity, label="contiguous, prompt + max_tokens each")
axes[0].plot(t, paged / capacity, label=f"paged, blocks of {BLOCK_SIZE} (measured)")
axes[0].plot(t, tokens / capacity, "k:", label="live KV (tokens computed)")
axes[0].axhline(1.0, color="r", lw=0.8, label="cache capacity")
axes[0].set(xlabel="engine step", ylabel="fraction of the cache", title="memory the running requests need")

block_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
live = sum(s["tokens"] for s in steps)
paged_waste = [
    1 - live / sum(int((-(-np.array(s["lengths"]) // bs) * bs).sum()) for s in steps) for bs in block_sizes
]
axes[1].semilogx(block_sizes, paged_waste, "o-", base=2, label="paged")
axes[1].axhline(1 - live / exact.sum(), color="C1", ls="--", label="contiguous, prompt + max_tokens")
axes[1].axhline(1 - live / slab.sum(), color="C0", ls="--", label="contiguous, max_model_len")
axes[1].set(
    xlabel="block size (tokens)",
    ylabel="wasted fraction of reserved slots",
    title="waste, averaged over the run's steps",
)
nb.finish_figure(
    fig,
    f"{NUM_REQUESTS} requests, prompts {PROMPT_LEN_RANGE[0]}-{PROMPT_LEN_RANGE[1]}, outputs "
    f"{OUTPUT_LEN_RANGE[0]}-{OUTPUT_LEN_RANGE[1]}, max_model_len {MAX_MODEL_LEN}",
)
plt.show()
waste = {
    "paged_block_16": 1 - live / paged.sum(),
    "exact_slab": 1 - live / exact.sum(),
    "max_model_len_slab": 1 - live / slab.sum(),
}
print({k: f"{v:.1%}" for k, v in waste.items()})

# %% [markdown]
# ## Explain the gap
#
# The paged cache wastes only the unfilled tail of each request's last block, a few
# percent of what it holds, so the running set grows until live KV nearly fills the
# cache. A `max_model_len` slab wastes most of its memory: a request's average length is
# far below the longest any request may reach. Even the "exact" slab, which trusts every
# request's `max_tokens`, reserves the output before it exists, about half of it on
# average over the request's life; with `ignore_eos` off, requests that stop early make
# that worse.
#
# The cost of paging is indirection: attention reads K and V through a block table
# (chapter 06) rather than from one contiguous tensor, and the scheduler allocates blocks
# as requests grow (`KVCacheManager.allocate_slots`, usually a no-op: 15 decode steps in
# 16 fit in the last block). Smaller blocks waste less but mean longer block tables and
# more allocation calls; vLLM's default of 16 sits where the waste curve has flattened.
#
# No GPU is needed here: allocation is the same on any device. On a GPU the cache is
# sized from free memory (`Worker.determine_available_memory`); the fractions are the same.

# %%
print(nb.save_figure(fig, "02_paged_kv_cache"))
print(
    nb.save_data(
        "02_paged_kv_cache",
        {
            "workload": {
                "num_requests": NUM_REQUESTS,
                "prompt_len_range": list(PROMPT_LEN_RANGE),
                "output_len_range": list(OUTPUT_LEN_RANGE),
                "seed": 0,
            },
            "block_size": BLOCK_SIZE,
            "num_blocks": NUM_BLOCKS,
            "max_model_len": MAX_MODEL_LEN,
            "num_steps": len(steps),
            "num_preemptions": num_preemptions,
            "peak_running": max(s["num_running"] for s in steps),
            "peak_usage": max(s["usage"] for s in steps),
            "waste": waste,
            "waste_vs_block_size": dict(zip(block_sizes, paged_waste)),
            "steps": [{k: v for k, v in s.items() if k != "lengths"} for s in steps],
        },
    )
)
