"""The penalty formula, `apply_all_penalties` (chapter 01, task ch01_t3), token by token.

Each test names its rule in its docstring and compares every logit with the definition
written out for one token at a time: CTRL's repetition penalty on tokens of the prompt or
the output, then OpenAI's frequency and presence penalties on output tokens only.
"""

from __future__ import annotations

import pytest
import torch

from nano_v1.sample.ops.penalties import apply_all_penalties

pytestmark = [pytest.mark.ch01, pytest.mark.ch01_t3]


def penalised(logit: float, in_prompt: bool, count: int, presence: float, frequency: float, rep: float) -> float:
    """One token's logit after the penalties, from their definitions."""
    if in_prompt or count > 0:
        logit = logit / rep if logit > 0 else logit * rep
    return logit - frequency * count - presence * (count > 0)


def check(
    logits: list[list[float]],
    prompts: list[list[int]],
    counts: list[dict[int, int]],
    penalties: list[tuple[float, float, float]],
) -> None:
    """Apply the penalties to `logits` and compare every entry with `penalised`; the message
    names the first wrong token, what the row has seen of it, and the row's penalties."""
    num_reqs, vocab = len(logits), len(logits[0])
    prompt_mask = torch.zeros(num_reqs, vocab, dtype=torch.bool)
    output_bin_counts = torch.zeros(num_reqs, vocab, dtype=torch.int32)
    for row in range(num_reqs):
        prompt_mask[row, prompts[row]] = True
        for token, count in counts[row].items():
            output_bin_counts[row, token] = count
    presence, frequency, repetition = (torch.tensor(column) for column in zip(*penalties))
    got = apply_all_penalties(
        torch.tensor(logits), prompt_mask, output_bin_counts, presence, frequency, repetition
    ).tolist()
    for row in range(num_reqs):
        p, f, r = penalties[row]
        for token in range(vocab):
            in_prompt, count = token in prompts[row], counts[row].get(token, 0)
            want = penalised(logits[row][token], in_prompt, count, p, f, r)
            assert got[row][token] == pytest.approx(want, abs=1e-5), (
                f"row {row}, token {token}: logit {logits[row][token]}, {'in' if in_prompt else 'not in'} the "
                f"prompt, sampled {count} time(s), penalties presence {p}, frequency {f}, repetition {r}: "
                f"should become {want:.4f}, became {got[row][token]:.4f}"
            )


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    """Rule: «a positive logit is divided by the penalty, a negative one multiplied by it», for tokens of the
    prompt or the output; «a token seen in neither is untouched»."""
    logits = [[2.0, -2.0, 3.0, -1.0, 0.5, -0.5]]
    check(logits, [[0, 1]], [{2: 1, 3: 2}], [(0.0, 0.0, 2.0)])
    # A penalty below 1 favours the seen tokens, by the same rule.
    check(logits, [[4, 5]], [{0: 1}], [(0.0, 0.0, 0.5)])


def test_frequency_and_presence_count_output_tokens_only():
    """Rule: frequency subtracts frequency x count and presence subtracts presence «once if the count is at
    least 1», «on output tokens only»; a token only in the prompt loses nothing to either."""
    logits = [[1.0, 1.0, 1.0, 1.0, -1.0]]
    check(logits, [[0, 1]], [{1: 3, 2: 1, 4: 2}], [(0.5, 0.25, 1.0)])
    # Negative penalties reward the same tokens.
    check(logits, [[0]], [{2: 4}], [(-0.5, -0.25, 1.0)])


def test_every_row_has_its_own_penalties_and_neutral_rows_are_unchanged():
    """Rule: the penalties are «per row», applied «In this order»: repetition on prompt or output tokens, then
    frequency and presence on output tokens; «A neutral row (repetition 1, frequency 0, presence 0) is
    unchanged».

    Rules together, per row: repetition first on prompt or output tokens, then frequency and
    presence on output tokens; a row with repetition 1, frequency 0, presence 0 is unchanged."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 12, generator=generator) * 3).tolist()
    prompts = [[0, 1, 2], [3, 3, 5], [7], [0, 11]]
    counts = [{2: 2, 4: 1}, {5: 3, 6: 1}, {}, {0: 1, 1: 2, 11: 5}]
    penalties = [(0.3, 0.2, 1.5), (0.0, 0.0, 1.0), (1.0, 1.0, 2.0), (-0.2, 0.4, 0.8)]
    check(logits, prompts, counts, penalties)
