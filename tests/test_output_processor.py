"""The frontend's output processor: one step's token ids in, the users' RequestOutputs out.

The outputs are fed by hand, one step at a time, with a tokenizer whose tokens each decode
to a piece of text the test chooses: so a test decides exactly where a stop string begins
and ends. Oracles: outputs written out by hand, and a brute-force model of a request (decode
everything so far, cut at the first stop string) that random streams must agree with. One
test runs the real engine, in this process, against its own unstopped output.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nano_v1.engine import EngineCoreOutput, EngineCoreRequest
from nano_v1.engine.llm_engine import fan_out
from nano_v1.engine.output_processor import OutputProcessor, OutputProcessorOutput
from nano_v1.metrics.stats import IterationStats
from nano_v1.sampling_params import RequestOutputKind, SamplingParams

pytestmark = [pytest.mark.ch09, pytest.mark.ch09_t3]

DELTA, CUMULATIVE, FINAL_ONLY = (
    RequestOutputKind.DELTA,
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.FINAL_ONLY,
)


class PieceTokenizer:
    """Token i decodes to `pieces[i]`, with no merges between tokens: `decode` joins the pieces.

    `ids` hands out a token id per distinct piece, so a test writes its tokens as text.
    """

    def __init__(self) -> None:
        self.pieces: list[str] = ["P"]  # token 0: the prompts' token

    def ids(self, *pieces: str) -> list[int]:
        for piece in pieces:
            if piece not in self.pieces:
                self.pieces.append(piece)
        return [self.pieces.index(piece) for piece in pieces]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[t] for t in token_ids)


class Frontend:
    """An OutputProcessor with the piece tokenizer; `step` feeds it one step of outputs."""

    def __init__(self) -> None:
        self.tokenizer = PieceTokenizer()
        self.processor = OutputProcessor(self.tokenizer)

    def add(self, request_id: str, params: SamplingParams, prompt_len: int = 3) -> None:
        request = EngineCoreRequest(request_id, [0] * prompt_len, params, eos_token_id=None, arrival_time=0.0)
        self.processor.add_request(request_id, None, fan_out(request))

    def output(
        self, request_id: str, *pieces: str, finish_reason: str | None = None, num_cached_tokens: int = 0
    ) -> EngineCoreOutput:
        """What the core sends for `request_id` in one step: these tokens, and its finish reason if it ended."""
        return EngineCoreOutput(
            request_id,
            self.tokenizer.ids(*pieces),
            finish_reason=finish_reason,
            num_cached_tokens=num_cached_tokens,
        )

    def step(self, *outputs: EngineCoreOutput, stats: IterationStats | None = None) -> OutputProcessorOutput:
        try:
            return self.processor.process_outputs(list(outputs), stats)
        except KeyError as error:
            pytest.fail(
                f"process_outputs raised KeyError({error}): it looked up or freed state this processor "
                f"no longer holds (each request's and each parent's state is freed once, when it finishes)"
            )


def one_completion(processed: OutputProcessorOutput) -> tuple[str, str | None, str | int | None]:
    """(text, finish reason, stop reason) of the one completion of the one output of a step."""
    assert len(processed.request_outputs) == 1, (
        f"one request got tokens in this step, so it must get one RequestOutput, "
        f"got {len(processed.request_outputs)}"
    )
    (completion,) = processed.request_outputs[0].outputs
    return completion.text, completion.finish_reason, completion.stop_reason


# ----------------------------------------------------------------------------- stop strings


def test_a_stop_string_across_three_steps_is_held_back_then_cut():
    """Rule: a stop string «may have begun in an earlier step»: the text that may be its start is «held-back»
    until it is known, and «its text ends before the stop string»."""
    frontend = Frontend()
    frontend.add("r", SamplingParams(stop=["abc"]))  # CUMULATIVE: each output shows all the text so far
    pieces = ["x", "a", "b", "y", "a", "b"]
    # "abc" may begin in the last 2 characters of a running request: those are not shown yet.
    expected_texts = ["", "", "x", "xa", "xab", "xaby"]
    for k, (piece, expected) in enumerate(zip(pieces, expected_texts)):
        processed = frontend.step(frontend.output("r", piece))
        text, finish_reason, _ = one_completion(processed)
        so_far = "".join(pieces[: k + 1])
        assert finish_reason is None, f"no stop string is complete in {so_far!r}: the request must run on"
        assert text == expected, (
            f"while the stop string 'abc' may still complete, the last 2 characters are held back: "
            f"after {so_far!r} the output must show {expected!r}, got {text!r}"
        )
        assert processed.reqs_to_abort == [], "the core must abort only a request a stop string ended"
    processed = frontend.step(frontend.output("r", "c"))
    assert one_completion(processed) == ("xaby", "stop", "abc"), (
        f"'ab' in one step and 'c' in the next complete the stop string 'abc' (a stop string can "
        f"straddle steps): the request ends with finish reason 'stop', stop reason 'abc' and the "
        f"text before it, 'xaby'; got (text, finish, stop reason) = {one_completion(processed)}"
    )
    assert processed.reqs_to_abort == ["r"], (
        f"a stop string ended request 'r' here while the core still runs it: it must be in "
        f"reqs_to_abort, or the core goes on generating until max_tokens; got {processed.reqs_to_abort}"
    )
    assert not frontend.processor.has_unfinished_requests() and not frontend.processor.parent_requests, (
        "a finished request's state (and its parent's) must be freed"
    )


def test_include_stop_str_in_output_and_a_stop_inside_one_token():
    """Rule: «its text ends before the stop string, or after it with `include_stop_str_in_output`», also when
    the stop string lies inside one token's text."""
    frontend = Frontend()
    frontend.add("r", SamplingParams(stop=["abc"], include_stop_str_in_output=True))
    assert one_completion(frontend.step(frontend.output("r", "x"))) == ("x", None, None), (
        "with include_stop_str_in_output nothing is held back: the running text is shown whole"
    )
    # Two tokens bring five characters; "abc" ends two characters before the end of them.
    processed = frontend.step(frontend.output("r", "ab", "c!!"))
    got = one_completion(processed)
    assert got[1:] == ("stop", "abc"), (
        f"the tokens 'ab', 'c!!' complete the stop string 'abc' inside the step's new text (it "
        f"need not end at its last character: look through all the new characters, not the new "
        f"tokens): the request must end with ('stop', 'abc'), got {got[1:]}"
    )
    assert got[0] == "xabc", (
        f"with include_stop_str_in_output the text ends after the stop string: 'xabc', got {got[0]!r}"
    )
    assert processed.reqs_to_abort == ["r"], "a stop string ended 'r' here: the core must abort it"


