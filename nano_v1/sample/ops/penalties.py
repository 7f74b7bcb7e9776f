"""Repetition, frequency and presence penalties, applied to the whole batch at once.

Mirrors vllm/v1/sample/ops/penalties.py (chapter 01); the formula is v0.11.0's
`apply_penalties` in vllm/model_executor/layers/utils.py.

What differs from v0.11.0: vLLM rebuilds each row's prompt and output token bins from
the token lists every step (a padded prompt tensor kept by the batch, the output lists
copied to the device). nano_v1 keeps the bins themselves in the persistent batch
(`InputBatch.prompt_mask`, `InputBatch.output_bin_counts`), updated by diff: a row's
prompt bins once when it joins, one count per sampled token. So this takes the bins.
"""

from __future__ import annotations

import torch


def apply_all_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_bin_counts: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Penalise, in place, every row's logits [num_reqs, vocab] by what the row has seen; return them.

    `prompt_mask` [num_reqs, vocab] bool: the token is in the prompt. `output_bin_counts`
    [num_reqs, vocab] int32: how often the row has sampled the token. The penalties are
    per row ([num_reqs] each). In this order:
      1. Repetition (CTRL's), on every token seen in the prompt or the output: a positive
         logit is divided by the penalty, a negative one multiplied by it, so both move
         towards "less likely" for a penalty > 1; a token seen in neither is untouched.
      2. Then, on output tokens only (OpenAI's definition; the prompt does not count), the
         logit loses `frequency_penalty * count` (count: times sampled) and
         `presence_penalty` once if the count is at least 1, however large it is.
    A neutral row (repetition 1, frequency 0, presence 0) is unchanged; penalties may be
    negative (frequency and presence) or below 1 (repetition), which favour seen tokens.
    """
    # BEGIN TASK ch01_t3: repetition on prompt and output tokens (divide positive, multiply negative); then frequency x count and presence once, output only
    output_mask = output_bin_counts > 0
    repetition = repetition_penalties.unsqueeze(1).expand_as(logits)
    seen = prompt_mask | output_mask
    scale = torch.where(seen, repetition, 1.0)
    logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    logits -= frequency_penalties.unsqueeze(1) * output_bin_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    # END TASK
    return logits
