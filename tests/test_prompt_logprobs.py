"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the runner's chunked computation, the
prefix-cache rule, the frontend's `Logprob` dicts and the limits at the boundary.

Oracle: transformers' float32 log-softmax of the tiny checkpoint's logits over the whole
prompt, at every position; a token's rank is the number of tokens at least as likely as it.
One engine serves every engine test: a 16-token step budget, so that a 50-token prompt spans
four steps beside other requests, and prefix caching on.
"""

from __future__ import annotations

import pytest
import torch

from nano_v1 import LLM, SamplingParams
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from nano_v1.engine.llm_engine import fan_out
from nano_v1.engine.output_processor import OutputProcessor
from nano_v1.logprobs import Logprob
from nano_v1.outputs import LogprobsTensors
from nano_v1.sampling_params import RequestOutputKind

MAX_NUM_BATCHED_TOKENS = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_qwen3) -> LLM:
    return LLM(
        tiny_qwen3,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=True,
    )


@pytest.fixture(scope="module")
def hf_logprobs(tiny_qwen3):
    """prompt -> [len(prompt), vocab] float32 log-softmax of transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)

    return logprobs


def assert_prompt_logprobs_equal_hf(prompt_logprobs, prompt: list[int], k: int, expected: torch.Tensor) -> None:
    """Position 0 is None; position i holds prompt token i (its logprob and rank) and the top k of
    the logits at position i - 1, ranked 1..k, as transformers computes them."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None, "the first prompt token has no logprob: no token predicts it"
    for i in range(1, len(prompt)):
        row, token = expected[i - 1], prompt[i]
        got = prompt_logprobs[i]
        assert got[token].logprob == pytest.approx(row[token].item(), abs=ATOL), f"position {i}: its own token"
        assert got[token].rank == int((row >= row[token]).sum()), f"position {i}: its own token's rank"
        top_values, top_ids = row.topk(k)
        for rank, (token_id, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), start=1):
            assert token_id in got, f"position {i}: top-{rank} token {token_id} missing"
            assert got[token_id].logprob == pytest.approx(value, abs=ATOL)
            if token_id != token:
                assert got[token_id].rank == rank
        assert set(got) == {token, *top_ids.tolist()}, f"position {i}: exactly its token and the top {k}"


def test_prompt_logprobs_equal_transformers_across_chunked_prefill(llm, hf_logprobs):
    """A 50-token prompt over 4 steps of 16 tokens, beside requests with other settings:
    every position equals transformers', chunk boundaries included."""
    long_prompt = [(7 * i + 3) % 509 + 3 for i in range(50)]
    assert len(long_prompt) > 3 * MAX_NUM_BATCHED_TOKENS  # its prefill spans at least four steps
    prompts = [long_prompt, [(11 * i + 5) % 500 + 3 for i in range(21)], [(5 * i + 1) % 500 + 3 for i in range(9)]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5),
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=3),
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_prompt_logprobs_equal_hf(outputs[0].prompt_logprobs, prompts[0], 5, hf_logprobs(prompts[0]))
    assert_prompt_logprobs_equal_hf(outputs[1].prompt_logprobs, prompts[1], 0, hf_logprobs(prompts[1]))
    assert outputs[2].prompt_logprobs is None  # it asked for none


