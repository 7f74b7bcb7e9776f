"""Penalties, logit bias, allowed token ids, bad words and min-p, against references written
from vLLM v0.11.0's definitions (not from nano_v1's code).

- The ops on tensors: `apply_all_penalties` and `apply_bad_words` against element-by-element loops.
- The engine: greedy tokens of requests with different settings, in one batch, equal a
  step-by-step reference over transformers' logits of the same checkpoint.
- Min-p: the kept set is the direct definition's, and a seeded min-p row samples the same
  tokens alone or among other rows (its state reaches the processor as a `BatchUpdate`).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers.sampling import make_sampling_metadata

from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.sample.logits_processor import BatchUpdate, MinPLogitsProcessor
from nano_v1.sample.ops.bad_words import apply_bad_words
from nano_v1.sample.ops.penalties import apply_all_penalties
from nano_v1.sample.sampler import Sampler
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch01

VOCAB = 64


def reference_logits(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """One row, in v0.11.0's order: allowed ids, bad words, logit bias, then the penalties."""
    logits = list(logits)
    if params.allowed_token_ids is not None:
        logits = [x if t in params.allowed_token_ids else float("-inf") for t, x in enumerate(logits)]
    for word in params.bad_words_token_ids or []:
        if len(word) - 1 <= len(output) and output[len(output) - (len(word) - 1) :] == word[:-1]:
            logits[word[-1]] = float("-inf")
    for t, bias in (params.logit_bias or {}).items():
        logits[t] += bias
    counts = Counter(output)
    for t in set(prompt) | set(output):  # CTRL's repetition penalty, on prompt and output tokens
        x = logits[t]
        logits[t] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for t, c in counts.items():  # OpenAI's: on output tokens only
        logits[t] -= params.frequency_penalty * c + params.presence_penalty
    return logits


def test_apply_all_penalties_matches_the_definition():
    torch.manual_seed(0)
    rows = 5
    logits = torch.randn(rows, VOCAB) * 3
    logits[0, 3] = float("-inf")  # forbidden earlier: stays forbidden
    prompts = [[1, 2, 3, 3], [5], [7, 8, 9], [1], [0, 63]]
    outputs = [[2, 2, 4], [], [9, 9, 9, 10], [11], [63, 62, 62]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.5),
        SamplingParams(),  # neutral: unchanged
        SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.1),
    ]
    prompt_mask = torch.zeros(rows, VOCAB, dtype=torch.bool)
    output_bin_counts = torch.zeros(rows, VOCAB, dtype=torch.int32)
    for i in range(rows):
        prompt_mask[i, prompts[i]] = True
        for t in outputs[i]:
            output_bin_counts[i, t] += 1
    want = [reference_logits(logits[i].tolist(), prompts[i], outputs[i], params[i]) for i in range(rows)]
    got = apply_all_penalties(
        logits.clone(),
        prompt_mask,
        output_bin_counts,
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.repetition_penalty for p in params]),
    )
    torch.testing.assert_close(got, torch.tensor(want))
    assert got[3].tolist() == logits[3].tolist()


def test_apply_bad_words_forbids_only_completions_of_the_output():
    logits = torch.zeros(3, VOCAB)
    bad_words = {0: [[5], [1, 2, 6]], 2: [[3, 4], [9, 9, 9, 7]]}
    outputs = [[0, 1, 2], [3], [9, 9]]  # row 2: [9, 9, 9, 7] needs three 9s; [3, 4] needs a 3 last
    apply_bad_words(logits, bad_words, outputs)
    assert {(r, t) for r, t in (logits == float("-inf")).nonzero().tolist()} == {(0, 5), (0, 6)}
    logits = torch.zeros(1, VOCAB)
    apply_bad_words(logits, {0: [[3, 4]]}, [[1, 3]])
    assert logits[0, 4] == float("-inf")