def test_the_stop_string_is_left_out_and_the_text_after_it_dropped():
    """Rule: «its text ends before the stop string»: the stop string and whatever followed it in the step are
    dropped; «finish reason "stop" and the stop string as stop reason»."""
    frontend = Frontend()
    frontend.add("r", SamplingParams(stop=["ab", "b!"], output_kind=DELTA))
    streamed = one_completion(frontend.step(frontend.output("r", "xy")))[0]
    processed = frontend.step(frontend.output("r", "zab!", "q"))
    text, finish_reason, stop_reason = one_completion(processed)
    streamed += text
    assert (finish_reason, stop_reason) == ("stop", "ab"), (
        f"'ab' and 'b!' both end in 'xyzab!q'; 'ab' begins first, so it is the one that stops the "
        f"request: expected ('stop', 'ab'), got ({finish_reason!r}, {stop_reason!r})"
    )
    assert streamed == "xyz", (
        f"without include_stop_str_in_output the text ends before the stop string: the deltas "
        f"must add up to 'xyz', got {streamed!r}"
    )


def test_a_stop_in_the_step_the_core_ended_the_request_is_not_aborted():
    """Rule: a stop string wins «even if the core finished it for another reason in this step», but «Not those
    the core finished itself» go into `reqs_to_abort`."""
    frontend = Frontend()
    frontend.add("r", SamplingParams(stop=["b"]))
    frontend.step(frontend.output("r", "x"))
    # The core ended the request (max_tokens) in the same step that completed the stop string.
    processed = frontend.step(frontend.output("r", "ab", finish_reason="length"))
    assert one_completion(processed) == ("xa", "stop", "b"), (
        f"a stop string found in the step the core ended the request (max_tokens) still decides how "
        f"it ends: ('xa', 'stop', 'b'), got {one_completion(processed)}"
    )
    assert processed.reqs_to_abort == [], (
        f"the core finished 'r' itself and freed it already: it must not be asked to abort it "
        f"(an ABORT sent after the id is reused would end the new request); got {processed.reqs_to_abort}"
    )


