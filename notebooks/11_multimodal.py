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
# # 11 · Multimodal: images through the unified scheduler
#
# Chapter 11 runs LLaVA (a CLIP vision tower, a projector, a Qwen3 decoder): each image of
# a prompt becomes a run of placeholder positions, scheduled under the same token budget as
# text, and its encoder output is computed once, whole, within a per-step encoder budget,
# then cached by the image's content hash. This notebook
#
# 1. draws the schedule of the seed's example, text, an image, text, chunk by chunk;
# 2. measures the encoder cache: hit rate and time saved when many requests share images;
# 3. measures what a token costs in the encoder and in the decoder;
# 4. measures how `max_num_encoder_input_tokens` moves time to first token.
#
# The model is a random LLaVA written by `write_tiny_llava`, with LLaVA-1.5's image grid
# (336-pixel images in 14-pixel patches: 576 positions per image) and the tiny (5.2M-parameter)
# Qwen3 as its decoder; nothing is downloaded.

# %%
import tempfile

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

import nb  # first: it puts the checkout's root on sys.path, for benchmarks/
from benchmarks.multimodal import (
    LLAVA_15_VISION_GRID,
    encoder_cache_sweep,
    image_prompt,
    per_token_costs,
    random_image,
    record_schedule,
    time_to_first_token,
    weight_counts,
    write_tiny_llava,
)
from nano_v1 import LLM
from nano_v1.benchmarks.utils import TINY_QWEN3_SHAPE
from nano_v1.engine.arg_utils import EngineArgs

SMOKE = nb.SMOKE  # NANO_V1_SMOKE=1 shrinks every size (CI)
threads = nb.set_threads()
GRID = nb.pick(cpu=LLAVA_15_VISION_GRID, gpu=LLAVA_15_VISION_GRID, smoke=dict(image_size=56, patch_size=14))
VISION_WIDTH = nb.pick(cpu=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
                       gpu=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
                       smoke=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2))
