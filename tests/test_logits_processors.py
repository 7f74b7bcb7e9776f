"""Custom logits processors, prompt truncation and the detokenizer's options, as vLLM v0.11.0 has them.

- Custom processors (the shipped example, `DummyLogitsProcessor`, and an
  `AdapterLogitsProcessor`): loaded by class or by name, in the engine's process and in the
  engine-core process; they change exactly the rows of the requests that ask (oracle:
  transformers' logits, edited by the processor's definition), across any adds, removes and
  condenses of the persistent batch; bad names and classes are refused.
- `truncate_prompt_tokens` keeps the prompt's last k tokens (oracle: the same engine on the
  last k tokens), and the prefix cache sees the kept part.
- `detokenize=False` returns the same ids and no text; `spaces_between_special_tokens`
  against transformers' decode and v0.11.0's rule for adjacent added tokens.
- The fields' validation, in `SamplingParams`, the `Processor` and the server's protocol.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from examples.offline_inference.logits_processor.custom import FQCN, DummyLogitsProcessor
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.detokenizer import IncrementalDetokenizer
from nano_v1.entrypoints.llm import LLM
from nano_v1.sample.logits_processor import AdapterLogitsProcessor, LogitsProcessor, build_logitsprocs
from nano_v1.sample.sampler import Sampler
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_input_batch import CachedRequestState, InputBatch

pytestmark = pytest.mark.ch01

MAX_TOKENS = 8
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):", "x = ["]


class BanToken(AdapterLogitsProcessor):
    """Per request: `extra_args={"ban": t}` makes token t impossible (one function per row)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        ban = (params.extra_args or {}).get("ban")
        if ban is None:
            return None

        def ban_token(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[ban] = float("-inf")
            return logits

        return ban_token


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The demo model in this process, with both custom processors given as classes."""
    args = EngineArgs(
        model=str(DEMO_MODEL_PATH), dtype="float32", logits_processors=[DummyLogitsProcessor, BanToken]
    )
    return LLM.from_engine_args(args, enable_multiprocessing=False)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH, dtype=torch.float32).eval()


def greedy(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def reference_greedy(model, prompt: list[int], extra_args: dict | None) -> list[int]:
    """Greedy over transformers' logits, edited as the processors define: all but the target
    token masked (`target_token`), or one token forbidden (`ban`)."""
    extra_args = extra_args or {}
    output: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            if "target_token" in extra_args:
                masked = torch.full_like(logits, float("-inf"))
                masked[extra_args["target_token"]] = logits[extra_args["target_token"]]
                logits = masked
            if "ban" in extra_args:
                logits[extra_args["ban"]] = float("-inf")
            output.append(int(logits.argmax()))
    return output


def params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


# ---------------------------------------------------------------------------- custom processors
def test_custom_processors_change_exactly_the_rows_that_ask(llm, hf_model):
    """In one batch, requests with `target_token` sample only it, requests with `ban` never sample
    their token, and every other request is token-identical to transformers' greedy."""
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    plain = reference_greedy(hf_model, prompts[1], None)
    ban = plain[0]  # what request 1 samples first unless banned
    extra_args = [{"target_token": 7}, {"ban": ban}, None, {"target_token": 300, "ban": 5}, None]
    got = greedy(llm, [{"prompt_token_ids": p} for p in prompts], [params(extra_args=a) for a in extra_args])
    want = [reference_greedy(hf_model, p, a) for p, a in zip(prompts, extra_args)]
    assert got == want
    assert got[0] == [7] * MAX_TOKENS and got[3] == [300] * MAX_TOKENS
    assert got[1] != plain and ban not in got[1]


def test_custom_processor_by_name_in_the_engine_core_process():
    """The worker in another process builds the processor from its name ("module:Class")."""
    llm = LLM(model=str(DEMO_MODEL_PATH), dtype="float32", logits_processors=[FQCN])
    try:
        got = greedy(llm, PROMPTS[:2], [params(extra_args={"target_token": 11}), params()])
        alone = greedy(llm, PROMPTS[1:2], [params()])
    finally:
        llm.llm_engine.shutdown()
    assert got == [[11] * MAX_TOKENS, alone[0]]


def test_custom_processor_follows_the_persistent_batch():
    """After any sequence of adds, removes and condenses, the processor's rows are exactly the
    requests with a target at their current rows, and sampling changes those rows only: the
    others equal the sampler's result without the processor."""
    rng = random.Random(0)
    vocab = 64
    batch = InputBatch(
        max_num_reqs=8,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=vocab,
        block_sizes=[16],
        logitsprocs=build_logitsprocs(None, torch.device("cpu"), False, [DummyLogitsProcessor]),
    )
    (dummy,) = [p for p in batch.logitsprocs if isinstance(p, DummyLogitsProcessor)]
    targets: dict[str, int | None] = {}
    for step in range(200):
        removed = sorted(
            (batch.remove_request(r) for r in rng.sample(sorted(targets), k=rng.randint(0, min(3, len(targets))))),
            reverse=True,
        )
        for r in set(targets) - set(batch.req_id_to_index):
            del targets[r]
        for i in range(rng.randint(0, 3)):
            if len(targets) == batch.max_num_reqs:
                break
            target = rng.choice([None, rng.randrange(vocab)])
            state = CachedRequestState(
                req_id=f"r{step}_{i}",
                prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 20))],
                sampling_params=SamplingParams(
                    temperature=0.0, extra_args=None if target is None else {"target_token": target}
                ),
                generator=None,
                block_ids=([1],),
                num_computed_tokens=0,
                output_token_ids=[],
            )
            targets[state.req_id] = target
            batch.add_request(state, removed.pop() if removed else None)
        batch.condense(removed)
        batch.refresh_metadata()
        rows = {i: targets[r] for i, r in enumerate(batch.req_ids) if targets[r] is not None}
        assert dummy.req_info == rows
        if not batch.num_reqs:
            continue
        logits = torch.randn(batch.num_reqs, vocab)
        md = batch.sampling_metadata
        got = Sampler()(logits.clone(), md).sampled_token_ids.view(-1).tolist()
        without = dataclasses.replace(md, logitsprocs=[p for p in md.logitsprocs if p is not dummy])
        plain = Sampler()(logits.clone(), without).sampled_token_ids.view(-1).tolist()
        assert got == [rows.get(i, plain[i]) for i in range(batch.num_reqs)]


