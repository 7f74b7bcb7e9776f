"""Directed tests for assignment tasks whose details the chapter suites do not pin down.

Each test carries its chapter marker and its task marker, so `pytest -m ch04` runs it and
`grade` counts it for the task. The other tests of a task live in the chapter's own test
file (test_kv_cache.py, test_scheduler.py, test_input_batch.py) under the same marker.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.scheduler import FakeModelRunner, make_scheduler

from nano_v1.core.sched.utils import check_stop
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.block_table import BlockTable

EOS = 2


@pytest.mark.ch04
@pytest.mark.ch04_t2
def test_long_prefill_threshold_caps_every_chunk_of_a_running_request():
    """Rule: «`long_prefill_token_threshold` (0: none) caps every chunk, a running request's too»."""
    sched = make_scheduler(64, 4, budget=64, max_seqs=4, max_model_len=100, caching=False)
    sched.long_prefill_token_threshold = 4
    runner = FakeModelRunner(4)
    sched.add_request(Request("a", list(range(1, 11)), SamplingParams(max_tokens=2, ignore_eos=True), None))
    # The first chunk is admitted by the waiting pass; the rest come from the running pass.
    for step, chunk in enumerate([4, 4, 2, 1]):
        so = sched.schedule()
        assert so.num_scheduled_tokens == {"a": chunk}, (
            f"step {step} of a 10-token prompt under long_prefill_token_threshold = 4 scheduled "
            f"{so.num_scheduled_tokens}; expected {chunk} tokens (chunks of 4, 4, 2, then one decode)"
        )
        sched.update_from_output(so, runner.execute_model(so))
    assert not sched.has_unfinished_requests(), "the request must finish after its 2 output tokens"


# A waiting request's computed tokens are its prefix-cache hits, which the scheduler passes
# in; request.num_computed_tokens is still 0. A running request's are its own.
@pytest.mark.ch04
@pytest.mark.ch04_t2
@pytest.mark.parametrize(
    "waiting, prompt_len, num_outputs, num_drafts, num_computed, threshold, expected, why",
    [
        pytest.param(
            False, 6, 1, 0, 6, 0, 1, "a decoding request lacks the KV of its last sampled token only", id="decode"
        ),
        pytest.param(True, 10, 0, 0, 0, 0, 10, "a new 10-token prompt lacks all 10 tokens", id="prompt"),
        pytest.param(False, 10, 0, 0, 4, 0, 6, "a prompt with 4 of 10 tokens computed lacks 6", id="rest_of_prompt"),
        pytest.param(
            False, 6, 1, 3, 6, 0, 4, "3 drafts are verified in the step that computes the last token: 1 + 3 tokens",
            id="drafts",
        ),
        pytest.param(
            True, 10, 0, 0, 8, 0, 2,
            "a waiting request with 8 tokens hit in the prefix cache counts from the num_computed_tokens "
            "given, not request.num_computed_tokens (still 0): 2 tokens",
            id="cache_hits",
        ),
        pytest.param(
            True, 10, 0, 0, 0, 4, 4, "long_prefill_token_threshold = 4 caps a 10-token prompt at 4", id="threshold"
        ),
        pytest.param(
            False, 6, 1, 0, 6, 4, 1, "a threshold of 4 leaves a 1-token decode alone", id="threshold_not_reached"
        ),
        pytest.param(
            True, 10, 0, 0, 0, 0, 10, "long_prefill_token_threshold = 0 means no threshold", id="no_threshold"
        ),
        pytest.param(
            False, 16, 1, 5, 16, 0, 3,
            "with 16 of max_model_len = 20 positions computed, 3 more tokens fit: the token sampled after "
            "them takes position 19, the last one",
            id="context_window",
        ),
    ],
)  # fmt: skip
def test_get_num_new_tokens(
    waiting, prompt_len, num_outputs, num_drafts, num_computed, threshold, expected, why
):
    """Rule: «What it lacks: its tokens, drafts included», past `num_computed_tokens`;
    «`long_prefill_token_threshold` (0: none) caps every chunk»; «the token sampled after them must
    stay below `max_model_len`»."""
    sched = make_scheduler(64, 4, budget=64, max_seqs=4, max_model_len=20, caching=False)
    sched.long_prefill_token_threshold = threshold
    request = Request("r", [5] * prompt_len, SamplingParams(max_tokens=10, ignore_eos=True), None)
    for _ in range(num_outputs):
        request.append_output_token_ids(7)
    request.spec_token_ids = [8] * num_drafts
    request.num_computed_tokens = 0 if waiting else num_computed
    num_new_tokens = sched._get_num_new_tokens(request, num_computed)
    assert num_new_tokens == expected, f"{why}; got {num_new_tokens}"


def decode(prompt_len: int, outputs: list[int], max_model_len: int, why: str, **params) -> Request:
    """A request after sampling `outputs`, with check_stop run after each token like the scheduler does.

    `why` says what the case is about, for the message when check_stop stops it too early.
    """
    request = Request("r", [5] * prompt_len, SamplingParams(**params), eos_token_id=EOS)
    for i, token in enumerate(outputs):
        assert not request.is_finished(), (
            f"check_stop finished the request ({request.status.name}) after output {i} of {outputs}, "
            f"too early: {why}"
        )
        request.append_output_token_ids(token)
        check_stop(request, max_model_len)
    return request