def test_only_the_request_a_stop_string_ended_is_aborted_and_its_late_output_dropped():
    """Rule: «`reqs_to_abort` lists the requests a stop string finished here while the core still runs them»;
    «One of a request this processor no longer holds is dropped»."""
    frontend = Frontend()
    frontend.add("stopped", SamplingParams(stop=["!"]))
    frontend.add("running", SamplingParams(stop=["!"]))
    frontend.add("done", SamplingParams(stop=["!"]))
    processed = frontend.step(
        frontend.output("stopped", "a!"), frontend.output("running", "b"),
        frontend.output("done", "c", finish_reason="length"),
    )  # fmt: skip
    assert processed.reqs_to_abort == ["stopped"], (
        f"only 'stopped' was ended by a stop string while the core runs it ('done' the core ended "
        f"itself): reqs_to_abort must be ['stopped'], got {processed.reqs_to_abort}"
    )
    assert [o.request_id for o in processed.request_outputs] == ["stopped", "running", "done"], (
        "each request that got tokens gets its RequestOutput, in the order of the core's outputs"
    )
    assert frontend.processor.get_num_unfinished_requests() == 1, (
        f"'stopped' and 'done' finished, so only 'running' is left; the processor still holds "
        f"{frontend.processor.get_num_unfinished_requests()} requests: free a finished request's state"
    )
    # The core ran one more step before the abort reached it: that output comes, and is dropped.
    try:
        late = frontend.processor.process_outputs(
            [frontend.output("stopped", "z"), frontend.output("running", "d")]
        )
    except KeyError as error:
        pytest.fail(
            f"an output for a request that has already finished here must be dropped, not raise {error!r}"
        )
    assert [o.request_id for o in late.request_outputs] == ["running"], (
        "an output for a request that has already finished here (the core had not seen its abort "
        "yet) must be dropped: no RequestOutput for it"
    )


# ----------------------------------------------------------------------------- n > 1 and output kinds


def test_final_only_parent_waits_for_all_its_children():
    """Rule: «a FINAL_ONLY request gets only its final one, once all n completions are finished»."""
    frontend = Frontend()
    frontend.add("p", SamplingParams(n=2, output_kind=FINAL_ONLY), prompt_len=20)
    # Child 0 found 16 of the prompt's tokens cached; child 1, admitted before they were, none.
    processed = frontend.step(
        frontend.output("0_p", "a", finish_reason="length", num_cached_tokens=16), frontend.output("1_p", "b")
    )
    assert processed.request_outputs == [], (
        "a FINAL_ONLY request gets no output until all its n completions are finished; child 1 still runs"
    )
    assert frontend.processor.get_num_unfinished_requests() == 1, (
        "child 0 finished: its state must be freed, child 1's kept"
    )
    assert "p" in frontend.processor.parent_requests, (
        "the parent request must stay until its last child finishes (child 1 still runs)"
    )
    processed = frontend.step(frontend.output("1_p", "c", finish_reason="length"))
    assert len(processed.request_outputs) == 1, (
        "the last child finished: the parent's one final output is due"
    )
    (output,) = processed.request_outputs
    got = [(c.index, c.text, c.finish_reason) for c in output.outputs]
    expected = ("p", True, [(0, "a", "length"), (1, "bc", "length")])
    assert (output.request_id, output.finished, got) == expected, (
        f"the final output is the parent's ('p', finished) with both completions in index order, "
        f"each with all its text: got {output.request_id!r}, finished={output.finished}, {got}"
    )
    assert output.num_cached_tokens == 16, (
        f"the parent reports the most prompt tokens any child found cached, 16: got {output.num_cached_tokens}"
    )
    assert not frontend.processor.parent_requests and not frontend.processor.has_unfinished_requests(), (
        "every child finished: the parent's state must be freed too"
    )