def test_requests_with_extra_args_are_not_drafted_for():
    """The rejection sampler knows nothing of custom processors, so with n-gram speculation a
    request with `extra_args` gets no drafts: its tokens are still the processor's."""
    args = EngineArgs(
        model=str(DEMO_MODEL_PATH),
        dtype="float32",
        logits_processors=[DummyLogitsProcessor],
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    )
    llm = LLM.from_engine_args(args, enable_multiprocessing=False)
    prompt = "x = 1\n" * 8  # repetitive: the n-gram proposer drafts for the other request
    got = greedy(llm, [prompt, prompt], [params(extra_args={"target_token": 7}), params()])
    assert got[0] == [7] * MAX_TOKENS
    assert got[1] == greedy(llm, [prompt], [params()])[0]


class NotAProcessor:
    pass


@pytest.mark.parametrize(
    "spec, error, message",
    [
        (NotAProcessor, ValueError, "NotAProcessor is not a subclass of LogitsProcessor"),
        ("collections:OrderedDict", ValueError, "OrderedDict must be a subclass of LogitsProcessor"),
        ("os:sep", ValueError, "Loaded logit processor must be a type."),
        ("no_such_module_xyz:Proc", RuntimeError, "Failed to load 0th LogitsProcessor plugin"),
        ("collections:NoSuchClass", ValueError, "collections has no NoSuchClass"),
        ("collections.OrderedDict", ValueError, "written 'module.path:ClassName'"),
    ],
)
def test_bad_logits_processors_are_refused(spec, error, message):
    with pytest.raises(error, match=message):
        build_logitsprocs(None, torch.device("cpu"), False, [spec])


def test_builtin_and_custom_processors_take_v0_11_0s_constructor():
    procs = build_logitsprocs(None, torch.device("cpu"), False, [FQCN, BanToken])
    names = [type(p).__name__ for p in procs]
    assert names == [
        "MinTokensLogitsProcessor",
        "LogitBiasLogitsProcessor",
        "MinPLogitsProcessor",
        "DummyLogitsProcessor",
        "BanToken",
    ]
    assert all(isinstance(p, LogitsProcessor) for p in procs)


