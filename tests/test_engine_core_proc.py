"""The engine core in its own process: messages, the sync client, failures.

Oracle: the in-process engine (tested against transformers in test_model.py/test_llm.py)
must produce exactly what the multiprocess one produces.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# The engine core's process talks ZMQ and msgpack; the GPU image has neither package.
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from helpers.engine_core import LoopOnlyCore, QueueOnlyCore, start_input_loop, wait
from helpers.generation import prefix_cache_counters, shared_prefix_prompts

from nano_v1 import LLM, SamplingParams
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from nano_v1.engine.core_client import InprocClient, SyncMPClient
from nano_v1.engine.detokenizer import IncrementalDetokenizer
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.engine.output_processor import OutputProcessor
from nano_v1.sampling_params import RequestOutputKind
from nano_v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from nano_v1.utils import get_mp_context

pytestmark = pytest.mark.ch09

ENGINE_KWARGS = dict(max_model_len=256, num_gpu_blocks_override=128, dtype="float32")
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]


@pytest.fixture(scope="module")
def llms():
    """The same engine twice: in this process, and with the core in a child process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        inproc = LLM(**ENGINE_KWARGS)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        multiproc = LLM(**ENGINE_KWARGS)
    assert isinstance(inproc.llm_engine.engine_core, InprocClient)
    assert isinstance(multiproc.llm_engine.engine_core, SyncMPClient)
    yield inproc, multiproc
    multiproc.llm_engine.shutdown()


def test_request_round_trips_through_msgpack():
    params = SamplingParams(n=1, temperature=0.5, stop=["\n\n"], seed=3)
    params.all_stop_token_ids = {0, 7}  # filled by the Processor; must survive the trip
    request = EngineCoreRequest("r1", [1, 2, 3], params, eos_token_id=0, arrival_time=12.5, priority=1)
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert decoded == request and decoded.sampling_params.all_stop_token_ids == {0, 7}


@dataclasses.dataclass
class Stats:
    num_draft_tokens: int
    accepted_per_pos: list[int]


@dataclasses.dataclass
class WithStats:
    outputs: EngineCoreOutputs
    scheduler_stats: Stats | None = None


def test_outputs_round_trip_including_a_nested_dataclass():
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [5], [{5: -0.25, 9: -1.5}], finish_reason="stop", stop_reason=5)],
        utility_output=UtilityOutput(call_id=2**63, result=[1, 2]),
    )
    assert MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs)) == outputs
    # A field added later (say, scheduler stats) that is itself a dataclass travels as well.
    message = WithStats(outputs, Stats(4, [3, 1]))
    assert MsgpackDecoder(WithStats).decode(MsgpackEncoder().encode(message)) == message


def test_detokenizer_never_splits_a_multibyte_character(llms):
    tokenizer = llms[0].get_tokenizer()
    text = "print('héllo 世界 ✓ ok')"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # The test means something only if some character spans several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    prompt_ids = tokenizer.encode("x = ", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.update([t]) for t in token_ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(token_ids) == text


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=8),
        SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop=["(", ":"]),
    ],
    ids=["greedy", "n2-seeded", "stop-strings"],
)
def test_multiprocess_matches_in_process(llms, params):
    inproc, multiproc = llms
    expected = inproc.generate(PROMPTS, params, use_tqdm=False)
    got = multiproc.generate(PROMPTS, params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert [(c.text, c.token_ids, c.finish_reason) for c in g.outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in e.outputs
        ]
    if params.stop:
        assert any(
            c.finish_reason == "stop" and isinstance(c.stop_reason, str) for o in got for c in o.outputs
        )
    # Stop strings end requests in the frontend; the core must have been told to abort them.
    engine_core = multiproc.llm_engine.engine_core
    assert engine_core.call_utility("get_num_unfinished_requests") == 0
    assert engine_core.call_utility("get_kv_cache_usage") == 0.0


def test_prefix_cache_metrics_cross_the_process_boundary(monkeypatch):
    """Each step's statistics ride on its outputs, also from steps that sample nothing."""
    # A 32-token budget chunks the prompts: some requests are admitted in steps that
    # finish no prompt, whose outputs are statistics only.
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(3)]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    counters = []
    for multiprocessing in ("0", "1"):
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
        llm = LLM(**ENGINE_KWARGS, max_num_batched_tokens=32)
        assert isinstance(llm.llm_engine.engine_core, SyncMPClient) == (multiprocessing == "1")
        try:
            llm.generate(prompts, params, use_tqdm=False)
            counters.append(prefix_cache_counters(llm))
        finally:
            llm.llm_engine.shutdown()
    queries, hits = counters[0]
    assert queries == sum(len(p["prompt_token_ids"]) for p in prompts) and hits > 0
    assert counters[1] == counters[0]


def test_startup_error_in_child_is_raised_not_hung(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="max_model_len"):  # 3 usable blocks of 16 < 256 tokens
        LLM(max_model_len=256, num_gpu_blocks_override=4, dtype="float32")


