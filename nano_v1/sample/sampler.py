"""The sampler: one token per request from a batch of logits (restrictions, penalties, greedy,
temperature, min-p, top-k, top-p).

Mirrors vllm/v1/sample/sampler.py and vllm/v1/sample/ops/topk_topp_sampler.py (chapter 01);
`SamplerOutput` lives in vllm/v1/outputs.py there (`LogprobsTensors` does in nano_v1 too).

Why it is shaped this way: every row of the batch may want different settings, yet the
work must stay a handful of batched tensor ops with no per-row Python and no GPU->CPU
synchronisation. So greedy and random rows are both computed and merged with a
`torch.where`; truncation is one sort; and the draw itself is the "exponential race"
(argmax of probs / Exp(1) noise), which needs no CPU round trip, unlike
`torch.multinomial`, and lets a seeded row take its noise from its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nano_v1.outputs import LogprobsTensors
from nano_v1.sample.metadata import SamplingMetadata
from nano_v1.sample.ops.bad_words import apply_bad_words
from nano_v1.sample.ops.penalties import apply_all_penalties
from nano_v1.sampling_params import _SAMPLING_EPS


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs, 1] int32 (one token per request)
    logprobs_tensors: LogprobsTensors | None


class Sampler(nn.Module):
    """logits [num_reqs, vocab] + SamplingMetadata -> one token per row.

    Logprobs, when asked for, are those of the model's raw distribution (log_softmax of
    the logits before logits processors, temperature and truncation), as in vLLM's
    default mode. The order is v0.11.0's: allowed token ids, bad words, the logits
    processors that can change an argmax (logit bias, min tokens), penalties; then
    greedy rows take their argmax, and random rows go on to temperature, the
    argmax-invariant processors (min-p) and top-k/top-p (`LogitsProcessor.is_argmax_invariant`).
    """

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        num_logprobs = sampling_metadata.max_num_logprobs
        raw_logprobs = None if num_logprobs is None else self.compute_logprobs(logits)
        logits = logits.to(torch.float32)
        logits = self.apply_allowed_token_ids(logits, sampling_metadata)
        logits = self.apply_bad_words(logits, sampling_metadata)
        for processor in sampling_metadata.logitsprocs:
            if not processor.is_argmax_invariant():
                logits = processor.apply(logits)  # e.g. no EOS before min_tokens
        logits = self.apply_penalties(logits, sampling_metadata)
        sampled = self.sample(logits, sampling_metadata)  # [num_reqs] int64
        return SamplerOutput(
            sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),  # [num_reqs, 1]
            logprobs_tensors=None
            if raw_logprobs is None
            else self.gather_logprobs(raw_logprobs, num_logprobs, sampled),
        )

    def sample(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; random rows take a draw from the truncated distribution."""
        md = sampling_metadata
        greedy_sampled = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy_sampled
        assert md.temperature is not None
        logits = self.apply_temperature(logits, md.temperature)
        # Processors that cannot change an argmax (min-p, say) matter only to random rows, so
        # they run after the greedy rows are decided, and not at all in an all-greedy batch.
        for processor in md.logitsprocs:
            if processor.is_argmax_invariant():
                logits = processor.apply(logits)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        random_sampled = random_sample(probs, md.generators)
        if greedy_sampled is None:
            return random_sampled
        # Mixed batch: each row keeps the result of its own kind.
        return torch.where(md.temperature < _SAMPLING_EPS, greedy_sampled, random_sampled)

    @staticmethod
    def apply_allowed_token_ids(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        if sampling_metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(sampling_metadata.allowed_token_ids_mask, float("-inf"))
        return logits

    @staticmethod
    def apply_bad_words(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        if sampling_metadata.bad_words_token_ids:
            apply_bad_words(logits, sampling_metadata.bad_words_token_ids, sampling_metadata.output_token_ids)
        return logits

    @staticmethod
    def apply_penalties(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        md = sampling_metadata
        if md.no_penalties:
            return logits
        return apply_all_penalties(
            logits,
            md.prompt_mask,
            md.output_bin_counts,
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
        )

    @staticmethod
    def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        # Greedy rows carry temperature 0; divide them by 1 instead (their random draw is discarded).
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        return logits / temperature.unsqueeze(1)  # [num_reqs, vocab]

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1, dtype=torch.float32)

    @staticmethod
    def gather_logprobs(
        logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
    ) -> LogprobsTensors:
        """Per row: the given token's logprob, then the top `num_logprobs` (ids and values), and
        the given token's rank: how many tokens are at least as likely as it (itself included)."""
        topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)  # [num_rows, k]
        token_ids = token_ids.unsqueeze(-1)  # [num_rows, 1]
        token_logprobs = logprobs.gather(-1, token_ids)  # [num_rows, 1]
        return LogprobsTensors(
            logprob_token_ids=torch.cat((token_ids, topk_indices), dim=1),
            logprobs=torch.cat((token_logprobs, topk_logprobs), dim=1),
            selected_token_ranks=(logprobs >= token_logprobs).sum(dim=-1),
        )


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus.

    One ascending sort serves both. Top-k keeps values >= the k-th largest (at sorted
    index vocab - k). Top-p then drops a token when the tokens *above* it in the order
    already hold probability >= p; in ascending order that is `cumsum(probs) <= 1 - p`,
    where the cumulative sum includes the token itself. The largest token always stays.
    A row with k = vocab and p = 1 is unchanged.
    """
    if k is None and p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [num_reqs, vocab] each
    if k is not None:
        kth_index = (logits_sort.size(1) - k.to(torch.long)).unsqueeze(1)  # [num_reqs, 1]
        kth_largest = logits_sort.gather(1, kth_index)  # [num_reqs, 1]
        logits_sort.masked_fill_(logits_sort < kth_largest, float("-inf"))
    if p is not None:
        cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # [num_reqs, vocab]
        outside_nucleus = cumulative <= 1 - p.unsqueeze(1)
        outside_nucleus[:, -1] = False
        logits_sort.masked_fill_(outside_nucleus, float("-inf"))
    # Undo the sort: position logits_idx[r, j] receives logits_sort[r, j].
    return torch.empty_like(logits).scatter_(dim=-1, index=logits_idx, src=logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row: argmax_i probs_i / E_i with E_i ~ Exp(1) i.i.d.

    E_i / probs_i is exponential with rate probs_i, and the smallest of independent
    exponentials is the one with rate r_i with probability r_i / sum(r): exactly the
    categorical draw. Rows of seeded requests take their noise from their own generator,
    always a full vocabulary-sized row, so their samples do not depend on which other
    requests share the batch or on the row they sit in.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)  # [num_reqs]
