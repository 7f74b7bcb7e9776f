"""The sampler against direct computations: greedy, truncation masks, frequencies, seeds, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.sampling import make_sampling_metadata

from nano_v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from nano_v1.sample.metadata import SamplingMetadata
from nano_v1.sample.sampler import Sampler, apply_top_k_top_p

pytestmark = pytest.mark.ch01

VOCAB = 64


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> list[int]:
    return Sampler()(logits, md).sampled_token_ids.view(-1).tolist()


def test_seeded_rows_reproduce_across_batch_compositions():
    torch.manual_seed(0)
    row = torch.randn(VOCAB) * 0.5  # flat enough that samples vary from draw to draw
    other = torch.randn(5, VOCAB)
    alone, in_batch, other_seed = [], [], []
    gen_alone, gen_batch, gen_other = seeded(42), seeded(42), seeded(43)
    for step in range(30):
        alone += sample(
            row[None], make_sampling_metadata([0.9], top_p=[0.95], top_k=[40], generators={0: gen_alone})
        )
        # Same request at a different row, among greedy, unseeded and differently seeded rows.
        logits = torch.cat([other[:3], row[None], other[3:]])
        md = make_sampling_metadata(
            [0.0, 1.0, 0.7, 0.9, 1.3, 0.0],
            top_p=[1.0, 0.8, 1.0, 0.95, 0.9, 1.0],
            top_k=[VOCAB, 5, VOCAB, 40, 10, VOCAB],
            generators={3: gen_batch, 4: seeded(step)},
        )
        in_batch.append(sample(logits, md)[3])
        other_seed += sample(
            row[None], make_sampling_metadata([0.9], top_p=[0.95], top_k=[40], generators={0: gen_other})
        )
    assert alone == in_batch
    assert len(set(alone)) > 5  # the draws really vary ...
    assert alone != other_seed  # ... and depend on the seed


def test_top_k_1_and_tiny_temperature_equal_greedy():
    torch.manual_seed(1)
    logits = torch.randn(32, VOCAB) * 3
    argmax = logits.argmax(-1).tolist()
    assert sample(logits, make_sampling_metadata([1.0] * 32, top_k=[1] * 32)) == argmax
    # Greedy rows (temperature 0) give exactly the argmax even among random rows.
    temperature = [0.0 if i % 2 else 1.5 for i in range(32)]
    mixed = sample(logits, make_sampling_metadata(temperature))
    assert [mixed[i] for i in range(1, 32, 2)] == [argmax[i] for i in range(1, 32, 2)]
    assert [mixed[i] for i in range(0, 32, 2)] != [argmax[i] for i in range(0, 32, 2)]
    # A temperature just above the greedy cut-off goes through the random path and still
    # lands on the argmax once the top logit leads by 0.1: the runner-up has odds e^-100.
    logits[torch.arange(32), logits.argmax(-1)] += 0.1
    assert sample(logits, make_sampling_metadata([1e-3] * 32)) == argmax


def direct_kept_set(row: list[float], k: int | None, p: float | None) -> set[int] | None:
    """Tokens top-k then top-p keep, computed plainly in float64; None if p sits on a boundary."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if k is not None:
        order = order[:k]
    if p is None:
        return set(order)
    weights = [math.exp(row[i] - row[order[0]]) for i in order]
    total = sum(weights)
    kept, mass_above = set(), 0.0
    for i, w in zip(order, weights):
        if abs(mass_above - p) < 1e-5:
            return None
        if mass_above < p:
            kept.add(i)
        mass_above += w / total
    return kept


