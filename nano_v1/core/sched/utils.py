"""Stop conditions checked by the scheduler after each sampled token.

Mirrors vllm/v1/core/sched/utils.py (chapter 04).

Token-level stops (EOS, stop token ids, length) are decided here in the engine core,
where the tokens are; string-level stops need detokenized text and are decided in the
frontend (engine/output_processor.py), which then aborts the request.
"""

from __future__ import annotations

from nano_v1.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status on `request` and return True if its last token ends it.

    A length limit (`request.num_tokens` reaching `max_model_len`, or `max_tokens` output
    tokens) finishes it FINISHED_LENGTH_CAPPED, and outranks a stop. Otherwise the EOS
    token (unless `ignore_eos`) finishes it FINISHED_STOPPED with no `stop_reason`, and
    a stop token id FINISHED_STOPPED with `stop_reason` set to that id. A request that
    goes on keeps its status, and the answer is False.

    `min_tokens` is not checked here: the sampler's `MinTokensLogitsProcessor` never lets
    a request sample a stop token before its minimum, so one here is a real stop (as in
    vLLM v0.11.0).
    """
    # BEGIN TASK ch04_t1: does the last token end the request, and why? Hitting a length limit outranks a stop
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False
    # END TASK