def test_children_in_one_step_make_one_output_for_their_parent():
    """Rule: «one `RequestOutput` per user request that got output in this step, in the order of their first
    outputs»."""
    frontend = Frontend()
    frontend.add("p", SamplingParams(n=2, output_kind=DELTA))
    streams = [[], []]
    steps = [
        [frontend.output("0_p", "a"), frontend.output("1_p", "b")],
        [frontend.output("1_p", "c")],
        [
            frontend.output("0_p", "d", finish_reason="length"),
            frontend.output("1_p", "e", finish_reason="length"),
        ],
    ]
    for i, outputs in enumerate(steps):
        processed = frontend.step(*outputs)
        assert [o.request_id for o in processed.request_outputs] == ["p"], (
            f"step {i}: the children of 'p' make one RequestOutput for their parent per step, got "
            f"{[o.request_id for o in processed.request_outputs]}"
        )
        for completion in processed.request_outputs[0].outputs:
            streams[completion.index].append(completion.text)
    assert ["".join(s) for s in streams] == ["ad", "bce"], (
        f"each completion's deltas must add up to its text: got {[''.join(s) for s in streams]}"
    )
    assert processed.request_outputs[0].finished and not frontend.processor.parent_requests, (
        "both children finished: the parent's last output is finished and its state freed"
    )


def test_final_only_single_request_and_logprobs():
    """Rule: «a FINAL_ONLY request gets only its final one»: «every token id (and logprob) so far»."""
    frontend = Frontend()
    frontend.add("r", SamplingParams(logprobs=1, output_kind=FINAL_ONLY))
    first = EngineCoreOutput("r", frontend.tokenizer.ids("a"), [{1: -0.5}])
    assert frontend.step(first).request_outputs == [], "a running FINAL_ONLY request gets no output"
    last = EngineCoreOutput(
        "r", frontend.tokenizer.ids("b", "c"), [{2: -1.0}, {3: -2.0}], finish_reason="length"
    )
    (output,) = frontend.step(last).request_outputs
    (completion,) = output.outputs
    assert (completion.text, completion.token_ids) == ("abc", frontend.tokenizer.ids("a", "b", "c")), (
        f"the final output holds all the text and token ids: got {completion.text!r}, {completion.token_ids}"
    )
    assert completion.logprobs == [{1: -0.5}, {2: -1.0}, {3: -2.0}], (
        f"a request that asked for logprobs gets one entry per token, gathered over the steps: "
        f"got {completion.logprobs}"
    )


# ----------------------------------------------------------------------------- stats


def test_each_output_is_counted_in_the_iteration_stats():
    """Rule: «count it in `iteration_stats`, if given (`IterationStats.update_from_output`)», every output of
    the step."""
    frontend = Frontend()
    frontend.add("r1", SamplingParams(), prompt_len=3)
    frontend.add("r2", SamplingParams(), prompt_len=5)
    first = IterationStats()
    frontend.step(frontend.output("r1", "a", "b"), stats=first)  # two tokens: a speculative step
    counts = (first.num_prompt_tokens, first.num_generation_tokens, len(first.time_to_first_tokens_iter))
    assert counts == (3, 2, 1), (
        f"r1 got its first 2 tokens: the step counts its 3 prompt tokens, 2 generated tokens and "
        f"one time to first token; got (prompt, generated, TTFTs) = {counts}"
    )
    second = IterationStats()
    frontend.step(frontend.output("r1", "c"), frontend.output("r2", "d"), stats=second)
    counts = (
        second.num_prompt_tokens, second.num_generation_tokens,
        len(second.time_to_first_tokens_iter), len(second.inter_token_latencies_iter),
    )  # fmt: skip
    assert counts == (5, 2, 1, 1), (
        f"r2's first token (its 5 prompt tokens, a TTFT) and r1's next one (an inter-token latency): "
        f"expected (prompt, generated, TTFTs, ITLs) = (5, 2, 1, 1), got {counts}"
    )


# ----------------------------------------------------------------------------- brute force


def brute_force(steps: list[list[str]], stop: list[str], include: bool) -> tuple[int, str, str | None]:
    """(the step the request ends in, its final text, the stop string that ended it or None):
    decode everything after each step and cut at the first stop string in it."""
    text = ""
    for k, step in enumerate(steps):
        text += "".join(step)
        hits = [(text.find(s), i, s) for i, s in enumerate(stop) if s in text]
        if hits:
            idx, _, s = min(hits)
            return k, text[: idx + len(s)] if include else text[:idx], s
    return len(steps) - 1, text, None


