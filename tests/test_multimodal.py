"""LLaVA end to end: nano_v1's greedy tokens equal transformers' on tiny random checkpoints with images.

The oracle is transformers' own `LlavaForConditionalGeneration.generate(do_sample=False)` in
float32, one prompt at a time, fed the checkpoint's own image processor's pixel values and
the prompt with each image token expanded by the test itself. nano_v1 loads the same
directory through its own path (config, safetensors, the processor, its own CLIP and
decoder) and runs the prompts as one batch, under the settings that exercise the
multimodal path: images first, in the middle, last, two of them, the same one twice;
chunks that split an image or stop before it; prefix caching; the encoder cache.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import TINY_SHAPES

from benchmarks.multimodal import random_image, write_tiny_llava
from nano_v1 import LLM, SamplingParams
from nano_v1.engine import EngineCoreRequest

pytestmark = pytest.mark.ch11

MAX_NEW = 8
# CLIP at 28 pixels in 7-pixel patches: 16 positions per image.
GRID = {"image_size": 28, "patch_size": 7}
VISION_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    **GRID,
}
NUM_IMAGE_TOKENS = 16
TEXT_SHAPES = {"llama": TINY_SHAPES, "qwen3": dict(TINY_SHAPES, head_dim=32)}


@pytest.fixture(scope="module")
def llava_llama(tmp_path_factory) -> str:
    """LLaVA over Llama, with a tokenizer that knows `<image>` (so text prompts and chat work too)."""
    return write_tiny_llava(
        tmp_path_factory.mktemp("llava"), text_arch="llama", text_shape=TINY_SHAPES, vision_shape=VISION_SHAPE,
        with_tokenizer=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llava_qwen3(tmp_path_factory) -> str:
    return write_tiny_llava(
        tmp_path_factory.mktemp("llava_qwen3"), text_arch="qwen3", text_shape=TEXT_SHAPES["qwen3"],
        vision_shape=VISION_SHAPE,
    )  # fmt: skip


def image_token_id(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).image_token_index


def hf_greedy(
    path: str, prompts: list[tuple[list[int], list]], max_new_tokens: int = MAX_NEW
) -> list[list[int]]:
    """transformers' greedy tokens for (prompt with one image token per image, images) pairs."""
    import transformers
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    # From its module: transformers 5.17's top-level AutoImageProcessor is a placeholder needing torchvision.
    processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    image_token = image_token_id(path)
    outputs = []
    with torch.no_grad():
        for prompt, images in prompts:
            expanded = [
                t
                for token in prompt
                for t in ([token] * NUM_IMAGE_TOKENS if token == image_token else [token])
            ]
            ids = torch.tensor([expanded])
            image_inputs = (
                {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]}
                if images
                else {}
            )
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                **image_inputs,
            )
            outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def nano_prompts(prompts: list[tuple[list[int], list]]) -> list[dict]:
    return [{"prompt_token_ids": p, "multi_modal_data": {"image": images}} if images else {"prompt_token_ids": p}
            for p, images in prompts]  # fmt: skip


