"""Stop conditions checked by the scheduler after each sampled token.

Mirrors vllm/v1/core/sched/utils.py (chapter 04).

Token-level stops (EOS, stop token ids, length) are decided here in the engine core,
where the tokens are; string-level stops need detokenized text and are decided in the
frontend (engine/output_processor.py), which then aborts the request.
"""

from __future__ import annotations

from nano_v1.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status on `request` and return True if its last token ends it."""
    # BEGIN TASK ch04_t1: length cap first; after min_tokens, stop on EOS or a stop token id
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    max_tokens = request.max_tokens
    if request.num_tokens >= max_model_len or (max_tokens is not None and num_output_tokens >= max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if num_output_tokens < params.min_tokens:
        return False
    last_token_id = output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False
    # END TASK
