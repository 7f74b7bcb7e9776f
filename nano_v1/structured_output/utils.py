"""Structured outputs' helpers on both sides of the step: the runner's mask, the front end's choice.

Mirrors vllm/v1/structured_output/utils.py (chapter 15).

`apply_grammar_bitmask` is the worker's whole part in structured outputs: the scheduler
process sends one packed bitmask for the step (`SchedulerOutput.grammar_bitmask`, 32
tokens per int32, a row per structured request and per draft token of it), and the
runner sets to -inf every logit whose bit is clear, before sampling.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from nano_v1.core.sched.output import SchedulerOutput
    from nano_v1.worker.gpu_input_batch import InputBatch


def apply_grammar_bitmask(
    scheduler_output: SchedulerOutput,
    input_batch: InputBatch,
    logits: torch.Tensor,
    device: torch.device,
) -> None:
    """Mask `logits` ([num_reqs + num_drafts, vocab]) in place with the step's grammar bitmask:
    -inf wherever a row's bit is clear (`xgr.apply_token_bitmask_inplace`).

    The two arrays order their rows differently. The bitmask's come in «the scheduler's order»
    (`structured_output_request_ids`: request id -> its index in the scheduler's list, not a
    logits row), each structured request's «1 + its drafts» rows together. The logits' come in
    «the batch's order» (`input_batch.req_ids`, a request's first row at `req_id_to_index`), each
    request with its draft rows before its bonus row, so that «every earlier request's drafts»,
    structured or not, shift a request's first logits row down. Rows of «unconstrained requests
    stay untouched».
    """
    grammar_bitmask = scheduler_output.grammar_bitmask
    if grammar_bitmask is None:
        return
    # BEGIN TASK ch15_t2: each structured request's first logits row in batch order (earlier requests' drafts shift it); its 1 + drafts bitmask rows (scheduler order) go there; mask those rows only
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    # Each structured request's first logits row: drafts of the requests before it shift it down.
    struct_out_req_batch_indices: dict[str, int] = {}
    cumulative_offset = 0
    for req_id in input_batch.req_ids:
        logit_index = input_batch.req_id_to_index[req_id] + cumulative_offset
        cumulative_offset += len(spec_tokens.get(req_id, ()))
        if req_id in scheduler_output.structured_output_request_ids:
            struct_out_req_batch_indices[req_id] = logit_index

    # The bitmask's rows moved to their logits rows; every other row allows every token (-1).
    sorted_bitmask = np.full((logits.shape[0], grammar_bitmask.shape[1]), -1, dtype=grammar_bitmask.dtype)
    out_indices: list[int] = []
    cumulative_index = 0
    ordered = sorted(scheduler_output.structured_output_request_ids.items(), key=lambda item: item[1])
    for req_id, _ in ordered:
        num_rows = 1 + len(spec_tokens.get(req_id, ()))
        if req_id in struct_out_req_batch_indices:
            logit_index = struct_out_req_batch_indices[req_id]
            sorted_bitmask[logit_index : logit_index + num_rows] = grammar_bitmask[
                cumulative_index : cumulative_index + num_rows
            ]
            out_indices.extend(range(logit_index, logit_index + num_rows))
        cumulative_index += num_rows

    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits,
        torch.from_numpy(sorted_bitmask).to(device, non_blocking=True),
        indices=out_indices if len(out_indices) != logits.shape[0] else None,
    )
    # END TASK


def choice_as_grammar(choice: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings (each quoted as a JSON
    string, whose escapes xgrammar's EBNF reads the same)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)