@pytest.mark.parametrize("mode", ["k", "p", "kp"])
def test_top_k_top_p_masks_match_direct_computation(mode):
    torch.manual_seed(2)
    n = 200
    logits = torch.randn(n, VOCAB) * torch.rand(n, 1) * 4
    ks = torch.randint(1, VOCAB + 1, (n,), dtype=torch.int32) if "k" in mode else None
    ps = torch.rand(n) * 0.98 + 0.01 if "p" in mode else None
    masked = apply_top_k_top_p(logits.clone(), ks, ps)
    checked = 0
    for r in range(n):
        want = direct_kept_set(
            logits[r].double().tolist(),
            None if ks is None else int(ks[r]),
            None if ps is None else float(ps[r]),
        )
        if want is None:
            continue
        kept = torch.isfinite(masked[r])
        assert set(torch.nonzero(kept).view(-1).tolist()) == want, r
        assert torch.equal(masked[r][kept], logits[r][kept])  # kept logits are untouched
        checked += 1
    assert checked > 0.9 * n


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, None, None), (0.5, None, None), (1.0, 4, None), (1.3, None, 0.7), (0.8, 5, 0.9)],
)
def test_sampled_frequencies_match_probabilities(temperature, top_k, top_p):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    expected = torch.softmax(logits.double() / temperature, -1)
    kept = direct_kept_set((logits.double() / temperature).tolist(), top_k, top_p)
    expected = torch.tensor([float(expected[i]) if i in kept else 0.0 for i in range(6)], dtype=torch.float64)
    expected /= expected.sum()

    n = 20_000
    torch.manual_seed(3)
    md = make_sampling_metadata(
        [temperature] * n,
        top_p=None if top_p is None else [top_p] * n,
        top_k=None if top_k is None else [top_k] * n,
    )
    counts = torch.bincount(torch.tensor(sample(logits.expand(n, 6).clone(), md)), minlength=6).double()
    assert (counts[expected == 0] == 0).all()
    support = expected > 0
    chi2 = (((counts - n * expected) ** 2)[support] / (n * expected[support])).sum().item()
    # 99.9th percentile of chi-square with <= 5 degrees of freedom is 20.5; a wrong
    # temperature, mask or draw rule is off by hundreds at n = 20,000.
    assert chi2 < 20.5, (chi2, counts.tolist(), (n * expected).tolist())


def test_logprobs_are_log_softmax_of_raw_logits():
    torch.manual_seed(4)
    logits = torch.randn(6, VOCAB) * 2
    md = make_sampling_metadata(
        [0.0, 0.5, 1.0, 2.0, 0.0, 1.0], top_k=[VOCAB, 3, VOCAB, 10, VOCAB, 1], max_num_logprobs=4
    )
    out = Sampler()(logits, md)
    sampled = out.sampled_token_ids.view(-1)
    reference = torch.log_softmax(logits.double(), -1)
    ids, values = out.logprobs_tensors.logprob_token_ids, out.logprobs_tensors.logprobs
    assert ids.shape == values.shape == (6, 5)
    assert torch.equal(ids[:, 0], sampled.long())
    assert torch.equal(ids[:, 1:], reference.topk(4).indices)
    torch.testing.assert_close(values.double(), reference.gather(1, ids), atol=1e-5, rtol=0)


class OnlyToken(LogitsProcessor):
    """Leaves one token possible in every row, and records the logits it was given."""

    def __init__(self, token: int, argmax_invariant: bool) -> None:
        self.token, self.argmax_invariant = token, argmax_invariant
        self.seen: list[torch.Tensor] = []

    def is_argmax_invariant(self) -> bool:
        return self.argmax_invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(logits.clone())
        keep = logits[:, self.token].clone()
        logits.fill_(float("-inf"))[:, self.token] = keep
        return logits


def test_argmax_invariant_processors_run_after_greedy_rows_are_decided():
    """As in v0.11.0: a processor that says it cannot change an argmax edits only the random
    rows' temperature-scaled logits, and an all-greedy batch never calls it."""
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    logits[:, 0] = -10.0  # token 0 is nobody's argmax
    argmax = logits.argmax(-1).tolist()
    temperature = [0.0, 0.5, 0.0, 2.0]

    invariant = OnlyToken(0, argmax_invariant=True)
    md = dataclasses.replace(make_sampling_metadata([0.0] * 4), logitsprocs=[invariant])
    assert sample(logits.clone(), md) == argmax and invariant.seen == []

    md = dataclasses.replace(make_sampling_metadata(temperature), logitsprocs=[invariant])
    assert sample(logits.clone(), md) == [argmax[0], 0, argmax[2], 0]
    (seen,) = invariant.seen
    torch.testing.assert_close(seen[[1, 3]], logits[[1, 3]] / torch.tensor([[0.5], [2.0]]))

    # The same edit from a processor that can change an argmax reaches the greedy rows too.
    md = dataclasses.replace(make_sampling_metadata(temperature), logitsprocs=[OnlyToken(0, False)])
    assert sample(logits.clone(), md) == [0, 0, 0, 0]
