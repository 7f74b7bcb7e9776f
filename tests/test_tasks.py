"""Directed tests for assignment tasks whose details the chapter suites do not pin down.

Each test carries its chapter marker and its task marker, so `pytest -m ch04` runs it and
`grade` counts it for the task. The other tests of a task live in the chapter's own test
file (test_kv_cache.py, test_scheduler.py, test_input_batch.py) under the same marker.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_scheduler
from test_scheduler import FakeModelRunner

from nano_v1.core.sched.utils import check_stop
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.block_table import BlockTable

EOS = 2


@pytest.mark.ch04
@pytest.mark.ch04_t2
def test_long_prefill_threshold_caps_every_chunk_of_a_running_request():
    sched = make_scheduler(64, 4, budget=64, max_seqs=4, max_model_len=100, caching=False)
    sched.long_prefill_token_threshold = 4
    runner = FakeModelRunner(4)
    sched.add_request(Request("a", list(range(1, 11)), SamplingParams(max_tokens=2, ignore_eos=True), None))
    # The first chunk is admitted by the waiting pass; the rest come from the running pass.
    for chunk in [4, 4, 2, 1]:
        so = sched.schedule()
        assert so.num_scheduled_tokens == {"a": chunk}
        sched.update_from_output(so, runner.execute_model(so))
    assert not sched.has_unfinished_requests()


def decode(prompt_len: int, outputs: list[int], max_model_len: int = 100, **params) -> Request:
    """A request after sampling `outputs`, with check_stop run after each token like the scheduler does."""
    request = Request("r", [5] * prompt_len, SamplingParams(**params), eos_token_id=EOS)
    for token in outputs:
        assert not request.is_finished(), "check_stop stopped the request too early"
        request.append_output_token_ids(token)
        check_stop(request, max_model_len)
    return request


@pytest.mark.ch04
@pytest.mark.ch04_t1
@pytest.mark.parametrize(
    "prompt_len, outputs, max_model_len, params, status, stop_reason",
    [
        (3, [7, 8, EOS], 100, dict(max_tokens=10), RequestStatus.FINISHED_STOPPED, None),
        (
            3,
            [EOS, EOS, 9],
            100,
            dict(max_tokens=3, ignore_eos=True),
            RequestStatus.FINISHED_LENGTH_CAPPED,
            None,
        ),
        # min_tokens is the sampler's to hold (it masks stop tokens until then); a stop token
        # that check_stop does see ends the request (vLLM v0.11.0).
        (3, [EOS], 100, dict(max_tokens=10, min_tokens=3), RequestStatus.FINISHED_STOPPED, None),
        (3, [11, 12], 100, dict(max_tokens=10, stop_token_ids=[12]), RequestStatus.FINISHED_STOPPED, 12),
        (3, [11, 12], 100, dict(max_tokens=10, min_tokens=5, stop_token_ids=[12]), RequestStatus.FINISHED_STOPPED, 12),
        # ignore_eos: EOS is an ordinary token, but a stop token id still stops.
        (3, [EOS, 12], 100, dict(max_tokens=10, ignore_eos=True, stop_token_ids=[12]), RequestStatus.FINISHED_STOPPED, 12),
        # The length cap wins over a stop token sampled at the same step.
        (3, [7, EOS], 100, dict(max_tokens=2), RequestStatus.FINISHED_LENGTH_CAPPED, None),
        # The context window caps the request even before min_tokens.
        (5, [7, 8], 7, dict(max_tokens=10, min_tokens=5), RequestStatus.FINISHED_LENGTH_CAPPED, None),
    ],
)
def test_check_stop(prompt_len, outputs, max_model_len, params, status, stop_reason):
    request = decode(prompt_len, outputs, max_model_len, **params)
    assert request.status == status
    assert request.stop_reason == stop_reason


@pytest.mark.ch04
@pytest.mark.ch04_t1
def test_check_stop_keeps_an_unfinished_request_running():
    request = decode(3, [7, 8, 9], max_tokens=10, stop_token_ids=[12])
    assert request.status == RequestStatus.WAITING  # check_stop leaves a live request's status alone
    assert not check_stop(request, 100)


@pytest.mark.ch05
@pytest.mark.ch05_t1
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_compute_slot_mapping_matches_a_loop(block_size):
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
    assert table.slot_mapping.np[:40].tolist() == expected
