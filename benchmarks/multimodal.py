"""Multimodal measurements (notebook 11): the schedule of an image prompt, the encoder cache, the encoder budget.

Mirrors no single vLLM file; the checkpoints are built the way tests/helpers/checkpoints.py builds
text ones (chapter 11).
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: chapter 11's claims need an engine running a real LLaVA architecture, and
nothing here may be downloaded. `write_tiny_llava` writes a random LLaVA (CLIP vision
tower, projector, Qwen3 or Llama language model) with transformers itself, plus the
image processor's config and, if asked, a tokenizer that knows `<image>` (the demo
model's, with one token added), so that tests and the notebook load it through exactly
the path a real checkpoint takes. The measurements then read the engine's own records:
each step's `SchedulerOutput`, and the model runner's `StepTiming`s (encoder and forward
time, encoder tokens computed).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

# The vision tower of LLaVA-1.5 at a fraction of the width: 336-pixel images in 14-pixel
# patches, so each image is 24 x 24 = 576 positions, as in LLaVA-1.5-7B (CLIP ViT-L/14-336).
LLAVA_15_VISION_GRID = dict(image_size=336, patch_size=14)


def write_tiny_llava(
    path: str | os.PathLike,
    *,
    text_arch: str = "qwen3",
    text_shape: dict[str, Any],
    vision_shape: dict[str, Any],
    seed: int = 0,
    weight_std: float | None = 0.15,
    with_tokenizer: bool = False,
) -> str:
    """Write a random LLaVA (float32) to `path` and return it.

    `text_shape`: the language model's config fields (vocab_size, hidden_size, ...);
    `vision_shape`: CLIP's (hidden_size, num_hidden_layers, image_size, patch_size, ...).
    `weight_std`: redraw every matrix from N(0, std), so that greedy decoding of a random
    model is not a lottery of near-ties (None keeps transformers' init); at 0.15 the
    tokens depend on the image, where at 0.08 (tests/helpers/checkpoints.py's value for text models)
    this model soon repeats one token whatever it is shown. With
    `with_tokenizer`, the demo model's tokenizer plus an `<image>` token (and its chat
    template) is saved too, and `<image>` is the image token; without, the image token is
    the last id of the vocabulary.
    """
    import torch
    import transformers

    text_shape = dict(text_shape)
    tokenizer = None
    if with_tokenizer:
        from nano_v1.demo_model import DEMO_MODEL_PATH

        tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
        text_shape["vocab_size"] = max(text_shape["vocab_size"], len(tokenizer))
        image_token_index = tokenizer.convert_tokens_to_ids("<image>")
        eos_token_id = tokenizer.eos_token_id
    else:
        image_token_index = text_shape["vocab_size"] - 1
        eos_token_id = 2
    text_cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[text_arch]
    text_config = text_cls(**text_shape, bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision_shape),
        text_config=text_config,
        image_token_index=image_token_index,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32).eval()
    if weight_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, weight_std)
    model.save_pretrained(path)
    size = vision_shape["image_size"]
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def random_image(seed: int, height: int = 40, width: int = 50):
    """A `height x width` RGB image of uniform noise: every seed a different image."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_prompt(rng: np.random.Generator, num_before: int, num_after: int, image_token_id: int) -> list[int]:
    """`num_before` random text tokens, one image placeholder, `num_after` random text tokens."""
    text = rng.integers(3, image_token_id, size=num_before + num_after).tolist()  # never the image token
    return [*text[:num_before], image_token_id, *text[num_before:]]


def in_process_core(llm):
    """The `EngineCore` of an engine that runs it in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core


# ---------------------------------------------------------------------------- the schedule of one prompt
def record_schedule(llm, prompt: dict[str, Any], max_tokens: int) -> list[dict[str, Any]]:
    """Generate `prompt` alone and return its steps: chunk start, chunk length, whether the encoder ran.

    One request without prefix-cache hits or preemption, so each chunk starts where the
    previous one ended.
    """
    from nano_v1 import SamplingParams

    scheduler = in_process_core(llm).scheduler
    schedule = scheduler.schedule
    steps: list[dict[str, Any]] = []

    def recording_schedule():
        scheduler_output = schedule()
        start = steps[-1]["start"] + steps[-1]["num_tokens"] if steps else 0
        steps.append({
            "start": start,
            "num_tokens": scheduler_output.total_num_scheduled_tokens,
            "encoded": bool(scheduler_output.scheduled_encoder_inputs),
        })  # fmt: skip
        return scheduler_output

    scheduler.schedule = recording_schedule
    try:
        llm.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
        )
    finally:
        del scheduler.schedule  # back to the class's method
    return steps


# ---------------------------------------------------------------------------- the encoder cache
def timed_generate(llm, prompts: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One greedy `generate` of `prompts`, with the runner's step timings summed."""
    from nano_v1 import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.collective_rpc("start_step_timing")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    timings = llm.collective_rpc("stop_step_timing")[0]
    return {
        "wall_s": wall_s,
        "num_steps": len(timings),
        "encoder_s": sum(t.encoder_s for t in timings),
        "num_encoder_tokens": sum(t.num_encoder_tokens for t in timings),
        "forward_s": sum(t.forward_s for t in timings),
        "num_scheduled_tokens": sum(t.num_scheduled_tokens for t in timings),
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def encoder_cache_sweep(
    llm,
    image_token_id: int,
    num_image_tokens: int,
    num_requests: int,
    distinct_images: list[int],
    repeats: int,
    text_len: int = 16,
    max_tokens: int = 4,
) -> list[dict[str, Any]]:
    """`num_requests` requests that show `k` different images between them (round robin), for each k.

    Every request has its own text before its image, so the prefix cache never covers an
    image and whatever is saved is the encoder cache's. Every run draws new images and
    text: nothing is cached from an earlier run. Runs of all k alternate within each repeat.
    """
    rows = []
    for repeat in range(repeats):
        for k in distinct_images:
            rng = np.random.default_rng([repeat, k])
            images = [random_image(int(seed)) for seed in rng.integers(0, 2**31, size=k)]
            prompts = [
                {"prompt_token_ids": image_prompt(rng, text_len, text_len, image_token_id),
                 "multi_modal_data": {"image": images[i % k]}}
                for i in range(num_requests)
            ]  # fmt: skip
            run = timed_generate(llm, prompts, max_tokens)
            num_encoded = run["num_encoder_tokens"] // num_image_tokens
            rows.append({
                "repeat": repeat,
                "distinct_images": k,
                "images_encoded": num_encoded,
                "hit_rate": 1 - num_encoded / num_requests,
                **{key: value for key, value in run.items() if key != "token_ids"},
            })  # fmt: skip
    return rows


# ---------------------------------------------------------------------------- encoder vs decoder
def per_token_costs(
    llm, image_token_id: int, num_requests: int, text_len: int, repeats: int
) -> list[dict[str, float]]:
    """Encoder and decoder time per token, from the same prefill-only runs (one output token each).

    Encoder: its seconds over the image tokens it produced. Decoder: the forward pass's
    seconds over the positions it computed, text and image alike.
    """
    rows = []
    for repeat in range(repeats):
        rng = np.random.default_rng([1000, repeat])
        prompts = [
            {"prompt_token_ids": image_prompt(rng, text_len, text_len, image_token_id),
             "multi_modal_data": {"image": random_image(int(rng.integers(2**31)))}}
            for _ in range(num_requests)
        ]  # fmt: skip
        run = timed_generate(llm, prompts, max_tokens=1)
        rows.append({
            "encoder_us_per_token": 1e6 * run["encoder_s"] / run["num_encoder_tokens"],
            "decoder_us_per_token": 1e6 * run["forward_s"] / run["num_scheduled_tokens"],
        })  # fmt: skip
    return rows


def weight_counts(llm) -> dict[str, int]:
    """Matmul weights that every token goes through: the vision tower's and the projector's
    (for an image token), the decoder layers' (for any token; the LM head runs only on
    sampled rows)."""

    def count(worker) -> dict[str, int]:
        model = worker.model_runner.model
        vision = sum(
            p.numel() for n, p in model.named_parameters() if n.startswith(("vision_tower.", "multi_modal"))
        )
        vision -= model.vision_tower.embeddings.position_embedding.weight.numel()
        decoder = sum(p.numel() for n, p in model.language_model.model.layers.named_parameters())
        return {"vision_weights": vision, "decoder_weights": decoder}

    return llm.collective_rpc(count)[0]


# ---------------------------------------------------------------------------- time to first token
def time_to_first_token(llm, prompts: list[dict[str, Any]], max_tokens: int) -> list[float]:
    """Seconds from adding all `prompts` at once until each one's first output token, in prompt order."""
    from nano_v1 import SamplingParams
    from nano_v1.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params.output_kind = RequestOutputKind.DELTA
    start = time.perf_counter()
    request_ids = [f"ttft-{start}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, params)
    first_token_s: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id not in first_token_s and output.outputs[0].token_ids:
                first_token_s[output.request_id] = time.perf_counter() - start
    return [first_token_s[request_id] for request_id in request_ids]