@pytest.mark.ch04
@pytest.mark.ch04_t1
@pytest.mark.parametrize(
    "prompt_len, outputs, max_model_len, params, status, stop_reason, why",
    [
        pytest.param(
            3, [7, 8, EOS], 100, dict(max_tokens=10), RequestStatus.FINISHED_STOPPED, None,
            "EOS stops the request, with no stop_reason (that is for stop token ids)", id="eos",
        ),
        pytest.param(
            3, [EOS, EOS, 9], 100, dict(max_tokens=3, ignore_eos=True), RequestStatus.FINISHED_LENGTH_CAPPED, None,
            "with ignore_eos, EOS is an ordinary token: the request runs until max_tokens", id="ignore_eos",
        ),
        # min_tokens is the sampler's to hold (it masks stop tokens until then); a stop token
        # that check_stop does see ends the request (vLLM v0.11.0).
        pytest.param(
            3, [EOS], 100, dict(max_tokens=10, min_tokens=3), RequestStatus.FINISHED_STOPPED, None,
            "check_stop leaves min_tokens to the sampler: an EOS it sees stops the request", id="eos_min_tokens",
        ),
        pytest.param(
            3, [11, 12], 100, dict(max_tokens=10, stop_token_ids=[12]), RequestStatus.FINISHED_STOPPED, 12,
            "a stop token id stops the request and is its stop_reason", id="stop_token",
        ),
        pytest.param(
            3, [11, 12], 100, dict(max_tokens=10, min_tokens=5, stop_token_ids=[12]), RequestStatus.FINISHED_STOPPED,
            12, "a stop token id check_stop sees stops the request, min_tokens or not", id="stop_token_min_tokens",
        ),
        pytest.param(
            3, [EOS, 12], 100, dict(max_tokens=10, ignore_eos=True, stop_token_ids=[12]),
            RequestStatus.FINISHED_STOPPED, 12, "ignore_eos ignores EOS only: a stop token id still stops",
            id="ignore_eos_stop_token",
        ),
        pytest.param(
            3, [7, EOS], 100, dict(max_tokens=2), RequestStatus.FINISHED_LENGTH_CAPPED, None,
            "an EOS sampled as the max_tokens-th token: the length cap comes first", id="length_before_eos",
        ),
        pytest.param(
            5, [7, 8], 7, dict(max_tokens=10, min_tokens=5), RequestStatus.FINISHED_LENGTH_CAPPED, None,
            "5 prompt + 2 output tokens reach max_model_len = 7: the context window caps the request",
            id="max_model_len",
        ),
    ],
)  # fmt: skip
def test_check_stop(prompt_len, outputs, max_model_len, params, status, stop_reason, why):
    """Rule: «A length limit (`request.num_tokens` reaching `max_model_len`, or `max_tokens` output tokens)
    finishes it FINISHED_LENGTH_CAPPED, and outranks a stop»; «the EOS token (unless `ignore_eos`)» and
    «a stop token id» finish it FINISHED_STOPPED, «with `stop_reason` set to that id» for a stop token
    only."""
    request = decode(prompt_len, outputs, max_model_len, why, **params)
    assert (request.status, request.stop_reason) == (status, stop_reason), (
        f"{why}: expected {status.name} with stop_reason {stop_reason}, "
        f"got {request.status.name} with stop_reason {request.stop_reason}"
    )


@pytest.mark.ch04
@pytest.mark.ch04_t1
def test_check_stop_keeps_an_unfinished_request_running():
    """Rule: «A request that goes on keeps its status, and the answer is False»."""
    request = decode(
        3, [7, 8, 9], 100, "no limit is reached and no stop token sampled", max_tokens=10, stop_token_ids=[12]
    )
    assert request.status == RequestStatus.WAITING, (
        f"check_stop must leave a live request's status alone, but set {request.status.name}"
    )
    assert not check_stop(request, 100), "check_stop returns False for a request that goes on"


@pytest.mark.ch05
@pytest.mark.ch05_t1
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_compute_slot_mapping_matches_a_loop(block_size):
    """Rule: «Cache slot of each scheduled token: block_table[req, pos // B] * B + pos % B», with «no loop»."""
    rng = np.random.default_rng(block_size)
    max_num_reqs, max_blocks = 5, 7
    table = BlockTable(block_size, max_num_reqs, max_blocks, 64, pin_memory=False, device=torch.device("cpu"))
    rows = [rng.permutation(100)[: rng.integers(1, max_blocks + 1)].tolist() for _ in range(max_num_reqs)]
    for row_idx, block_ids in enumerate(rows):
        table.add_row(block_ids, row_idx)
    req_indices = rng.integers(0, max_num_reqs, size=40)
    positions = np.array([rng.integers(0, len(rows[r]) * block_size) for r in req_indices])
    expected = [
        rows[r][p // block_size] * block_size + p % block_size for r, p in zip(req_indices, positions)
    ]
    table.compute_slot_mapping(req_indices, positions)
    got = table.slot_mapping.np[:40].tolist()
    wrong = [i for i in range(40) if got[i] != expected[i]]
    if wrong:
        i = wrong[0]
        r, pos = req_indices[i], positions[i]
        raise AssertionError(
            f"{len(wrong)} of 40 slots are wrong; token {i} (row {r}, position {pos}, block size {block_size}) "
            f"is at offset {pos % block_size} of its row's block {pos // block_size}, block id "
            f"{rows[r][pos // block_size]}: slot {expected[i]}, not {got[i]}"
        )