def nano_greedy(llm: LLM, prompts: list[tuple[list[int], list]], max_new_tokens: int = MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate(nano_prompts(prompts), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], outputs


def layouts(image: int) -> list[tuple[list[int], list]]:
    """Image first, in the middle, last, two different ones, the same one twice, none, and
    the second prompt again with the other image (which must change its output)."""
    a, b = random_image(1), random_image(2, 30, 30)
    return [
        ([image, 11, 12, 13], [a]),
        ([5, 6, 7, image, 8, 9], [b]),
        ([20, 21, 22, 23, 24, image], [a]),
        ([30, image, 31, 32, image, 33], [a, b]),
        ([40, image, image, 41], [b, b]),
        ([50, 51, 52, 53, 54, 55], []),
        ([5, 6, 7, image, 8, 9], [a]),
    ]


def engine_core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


@pytest.fixture(scope="module")
def llama_reference(llava_llama) -> tuple[list, list[list[int]]]:
    """The layouts and transformers' greedy tokens for them, computed once for the module."""
    prompts = layouts(image_token_id(llava_llama))
    expected = hf_greedy(llava_llama, prompts)
    assert expected[1] != expected[-1], "the image must change the output"
    return prompts, expected


@pytest.fixture(scope="module")
def llm(llava_llama) -> LLM:
    """One engine at default settings, shared by the tests that leave it as they found it."""
    return LLM(model=llava_llama, dtype="float32")


def test_greedy_matches_transformers(llm, llama_reference):
    prompts, expected = llama_reference
    got, outputs = nano_greedy(llm, prompts)
    assert got == expected
    assert [len(o.prompt_token_ids) for o in outputs] == [3 + 16, 5 + 16, 5 + 16, 4 + 32, 2 + 32, 6, 5 + 16]


def test_greedy_matches_transformers_over_qwen3(llava_qwen3):
    prompts = layouts(image_token_id(llava_qwen3))
    expected = hf_greedy(llava_qwen3, prompts)
    assert expected[1] != expected[-1], "the image must change the output"
    got, _ = nano_greedy(LLM(model=llava_qwen3, dtype="float32"), prompts)
    assert got == expected


@pytest.mark.parametrize("disable_chunked_mm_input", [False, True])
def test_chunked_prefill_around_the_image_matches_transformers(
    llava_llama, llama_reference, disable_chunked_mm_input
):
    """The seed's text / image / text prompt at small sizes, chunk by chunk, and a batch beside it."""
    image = image_token_id(llava_llama)
    seed_prompt = ([*range(100, 106), image, *range(110, 116)], [random_image(3)])  # 6 + 16 + 6 positions
    prompts, expected = (
        [seed_prompt, *llama_reference[0]],
        hf_greedy(llava_llama, [seed_prompt]) + llama_reference[1],
    )
    llm = LLM(
        model=llava_llama, dtype="float32", block_size=4, max_num_batched_tokens=16,
        disable_chunked_mm_input=disable_chunked_mm_input,
    )  # fmt: skip
    core = engine_core(llm)
    steps, schedule = [], core.scheduler.schedule

    def recording_schedule():
        so = schedule()
        steps.append((dict(so.num_scheduled_tokens), dict(so.scheduled_encoder_inputs)))
        return so

    core.scheduler.schedule = recording_schedule
    got, _ = nano_greedy(llm, prompts[:1])
    first_steps = [(tokens["0"], inputs.get("0")) for tokens, inputs in steps[:3]]
    if disable_chunked_mm_input:
        assert first_steps == [(6, None), (16, [0]), (6, None)]  # text, the image, text
    else:
        assert first_steps == [(16, [0]), (12, None), (1, None)]  # the image split, encoded once
    got += nano_greedy(llm, prompts[1:])[0]
    assert got == expected


def test_prefix_caching_shares_kv_for_the_same_image_only(llava_llama):
    image = image_token_id(llava_llama)
    text = [60, 61, 62, 63, 64, 65]
    same_a = (text + [image, 70, 71], [random_image(4)])
    other_b = (text + [image, 70, 71], [random_image(5)])
    expected = hf_greedy(llava_llama, [same_a, other_b])
    llm = LLM(model=llava_llama, dtype="float32", block_size=4)
    first, _ = nano_greedy(llm, [same_a])
    again, outputs = nano_greedy(llm, [same_a, other_b])
    assert [first[0], *again] == [expected[0], *expected]
    # 24 positions: the same image hits 5 full blocks (the last token is always computed);
    # another image behind the same text hits only the block before the image.
    assert [o.num_cached_tokens for o in outputs] == [20, 4]


def step_timings(llm: LLM, prompts, **params):
    llm.collective_rpc("start_step_timing")
    llm.generate(nano_prompts(prompts), SamplingParams(temperature=0.0, **params), use_tqdm=False)
    return llm.collective_rpc("stop_step_timing")[0]


def test_a_shared_image_is_encoded_once_and_evicted_when_space_is_needed(llava_llama):
    image = image_token_id(llava_llama)
    shared = random_image(6)
    # One image's worth of encoder cache: the next new image must evict the last one.
    llm = LLM(model=llava_llama, dtype="float32", encoder_cache_size=NUM_IMAGE_TOKENS)
    runner = llm.collective_rpc(lambda worker: worker.model_runner)[0]
    prompts = [([100 + i, image, 7], [shared]) for i in range(4)]  # different text first: no prefix hits
    timings = step_timings(llm, prompts, max_tokens=2)
    assert sum(t.num_encoder_tokens for t in timings) == NUM_IMAGE_TOKENS  # four requests, one encoding
    (shared_hash,) = runner.encoder_cache
    manager = engine_core(llm).scheduler.encoder_cache_manager
    assert manager.cached == {shared_hash: set()} and list(manager.freeable) == [shared_hash]
    timings = step_timings(llm, [([9, image], [random_image(7)])], max_tokens=1)
    assert sum(t.num_encoder_tokens for t in timings) == NUM_IMAGE_TOKENS
    assert shared_hash not in runner.encoder_cache and len(runner.encoder_cache) == 1


def test_piecewise_compiled_model_matches_transformers(llava_llama, llama_reference):
    prompts, expected = llama_reference
    got, _ = nano_greedy(LLM(model=llava_llama, dtype="float32", compilation_config=3), prompts)
    assert got == expected


@pytest.mark.ch13
def test_tensor_parallel_model_matches_transformers(llava_llama, llama_reference):
    """TP=2 (two gloo worker processes): each rank holds one of CLIP's two heads, half the
    projector and half the decoder; the tokens stay transformers'."""
    prompts, expected = llama_reference
    llm = LLM(
        model=llava_llama,
        dtype="float32",
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
        max_model_len=256,
    )
    try:
        got, _ = nano_greedy(llm, prompts)
    finally:
        llm.llm_engine.shutdown()
    assert got == expected


def test_engine_core_request_with_images_crosses_msgpack():
    pytest.importorskip("msgspec")  # the engine core's process's codec; the GPU image has no msgspec
    from nano_v1.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from nano_v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    pixel_values = torch.randn(3, 28, 28)

    request = EngineCoreRequest(
        "r", [1, 2] + [9] * 16, SamplingParams(max_tokens=3), 2, 0.0,
        mm_features=[MultiModalFeatureSpec({"pixel_values": pixel_values}, "image", "ab12", PlaceholderRange(2, 16))],
    )  # fmt: skip
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    (feature,) = decoded.mm_features
    assert torch.equal(feature.data["pixel_values"], pixel_values)
    assert (feature.identifier, feature.mm_position) == ("ab12", PlaceholderRange(2, 16))


# ----------------------------------------------------------------------------- bad input


# Bad prompts (given the image token id), and the start of the error each must raise.
BAD_PROMPTS = {
    "an image of the wrong type": (
        lambda i: {"prompt_token_ids": [1, i], "multi_modal_data": {"image": "cat.png"}},
        r"multi_modal_data\['image'\]\[0\] must be a PIL.Image.Image, got str",
    ),
    "more images than placeholders": (
        lambda i: {
            "prompt_token_ids": [1, i],
            "multi_modal_data": {"image": [random_image(1), random_image(2)]},
        },
        r"the prompt has 1 image placeholder token\(s\) \(id \d+\) but multi_modal_data has 2 image\(s\)",
    ),
    "more placeholders than images": (
        lambda i: {"prompt_token_ids": [1, i, i, 2], "multi_modal_data": {"image": random_image(1)}},
        r"the prompt has 2 image placeholder token\(s\)",
    ),
    "a placeholder without an image": (
        lambda i: {"prompt_token_ids": [1, i, 2]},
        r"the prompt has 1 image placeholder token\(s\) .* has 0 image",
    ),
    "an unknown modality": (
        lambda i: {"prompt_token_ids": [1, i], "multi_modal_data": {"video": random_image(1)}},
        r"multi_modal_data has modality \['video'\]; this model takes \['image'\]",
    ),
    "multi_modal_data not a dict": (
        lambda i: {"prompt_token_ids": [1, i], "multi_modal_data": [random_image(1)]},
        r"multi_modal_data must be a dict",
    ),
}


@pytest.mark.parametrize("case", BAD_PROMPTS)
def test_bad_multimodal_input_is_rejected_and_loses_nothing(llm, llama_reference, case):
    make_prompt, message = BAD_PROMPTS[case]
    image = image_token_id(llm.llm_engine.vllm_config.model_config.model)
    prompts, expected = llama_reference
    good = nano_prompts(prompts[1:2])[0]
    with pytest.raises(ValueError, match=r"prompt 1: " + message):
        llm.generate([good, make_prompt(image)], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert engine_core(llm).scheduler.get_num_unfinished_requests() == 0
    assert nano_greedy(llm, prompts[1:2])[0] == expected[1:2]


def processor(model: str, **scheduler_args):
    """The frontend's `Processor` alone: the checks of bad input need no engine."""
    from nano_v1.config import ModelConfig, SchedulerConfig, VllmConfig
    from nano_v1.engine.processor import Processor

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model), scheduler_config=SchedulerConfig(**scheduler_args)
    )
    return Processor(vllm_config, tokenizer=None)


