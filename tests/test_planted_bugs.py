"""Planted bugs: subtly wrong versions of the chapter 11 tasks, which the tasks' tests must catch.

The integrity check (test_assignments.py) proves that a task's tests fail when the task is
missing; this file proves they also fail when it is there but wrong in the ways a student
is likely to get it wrong. Each bug is a small change of the reference's behaviour,
patched in for one test run; every listed test of the task must then fail.
"""

from __future__ import annotations

import pytest
import test_encoder_cache as tests

from nano_v1.core import kv_cache_utils
from nano_v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.assignments

_try_schedule = Scheduler._try_schedule_encoder_inputs
_mm_keys = kv_cache_utils._gen_mm_extra_hash_keys


def ignores_the_compute_budget(self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget):
    """Encodes every image the chunk covers, however many the budget allows."""
    inputs, num_new_tokens, _ = _try_schedule(self, request, num_computed_tokens, num_new_tokens, 10**9)
    return (
        inputs,
        num_new_tokens,
        encoder_compute_budget - sum(request.get_num_encoder_tokens(i) for i in inputs),
    )


def never_cuts_the_chunk(self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget):
    """Skips the images it cannot encode, but lets the chunk run over them."""
    inputs, _, budget_left = _try_schedule(
        self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget
    )
    return inputs, num_new_tokens, budget_left


def only_at_the_block_start(request, start_token_idx, end_token_idx):
    """Looks for images at the block's first position only."""
    return _mm_keys(request, start_token_idx, start_token_idx + 1)


def one_short_at_the_block_end(request, start_token_idx, end_token_idx):
    """Misses an image that starts at the block's last position."""
    return _mm_keys(request, start_token_idx, end_token_idx - 1)


def every_image_of_the_request(request, start_token_idx, end_token_idx):
    """Keys every block with all the request's images: safe, but nothing before an image is shared."""
    return [feature.identifier for feature in request.mm_features]


TRY_SCHEDULE = (Scheduler, "_try_schedule_encoder_inputs")
MM_KEYS = (kv_cache_utils, "_gen_mm_extra_hash_keys")


@pytest.mark.parametrize(
    "target, bug, test",
    [
        (
            TRY_SCHEDULE,
            ignores_the_compute_budget,
            tests.test_try_schedule_encodes_covered_images_and_cuts_before_the_rest,
        ),
        (TRY_SCHEDULE, ignores_the_compute_budget, tests.test_random_workloads_keep_the_encoder_invariants),
        (
            TRY_SCHEDULE,
            never_cuts_the_chunk,
            tests.test_try_schedule_encodes_covered_images_and_cuts_before_the_rest,
        ),
        (
            TRY_SCHEDULE,
            never_cuts_the_chunk,
            tests.test_try_schedule_respects_the_cache_size_and_chunked_mm_input,
        ),
        (TRY_SCHEDULE, never_cuts_the_chunk, tests.test_seed_schedule_text_image_text),
        (
            MM_KEYS,
            only_at_the_block_start,
            tests.test_block_hashes_differ_from_the_first_block_with_a_different_image,
        ),
        (MM_KEYS, only_at_the_block_start, tests.test_mm_extra_keys_are_exactly_the_images_in_the_block),
        (MM_KEYS, one_short_at_the_block_end, tests.test_mm_extra_keys_are_exactly_the_images_in_the_block),
        (
            MM_KEYS,
            every_image_of_the_request,
            tests.test_block_hashes_differ_from_the_first_block_with_a_different_image,
        ),
        (MM_KEYS, every_image_of_the_request, tests.test_prefix_cache_shares_blocks_for_the_same_image_only),
    ],
    ids=lambda x: getattr(x, "__name__", "") if callable(x) else x[1],
)
def test_the_task_tests_catch_the_bug(target, bug, test, monkeypatch):
    monkeypatch.setattr(*target, bug)
    with pytest.raises(AssertionError):
        test()
