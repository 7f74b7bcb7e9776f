"""Persistent input batch: per-request state kept in preallocated columns between steps.

Mirrors vllm/v1/worker/gpu_input_batch.py (chapters 05 and 12).

Why it exists: rebuilding the batch every step costs O(batch x context) Python work;
keeping each request in a fixed row of preallocated arrays and applying only the
scheduler's diff (a new request, a finished one, a few new block ids) costs
O(changes). The penalties' token bins follow the same rule: a row's prompt bins are
written once, at the first refresh after it joins, and each sampled token adds one count.
Rows stay dense (`0 .. num_reqs-1`) so that every column can be sliced
`[:num_reqs]` and handed to numpy or copied to the device in one piece.

What differs from v0.11.0: the penalties' token bins live here (vLLM rebuilds them in the
sampler every step), and they and the allowed-token mask (which vLLM allocates when the
first request asks for one) are allocated with the batch, before the memory profile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from nano_v1.core.sched.output import NewRequestData
from nano_v1.multimodal.inputs import MultiModalFeatureSpec
from nano_v1.outputs import LogprobsTensors
from nano_v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    build_logitsprocs,
)
from nano_v1.sample.logits_processor.interface import AddedRequest, MovedRequest
from nano_v1.sample.metadata import SamplingMetadata
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.block_table import CpuGpuBuffer, MultiGroupBlockTable


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers about a request, in or out of the persistent batch.

    A preempted request leaves the batch but keeps this record, so that when it resumes
    its prompt, sampled tokens and generator are still here; only its blocks are new.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # set for seeded requests only
    block_ids: tuple[list[int], ...]  # one list per KV cache group
    num_computed_tokens: int
    output_token_ids: list[int]
    # The prompt's images (chapter 11): where their encoder outputs go, and their hashes.
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)

    @classmethod
    def from_new_request(cls, new_req: NewRequestData, device: torch.device) -> CachedRequestState:
        """The state of a request the scheduler sends for the first time; seeded requests get a generator."""
        params = new_req.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(
            req_id=new_req.req_id,
            prompt_token_ids=new_req.prompt_token_ids,
            sampling_params=params,
            generator=generator,
            block_ids=tuple(list(ids) for ids in new_req.block_ids),
            num_computed_tokens=new_req.num_computed_tokens,
            output_token_ids=[],
            mm_features=new_req.mm_features,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Up to `max_num_reqs` requests, row-aligned across every column below.

    Invariant after `condense`: rows `0 .. num_reqs-1` are occupied, and
    `req_ids[i]`, `token_ids_cpu[i]`, `num_computed_tokens_cpu[i]`, row i of every block table and
    every sampling column at i describe the same request.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        pin_memory: bool,
        vocab_size: int,
        block_sizes: list[int],
        logitsprocs: list[LogitsProcessor] | None = None,
    ) -> None:
        """`logitsprocs`: the worker's (`build_logitsprocs`); None gives the builtin ones alone."""
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device

        # Row -> request id; None marks a hole left by remove_request until condense().
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}

        # Every token of every request (prompt, then sampled). Never copied to the device
        # whole: the runner gathers just this step's tokens out of it.
        self.token_ids_cpu_tensor = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()

        # One block table per KV cache group (chapter 12); most models have one.
        self.block_table = MultiGroupBlockTable(
            max_num_reqs=max_num_reqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            pin_memory=pin_memory,
            device=device,
            block_sizes=block_sizes,
        )

        # Sampling columns, and the sets that let the sampler skip work nobody asked for.
        self.temperature = CpuGpuBuffer(
            max_num_reqs, dtype=torch.float32, device=device, pin_memory=pin_memory
        )
        self.top_p = CpuGpuBuffer(max_num_reqs, dtype=torch.float32, device=device, pin_memory=pin_memory)
        self.top_k = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device, pin_memory=pin_memory)
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        self.top_p_reqs: set[str] = set()
        self.top_k_reqs: set[str] = set()
        # Penalty columns, and the rows' token bins: [max_num_reqs, vocab] on the device,
        # valid in rows with a penalty only. `num_counted_output_tokens[i]`: how many of row
        # i's output tokens its bins count. Every per-vocab table is allocated here, before the
        # worker's profile run measures peak memory, so that the KV cache leaves room for it.
        self.presence_penalties = CpuGpuBuffer(
            max_num_reqs, dtype=torch.float32, device=device, pin_memory=pin_memory
        )
        self.frequency_penalties = CpuGpuBuffer(
            max_num_reqs, dtype=torch.float32, device=device, pin_memory=pin_memory
        )
        self.repetition_penalties = CpuGpuBuffer(
            max_num_reqs, dtype=torch.float32, device=device, pin_memory=pin_memory
        )
        self.presence_penalties_reqs: set[str] = set()
        self.frequency_penalties_reqs: set[str] = set()
        self.repetition_penalties_reqs: set[str] = set()
        self.prompt_mask = torch.zeros(max_num_reqs, vocab_size, dtype=torch.bool, device=device)
        self.output_bin_counts = torch.zeros(max_num_reqs, vocab_size, dtype=torch.int32, device=device)
        self.num_counted_output_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Requests with a penalty that joined since the last refresh: their rows' bins are stale.
        self.penalty_reqs_to_bin: set[str] = set()
        # Row -> the request's output token ids (its own list, which the runner extends).
        self.req_output_token_ids: list[list[int] | None] = []
        # [max_num_reqs, vocab] bool on the device, True where a row may not sample.
        self.allowed_token_ids_mask = torch.zeros(max_num_reqs, vocab_size, dtype=torch.bool, device=device)
        self.has_allowed_token_ids: set[str] = set()
        # Row -> bad words as token id sequences.
        self.bad_words_token_ids: dict[int, list[list[int]]] = {}
        # Row -> generator, for seeded requests only.
        self.generators: dict[int, torch.Generator] = {}
        # Request id -> number of top logprobs it wants.
        self.num_logprobs: dict[str, int] = {}
        # Request id -> number of top prompt logprobs it wants, for those whose prefill is
        # still to complete; and the prompt logprobs of its chunks so far (chapter 01). A
        # request that leaves the batch before its prefill completes was preempted: it
        # computes its prompt again from the start, logprobs included.
        self.num_prompt_logprobs: dict[str, int] = {}
        self.in_progress_prompt_logprobs_cpu: dict[str, LogprobsTensors] = {}
        # Requests the proposer must not draft for (chapter 10): those that want logprobs
        # (drafts would need them at every position) or min_tokens (the stop mask too).
        self.spec_decode_unsupported_reqs: set[str] = set()
        # Logits processors and the batch changes they have not seen yet (removed, added, moved).
        self.logitsprocs: list[LogitsProcessor] = (
            build_logitsprocs(None, device, pin_memory) if logitsprocs is None else logitsprocs
        )
        self._removed: list[int] = []
        self._added: list[AddedRequest] = []
        self._moved: list[MovedRequest] = []

        # Async scheduling (chapter 14): the last step's sampled tokens, [num_reqs, 1] on the
        # device, and the row each request that kept its token had then. Set while the host
        # holds placeholders for those tokens; None otherwise (always, without async scheduling).
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] | None = None

        # The per-row numpy columns, moved together with the request.
        self._columns: list[np.ndarray] = [
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens_cpu,
            self.temperature.np,
            self.top_p.np,
            self.top_k.np,
            self.presence_penalties.np,
            self.frequency_penalties.np,
            self.repetition_penalties.np,
            self.num_counted_output_tokens,
        ]
        self.sampling_metadata = self._make_sampling_metadata()

    # ------------------------------------------------------------------ membership
    @property
    def req_ids(self) -> list[str]:
        """Request id of each row (dense after condense())."""
        return self._req_ids  # type: ignore[return-value]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, request: CachedRequestState, req_index: int | None = None) -> int:
        """Write `request` into row `req_index` (a hole) or, when None, a new last row."""
        if req_index is None:
            req_index = len(self._req_ids)
            assert req_index < self.max_num_reqs, "persistent batch is full"
            self._req_ids.append(request.req_id)
            self.req_output_token_ids.append(request.output_token_ids)
        else:
            assert self._req_ids[req_index] is None, f"row {req_index} is occupied"
            self._req_ids[req_index] = request.req_id
            self.req_output_token_ids[req_index] = request.output_token_ids
        req_id = request.req_id
        self.req_id_to_index[req_id] = req_index

        num_prompt_tokens = request.num_prompt_tokens
        num_tokens = request.num_tokens
        row = self.token_ids_cpu[req_index]
        row[:num_prompt_tokens] = request.prompt_token_ids
        row[num_prompt_tokens:num_tokens] = request.output_token_ids
        self.num_prompt_tokens[req_index] = num_prompt_tokens
        self.num_tokens[req_index] = num_tokens
        self.num_computed_tokens_cpu[req_index] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids, req_index)

        params = request.sampling_params
        if params.greedy:
            self.temperature.np[req_index] = 0.0
            self.greedy_reqs.add(req_id)
        else:
            self.temperature.np[req_index] = params.temperature
            self.random_reqs.add(req_id)
        self.top_p.np[req_index] = params.top_p
        if params.top_p < 1.0:
            self.top_p_reqs.add(req_id)
        # top_k == vocab_size keeps every token, so "no top-k" is stored as that.
        if 0 < params.top_k < self.vocab_size:
            self.top_k.np[req_index] = params.top_k
            self.top_k_reqs.add(req_id)
        else:
            self.top_k.np[req_index] = self.vocab_size
        if request.generator is not None:
            self.generators[req_index] = request.generator
        self._add_penalties(req_index, request)
        if params.allowed_token_ids:
            self.has_allowed_token_ids.add(req_id)
            self.allowed_token_ids_mask[req_index] = True
            self.allowed_token_ids_mask[req_index, params.allowed_token_ids] = False
        else:
            self.allowed_token_ids_mask[req_index] = False
        if params.bad_words_token_ids:
            self.bad_words_token_ids[req_index] = params.bad_words_token_ids
        if params.logprobs is not None:
            # Asking for more than the vocabulary returns the whole vocabulary.
            self.num_logprobs[req_id] = min(params.logprobs, self.vocab_size)
        if params.prompt_logprobs is not None:
            self.num_prompt_logprobs[req_id] = (
                self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
            )
        if params.logprobs is not None or params.min_tokens > 0 or _shapes_logits(params):
            self.spec_decode_unsupported_reqs.add(req_id)
        if req_index in self._removed:
            self._removed.remove(req_index)  # the hole is filled: not a removal any more
        self._added.append((req_index, params, request.prompt_token_ids, request.output_token_ids))
        return req_index

    def _add_penalties(self, req_index: int, request: CachedRequestState) -> None:
        """Write the row's penalty columns; if it has a penalty, its bins are rebuilt at the next refresh."""
        params = request.sampling_params
        req_id = request.req_id
        self.presence_penalties.np[req_index] = params.presence_penalty
        self.frequency_penalties.np[req_index] = params.frequency_penalty
        self.repetition_penalties.np[req_index] = params.repetition_penalty
        if params.presence_penalty != 0.0:
            self.presence_penalties_reqs.add(req_id)
        if params.frequency_penalty != 0.0:
            self.frequency_penalties_reqs.add(req_id)
        if params.repetition_penalty != 1.0:
            self.repetition_penalties_reqs.add(req_id)
        if self._has_penalties(req_id):
            self.penalty_reqs_to_bin.add(req_id)

    def remove_request(self, req_id: str) -> int | None:
        """Leave a hole where `req_id` was; return its row (None if it was not here).

        Must be followed by add_request into the hole or by condense().
        """
        req_index = self.req_id_to_index.pop(req_id, None)
        if req_index is None:
            return None
        self._req_ids[req_index] = None
        self.greedy_reqs.discard(req_id)
        self.random_reqs.discard(req_id)
        self.top_p_reqs.discard(req_id)
        self.top_k_reqs.discard(req_id)
        self.generators.pop(req_index, None)
        self.presence_penalties_reqs.discard(req_id)
        self.frequency_penalties_reqs.discard(req_id)
        self.repetition_penalties_reqs.discard(req_id)
        self.penalty_reqs_to_bin.discard(req_id)
        self.has_allowed_token_ids.discard(req_id)
        self.bad_words_token_ids.pop(req_index, None)
        self.req_output_token_ids[req_index] = None
        self.num_logprobs.pop(req_id, None)
        self.num_prompt_logprobs.pop(req_id, None)
        self.in_progress_prompt_logprobs_cpu.pop(req_id, None)
        self.spec_decode_unsupported_reqs.discard(req_id)
        # Added since the last refresh: the processors must not hear of it at all.
        self._added = [added for added in self._added if added[0] != req_index]
        self._removed.append(req_index)
        return req_index

    def condense(self, empty_req_indices: list[int]) -> None:
        """Close the holes left by remove_request: move the last row into the lowest hole.

        Moving the last row (rather than shifting everything down) touches one row per
        hole, so the cost is O(holes x row length), independent of the batch size.
        """
        for hole in sorted(empty_req_indices):
            self._trim_trailing_holes()
            if hole >= len(self._req_ids):
                break  # every remaining hole was at the end
            self._move_request(len(self._req_ids) - 1, hole)
        self._trim_trailing_holes()
        assert len(self._req_ids) == self.num_reqs, "condense left a hole"

    def _trim_trailing_holes(self) -> None:
        while self._req_ids and self._req_ids[-1] is None:
            self._req_ids.pop()
            self.req_output_token_ids.pop()

    def _move_request(self, src: int, tgt: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None and self._req_ids[tgt] is None
        self._req_ids[tgt], self._req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = tgt
        n = self.num_tokens[src]
        self.token_ids_cpu[tgt, :n] = self.token_ids_cpu[src, :n]
        for column in self._columns:
            column[tgt] = column[src]
        self.block_table.move_row(src, tgt)
        generator = self.generators.pop(src, None)
        if generator is not None:
            self.generators[tgt] = generator
        self.req_output_token_ids[tgt], self.req_output_token_ids[src] = self.req_output_token_ids[src], None
        bad_words = self.bad_words_token_ids.pop(src, None)
        if bad_words is not None:
            self.bad_words_token_ids[tgt] = bad_words
        if self._has_penalties(req_id) and req_id not in self.penalty_reqs_to_bin:
            self.prompt_mask[tgt] = self.prompt_mask[src]
            self.output_bin_counts[tgt] = self.output_bin_counts[src]
        self.allowed_token_ids_mask[tgt] = self.allowed_token_ids_mask[src]
        self._moved.append((src, tgt, MoveDirectionality.UNIDIRECTIONAL))

    # ------------------------------------------------------------------ sampling
    @property
    def all_greedy(self) -> bool:
        return not self.random_reqs

    @property
    def all_random(self) -> bool:
        return not self.greedy_reqs

    @property
    def no_top_p(self) -> bool:
        return not self.top_p_reqs

    @property
    def no_top_k(self) -> bool:
        return not self.top_k_reqs

    @property
    def no_penalties(self) -> bool:
        return not (
            self.presence_penalties_reqs or self.frequency_penalties_reqs or self.repetition_penalties_reqs
        )

    def _has_penalties(self, req_id: str) -> bool:
        return (
            req_id in self.presence_penalties_reqs
            or req_id in self.frequency_penalties_reqs
            or req_id in self.repetition_penalties_reqs
        )

    def _update_penalty_bins(self) -> None:
        """Bring the token bins of every row with a penalty up to date, from the batch's diff.

        Rows are those of `req_id_to_index` now (condense has moved each row's bins with it).
        A request in `penalty_reqs_to_bin` joined since the last refresh, new or resumed: its
        row may still hold the bins of the row's previous request, so its row of each table
        is rebuilt: `prompt_mask[row]` True exactly at its prompt's tokens
        (`token_ids_cpu[row, :num_prompt_tokens[row]]`), `output_bin_counts[row]` zero, and
        `num_counted_output_tokens[row]` zero. Then every row counts the output tokens it
        sampled since the last refresh (`req_output_token_ids[row]` past
        `num_counted_output_tokens[row]`, one or several: a resumed request brings all its
        earlier ones, and the same token may come twice), each exactly once, with one
        indexed add for the whole batch, and records how many it has counted.
        """
        # BEGIN TASK ch05_t3: rebuild the bins of rows that joined; count each row's new output tokens exactly once
        rows: list[int] = []
        token_ids: list[int] = []
        penalized = (
            self.presence_penalties_reqs | self.frequency_penalties_reqs | self.repetition_penalties_reqs
        )
        for req_id in penalized:
            row = self.req_id_to_index[req_id]
            if req_id in self.penalty_reqs_to_bin:
                prompt = self.token_ids_cpu_tensor[row, : self.num_prompt_tokens[row]]
                self.prompt_mask[row] = False
                self.prompt_mask[row, prompt.to(self.device, torch.int64)] = True
                self.output_bin_counts[row] = 0
                self.num_counted_output_tokens[row] = 0
            output = self.req_output_token_ids[row]
            new = output[self.num_counted_output_tokens[row] :]
            rows += [row] * len(new)
            token_ids += new
            self.num_counted_output_tokens[row] = len(output)
        self.penalty_reqs_to_bin.clear()
        if rows:
            index = (torch.tensor(rows, device=self.device), torch.tensor(token_ids, device=self.device))
            ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
            self.output_bin_counts.index_put_(index, ones, accumulate=True)
        # END TASK

    @property
    def max_num_logprobs(self) -> int | None:
        return max(self.num_logprobs.values()) if self.num_logprobs else None

    def refresh_metadata(self) -> None:
        """Tell every logits processor what changed since the last step, and rebuild the
        sampling metadata if the batch's rows did; call once per step (output lengths grow
        every step, so a processor's state changes even when rows do not)."""
        batch_update = None
        if self._removed or self._added or self._moved:
            batch_update = BatchUpdate(self.num_reqs, self._removed, self._added, self._moved)
            self._removed, self._added, self._moved = [], [], []
        for processor in self.logitsprocs:
            processor.update_state(batch_update)
        if not self.no_penalties:
            self._update_penalty_bins()
        if batch_update is not None:
            self.sampling_metadata = self._make_sampling_metadata()

    def _make_sampling_metadata(self) -> SamplingMetadata:
        num_reqs = self.num_reqs
        no_penalties = self.no_penalties
        # Columns nobody uses are not copied to the device at all.
        return SamplingMetadata(
            temperature=None if self.all_greedy else self.temperature.copy_to_gpu(num_reqs),
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_p=None if self.no_top_p else self.top_p.copy_to_gpu(num_reqs),
            top_k=None if self.no_top_k else self.top_k.copy_to_gpu(num_reqs),
            generators=self.generators,
            max_num_logprobs=self.max_num_logprobs,
            logitsprocs=self.logitsprocs,
            no_penalties=no_penalties,
            presence_penalties=None if no_penalties else self.presence_penalties.copy_to_gpu(num_reqs),
            frequency_penalties=None if no_penalties else self.frequency_penalties.copy_to_gpu(num_reqs),
            repetition_penalties=None if no_penalties else self.repetition_penalties.copy_to_gpu(num_reqs),
            # Views: the bins are updated in place every step, the metadata only on changes.
            prompt_mask=None if no_penalties else self.prompt_mask[:num_reqs],
            output_bin_counts=None if no_penalties else self.output_bin_counts[:num_reqs],
            output_token_ids=self.req_output_token_ids,
            allowed_token_ids_mask=None
            if not self.has_allowed_token_ids
            else self.allowed_token_ids_mask[:num_reqs],
            bad_words_token_ids=self.bad_words_token_ids,
        )

    def sampling_metadata_for_step(self, discard_req_indices: np.ndarray) -> SamplingMetadata:
        """The batch's sampling metadata, minus the generators of rows whose sample is discarded.

        A seeded request must draw from its generator only for tokens it keeps; otherwise
        its output would depend on how its prompt was chunked.
        """
        metadata = self.sampling_metadata
        discarded = set(discard_req_indices.tolist())
        if discarded.isdisjoint(metadata.generators):
            return metadata
        generators = {row: g for row, g in metadata.generators.items() if row not in discarded}
        return dataclasses.replace(metadata, generators=generators)


def _shapes_logits(params: SamplingParams) -> bool:
    """True for the settings the rejection sampler does not apply to drafts (chapter 10), custom
    logits processors' `extra_args` included (v0.11.0 drafts for those, and its rejection sampler
    never applies the processor to the drafted positions)."""
    return (
        bool(params.extra_args)
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_p > 0.0
        or bool(params.logit_bias)
        or params.allowed_token_ids is not None
        or bool(params.bad_words)
    )