VISION_SHAPE = dict(**VISION_WIDTH, **GRID)
SMOKE_TEXT = dict(TINY_QWEN3_SHAPE, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
TEXT_SHAPE = nb.pick(cpu=TINY_QWEN3_SHAPE, gpu=TINY_QWEN3_SHAPE, smoke=SMOKE_TEXT)
NUM_IMAGE_TOKENS = (GRID["image_size"] // GRID["patch_size"]) ** 2
REPEATS = nb.pick(cpu=5, gpu=5, smoke=1)
NUM_REQUESTS = nb.pick(cpu=16, gpu=16, smoke=4)
MODEL = write_tiny_llava(tempfile.mkdtemp(prefix="nano_v1_nb11_"), text_shape=TEXT_SHAPE, vision_shape=VISION_SHAPE)
IMAGE = TEXT_SHAPE["vocab_size"] - 1  # the image token of a checkpoint without a tokenizer
# Every engine here: float32, and a KV cache of 1024 blocks (16k tokens, more than any run needs)
# instead of the CPU default of 1 GiB, which costs seconds to zero at each start.
ENGINE_ARGS = dict(model=MODEL, dtype="float32", num_gpu_blocks_override=1024)


def in_process_llm(**engine_args) -> LLM:
    """An `LLM` whose engine core runs in this process, so that the notebook can read its scheduler."""
    return LLM.from_engine_args(EngineArgs(**ENGINE_ARGS, **engine_args), enable_multiprocessing=False)

print(nb.device_label(), f"torch threads: {threads}; {NUM_IMAGE_TOKENS} positions per image")

# %% [markdown]
# ## The seed's example, step by step
#
# A prompt of 100 text tokens, an image and 100 more text tokens: 776 positions with
# LLaVA-1.5's 576-position images. The scheduler sees positions, not pixels; the one new
# rule is that a chunk may cover an image's positions only if the image's encoder output
# is cached or is computed in this step, whole. Three settings:
#
# - a budget of 512 tokens: the first chunk runs into the image, so the image is encoded
#   in step 1, and step 2 reads the rest of it from the encoder cache;
# - a budget of 576 with `disable_chunked_mm_input`: a chunk never ends inside an image,
#   so the steps are text, image, text, the seed's `{r: 100}, {r: 576}, {r: 100}`;
# - a budget of 256: the image is spread over three steps and still encoded once.

# %%
NUM_TEXT = nb.pick(cpu=100, gpu=100, smoke=8)
seed_prompt = {
    "prompt_token_ids": image_prompt(np.random.default_rng(0), NUM_TEXT, NUM_TEXT, IMAGE),
    "multi_modal_data": {"image": random_image(0)},
}
SETTINGS = {
    "budget 512": dict(max_num_batched_tokens=nb.pick(cpu=512, gpu=512, smoke=16)),
    "budget 576, disable_chunked_mm_input": dict(
        max_num_batched_tokens=NUM_IMAGE_TOKENS, disable_chunked_mm_input=True
    ),
    "budget 256": dict(max_num_batched_tokens=nb.pick(cpu=256, gpu=256, smoke=8)),
}
schedules = {}
for name, engine_args in SETTINGS.items():
    llm = in_process_llm(**engine_args)
    schedules[name] = record_schedule(llm, seed_prompt, max_tokens=2)
    print(f"{name:>38}: " + ", ".join(f"{{r: {s['num_tokens']}}}" + (" +encoder" if s["encoded"] else "")
                                      for s in schedules[name]))
assert [s["num_tokens"] for s in schedules["budget 576, disable_chunked_mm_input"][:3]] == [
    NUM_TEXT, NUM_IMAGE_TOKENS, NUM_TEXT
]

# %%
image_span = (NUM_TEXT, NUM_TEXT + NUM_IMAGE_TOKENS)
fig, axes = plt.subplots(len(schedules), 1, figsize=(10, 1.2 + 1.1 * len(schedules)), sharex=True)
for ax, (name, steps) in zip(axes, schedules.items()):
    for i, step in enumerate(steps):
        start, end = step["start"], step["start"] + step["num_tokens"]
        # The chunk's text before the image, its image positions, its text after.
        pieces = [(start, min(end, image_span[0]), "tab:blue"),
                  (max(start, image_span[0]), min(end, image_span[1]), "tab:orange"),
                  (max(start, image_span[1]), end, "tab:blue")]
        for lo, hi, color in pieces:
            if hi > lo:
                ax.barh(i, hi - lo, left=lo, color=color, edgecolor="black", linewidth=0.5)
        ax.text(end + 4, i, f"{step['num_tokens']}" + ("  encoder runs" if step["encoded"] else ""),
                va="center", fontsize=8)
    ax.set_yticks(range(len(steps)), [f"step {i + 1}" for i in range(len(steps))])
    ax.invert_yaxis()
    ax.set_title(name, fontsize=9)
axes[-1].set_xlabel("prompt position (tokens)")
axes[-1].set_xlim(0, 2 * NUM_TEXT + NUM_IMAGE_TOKENS + 120)
fig.legend(handles=[Patch(color="tab:blue", label="text"), Patch(color="tab:orange", label="image positions")],
           loc="lower right", fontsize=8)
nb.finish_figure(fig, f"text {NUM_TEXT} + image {NUM_IMAGE_TOKENS} + text {NUM_TEXT}, one chunk per step")
nb.save_figure(fig, "11_schedule")

# %% [markdown]
# ## The encoder cache
#
# Predict first. Without sharing, every request pays for its image once in the encoder
# and once in the decoder (its 576 positions). With k different images among n requests,
# only k encodings happen, and the hit rate is 1 - k / n; the decoder work does not
# change (the requests have different text before their images, so the prefix cache
# cannot help). The time saved is (n - k) encodings.
#
# `encoder_cache_sweep` runs `NUM_REQUESTS` requests that show k different images between
# them, for k from 1 to `NUM_REQUESTS`, alternating within each repeat. The runner's step
# timings give the encoder's seconds and the image tokens it computed (`StepTiming`); the
# peer of every run is the run without sharing (k = n) of the same repeat.

# %%
llm = in_process_llm()
DISTINCT = sorted({1, 2, 4, NUM_REQUESTS // 2, NUM_REQUESTS})
rows = encoder_cache_sweep(llm, IMAGE, NUM_IMAGE_TOKENS, NUM_REQUESTS, DISTINCT, REPEATS)


def median(values):
    return float(np.median(values))


cache_summary = []
for k in DISTINCT:
    mine = [r for r in rows if r["distinct_images"] == k]
    peers = [r for r in rows if r["distinct_images"] == NUM_REQUESTS]
    cache_summary.append({
        "distinct_images": k,
        "hit_rate": median([r["hit_rate"] for r in mine]),
        "images_encoded": median([r["images_encoded"] for r in mine]),
        "wall_s": median([r["wall_s"] for r in mine]),
        "encoder_s": median([r["encoder_s"] for r in mine]),
        "speedup_vs_no_sharing": median([p["wall_s"] / r["wall_s"] for r, p in zip(mine, peers)]),
        "encoder_s_saved": median([p["encoder_s"] - r["encoder_s"] for r, p in zip(mine, peers)]),
    })  # fmt: skip
print(f"{'k':>3} {'hit rate':>9} {'encoded':>8} {'wall s':>7} {'encoder s':>10} {'saved s':>8} {'speed-up':>9}")
for row in cache_summary:
    print(f"{row['distinct_images']:>3} {row['hit_rate']:>9.2f} {row['images_encoded']:>8.0f} {row['wall_s']:>7.3f} "
          f"{row['encoder_s']:>10.3f} {row['encoder_s_saved']:>8.3f} {row['speedup_vs_no_sharing']:>8.2f}x")
assert all(r["images_encoded"] == r["distinct_images"] for r in rows), "each image must be encoded exactly once"

# %% [markdown]
# ## A token in the encoder, a token in the decoder
#
# Arithmetic first: a token costs about 2 FLOPs per weight it meets, plus attention. An
# image token meets the vision tower's and the projector's weights; every position,
# image or text, then meets the decoder's. The counts below are this model's; the same
# arithmetic for LLaVA-1.5-7B (CLIP ViT-L/14-336, 23 of its 24 layers used, and the
# projector: about 0.31 B weights; Llama-7B's decoder layers: about 6.5 B) puts the encoder
# at about 5% of the decoder per token, before attention, which for the encoder covers
# 577 positions and for the decoder the context so far.

# %%
weights = weight_counts(llm)
vision_layers = VISION_SHAPE["num_hidden_layers"] - 1  # LLaVA reads layer -2
seq = NUM_IMAGE_TOKENS + 1
vision_flops = 2 * weights["vision_weights"] + 4 * seq * VISION_SHAPE["hidden_size"] * vision_layers
text_len = nb.pick(cpu=32, gpu=32, smoke=4)
context = text_len + NUM_IMAGE_TOKENS  # the average context over a prompt of twice that
q_size = TEXT_SHAPE["num_attention_heads"] * TEXT_SHAPE["head_dim"]
decoder_flops = 2 * weights["decoder_weights"] + 4 * context * q_size * TEXT_SHAPE["num_hidden_layers"]
costs = per_token_costs(llm, IMAGE, nb.pick(cpu=8, gpu=8, smoke=2), text_len, REPEATS)
encoder_us = median([c["encoder_us_per_token"] for c in costs])
decoder_us = median([c["decoder_us_per_token"] for c in costs])
print(f"weights per token: encoder {weights['vision_weights'] / 1e6:.2f} M, decoder {weights['decoder_weights'] / 1e6:.2f} M")
print(f"predicted: encoder / decoder = {vision_flops / decoder_flops:.2f} "
      f"({vision_flops / 1e6:.1f} vs {decoder_flops / 1e6:.1f} MFLOP per token)")
print(f"measured:  encoder {encoder_us:.1f} us/token, decoder {decoder_us:.1f} us/token, "
      f"ratio {encoder_us / decoder_us:.2f}")

# %% [markdown]
# ## The encoder budget and time to first token
#
# `max_num_encoder_input_tokens` caps the image tokens one step may encode. `NUM_TTFT`
# requests of text, an image and text arrive at once, with a token budget that could
# take several of them per step. With a budget of one image, each step encodes one
# image, and the other requests' chunks stop before their images: the first request's
# first token comes early, in a small step, and the last one's late, after many steps.
# With a budget for all images, the first step is big (several images and their
# positions) and every request waits for it. The peer is the default budget,
# `max(max_num_batched_tokens, one image)`, measured in the same run.

# %%
NUM_TTFT = nb.pick(cpu=8, gpu=8, smoke=2)
TOKEN_BUDGET = nb.pick(cpu=2048, gpu=2048, smoke=64)
DEFAULT_BUDGET = max(TOKEN_BUDGET, NUM_IMAGE_TOKENS)  # what max_num_encoder_input_tokens=None gives
# Encoder budgets of one image per step, two, all of them at once, and the default.
IMAGES_PER_STEP = nb.pick(cpu=[1, 2, NUM_TTFT], gpu=[1, 2, NUM_TTFT], smoke=[1])
BUDGETS = sorted({n * NUM_IMAGE_TOKENS for n in IMAGES_PER_STEP} | {DEFAULT_BUDGET})
ttft, ttft_runs = {}, {}
for budget in BUDGETS:
    engine = in_process_llm(max_num_batched_tokens=TOKEN_BUDGET, max_num_encoder_input_tokens=budget,
                            enable_prefix_caching=False)
    runs = []
    for repeat in range(REPEATS):
        rng = np.random.default_rng([2000, repeat])
        prompts = [{"prompt_token_ids": image_prompt(rng, text_len, text_len, IMAGE),
                    "multi_modal_data": {"image": random_image(int(rng.integers(2**31)))}} for _ in range(NUM_TTFT)]
        runs.append(time_to_first_token(engine, prompts, max_tokens=2))
    ttft_runs[budget] = runs
    ttft[budget] = np.median(np.array(runs), axis=0).tolist()  # per request, median over repeats
print(f"token budget {TOKEN_BUDGET}; default encoder budget {DEFAULT_BUDGET}")
for budget, times in ttft.items():
    peer = ttft[DEFAULT_BUDGET]
    print(f"encoder budget {budget:>5} ({budget / NUM_IMAGE_TOKENS:.2f} images): TTFT first {times[0] * 1e3:6.0f} ms, "
          f"mean {np.mean(times) * 1e3:6.0f} ms ({np.mean(times) / np.mean(peer):.2f}x the default's), "
          f"last {times[-1] * 1e3:6.0f} ms; mean over each repeat "
          f"{min(map(np.mean, ttft_runs[budget])) * 1e3:.0f}-{max(map(np.mean, ttft_runs[budget])) * 1e3:.0f} ms")

# %%
fig, axes = plt.subplots(1, 3, figsize=(14, 4))
ks = [r["distinct_images"] for r in cache_summary]
axes[0].plot(ks, [r["hit_rate"] for r in cache_summary], "o-", label="measured")
axes[0].plot(ks, [1 - k / NUM_REQUESTS for k in ks], "k--", lw=0.8, label="1 - k / n")
axes[0].set(xscale="log", xlabel=f"different images among {NUM_REQUESTS} requests", ylabel="encoder cache hit rate",
            title="hit rate", ylim=(-0.05, 1.05))
axes[1].plot(ks, [r["encoder_s"] for r in cache_summary], "o-", label="encoder")
axes[1].plot(ks, [r["wall_s"] for r in cache_summary], "s-", label="whole generate")
axes[1].set(xscale="log", xlabel=f"different images among {NUM_REQUESTS} requests", ylabel="seconds (median)",
            title="time, encoder and total")
nb.tick_at(axes[:2], ks)
for budget, times in ttft.items():
    axes[2].plot(range(1, NUM_TTFT + 1), [t * 1e3 for t in times], "o-",
                 label=f"{budget} ({budget / NUM_IMAGE_TOKENS:.2f} images)" + (" default" if budget == DEFAULT_BUDGET else ""))
axes[2].set(xlabel="request (arrival order)", ylabel="time to first token (ms)",
            title=f"max_num_encoder_input_tokens, {NUM_TTFT} requests at once")
nb.finish_figure(fig, f"encoder cache and encoder budget, tiny LLaVA ({NUM_IMAGE_TOKENS} positions/image)")
nb.save_figure(fig, "11_encoder_cache")

nb.save_data("11_multimodal", {
    "model": {"vision": VISION_SHAPE, "text": TEXT_SHAPE, "num_image_tokens": NUM_IMAGE_TOKENS, **weights},
    "schedules": schedules,
    "encoder_cache": {"num_requests": NUM_REQUESTS, "runs": rows, "summary": cache_summary},
    "per_token": {"runs": costs, "encoder_us_per_token": encoder_us, "decoder_us_per_token": decoder_us,
                  "predicted_ratio": vision_flops / decoder_flops},
    "ttft": {"num_requests": NUM_TTFT, "max_num_batched_tokens": TOKEN_BUDGET,
             "median_seconds_by_encoder_budget": {str(b): t for b, t in ttft.items()},
             "runs_by_encoder_budget": {str(b): r for b, r in ttft_runs.items()}},
})  # fmt: skip

# %% [markdown]
# ## What the numbers say
#
# The schedule is the scheduler's alone: three budgets, three ways to cut the same 776
# positions, and the image encoded once in each, in the first step that reaches it. The
# hit rate is 1 - k / n exactly (the cell above asserts that every image is encoded once),
# and the encoder time saved is the encodings avoided. Per token, the encoder costs less
# against the decoder than the FLOP count says: on this CPU the vision tower attends with
# one fused kernel over whole images, while the decoder runs the reference attention of
# chapter 06 over the paged cache. The encoder budget changes how a burst of images is
# cut into steps, not how much is computed: one image per step brings the first request's
# first token much sooner. Chapter 11 discusses the numbers this notebook produced.
