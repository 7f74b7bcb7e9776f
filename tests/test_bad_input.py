"""Bad input gets a clear `ValueError` naming the problem, and loses nothing else."""

from __future__ import annotations

import pytest

from nano_v1 import LLM, SamplingParams

pytestmark = pytest.mark.ch01


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(n=0), "n must"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty must be in \\[-2, 2\\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero"),
        (dict(repetition_penalty="1"), "repetition_penalty"),
        (dict(min_p=1.5), "min_p must be in \\[0, 1\\]"),
        (dict(min_p=-0.1), "min_p"),
        (dict(logit_bias={"5": 1.0}), "logit_bias must map integer token ids"),
        (dict(logit_bias={5: float("inf")}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty"),
        (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids must be a list of integers"),
        (dict(bad_words=["ok", " "]), "bad_words must be a list of non-blank strings"),
        (dict(bad_words="word"), "bad_words"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(model=tiny_qwen3, dtype="float32", max_model_len=64)


GOOD = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": list(range(3, 3 + 64))}, "max_model_len"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5, 100000]}, "out of vocabulary"),
        ({"prompt_token_ids": [5, -1]}, "out of vocabulary"),
        ({"prompt_token_ids": "abc"}, "list of integers"),
        ("text prompt", "no tokenizer"),
        ({"wrong_key": 1}, "prompt_token_ids"),
    ],
)
def test_bad_prompt_rejected_and_engine_keeps_serving(llm, bad, message):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = llm.generate(GOOD, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD, bad, GOOD], params, use_tqdm=False)
    # Nothing of the failed batch was queued, and the engine still serves.
    assert not llm.llm_engine.has_unfinished_requests()
    after = llm.generate([GOOD, GOOD], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [before, before]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(logit_bias={5: 1.0, 100000: 2.0}), "logit_bias has out-of-vocabulary token ids \\[100000\\]"),
        (dict(logit_bias={-1: 2.0}), "logit_bias has out-of-vocabulary token ids \\[-1\\]"),
        (
            dict(allowed_token_ids=[5, 100000]),
            "allowed_token_ids has out-of-vocabulary token ids \\[100000\\]",
        ),
        (dict(bad_words=["word"]), "no tokenizer, so bad_words"),
    ],
)
def test_bad_token_ids_in_params_rejected(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(
            [GOOD, GOOD],
            [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, **kwargs)],
            use_tqdm=False,
        )
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_words_tokenized_with_and_without_leading_space():
    """As v0.11.0's `update_from_tokenizer`: the word as it starts a text, and again after a space
    when the space folds into its first token (same length, new first token), never twice."""
    from transformers import AutoTokenizer

    from nano_v1.demo_model import DEMO_MODEL_PATH

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    params = SamplingParams(bad_words=["the", "  cat", "!", " the"])
    params.update_from_tokenizer(tokenizer)
    assert params.bad_words_token_ids == [
        [1429],  # "the"
        [296],  # " the": one token
        [67, 278],  # "cat": leading spaces are stripped first
        [283, 278],  # " cat"
        [1],  # "!": " !" is [221, 1], a token longer, so not added
        [1429],  # " the" is stripped to "the" again
        [296],
    ]
    assert SamplingParams().bad_words_token_ids is None


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([GOOD, GOOD], [SamplingParams()] * 3, use_tqdm=False)


def test_abort_unknown_request_id(llm):
    with pytest.raises(ValueError, match="unknown"):
        llm.llm_engine.abort_request("no-such-request")


def test_abort_one_request_others_finish(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("keep", GOOD, params)
    engine.add_request("drop", GOOD, params)
    engine.step()
    engine.abort_request("drop")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert len(finished[0].outputs[0].token_ids) == 8
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model="/nonexistent/model"), "config.json"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=-1), "max_num_seqs"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_bad_engine_args(tiny_qwen3, kwargs, message):
    kwargs = {"model": tiny_qwen3, **kwargs}
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)


def test_unknown_engine_arg(tiny_qwen3):
    with pytest.raises(TypeError, match="not_an_arg"):
        LLM(model=tiny_qwen3, not_an_arg=1)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(model=str(tmp_path))