def test_an_image_larger_than_the_encoder_cache_is_rejected(llava_llama):
    image = image_token_id(llava_llama)
    for limit in ("encoder_cache_size", "max_num_encoder_input_tokens"):
        with pytest.raises(
            ValueError, match=rf"image 0 takes 16 tokens, more than the encoder can ever hold .*{limit}=15"
        ):
            processor(llava_llama, **{limit: NUM_IMAGE_TOKENS - 1}).process_inputs(
                "r",
                {"prompt_token_ids": [1, image], "multi_modal_data": {"image": random_image(1)}},
                SamplingParams(),
            )
    # Prompts without images are still served.
    _, request = processor(llava_llama, encoder_cache_size=1).process_inputs(
        "r", {"prompt_token_ids": [5, 6]}, SamplingParams()
    )
    assert request.prompt_token_ids == [5, 6] and request.mm_features is None


def test_the_config_settles_the_encoder_budget(llava_llama, tiny_qwen3):
    """Once, when the VllmConfig is built: the frontend and the scheduler both read it there."""
    from nano_v1.config import ModelConfig, SchedulerConfig, VllmConfig

    def budget(model: str, **scheduler_args) -> tuple[int | None, int | None]:
        scheduler_config = SchedulerConfig(**scheduler_args)
        VllmConfig(model_config=ModelConfig(model=model), scheduler_config=scheduler_config)
        return scheduler_config.max_num_encoder_input_tokens, scheduler_config.encoder_cache_size

    assert budget(tiny_qwen3) == (0, 0)  # never has encoder inputs
    assert budget(llava_llama, max_num_batched_tokens=64) == (64, 64)
    # Raised to one image, so that any image fits; an explicit value is kept, even if too small.
    assert budget(llava_llama, max_num_batched_tokens=8) == (NUM_IMAGE_TOKENS, NUM_IMAGE_TOKENS)
    assert budget(llava_llama, max_num_batched_tokens=64, encoder_cache_size=4) == (64, 4)
    with pytest.raises(ValueError, match="disable_chunked_mm_input needs a whole image"):
        budget(llava_llama, max_num_batched_tokens=8, disable_chunked_mm_input=True)


