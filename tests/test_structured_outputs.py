"""Structured outputs (chapter 15): grammars through the scheduler, the bitmask through the runner.

Oracles: `jsonschema` for JSON outputs, `re.fullmatch` for regexes, the choice set, and
xgrammar's own `GrammarMatcher` (built here, apart from the engine) for every bitmask row
and every token the engine emits; brute-force bit unpacking for `apply_grammar_bitmask`.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import types

import numpy as np
import pytest
import torch
from benchmarks.structured_outputs import PERSON
from helpers.scheduler import make_scheduler

from nano_v1 import LLM, SamplingParams
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.processor import load_tokenizer
from nano_v1.metrics.reader import spec_decoding_stats_from_metrics
from nano_v1.outputs import DraftTokenIds, ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import StructuredOutputsParams
from nano_v1.structured_output import StructuredOutputManager
from nano_v1.structured_output.backend_types import StructuredOutputOptions
from nano_v1.structured_output.utils import apply_grammar_bitmask, choice_as_grammar

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.ch15

VOCAB_SIZE = 4096  # the demo model's
REGEX = r"[a-z]{2,6}-[0-9]{3}"
CHOICES = ["yes", 'say "no"', "back\\slash", "two\nlines", "naïve"]
STRING_LITERAL = re.compile(r'"(\\.|[^"\\])*"')


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EngineArgs(model=str(DEMO_MODEL_PATH)).create_engine_config().model_config)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """The oracle's compiler: xgrammar on the same vocabulary, outside the engine."""
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE))


@pytest.fixture(scope="module")
def llm():
    return LLM.from_engine_args(EngineArgs(model=str(DEMO_MODEL_PATH), seed=0), enable_multiprocessing=False)


def so_params(**kwargs) -> SamplingParams:
    """Sampling at temperature 0.8 under `StructuredOutputsParams(**kwargs)`."""
    return SamplingParams(temperature=0.8, max_tokens=160, structured_outputs=StructuredOutputsParams(**kwargs))


# ---------------------------------------------------------------------------- the boundary
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"json": PERSON, "regex": "a"}, "exactly one of"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json": 3}, "json must be a schema"),
        ({"json_object": False}, "json_object must be True"),
        ({"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "}, "not both"),
    ],
)
def test_params_take_exactly_one_well_formed_constraint(kwargs, message):
    """Rule: «exactly one of» json, regex, choice, grammar or json_object, each of its type."""
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"json": {"type": "nonsense"}}, 'Unsupported type "nonsense"'),
        ({"json": "{not json"}, "Invalid JSON schema: not JSON"),
        ({"json": "[1, 2]"}, "a schema is a JSON object"),
        ({"json": {"type": "string", "format": "email"}}, "features not supported by xgrammar"),
        ({"json": {"$ref": "#/nowhere"}}, "Cannot find field 'nowhere'"),
        ({"regex": "(ab"}, "Failed to transform regex into a grammar: Regex parsing error"),
        ({"regex": "(?=a)b"}, "Lookahead is not supported"),
        ({"grammar": "root ::= item"}, 'Rule "item" is not defined'),
        ({"grammar": 'start: "a"'}, "Invalid grammar specification"),
        ({"json": PERSON, "whitespace_pattern": "("}, "whitespace_pattern '\\(' is not a regex"),
    ],
)
def test_bad_constraint_is_refused_and_leaves_nothing_behind(llm, kwargs, message):
    """Rule: a schema, regex or grammar xgrammar cannot build is a ValueError naming the problem."""
    good = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match=message):
        llm.generate(["def f(x):", "import os"], [good, so_params(**kwargs)], use_tqdm=False)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    assert llm.generate(["def f(x):"], good, use_tqdm=False)[0].outputs[0].token_ids


def test_async_scheduling_refuses_structured_outputs(llm, monkeypatch):
    """Rule: structured outputs are refused «with async scheduling» (the bitmask would be a step late)."""
    monkeypatch.setattr(llm.llm_engine.processor, "async_scheduling", True)
    with pytest.raises(ValueError, match="not supported with async scheduling"):
        llm.generate(["def f(x):"], so_params(regex=REGEX), use_tqdm=False)