# Two letters make stop strings recur and straddle steps often; a piece may be empty (a token
# that prints nothing yet).
pieces = st.text(alphabet="ab", max_size=2)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.lists(pieces, min_size=1, max_size=3), min_size=1, max_size=10),
    stop=st.lists(st.text(alphabet="ab", min_size=2, max_size=4), min_size=1, max_size=2),
    include=st.booleans(),
    kind=st.sampled_from([DELTA, CUMULATIVE]),
)
def test_random_streams_agree_with_decoding_everything_and_cutting_at_the_first_stop(
    steps, stop, include, kind
):
    """Rule: «look for a stop string that the new text completes; it may have begun in an earlier step»: over
    random streams, the text is the whole decoded text cut at the first stop string."""
    frontend = Frontend()
    frontend.add("r", SamplingParams(stop=stop, include_stop_str_in_output=include, output_kind=kind))
    end, final_text, stop_str = brute_force(steps, stop, include)
    hold = 0 if include else max(map(len, stop)) - 1
    shown, text_so_far = "", ""
    for k, step in enumerate(steps[: end + 1]):
        core_done = k == len(steps) - 1
        processed = frontend.step(frontend.output("r", *step, finish_reason="length" if core_done else None))
        text_so_far += "".join(step)
        (output,) = processed.request_outputs
        (completion,) = output.outputs
        shown = shown + completion.text if kind == DELTA else completion.text
        where = f"stop={stop}, include_stop_str_in_output={include}, {kind.name}, steps {steps[: k + 1]}"
        if k < end:
            assert completion.finish_reason is None, (
                f"{where}: no stop string is complete yet, the request runs on"
            )
            expected = text_so_far[: max(len(text_so_far) - hold, 0)]
            assert shown == expected, (
                f"{where}: a running request shows its text less the last {hold} character(s), where a "
                f"stop string may have begun: expected {expected!r}, shown {shown!r}"
            )
            assert processed.reqs_to_abort == [], f"{where}: no stop string ended the request: abort nothing"
    expected_end = (final_text, "length" if stop_str is None else "stop", stop_str)
    got_end = (shown, completion.finish_reason, completion.stop_reason)
    assert got_end == expected_end, (
        f"{where}: expected the request to end with (text, finish reason, stop reason) = {expected_end}, "
        f"got {got_end}"
    )
    expected_abort = ["r"] if stop_str is not None and end < len(steps) - 1 else []
    assert processed.reqs_to_abort == expected_abort, (
        f"{where}: reqs_to_abort must be {expected_abort} (only a request a stop string ended while the "
        f"core still runs it), got {processed.reqs_to_abort}"
    )
    assert not frontend.processor.has_unfinished_requests() and not frontend.processor.parent_requests, (
        f"{where}: the request finished: its state must be freed"
    )


# ----------------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def llm():
    from nano_v1 import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return LLM(max_model_len=256, num_gpu_blocks_override=64, dtype="float32")


def test_engine_stops_at_a_stop_string_and_the_core_lets_go(llm):
    """Rule: «the core would otherwise go on generating, and holding their KV blocks, until max_tokens»:
    through the engine, a stop string ends the request and the core frees it."""
    prompt = "def fibonacci(n):\n"
    (whole,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    token_ids = whole.outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode(token_ids[:k]) for k in range(len(token_ids) + 1)]
    stop = texts[-1][4:7]  # three characters from inside the text
    end = next(k for k, text in enumerate(texts) if stop in text)
    (stopped,) = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]), use_tqdm=False
    )
    completion = stopped.outputs[0]
    where = f"greedy decoding of {prompt!r} with stop={[stop]!r}"
    reasons = (completion.finish_reason, completion.stop_reason)
    assert reasons == ("stop", stop), f"{where} must end at the stop string: got {reasons}"
    expected_text = texts[end][: texts[end].index(stop)]
    assert (completion.text, completion.token_ids) == (expected_text, token_ids[:end]), (
        f"{where} must end after token {end}, whose text completes the stop string, with the text "
        f"before it, {expected_text!r}: got {completion.text!r} after {len(completion.token_ids)} tokens"
    )
    engine_core = llm.llm_engine.engine_core
    assert engine_core.call_utility("get_num_unfinished_requests") == 0, (
        "a stop string ended the request in the frontend, but the engine core still runs it: "
        "it must be in reqs_to_abort"
    )
    assert engine_core.call_utility("get_kv_cache_usage") == 0.0, "every KV block must be free afterwards"
