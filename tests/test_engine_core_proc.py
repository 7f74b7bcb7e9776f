"""The engine core in its own process: messages, the sync client, failures.

Oracle: the in-process engine (tested against transformers in test_model.py/test_llm.py)
must produce exactly what the multiprocess one produces.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

# The engine core's process talks ZMQ and msgpack; the GPU image has neither package.
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from test_llm import prefix_cache_counters, shared_prefix_prompts

from nano_v1 import LLM, SamplingParams
from nano_v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    UtilityOutput,
)
from nano_v1.engine.core_client import InprocClient, SyncMPClient
from nano_v1.engine.detokenizer import IncrementalDetokenizer
from nano_v1.serial_utils import MsgpackDecoder, MsgpackEncoder

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