# ---------------------------------------------------------------------------- end to end
def test_sampled_outputs_obey_their_constraint_and_others_are_unchanged(llm, compiler):
    """Rule: every structured output parses, validates or matches in full; unconstrained requests
    in the same batch get the same tokens as without them."""
    structured = (
        [so_params(json=PERSON, disable_any_whitespace=True) for _ in range(4)]
        + [so_params(json=PERSON, whitespace_pattern=r"[ ]?") for _ in range(2)]
        + [so_params(regex=REGEX) for _ in range(3)]
        + [so_params(choice=CHOICES) for _ in range(3)]
    )
    for i, params in enumerate(structured):
        params.seed = 100 + i
    plain = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=7, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    prompts = ["def parse(line):", "class Config:", "import json\n"]
    mixed = llm.generate(
        [prompts[i % 3] for i in range(len(structured))] + prompts, structured + plain, use_tqdm=False
    )
    alone = llm.generate(prompts, plain, use_tqdm=False)
    for out, ref in zip(mixed[len(structured) :], alone):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids

    for params, out in zip(structured, mixed):
        completion = out.outputs[0]
        text, so = completion.text, params.structured_outputs
        assert completion.finish_reason == "stop", (so, text)
        if so.json is not None:
            jsonschema.validate(json.loads(text), PERSON)
            outside_strings = STRING_LITERAL.sub('""', text)
            if so.disable_any_whitespace:  # xgrammar's fixed layout: one space after ":" and ","
                assert not re.search(r"\s", re.sub(r"[:,] ", "", outside_strings)), text
            else:
                assert not re.search(r"\s\s|[\n\t\r]", outside_strings), text
        elif so.regex is not None:
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES, text


def test_every_emitted_token_is_one_xgrammar_allows(llm, compiler):
    """Rule: xgrammar's own matcher, fed the output token by token, accepts every token, and a
    finished output ends terminated (the EOS the grammar allows last is the stop). Unbounded JSON
    (`json_object`) may run to max_tokens: then what it wrote is a prefix the grammar accepts."""
    params = [so_params(json=PERSON), so_params(regex=REGEX), so_params(json_object=True)]
    for i, p in enumerate(params):
        p.seed = 11 + i
    for p, out in zip(params, llm.generate(["def f(x):"] * len(params), params, use_tqdm=False)):
        so = p.structured_outputs
        matcher = xgr.GrammarMatcher(
            compiler.compile_json_schema(json.dumps(so.json or {"type": "object"}))
            if so.regex is None
            else compiler.compile_regex(so.regex)
        )
        completion = out.outputs[0]
        assert all(matcher.accept_token(t) for t in completion.token_ids)
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == 0 and matcher.is_terminated()  # EOS, kept as in vLLM
        else:
            assert completion.finish_reason == "length" and so.regex is None


def test_greedy_tokens_identical_with_ngram_speculation_under_a_grammar(llm):
    """Rule: n-gram drafts the grammar forbids are cut, and verification under the bitmask rows of
    every draft gives the tokens plain greedy decoding gives."""
    spec = LLM.from_engine_args(
        EngineArgs(
            model=str(DEMO_MODEL_PATH),
            seed=0,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        ),
        enable_multiprocessing=False,
    )
    prompts = ['{"a": "b", "a": "b", "a": "b", "a":', "aa-123 bb-123 cc-123 dd-"]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(json={"type": "object"})
        ),
        SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=32),
    ]
    prompts.append(prompts[0])
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec_decoding_stats_from_metrics(spec.get_metrics()).num_draft_tokens > 0


# ---------------------------------------------------------------------------- the scheduler's part
def structured_scheduler(tokenizer, num_spec_tokens: int = 0):
    scheduler = make_scheduler(
        num_blocks=64, block_size=4, budget=64, max_seqs=4, max_model_len=128, caching=False,
        num_spec_tokens=num_spec_tokens,
    )  # fmt: skip
    from nano_v1.structured_output.backend_xgrammar import XgrammarBackend

    manager = StructuredOutputManager(scheduler_vllm_config(scheduler, num_spec_tokens))
    manager.backend = XgrammarBackend(manager.vllm_config, tokenizer=tokenizer, vocab_size=VOCAB_SIZE)
    scheduler.structured_output_manager = manager
    return scheduler