def test_prompt_logprobs_of_a_one_token_prompt_and_of_a_prompt_ending_a_chunk(llm, hf_logprobs):
    """A one-token prompt has only the None; a 17-token prompt's first chunk (the whole 16-token
    budget) computes all 16 of its prompt logprobs, which wait for the step that samples."""
    one, seventeen = [42], [(3 * i + 8) % 500 + 3 for i in range(MAX_NUM_BATCHED_TOKENS + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    out_seventeen, out_one = llm.generate(
        [{"prompt_token_ids": seventeen}, {"prompt_token_ids": one}], params, use_tqdm=False
    )
    assert out_one.prompt_logprobs == [None]
    assert_prompt_logprobs_equal_hf(out_seventeen.prompt_logprobs, seventeen, 3, hf_logprobs(seventeen))


def test_prompt_logprobs_skip_the_prefix_cache(llm, hf_logprobs):
    """As v0.11.0: a request with prompt_logprobs never takes a prefix-cache hit (the cached
    positions' hidden states are gone), and its logprobs are whole; without them, the same
    prompt hits the blocks the others left."""
    prefix = [(13 * i + 2) % 500 + 3 for i in range(48)]
    first = prefix + [100, 101, 102]
    second = prefix + [200, 201, 202, 203]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate({"prompt_token_ids": first}, greedy, use_tqdm=False)
    (with_logprobs,) = llm.generate(
        {"prompt_token_ids": second},
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
        use_tqdm=False,
    )
    assert with_logprobs.num_cached_tokens == 0
    assert_prompt_logprobs_equal_hf(with_logprobs.prompt_logprobs, second, 2, hf_logprobs(second))
    (without,) = llm.generate({"prompt_token_ids": second}, greedy, use_tqdm=False)
    assert without.num_cached_tokens == 48
    assert without.outputs[0].token_ids == with_logprobs.outputs[0].token_ids


def test_prompt_logprobs_with_n_completions_and_sample_logprobs(llm, hf_logprobs):
    prompt = [(17 * i + 4) % 500 + 3 for i in range(20)]
    (output,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=4, prompt_logprobs=1, logprobs=2),
        use_tqdm=False,
    )
    assert_prompt_logprobs_equal_hf(output.prompt_logprobs, prompt, 1, hf_logprobs(prompt))
    assert all(len(c.logprobs) == 4 for c in output.outputs)


# ---------------------------------------------------------------- limits at the boundary
@pytest.mark.parametrize("value", [-2, 1.5, True, "3"])
def test_prompt_logprobs_must_be_an_integer_from_minus_one(value):
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative or -1"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.parametrize("value, shown", [(21, 21), (-1, 512)])  # -1: the whole 512-token vocabulary
def test_prompt_logprobs_above_the_maximum_are_refused(llm, value, shown):
    with pytest.raises(ValueError, match=f"Requested prompt logprobs of {shown}, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(prompt_logprobs=value), use_tqdm=False)


# ---------------------------------------------------------------- the frontend's side
def prompt_tensors(rows: list[tuple[list[int], list[float], int]]) -> LogprobsTensors:
    return LogprobsTensors(
        logprob_token_ids=torch.tensor([ids for ids, _, _ in rows]),
        logprobs=torch.tensor([values for _, values, _ in rows]),
        selected_token_ranks=torch.tensor([rank for _, _, rank in rows]),
    )


class LetterTokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_processor_makes_logprob_dicts_once_per_parent(kind):
    """Rows become {token: Logprob}: the prompt token with its rank, the top ones ranked 1, 2;
    the n children's second copy is ignored; a DELTA stream sends them in one output only."""
    processor = OutputProcessor(LetterTokenizer())
    params = SamplingParams(n=2, prompt_logprobs=2, max_tokens=2, output_kind=kind)
    processor.add_request("r", None, fan_out(EngineCoreRequest("r", [0, 1, 2], params, None, 0.0)))
    tensors = prompt_tensors([([1, 3, 1], [-2.0, -0.5, -2.0], 2), ([2, 0, 4], [-3.0, -1.0, -1.5], 7)])
    expected = [
        None,
        {1: Logprob(-2.0, 2, "b"), 3: Logprob(-0.5, 1, "d")},
        {2: Logprob(-3.0, 7, "c"), 0: Logprob(-1.0, 1, "a"), 4: Logprob(-1.5, 2, "e")},
    ]
    first = processor.process_outputs(
        [EngineCoreOutput("0_r", [5], new_prompt_logprobs_tensors=tensors),
         EngineCoreOutput("1_r", [6], new_prompt_logprobs_tensors=prompt_tensors([([9, 9, 9], [0.0] * 3, 1)] * 2))]
    ).request_outputs
    last = processor.process_outputs(
        [EngineCoreOutput("0_r", [5], finish_reason="length"), EngineCoreOutput("1_r", [6], finish_reason="length")]
    ).request_outputs
    if kind == RequestOutputKind.FINAL_ONLY:
        assert first == [] and last[0].prompt_logprobs == expected
    elif kind == RequestOutputKind.DELTA:
        assert first[0].prompt_logprobs == expected and last[0].prompt_logprobs == []
    else:
        assert first[0].prompt_logprobs == expected and last[0].prompt_logprobs == expected


def test_prompt_logprobs_tensors_cross_the_engine_core_wire():
    """The engine-core process sends them inside `EngineCoreOutput` (chapter 09)."""
    pytest.importorskip("msgspec")
    from nano_v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    tensors = LogprobsTensors.empty_cpu(3, 2)
    tensors.logprob_token_ids.copy_(torch.tensor([[1, 2], [3, 4], [5, 6]]))
    tensors.logprobs.copy_(torch.tensor([[-0.5, -0.25], [-1.0, -0.125], [-2.0, -0.0625]]))
    tensors.selected_token_ranks.copy_(torch.tensor([2, 1, 9]))
    sent = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [7], new_prompt_logprobs_tensors=tensors)])
    (received,) = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(sent)).outputs
    got = received.new_prompt_logprobs_tensors
    for name in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        assert torch.equal(getattr(got, name), getattr(tensors, name)), name



