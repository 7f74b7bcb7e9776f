"""The penalties' token bins in the persistent batch, updated by diff (chapter 05, task ch05_t3).

`InputBatch._update_penalty_bins` keeps, for every row with a penalty, `prompt_mask[row]`
(the prompt's tokens) and `output_bin_counts[row]` (how often the row sampled each
token). Each test names the rule of its docstring and checks it against bins rebuilt
from the requests' token lists. And the tables exist from the batch's construction, so
that the memory profile, which runs before any request, counts them.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from helpers.checkpoints import TINY_SHAPES, make_vllm_config

from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from nano_v1.worker.gpu_model_runner import GPUModelRunner

pytestmark = pytest.mark.ch05

VOCAB = 32
PENALIZED = SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.3)


def make_batch(max_num_reqs: int = 4) -> InputBatch:
    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=VOCAB,
        block_sizes=[4],
    )


def request(req_id: str, prompt: list[int], output: list[int] | None = None, params=PENALIZED):
    return CachedRequestState(req_id, list(prompt), params, None, ([1],), len(prompt), list(output or []))


def check_bins(batch: InputBatch, states: dict[str, CachedRequestState], when: str) -> None:
    """Each penalised row's bins equal its request's prompt tokens and output token counts."""
    for row, req_id in enumerate(batch.req_ids):
        state = states[req_id]
        if state.sampling_params.repetition_penalty == 1.0 and not (
            state.sampling_params.presence_penalty or state.sampling_params.frequency_penalty
        ):
            continue
        prompt = sorted(set(state.prompt_token_ids))
        got_prompt = batch.prompt_mask[row].nonzero().flatten().tolist()
        assert got_prompt == prompt, (
            f"{when}: row {row} ({req_id}) must have prompt_mask True exactly at its prompt's tokens "
            f"{prompt}, has {got_prompt}"
        )
        want = {t: state.output_token_ids.count(t) for t in sorted(set(state.output_token_ids))}
        counts = batch.output_bin_counts[row]
        got = {t: int(counts[t]) for t in counts.nonzero().flatten().tolist()}
        assert got == want, (
            f"{when}: row {row} ({req_id}) must count each output token once per time it was sampled: "
            f"outputs {state.output_token_ids} give {want}, the bins hold {got}"
        )


@pytest.mark.ch05_t3
def test_a_request_joining_a_row_gets_only_its_own_bins():
    """Rule: a row that joined «is rebuilt»: «`prompt_mask[row]` True exactly at its prompt's tokens»,
    output_bin_counts zero, whatever the row's previous request left there."""
    batch = make_batch()
    states = {"a": request("a", [1, 2, 3]), "b": request("b", [4, 4])}
    batch.add_request(states["a"])
    batch.add_request(states["b"])
    batch.refresh_metadata()
    states["a"].output_token_ids += [5, 6, 5]
    batch.refresh_metadata()
    check_bins(batch, states, "before a leaves")
    row = batch.remove_request("a")
    states["c"] = request("c", [7])
    batch.add_request(states["c"], row)  # c takes a's row, bins and all
    del states["a"]
    batch.refresh_metadata()
    check_bins(batch, states, "after c took a's row")


@pytest.mark.ch05_t3
def test_each_sampled_token_is_counted_exactly_once():
    """Rule: «every row counts the output tokens it sampled since the last refresh», «each exactly once», even
    when several came at once or «the same token may come twice»; a refresh with none adds nothing."""
    batch = make_batch()
    states = {"a": request("a", [1])}
    batch.add_request(states["a"])
    batch.refresh_metadata()
    check_bins(batch, states, "before any sample")
    for when, new in (
        ("after one token", [9]),
        ("after a refresh with no new token", []),
        ("after two tokens at once", [10, 11]),
        ("after the same token twice at once", [12, 12]),
    ):
        states["a"].output_token_ids += new
        batch.refresh_metadata()
        check_bins(batch, states, when)


@pytest.mark.ch05_t3
def test_a_resumed_request_counts_the_output_it_already_had():
    """Rule: «a resumed request brings all its earlier ones»: a request that joins with output tokens already
    sampled counts all of them, repeats included, at the next refresh."""
    batch = make_batch()
    states = {"a": request("a", [1, 2], [3, 3, 4])}
    batch.add_request(states["a"])
    batch.refresh_metadata()
    check_bins(batch, states, "after resuming with 3 output tokens")
    row = batch.remove_request("a")  # preempted again, with one more token
    states["a"].output_token_ids.append(3)
    batch.add_request(states["a"], row)
    batch.refresh_metadata()
    check_bins(batch, states, "after resuming a second time")


@pytest.mark.ch05_t3
@pytest.mark.parametrize("seed", range(3))
def test_bins_equal_a_rebuild_after_random_adds_removes_condenses_and_samples(seed):
    """Rule: rows that joined are rebuilt, «condense has moved each row's bins with it», and every refresh
    counts each new output token «exactly once», against bins rebuilt from scratch.

    Rules together: rows that joined are rebuilt, condense moves each row's bins with it,
    and every refresh counts each new output token once."""
    rng = random.Random(seed)
    batch = make_batch(max_num_reqs=6)
    states: dict[str, CachedRequestState] = {}
    left: list[CachedRequestState] = []  # preempted, may come back with their outputs
    for step in range(60):
        holes = []
        for req_id in rng.sample(sorted(states), k=rng.randint(0, min(2, len(states)))):
            holes.append(batch.remove_request(req_id))
            state = states.pop(req_id)
            if rng.random() < 0.5:
                left.append(state)
        holes.sort(reverse=True)
        for _ in range(rng.randint(0, 2)):
            if len(states) == batch.max_num_reqs:
                break
            if left and rng.random() < 0.5:
                state = left.pop(0)
            else:
                params = PENALIZED if rng.random() < 0.7 else SamplingParams()
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
                state = request(f"r{step}_{len(states)}", prompt, params=params)
            states[state.req_id] = state
            batch.add_request(state, holes.pop() if holes else None)
        batch.condense(holes)
        for state in states.values():
            state.output_token_ids += [rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 1, 2]))]
        batch.refresh_metadata()
        check_bins(batch, states, f"seed {seed}, step {step}")


def test_per_vocab_tables_exist_before_the_memory_profile(tmp_path):
    """The runner's persistent batch holds its [max_num_seqs, vocab] tables from construction,
    before `profile_run` measures peak memory, and serving requests that use them allocates none."""
    transformers.Qwen3Config(**TINY_SHAPES, head_dim=16, architectures=["Qwen3ForCausalLM"]).save_pretrained(
        tmp_path
    )
    vllm_config = make_vllm_config(str(tmp_path), dtype="float32", max_num_seqs=5, max_model_len=64)
    batch = GPUModelRunner(vllm_config, torch.device("cpu")).input_batch
    tables = {
        "prompt_mask": batch.prompt_mask,
        "output_bin_counts": batch.output_bin_counts,
        "allowed_token_ids_mask": batch.allowed_token_ids_mask,
    }
    for name, table in tables.items():
        assert table is not None and table.shape == (5, TINY_SHAPES["vocab_size"]), (
            f"{name} must be allocated with the batch, before the memory profile, at [max_num_seqs, vocab]"
        )
    params = SamplingParams(repetition_penalty=1.2, allowed_token_ids=[1, 2])
    batch.add_request(request("a", [1, 2, 3], params=params))
    batch.refresh_metadata()
    for name, table in tables.items():
        assert getattr(batch, name) is table, f"{name} was reallocated after the memory profile"