def scheduler_vllm_config(scheduler, num_spec_tokens: int):
    spec = types.SimpleNamespace(num_speculative_tokens=num_spec_tokens) if num_spec_tokens else None
    return types.SimpleNamespace(
        speculative_config=spec, scheduler_config=types.SimpleNamespace(max_num_seqs=scheduler.max_num_running_reqs)
    )


def add(scheduler, req_id: str, prompt: list[int], params: SamplingParams) -> Request:
    request = Request(req_id, prompt, params, eos_token_id=0)
    if request.use_structured_output:
        scheduler.structured_output_manager.grammar_init(request)
    scheduler.add_request(request)
    return request


def unpack(bitmask: np.ndarray, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """[rows, words] int32 -> [rows, vocab_size] bool, bit t of word t // 32 (brute force)."""
    bits = (bitmask.astype(np.int64)[:, :, None] >> np.arange(32)) & 1
    return bits.reshape(len(bitmask), -1)[:, :vocab_size].astype(bool)


def oracle_row(matcher) -> np.ndarray:
    row = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_next_token_bitmask(row)
    return unpack(row.numpy())[0]


def wait_for_grammar(request: Request) -> None:
    deadline = time.monotonic() + 10
    while not request.structured_output_request.is_grammar_ready:
        assert time.monotonic() < deadline
        time.sleep(0.001)


@pytest.mark.ch15_t1
def test_bitmask_rows_equal_xgrammars_matcher_token_by_token(tokenizer, compiler):
    """Rule: each step has «a row per draft» of each scheduled structured request and «one for the
    bonus token», equal to xgrammar's own matcher's after the tokens before that row; the matcher is
    «rolled back» after the drafts (drafts the grammar forbids are cut on arrival), and advances by
    the tokens kept."""
    scheduler = structured_scheduler(tokenizer, num_spec_tokens=2)
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["id", "ok"]}
    target = tokenizer.encode('{"id": 42, "ok": true}', add_special_tokens=False) + [0]
    params = SamplingParams(max_tokens=len(target) + 4, structured_outputs=StructuredOutputsParams(json=schema))
    plain = add(scheduler, "plain", [5, 6, 7], SamplingParams(max_tokens=len(target)))
    request = add(scheduler, "so", [5, 6, 7, 8], params)
    wait_for_grammar(request)
    oracle = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    forbidden = tokenizer.encode("]", add_special_tokens=False)[0]
    emitted: list[int] = []
    step = 0
    while not request.is_finished():
        output = scheduler.schedule()
        assert set(output.structured_output_request_ids) == {"so"}, output.structured_output_request_ids
        drafts = output.scheduled_spec_decode_tokens.get("so", [])
        rows = unpack(output.grammar_bitmask)
        assert len(rows) == 1 + len(drafts), f"step {step}: {len(rows)} rows for {len(drafts)} drafts, want 1 + drafts"
        for i, row in enumerate(rows):
            want = oracle_row(oracle)
            assert np.array_equal(row, want), (
                f"step {step}, row {i} of {len(rows)}: not xgrammar's mask after the tokens before it "
                f"({int((row != want).sum())} of {VOCAB_SIZE} tokens differ)"
            )
            if i < len(drafts):
                assert oracle.accept_token(drafts[i]), f"step {step}: draft {i} was validated, the oracle refuses it"
        if drafts:
            oracle.rollback(len(drafts))
        # The "model" samples the target: drafts are right up to where they leave it.
        pos = len(emitted)
        num_accepted = 0
        while num_accepted < len(drafts) and drafts[num_accepted] == target[pos + num_accepted]:
            num_accepted += 1
        sampled = target[pos : pos + num_accepted + 1]
        ids = ["plain", "so"] if "plain" in output.num_scheduled_tokens else ["so"]
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[9] if r == "plain" else sampled for r in ids]),
        )
        for token in sampled:
            assert oracle.accept_token(token), f"step {step}: the oracle refuses a token of the target"
        emitted += sampled
        if not request.is_finished():
            # Drafts: two right ones, or a right one then one the grammar forbids.
            nxt = target[len(emitted) : len(emitted) + 2]
            drafts = nxt if step % 2 else nxt[:1] + [forbidden]
            scheduler.update_draft_token_ids(DraftTokenIds(["so"], [drafts]))
            num_allowed = max(params.max_tokens - len(emitted) - 1, 0)
            kept = []
            for token in drafts[:num_allowed]:
                if not oracle.accept_token(token):
                    break
                kept.append(token)
            if kept:
                oracle.rollback(len(kept))
            assert request.spec_token_ids == kept, (
                f"step {step}: drafts {drafts} kept as {request.spec_token_ids}, want {kept}: the grammar's "
                "matcher must stand after the emitted tokens (rolled back after the step's drafts)"
            )
        step += 1
    assert emitted == target and oracle.is_terminated(), f"emitted {emitted}, want {target}"
    assert request.get_finished_reason() == "stop" and not plain.is_finished(), request.get_finished_reason()