def test_prompt_logprobs_of_preempted_requests(tiny_qwen3, hf_logprobs, monkeypatch):
    """A KV cache too small for the batch: requests are preempted, in prefill and after it, and
    compute their prompt again; each output still has its prompt logprobs once, whole and right."""
    in_prefill = []  # per preemption: was the victim still in its prefill?
    original = Scheduler._preempt
    monkeypatch.setattr(
        Scheduler,
        "_preempt",
        lambda self, req: (in_prefill.append(req.num_computed_tokens < req.num_prompt_tokens), original(self, req)),
    )
    llm = LLM(
        tiny_qwen3,
        dtype="float32",
        block_size=16,
        max_num_seqs=6,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=96,
        num_gpu_blocks_override=12,
    )
    prompts = [[(31 * i + 7 * r) % 500 + 3 for i in range(20 + 9 * r)] for r in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert set(in_prefill) == {True, False}, "the cache was meant to preempt prefills and decodes"
    for prompt, output in zip(prompts, outputs):
        assert_prompt_logprobs_equal_hf(output.prompt_logprobs, prompt, 2, hf_logprobs(prompt))


def test_prompt_logprobs_under_async_scheduling(tiny_qwen3, hf_logprobs):
    """Chapter 14's overlapped steps: the runner's output still carries each prompt's logprobs."""
    llm = LLM(
        tiny_qwen3,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        async_scheduling=True,
    )
    prompts = [[(7 * i + 3 + r) % 509 + 3 for i in range(20 + 13 * r)] for r in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_prompt_logprobs_equal_hf(output.prompt_logprobs, prompt, 2, hf_logprobs(prompt))
def test_server_clamps_minus_infinity_in_prompt_logprobs():
    """JSON has no infinity: the server answers -inf as -9999.0, as vLLM (`clamp_prompt_logprobs`)."""
    pytest.importorskip("fastapi")
    from nano_v1.entrypoints.openai.serving_engine import _clamp_prompt_logprobs

    original = [None, {3: Logprob(float("-inf"), 512, "x"), 4: Logprob(-0.5, 1, "y")}]
    assert _clamp_prompt_logprobs(original) == [None, {3: Logprob(-9999.0, 512, "x"), 4: Logprob(-0.5, 1, "y")}]
    assert original[1][3].logprob == float("-inf")  # the engine's output is left as it was
    assert _clamp_prompt_logprobs(None) is None