# ---------------------------------------------------------------------------- min-p
def min_p_processor(min_ps: list[float]) -> MinPLogitsProcessor:
    processor = MinPLogitsProcessor(None, torch.device("cpu"), False)
    added = [(row, SamplingParams(min_p=m), [], []) for row, m in enumerate(min_ps)]
    processor.update_state(BatchUpdate(len(min_ps), [], added, []))
    return processor


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 2
    min_ps = [0.0, 0.05, 0.3, 1.0]
    got = min_p_processor(min_ps).apply(logits.clone())
    for row, min_p in enumerate(min_ps):
        probs = logits[row].softmax(-1)
        kept = {t for t in range(VOCAB) if probs[t] >= min_p * probs.max()}
        assert {t for t in range(VOCAB) if got[row, t] > float("-inf")} == kept
    assert torch.equal(got[0], logits[0])


def test_seeded_min_p_reproducible_and_independent_of_the_batch():
    torch.manual_seed(2)
    row = torch.randn(VOCAB) * 0.7
    others = torch.randn(3, VOCAB)
    alone, in_batch, again = [], [], []
    gens = [torch.Generator().manual_seed(7) for _ in range(3)]
    for _ in range(25):
        md = make_sampling_metadata([0.8], generators={0: gens[0]})
        md.logitsprocs = [min_p_processor([0.2])]
        alone += Sampler()(row[None].clone(), md).sampled_token_ids.view(-1).tolist()
        md = make_sampling_metadata([1.0, 0.0, 0.8, 1.2], generators={2: gens[1]})
        md.logitsprocs = [min_p_processor([0.5, 0.0, 0.2, 0.0])]
        logits = torch.cat([others[:2], row[None], others[2:]])
        in_batch.append(Sampler()(logits, md).sampled_token_ids.view(-1).tolist()[2])
        md = make_sampling_metadata([0.8], generators={0: gens[2]})
        md.logitsprocs = [min_p_processor([0.2])]
        again += Sampler()(row[None].clone(), md).sampled_token_ids.view(-1).tolist()
    assert alone == in_batch == again
    assert len(set(alone)) > 1  # min-p 0.2 leaves a choice: the draws vary
    probs = (row / 0.8).softmax(-1)
    assert all(probs[t] >= 0.2 * probs.max() for t in alone)


# ---------------------------------------------------------------------------- the engine
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)


def reference_greedy(model, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    """Greedy continuations of one prompt under each of `params`: one batched forward per step
    (every row has the same length), each row's logits edited by `reference_logits`."""
    outputs: list[list[int]] = [[] for _ in params]
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([prompt + output for output in outputs])).logits[:, -1].tolist()
            for row, output, p in zip(logits, outputs, params):
                row = reference_logits(row, prompt, output, p)
                output.append(max(range(len(row)), key=row.__getitem__))
    return outputs


def test_greedy_tokens_under_each_parameter_match_the_reference(demo_tokenizer):
    from transformers import AutoModelForCausalLM

    from nano_v1 import LLM

    def params(**kwargs) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)

    control = params()
    requests = [
        (prompt, p)
        for prompt in PROMPTS
        for p in (
            control,
            params(presence_penalty=2.0),
            params(frequency_penalty=1.5),
            params(repetition_penalty=1.8),
            params(repetition_penalty=0.5),
            params(logit_bias={demo_tokenizer.encode(" return")[0]: 8.0, 10: -100.0}),
            params(allowed_token_ids=list(range(30, 400))),
            params(bad_words=["(", " self", "return"]),
            params(
                presence_penalty=0.7,
                frequency_penalty=0.4,
                repetition_penalty=1.3,
                logit_bias={demo_tokenizer.encode(":")[0]: 3.0},
                bad_words=["()"],
                min_p=0.1,  # argmax-invariant: greedy is unchanged by it
            ),
        )
    ]
    llm = LLM(model=str(DEMO_MODEL_PATH), dtype="float32")
    outputs = llm.generate([prompt for prompt, _ in requests], [p for _, p in requests], use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH).to(torch.float32).eval()
    for _, p in requests:
        p.update_from_tokenizer(demo_tokenizer)
    want = []
    for prompt in PROMPTS:
        want += reference_greedy(
            model, demo_tokenizer.encode(prompt), [p for q, p in requests if q == prompt]
        )
    assert got == want
    # The settings bite: most requests differ from their prompt's control.
    n = len(requests) // len(PROMPTS)
    changed = sum(got[i] != got[i - i % n] for i in range(len(got)) if i % n)
    assert changed >= len(got) - len(PROMPTS) - 3