@pytest.mark.ch15_t1
def test_grammar_bitmask_packs_rows_in_scheduler_order_and_leaves_matchers_where_they_were(tokenizer, compiler):
    """Rule: rows come in the scheduler's order, «a row per draft» and «one for the bonus token» per
    request, each equal to xgrammar's own matcher's after the tokens before it; a grammar that «is
    terminated» (here by its EOS draft) allows every token; every matcher is «rolled back», so a
    second call gives the same rows."""
    scheduler = structured_scheduler(tokenizer, num_spec_tokens=3)
    manager = scheduler.structured_output_manager
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    yes = encode("yes")
    # request id: (kind, spec, tokens already accepted, this step's drafts)
    cases = {
        "json": (StructuredOutputOptions.JSON, schema, [], encode('{"id": 4')[:3]),
        "regex": (StructuredOutputOptions.REGEX, REGEX, encode("ab"), []),
        "choice": (StructuredOutputOptions.GRAMMAR, choice_as_grammar(["yes", "no"]), yes[:-1], yes[-1:] + [0]),
        "done": (StructuredOutputOptions.GRAMMAR, choice_as_grammar(["yes", "no"]), yes + [0], []),
    }
    # The scheduler's list puts them in another order than the dict's, with unstructured requests between.
    structured_output_request_ids = {"regex": 3, "json": 0, "done": 5, "choice": 1}
    requests, oracles = {}, {}
    for req_id, (kind, spec, accepted, _) in cases.items():
        grammar = manager.backend.compile_grammar(kind, spec)
        assert grammar.accept_tokens(req_id, accepted)
        requests[req_id] = types.SimpleNamespace(structured_output_request=types.SimpleNamespace(grammar=grammar))
        oracles[req_id] = xgr.GrammarMatcher(
            compiler.compile_json_schema(spec) if kind == StructuredOutputOptions.JSON
            else compiler.compile_regex(spec) if kind == StructuredOutputOptions.REGEX
            else compiler.compile_grammar(spec)
        )  # fmt: skip
        assert all(oracles[req_id].accept_token(t) for t in accepted)
    drafts = {req_id: case[3] for req_id, case in cases.items() if case[3]}

    want: list[tuple[str, np.ndarray]] = []
    for req_id in sorted(structured_output_request_ids, key=structured_output_request_ids.get):
        oracle = oracles[req_id]
        for token in [*drafts.get(req_id, ()), None]:
            want.append((req_id, np.ones(VOCAB_SIZE, bool) if oracle.is_terminated() else oracle_row(oracle)))
            if token is not None:
                assert oracle.accept_token(token)
        oracle.rollback(len(drafts.get(req_id, ())))
    for call in ("first", "second"):
        bitmask = manager.grammar_bitmask(requests, structured_output_request_ids, drafts)
        assert bitmask is not None and len(bitmask) == len(want), (
            f"{call} call: {None if bitmask is None else len(bitmask)} rows, want {len(want)} "
            "(1 + drafts per structured request)"
        )
        rows = unpack(bitmask)
        for i, (req_id, row) in enumerate(want):
            assert np.array_equal(rows[i], row), (
                f"{call} call: row {i} is not {req_id!r}'s mask for that position (xgrammar's matcher "
                f"after the tokens before it); {int((rows[i] != row).sum())} of {VOCAB_SIZE} tokens differ"
            )
        for req_id, request in requests.items():
            grammar = request.structured_output_request.grammar
            assert grammar.num_processed_tokens == len(cases[req_id][2]), (
                f"{call} call: {req_id!r}'s matcher was not rolled back to where it stood"
            )