# ---------------------------------------------------------------------------- truncate_prompt_tokens
def test_truncate_prompt_tokens_keeps_the_last_k_tokens(llm):
    """The engine sees only the prompt's last k tokens: the same output as those alone, the
    prefix cache holds the kept part (a second request hits it), and stop strings still apply."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(70)]
    k = 40
    truncated = llm.generate({"prompt_token_ids": prompt}, params(truncate_prompt_tokens=k), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == prompt[-k:]
    assert greedy(llm, [{"prompt_token_ids": prompt[-k:]}], [params()]) == [list(truncated.outputs[0].token_ids)]
    again = llm.generate({"prompt_token_ids": prompt}, params(truncate_prompt_tokens=k), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # both full blocks of the 40 kept tokens
    text = llm.generate(PROMPTS[0], params(truncate_prompt_tokens=2), use_tqdm=False)[0]
    assert text.prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[0])[-2:]
    # Stop strings match the text that follows the kept part.
    full = text.outputs[0].text
    stop = full[3:6]
    stopped = llm.generate(PROMPTS[0], params(truncate_prompt_tokens=2, stop=[stop]), use_tqdm=False)[0]
    assert (stopped.outputs[0].text, stopped.outputs[0].finish_reason) == (full[: full.index(stop)], "stop")
    whole = llm.generate(PROMPTS[0], params(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[0])  # -1: max_model_len


def test_truncate_prompt_tokens_beyond_max_model_len_is_refused(llm):
    max_model_len = llm.llm_engine.vllm_config.model_config.max_model_len
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens value \({max_model_len + 1}\) is greater"):
        llm.generate(PROMPTS[0], params(truncate_prompt_tokens=max_model_len + 1), use_tqdm=False)


# ---------------------------------------------------------------------------- detokenize, spaces
def test_detokenize_false_returns_the_same_ids_and_no_text(llm):
    with_text = llm.generate(PROMPTS[:2], params(), use_tqdm=False)
    ids_only = llm.generate(PROMPTS[:2], params(detokenize=False), use_tqdm=False)
    for a, b in zip(with_text, ids_only):
        assert a.outputs[0].text and b.outputs[0].text == ""
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids)


@pytest.fixture(scope="module")
def wordpiece_tokenizer():
    """A tokenizer whose decoder puts a space between tokens, special ones included, with two
    added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "the", "cat"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<a>", "<b>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_spaces_between_special_tokens(wordpiece_tokenizer, skip_special_tokens, spaces_between_special_tokens):
    """Spaces on (the default) or special tokens skipped: exactly transformers' decode. Off, with
    special tokens kept: v0.11.0's rule, an added token after an added token loses its space."""
    tokenizer = wordpiece_tokenizer
    prompt = tokenizer.encode("the", add_special_tokens=False)
    output = tokenizer.encode("hello <a><b> world <b><a><b> cat <a>", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens, spaces_between_special_tokens)
    for token_id in output:
        detokenizer.update([token_id])
    whole = tokenizer.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    if spaces_between_special_tokens or skip_special_tokens:
        assert "the" + detokenizer.output_text == whole
    else:
        assert detokenizer.output_text == " hello <a><b> world <b><a><b> cat <a>"


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be an integer >= 1 or -1, got -2"),
        (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens must be an integer >= 1 or -1, got 2.0"),
        (dict(truncate_prompt_tokens=2**63), "truncate_prompt_tokens must fit in a signed 64-bit integer"),
        (dict(detokenize=False, stop="x"), "stop strings are only supported when detokenize is True"),
        (dict(detokenize="no"), "detokenize must be True or False"),
        (dict(spaces_between_special_tokens=None), "spaces_between_special_tokens must be True or False"),
        (dict(extra_args=[1]), "extra_args must be a dict with string keys"),
        (dict(extra_args={1: 2}), "extra_args must be a dict with string keys"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_server_takes_vllm_extras_into_sampling_params():
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from nano_v1.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    request = CompletionRequest(
        prompt="x", truncate_prompt_tokens=5, spaces_between_special_tokens=False, vllm_xargs={"target_token": 3}
    )
    sp = request.to_sampling_params(default_max_tokens=None)
    assert (sp.truncate_prompt_tokens, sp.spaces_between_special_tokens, sp.extra_args) == (
        5,
        False,
        {"target_token": 3},
    )
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], truncate_prompt_tokens=-1)
    assert chat.to_sampling_params(default_max_tokens=None).truncate_prompt_tokens == -1
    with pytest.raises(ValidationError, match="truncate_prompt_tokens"):
        CompletionRequest(prompt="x", truncate_prompt_tokens=-2)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1 or -1, got 0"):
        CompletionRequest(prompt="x", truncate_prompt_tokens=0).to_sampling_params(default_max_tokens=None)
