"""The rejection sampler: verify draft tokens so that the output is the target model's.

Mirrors vllm/v1/sample/rejection_sampler.py (chapter 10), in plain PyTorch where vLLM
uses Triton kernels.

Why it exists: a step that verifies k drafts computes the target model's distribution
p_1 .. p_{k+1} at every draft position at once. Which tokens may we keep?

* Greedy requests: draft i is kept while it equals argmax p_i; the first mismatch is
  replaced by that argmax, which is exactly the token plain decoding would have
  produced there. Greedy output is unchanged, token for token.
* Sampled requests (Leviathan et al., 2023, arXiv:2211.17192): draft x_i, proposed
  with probability q_i(x_i), is kept with probability min(1, p_i(x_i) / q_i(x_i));
  on rejection the token is drawn from the residual max(p_i - q_i, 0), renormalised.
  Kept or redrawn, the token is distributed exactly as p_i. An n-gram proposer has no
  distribution: its q_i is one-hot at the draft, so the rule becomes "keep with
  probability p_i(x_i), else draw from p_i with x_i removed".

Either way, the first rejection ends the request's output for the step (later drafts
were conditioned on the rejected one). If every draft survives, the target's own
sample at the position after the last draft, the "bonus" token, is added, so each step
yields between 1 and k + 1 tokens.

p_i is the *processed* distribution: temperature, top-k and top-p applied, as the
plain sampler would. Seeded requests draw their uniforms and their redraw noise from
their own generator, so their output does not depend on the rest of the batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from nano_v1.sample.metadata import SamplingMetadata
from nano_v1.sample.sampler import Sampler, apply_top_k_top_p, random_sample
from nano_v1.sampling_params import _SAMPLING_EPS
from nano_v1.spec_decode.metadata import SpecDecodeMetadata, segment_arange

# Marks output slots after the first rejection.
PLACEHOLDER_TOKEN_ID = -1


class RejectionSampler(nn.Module):
    """Drafts + target logits + bonus tokens -> the tokens each request keeps this step."""

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        target_logits: torch.Tensor,  # [num_draft_tokens_total, vocab]
        bonus_token_ids: torch.Tensor,  # [num_reqs, 1]
        sampling_metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Return [num_reqs, max_spec_len + 1] int32: kept tokens, then PLACEHOLDER_TOKEN_ID."""
        device = target_logits.device
        num_reqs = bonus_token_ids.shape[0]
        max_spec_len = metadata.max_spec_len
        num_draft = metadata.num_draft_tokens
        # Flat draft t belongs to request req_of_token[t], at position pos_in_req[t] of its drafts.
        req_of_token = torch.from_numpy(np.repeat(np.arange(num_reqs), num_draft)).to(device)
        pos_in_req = torch.from_numpy(segment_arange(num_draft)).to(device)
        draft_token_ids = metadata.draft_token_ids.to(torch.int64)

        target_argmax = target_logits.argmax(dim=-1)  # [num_draft_tokens_total]
        if sampling_metadata.all_greedy:
            accepted, recovered = draft_token_ids == target_argmax, target_argmax
        else:
            accepted, recovered = self._verify_random(
                metadata, target_logits, draft_token_ids, req_of_token, sampling_metadata
            )
            if not sampling_metadata.all_random:
                is_greedy = sampling_metadata.temperature[req_of_token] < _SAMPLING_EPS
                accepted = torch.where(is_greedy, draft_token_ids == target_argmax, accepted)
                recovered = torch.where(is_greedy, target_argmax, recovered)

        # Back to one row per request: [num_reqs, max_spec_len], padding counts as rejected.
        accepted_grid = torch.zeros(num_reqs, max_spec_len, dtype=torch.int32, device=device)
        accepted_grid[req_of_token, pos_in_req] = accepted.to(torch.int32)
        # Only an unbroken run of acceptances from the first draft counts.
        kept = accepted_grid.cumprod(dim=1).bool()  # [num_reqs, max_spec_len]
        num_accepted = kept.sum(dim=1, keepdim=True)  # [num_reqs, 1]
        draft_grid = torch.zeros(num_reqs, max_spec_len, dtype=torch.int64, device=device)
        draft_grid[req_of_token, pos_in_req] = draft_token_ids
        output = torch.full((num_reqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        output[:, :max_spec_len] = torch.where(kept, draft_grid, PLACEHOLDER_TOKEN_ID)
        # The token after the kept drafts: the redraw at the first rejected position, or,
        # when all drafts were kept (column num_draft), the bonus token.
        next_grid = bonus_token_ids.to(torch.int64).expand(num_reqs, max_spec_len + 1).clone()
        next_grid[req_of_token, pos_in_req] = recovered
        output.scatter_(1, num_accepted, next_grid.gather(1, num_accepted))
        return output.to(torch.int32)

    @staticmethod
    def _verify_random(
        metadata: SpecDecodeMetadata,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        req_of_token: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per draft: accepted with probability p(draft), else a draw from p without it.

        `uniform` and `token_generators` (below) hold each draft's random draw and, for a
        seeded request, its generator: a redraw uses the draft's generator
        (`random_sample(..., token_generators)`), so a seeded request's tokens do not depend
        on the batch around it.
        """
        md = sampling_metadata
        assert md.temperature is not None
        # Each request's settings, repeated for each of its drafts.
        logits = Sampler.apply_temperature(target_logits.to(torch.float32), md.temperature[req_of_token])
        logits = apply_top_k_top_p(
            logits,
            None if md.top_k is None else md.top_k[req_of_token],
            None if md.top_p is None else md.top_p[req_of_token],
        )
        probs = logits.softmax(dim=-1)  # [num_draft_tokens_total, vocab]

        # Seeded requests draw from their own generator, one draw per draft of theirs.
        starts = metadata.cu_num_draft_tokens - metadata.num_draft_tokens
        token_generators: dict[int, torch.Generator] = {}
        # float64: a float32 uniform can be exactly 0.0, which would accept a p = 0 draft.
        uniform = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
        for row, generator in md.generators.items():
            start, end = int(starts[row]), int(metadata.cu_num_draft_tokens[row])
            if end > start:
                uniform[start:end].uniform_(generator=generator)
                token_generators.update(dict.fromkeys(range(start, end), generator))
        # BEGIN TASK ch10_t2: keep draft x with probability p(x), else redraw from p without x: output ~ p
        draft_probs = probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)  # p(draft)
        accepted = uniform < draft_probs
        # The residual max(p - onehot(draft), 0) is p with the draft's entry zeroed;
        # random_sample's exponential race needs no normalisation.
        residual = probs.scatter(1, draft_token_ids.unsqueeze(1), 0.0)
        recovered = random_sample(residual, token_generators)
        # END TASK
        return accepted, recovered