def test_a_slow_grammar_never_holds_up_other_requests(tokenizer):
    """Rule: a request waits in `WAITING_FOR_FSM` while its grammar compiles; the others are scheduled."""
    scheduler = structured_scheduler(tokenizer)
    backend = scheduler.structured_output_manager.backend
    release = threading.Event()
    compile_grammar = backend.compile_grammar

    def slow_compile(*args):
        assert release.wait(10)
        return compile_grammar(*args)

    backend.compile_grammar = slow_compile
    slow = add(scheduler, "slow", [1, 2, 3], so_params(regex=REGEX))
    add(scheduler, "plain", [4, 5, 6], SamplingParams(max_tokens=8))
    for _ in range(3):
        output = scheduler.schedule()
        assert list(output.num_scheduled_tokens) == ["plain"] and slow.status == RequestStatus.WAITING_FOR_FSM
        scheduler.update_from_output(output, ModelRunnerOutput(["plain"], {"plain": 0}, [[7]]))
    release.set()
    wait_for_grammar(slow)
    output = scheduler.schedule()
    assert set(output.num_scheduled_tokens) == {"plain", "slow"} and slow.status == RequestStatus.RUNNING


def test_a_grammar_that_fails_to_compile_aborts_its_request_only(tokenizer):
    """Rule: a compilation error finishes that request as aborted, with the error as its stop reason;
    the engine and the other requests go on."""
    scheduler = structured_scheduler(tokenizer)

    def failing_compile(*args):
        raise RuntimeError("grammar too large")

    scheduler.structured_output_manager.backend.compile_grammar = failing_compile
    bad = add(scheduler, "bad", [1, 2, 3], so_params(regex=REGEX))
    add(scheduler, "plain", [4, 5, 6], SamplingParams(max_tokens=8))
    wait_for_grammar(bad)
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["plain"] and output.grammar_bitmask is None
    outputs = scheduler.update_from_output(output, ModelRunnerOutput(["plain"], {"plain": 0}, [[7]])).outputs
    (failed,) = [o for o in outputs if o.request_id == "bad"]
    assert failed.finish_reason == "abort" and "grammar too large" in failed.stop_reason
    assert "bad" not in scheduler.requests and "plain" in scheduler.requests
    assert scheduler.schedule().num_scheduled_tokens == {"plain": 1}


# ---------------------------------------------------------------------------- the runner's part
def random_bitmask(rng: np.random.Generator, rows: int, words: int) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)


def mask_logits(logits, grammar_bitmask, scheduler_order, spec, batch_order) -> None:
    """`apply_grammar_bitmask` on a stand-in step: the scheduler's order of the structured
    requests, their drafts, and the persistent batch's order of every request."""
    apply_grammar_bitmask(
        types.SimpleNamespace(
            grammar_bitmask=grammar_bitmask,
            structured_output_request_ids=scheduler_order,
            scheduled_spec_decode_tokens=spec,
        ),
        types.SimpleNamespace(req_ids=batch_order, req_id_to_index={r: i for i, r in enumerate(batch_order)}),
        logits,
        torch.device("cpu"),
    )


@pytest.mark.ch15_t2
def test_apply_grammar_bitmask_masks_exactly_the_forbidden_tokens():
    """Rule: each structured request's «1 + its drafts» rows get -inf where the bit is clear, taken
    from the bitmask in «the scheduler's order» and put at the request's rows in «the batch's order»
    of logits, where «every earlier request's drafts» shift it; «unconstrained requests stay untouched»."""
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    batch_order = ["a", "b", "c", "d"]  # the runner's rows; c and a are structured
    spec = {"a": [1, 2], "b": [3], "c": [4]}  # a: rows 0-2, b: 3-4, c: 5-6, d: 7
    scheduler_order = {"c": 0, "a": 1}  # the bitmask's: c's 2 rows, then a's 3
    words = (vocab + 31) // 32
    grammar_bitmask = random_bitmask(rng, 5, words)
    logits = torch.randn(8, vocab, dtype=torch.float32)
    expected = logits.clone()
    mask_logits(logits, grammar_bitmask, scheduler_order, spec, batch_order)
    allowed = unpack(grammar_bitmask, vocab)
    for logits_row, mask_row in [(5, 0), (6, 1), (0, 2), (1, 3), (2, 4)]:
        expected[logits_row][torch.from_numpy(~allowed[mask_row])] = float("-inf")
    owners = ["a", "a", "a", "b", "b", "c", "c", "d"]
    for row, owner in enumerate(owners):
        assert torch.equal(logits[row], expected[row]), (
            f"logits row {row} (request {owner}): "
            f"{int((logits[row] != expected[row]).sum())} of {vocab} logits masked wrongly"
        )