def test_a_text_model_rejects_multi_modal_data(tiny_qwen3):
    with pytest.raises(ValueError, match="is not multimodal; it takes no multi_modal_data"):
        processor(tiny_qwen3).process_inputs(
            "r",
            {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": random_image(1)}},
            SamplingParams(),
        )


def with_image_processor_layout(src: str, dst: Path, layout: str) -> str:
    """A copy of LLaVA checkpoint `src` whose image processor is saved in one of transformers' layouts:
    "processor" (the installed transformers' `LlavaProcessor.save_pretrained`: the image processor
    inside processor_config.json, and no preprocessor_config.json), or "preprocessor" (the older
    layout: preprocessor_config.json alone, no processor_config.json)."""
    import shutil

    import transformers
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    shutil.copytree(src, dst)
    image_processor = AutoImageProcessor.from_pretrained(src, local_files_only=True)
    (dst / "preprocessor_config.json").unlink()
    if layout == "processor":
        config = transformers.AutoConfig.from_pretrained(src)
        transformers.LlavaProcessor(
            image_processor=image_processor,
            tokenizer=transformers.AutoTokenizer.from_pretrained(src),
            patch_size=config.vision_config.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            image_token="<image>",
        ).save_pretrained(dst)
        assert "image_processor" in json.loads((dst / "processor_config.json").read_text())
    else:
        image_processor.save_pretrained(dst)
        assert not (dst / "processor_config.json").exists()
    return str(dst)


@pytest.mark.parametrize("layout", ["processor", "preprocessor"])
def test_every_image_processor_layout_transformers_writes_loads(
    llava_llama, llama_reference, tmp_path, layout
):
    """The installed transformers saves a processor whole (processor_config.json holds the image
    processor, and there is no preprocessor_config.json); older checkpoints have preprocessor_config.json
    alone. Both load, and give transformers' tokens."""
    prompts, expected = llama_reference
    path = with_image_processor_layout(llava_llama, tmp_path / "ckpt", layout)
    llm = LLM(model=path, dtype="float32")
    try:
        assert nano_greedy(llm, prompts[:2])[0] == expected[:2]
    finally:
        llm.llm_engine.shutdown()


def test_a_checkpoint_without_an_image_processor_fails_clearly(llava_llama, tmp_path):
    import shutil

    shutil.copytree(llava_llama, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match=r"is multimodal but has no image processor \(a preprocessor_config"):
        LLM(model=str(tmp_path / "ckpt"), dtype="float32")


# ----------------------------------------------------------------------------- the OpenAI server


def data_url(img, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def test_text_prompt_with_image_tag_matches_transformers(llm, llava_llama):
    tokenizer = llm.get_tokenizer()
    text = "def f(<image>):\n    return"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(image_token_id(llava_llama)) == 1
    img = random_image(9)
    expected, with_another_image = hf_greedy(llava_llama, [(ids, [img]), (ids, [random_image(10)])])
    assert expected != with_another_image, "the image must change the output"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    assert out.prompt == text


def test_chat_with_a_base64_image_through_the_openai_client(llava_llama):
    openai = pytest.importorskip("openai")
    from helpers.servers import ServerThread  # skips where the server's packages are missing
    from transformers import AutoTokenizer

    img = random_image(10)
    question = "what is in it?"
    tokenizer = AutoTokenizer.from_pretrained(llava_llama)
    # The server puts the image placeholder before the text, on its own line (vLLM's chat_utils).
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"<image>\n{question}"}], tokenize=False, add_generation_prompt=True
    )
    expected = hf_greedy(llava_llama, [(tokenizer.encode(prompt, add_special_tokens=False), [img])])[0]
    server = ServerThread(model=llava_llama, dtype="float32", max_model_len=512, num_gpu_blocks_override=64)
    try:
        client = server.client()
        content = [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {"url": data_url(img)}},
        ]
        messages = [{"role": "user", "content": content}]
        response = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0.0
        )
        assert response.choices[0].message.content == tokenizer.decode(expected)
        assert (
            response.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False)) - 1 + 16
        )
        bad_urls = {
            "https://example.com/cat.png": "nano_v1 never fetches images: image_url must be a data: URL",
            "data:image/png;base64,%%%": "is not valid base64",
            f"data:image/png;base64,{base64.b64encode(b'not an image').decode()}": "cannot be decoded as an image",
        }
        for url, message in bad_urls.items():
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(
                    model="demo", max_tokens=2,
                    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                )  # fmt: skip
            assert message in error.value.body["message"], error.value.body
            assert error.value.body["code"] == 400 and error.value.body["type"] == "BadRequestError"
        # Nothing was left behind: the same good request still gets the same answer.
        again = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0.0
        )
        assert again.choices[0].message.content == response.choices[0].message.content
    finally:
        server.stop()