def test_killed_engine_core_fails_generate_fast(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(**ENGINE_KWARGS)
    try:
        proc = llm.llm_engine.engine_core.resources.proc
        params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
        killer = threading.Timer(0.2, os.kill, args=(proc.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="exit code -9"):
            llm.generate(PROMPTS, params, use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[0], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


# ---------------------------------------------------------------- the busy loop, without sockets
@pytest.mark.ch09_t1
def test_idle_core_waits_for_a_request_without_spinning():
    """Rule: «Idle (no unfinished request and no step in flight): block on the input queue until there is
    work», handling each message «(an abort leaves the core idle)», «without spinning»."""
    core = LoopOnlyCore()
    calls = 0
    has_unfinished = core.scheduler.has_unfinished_requests

    def counting() -> bool:
        nonlocal calls
        calls += 1
        return has_unfinished()

    core.scheduler.has_unfinished_requests = counting
    loop, errors = start_input_loop(core)
    wait(loop, errors, 0.3)
    assert loop.is_alive(), "an idle core must wait for a request, not return to step an empty batch"
    assert calls <= 2, (
        f"an idle core must block on the input queue, not spin: it asked {calls} times in 0.3 s"
    )
    core.input_queue.put((EngineCoreRequestType.ABORT, ["gone"]))
    wait(loop, errors, 0.1)
    assert loop.is_alive(), "an abort leaves an idle core idle: it must keep waiting"
    core.input_queue.put((EngineCoreRequestType.ADD, "r0"))
    wait(loop, errors, 5)
    assert not loop.is_alive(), "a request arrived: the core must stop waiting and go on to step it"
    assert (core.added, core.aborted) == (["r0"], ["gone"]), "both messages must be handled, in order"


@pytest.mark.ch09_t1
def test_busy_core_takes_every_queued_message_and_never_waits():
    """Rule: «Busy: take every message already queued, and never wait for more»."""
    core = LoopOnlyCore()
    core.added.append("running")
    for i in range(3):
        core.input_queue.put((EngineCoreRequestType.ADD, f"r{i}"))
    loop, errors = start_input_loop(core)
    wait(loop, errors, 5)
    assert not loop.is_alive(), "a busy core must not wait for input: its requests need the next step"
    assert core.added == ["running", "r0", "r1", "r2"], (
        f"a busy core must take every message queued before its step, got {core.added[1:]}"
    )
    loop, errors = start_input_loop(core)
    wait(loop, errors, 5)
    assert not loop.is_alive(), "with nothing queued, a busy core must go straight on to its step"


@pytest.mark.ch09_t2
def test_client_requests_add_abort_and_call_utilities():
    """Rule: «ADD adds the request and ABORT aborts the listed ids: neither is answered»; «UTILITY `(call_id,
    method_name, args)` calls the core's method by name and answers with a `UtilityOutput` under its
    call id»."""
    core = QueueOnlyCore()
    core._handle_client_request(EngineCoreRequestType.ADD, "r0")
    core._handle_client_request(EngineCoreRequestType.ABORT, ["r0", "r1"])
    assert (core.added, core.aborted) == (["r0"], ["r0", "r1"]), (
        f"ADD must add the request and ABORT abort the listed ids; added {core.added}, aborted {core.aborted}"
    )
    assert core.output_queue.empty(), "ADD and ABORT have no answer"
    core._handle_client_request(EngineCoreRequestType.UTILITY, (7, "double", (21,)))
    answer = core.output_queue.get_nowait()
    assert answer == EngineCoreOutputs(utility_output=UtilityOutput(7, result=42)), (
        f"a utility call (7, 'double', (21,)) must be answered with its call id and result 42, got {answer}"
    )


@pytest.mark.ch09_t2
def test_a_failing_utility_call_is_answered_and_the_core_lives_on():
    """Rule: «if the call raised, a `failure_message` that names the method»; «A failed call is answered, not
    fatal: the core goes on»."""
    core = QueueOnlyCore()
    for call_id, method, args in [(1, "double", ()), (2, "no_such_method", ())]:
        core._handle_client_request(EngineCoreRequestType.UTILITY, (call_id, method, args))
        answer = core.output_queue.get_nowait().utility_output
        assert (answer.call_id, answer.result) == (call_id, None), (
            f"a failed call must still be answered, under its own call id {call_id}: got {answer}"
        )
        assert answer.failure_message and method in answer.failure_message, (
            f"the answer to a failed call must say which call failed: {answer.failure_message!r}"
        )
    core._handle_client_request(EngineCoreRequestType.UTILITY, (3, "double", (1,)))
    assert core.output_queue.get_nowait().utility_output == UtilityOutput(3, result=2), (
        "after failed calls the core must go on answering"
    )
@pytest.mark.ch09_t3
@pytest.mark.parametrize("stop_len", range(1, 13))
def test_streamed_deltas_add_up_to_the_text_whatever_the_stop_string_length(stop_len):
    """Rule: «DELTA sends what is new»: «the text so far less a running request's held-back tail», so the
    deltas add up to the text and never send a character twice.

    The held-back tail (a stop string may have begun there) never sends a character twice.

    Regression: with a stop string of 5+ characters, the held-back slice went negative
    while the text was short, the sent offset moved backwards, and characters repeated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    token_ids = tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else 1", add_special_tokens=False)
    params = SamplingParams(stop=["§" * stop_len], output_kind=RequestOutputKind.DELTA)  # never matches
    processor = OutputProcessor(tokenizer)
    request = EngineCoreRequest("r", [5, 6], params, eos_token_id=None, arrival_time=0.0)
    processor.add_request("r", None, [request])
    streamed = ""
    for i, token_id in enumerate(token_ids):
        finish_reason = "length" if i == len(token_ids) - 1 else None
        outputs = processor.process_outputs([EngineCoreOutput("r", [token_id], finish_reason=finish_reason)])
        (output,) = outputs.request_outputs
        streamed += output.outputs[0].text
    assert streamed == tokenizer.decode(token_ids), (
        f"with a {stop_len}-character stop string that never matches, the streamed deltas must add up "
        f"to the whole text, each character sent once: got {streamed!r}"
    )


def test_a_burst_of_3000_requests_all_finish(llms, monkeypatch):
    """Regression: libzmq's default queue limit (1,000 messages) made the ROUTER drop requests silently.

    The engine core is stopped (SIGSTOP) while the 3,000 requests are sent, so they all wait in
    the sockets' queues, as they do when a burst (or one request with a large `n`) arrives faster
    than the core reads; it continues once the last one is sent.
    """
    _, multiproc = llms
    pid = multiproc.llm_engine.engine_core.resources.proc.pid
    run_engine = multiproc._run_engine

    def continue_then_run(*args, **kwargs):
        os.kill(pid, signal.SIGCONT)
        return run_engine(*args, **kwargs)

    monkeypatch.setattr(multiproc, "_run_engine", continue_then_run)
    # A lost request would leave generate() waiting forever: after 60 s, end it with an error.
    guard = threading.Timer(60, os.kill, args=(pid, signal.SIGKILL))
    os.kill(pid, signal.SIGSTOP)
    guard.start()
    try:
        outputs = multiproc.generate(
            [{"prompt_token_ids": [5 + i % 50]} for i in range(3000)],
            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        os.kill(pid, signal.SIGCONT)
        guard.cancel()
    assert len(outputs) == 3000 and all(len(o.outputs[0].token_ids) == 1 for o in outputs)


def test_utility_call_times_out_instead_of_hanging(llms, monkeypatch):
    """A stopped engine core: the utility call fails after VLLM_RPC_TIMEOUT, and later calls still work."""
    _, multiproc = llms
    engine_core = multiproc.llm_engine.engine_core
    monkeypatch.setenv("VLLM_RPC_TIMEOUT", "1000")
    raised: list[BaseException] = []

    def call() -> None:
        try:
            engine_core.call_utility("get_num_unfinished_requests")
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            raised.append(e)

    os.kill(engine_core.resources.proc.pid, signal.SIGSTOP)
    try:
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(timeout=15)  # without a timeout the call would wait forever
        assert not caller.is_alive(), "the utility call is still waiting"
    finally:
        os.kill(engine_core.resources.proc.pid, signal.SIGCONT)
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised
    assert "get_num_unfinished_requests" in str(raised[0])
    # The late answer to the abandoned call is dropped; the next call gets its own.
    monkeypatch.setenv("VLLM_RPC_TIMEOUT", "60000")
    assert engine_core.call_utility("get_kv_cache_usage") == 0.0


README_EXAMPLE = Path(__file__).resolve().parents[1] / "README.md"


def readme_first_example() -> str:
    """README's first Python example, with fewer tokens to keep the test short."""
    text = README_EXAMPLE.read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "LLM()" in code and "__main__" not in code
    return code.replace("max_tokens=64", "max_tokens=4")


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "spawn"], ids=["default", "spawn"])
def test_readme_example_runs_as_a_plain_script(tmp_path, method):
    """No `if __name__ == "__main__":` guard, as most vLLM users write it: it must simply work.

    Regression: the forkserver child re-ran the script, built a second engine inside the
    child, died, and the parent failed with EOFError.
    """
    script = tmp_path / "example.py"
    script.write_text(readme_first_example())
    # The script's own defaults: the engine core in a process of its own, started the default way.
    defaults = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD")
    env = {k: v for k, v in os.environ.items() if k not in defaults}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(README_EXAMPLE.parent), env.get("PYTHONPATH")]))
    if method is not None:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = method
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("import os") for line in lines)
    assert any(line.startswith("class Stack:") for line in lines)


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_worker_multiproc_method_is_honoured(monkeypatch, method):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", method)
    assert get_mp_context().get_start_method() == method


def test_fork_after_cuda_initialised_spawns_instead(monkeypatch):
    """vLLM's rule: a forked child cannot use the parent's CUDA context, so spawn then."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setattr("nano_v1.utils.cuda_is_initialized", lambda: True)
    assert get_mp_context().get_start_method() == "spawn"