@pytest.mark.ch15_t2
def test_apply_grammar_bitmask_on_random_batches_matches_a_row_by_row_model():
    """Rule: a logits row holds (request, k), the batch's requests in «the batch's order», each with
    its drafts' rows then its bonus row; a bitmask row holds (request, k) for the structured ones in
    «the scheduler's order», «1 + its drafts» each. Each logits row of a structured request is masked
    by the bitmask row of the same (request, k) and «unconstrained requests stay untouched», with
    «every earlier request's drafts» counted (random batches, all or some structured)."""
    rng = np.random.default_rng(1)
    vocab, words = 70, 3
    for case in range(40):
        num_reqs = int(rng.integers(1, 7))
        batch_order = [f"r{i}" for i in rng.permutation(num_reqs)]
        spec = {r: [1] * int(rng.integers(0, 4)) for r in batch_order}
        spec = {r: d for r, d in spec.items() if d}
        structured = [r for r in batch_order if case % 4 == 0 or rng.random() < 0.5] or batch_order[:1]
        # The scheduler's list: its own order, unstructured requests interleaved.
        scheduler_list = [batch_order[i] for i in rng.permutation(num_reqs)]
        scheduler_order = {r: scheduler_list.index(r) for r in structured}
        logits_rows = [(r, k) for r in batch_order for k in range(1 + len(spec.get(r, ())))]
        bitmask_rows = [
            (r, k) for r in sorted(structured, key=scheduler_order.get) for k in range(1 + len(spec.get(r, ())))
        ]
        grammar_bitmask = random_bitmask(rng, len(bitmask_rows), words)
        logits = torch.randn(len(logits_rows), vocab, dtype=torch.float32)
        expected = logits.clone()
        mask_logits(logits, grammar_bitmask, scheduler_order, spec, batch_order)
        allowed = unpack(grammar_bitmask, vocab)
        for row, key in enumerate(logits_rows):
            if key in bitmask_rows:
                expected[row][torch.from_numpy(~allowed[bitmask_rows.index(key)])] = float("-inf")
            assert torch.equal(logits[row], expected[row]), (
                f"case {case}: logits row {row} (request {key[0]}, "
                f"{'draft ' + str(key[1]) if key[1] < len(spec.get(key[0], ())) else 'bonus'} row, "
                f"{'structured' if key[0] in scheduler_order else 'unconstrained'}) masked wrongly; batch "
                f"{batch_order}, drafts {({r: len(d) for r, d in spec.items()})}, scheduler order {scheduler_order}"
            )


def test_choice_grammar_accepts_exactly_the_choices(tokenizer, compiler):
    """Rule: a choice becomes a grammar whose sentences are the choices, quotes, backslashes,
    newlines and non-ASCII included."""
    grammar = compiler.compile_grammar(choice_as_grammar(CHOICES))
    for text in CHOICES + ["ye", "yes!", 'say "no', "two lines"]:
        matcher = xgr.GrammarMatcher(grammar)
        accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert (accepted and matcher.accept_token(0)) == (text in CHOICES), text


def test_a_reset_grammar_starts_over(tokenizer):
    """Rule: after `reset()` a grammar accepts its first token again, even once it had terminated."""
    from nano_v1.structured_output.backend_types import StructuredOutputOptions
    from nano_v1.structured_output.backend_xgrammar import XgrammarBackend

    backend = XgrammarBackend(types.SimpleNamespace(), tokenizer=tokenizer, vocab_size=VOCAB_SIZE)
    grammar = backend.compile_grammar(StructuredOutputOptions.REGEX, "ab")
    tokens = tokenizer.encode("ab", add_special_tokens=False) + [0]
    assert grammar.accept_tokens("r", tokens) and grammar.is_terminated()
    grammar.reset()
    assert not grammar.is_terminated() and grammar.accept_tokens("r", tokens) and grammar.is_terminated()
