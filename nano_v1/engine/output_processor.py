"""Output processing in the frontend: token ids in, user-facing `RequestOutput`s out.

Mirrors vllm/v1/engine/output_processor.py and vllm/v1/engine/parallel_sampling.py
(chapter 09).

Why in the frontend: detokenization and stop-string matching are pure Python string
work. Keeping them out of the engine core keeps the core's busy loop on the model; with
the core in its own process (chapter 09), this work overlaps the next step. A stop
string found here finishes the request, and the caller tells the core to abort it.

`n > 1` is fanned out here too: the core only ever sees independent requests
(`"{index}_{request_id}"`); a parent gathers their completions into one output.

What differs from v0.11.0: no `LogprobsProcessor` per request (vllm/v1/engine/logprobs.py).
Sample logprobs stay the core's `{token_id: logprob}` dicts; prompt logprobs become
`Logprob` dicts once per parent (`OutputProcessor._update_prompt_logprobs`), from the
first child whose prefill completes, where v0.11.0 keeps a copy per child.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from nano_v1.engine import EngineCoreOutput, EngineCoreRequest
from nano_v1.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from nano_v1.logprobs import Logprob, PromptLogprobs
from nano_v1.metrics.stats import IterationStats, RequestStateStats
from nano_v1.outputs import CompletionOutput, LogprobsTensors, RequestOutput
from nano_v1.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    """The user's request when `n > 1`: one completion per child request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    completions: list[CompletionOutput | None]
    num_cached_tokens: int = 0
    # With `prompt_logprobs`: [None] until the first child's prefill completes, then the
    # whole prompt's (`_update_prompt_logprobs`); None without. A DELTA output takes them once.
    prompt_logprobs: PromptLogprobs | None = None
    # Per completion, (tokens, characters) already sent: what DELTA outputs skip. Both only
    # grow: what was sent cannot be taken back.
    num_sent: list[tuple[int, int]] = field(default_factory=list)
    # The KV connector's params from a child's last output (chapter 16), for the final output.
    kv_transfer_params: dict[str, Any] | None = None

    def finished(self) -> bool:
        return all(c is not None and c.finished() for c in self.completions)


@dataclass
class RequestState:
    """Frontend state of one engine-core request."""

    request_id: str
    parent: ParentRequest
    index: int  # which of the parent's n completions this is
    detokenizer: IncrementalDetokenizer
    stop: list[str]
    include_stop_str_in_output: bool
    # Characters held back from a running request's output: a stop string may have begun
    # there, and text once streamed cannot be taken back when it completes next step.
    stop_buffer_length: int
    stats: RequestStateStats
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None

    def visible_text(self, text: str, finished: bool) -> str:
        """`text` less the held-back tail of a running request; it only grows as `text` does."""
        if finished or not self.stop_buffer_length:
            return text
        return text[: max(len(text) - self.stop_buffer_length, 0)]


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Requests finished here (by a stop string) that the engine core must abort.
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self, parent_id: str, prompt: str | None, requests: list[EngineCoreRequest]
    ) -> None:
        """Register a user request and its child engine-core requests (one per completion)."""
        if parent_id in self.parent_requests:
            raise ValueError(f"request id {parent_id!r} is already in use.")
        first = requests[0]
        parent = ParentRequest(
            request_id=parent_id,
            prompt=prompt,
            prompt_token_ids=first.prompt_token_ids,
            output_kind=first.sampling_params.output_kind,
            completions=[None] * len(requests),
            prompt_logprobs=None if first.sampling_params.prompt_logprobs is None else [None],
            num_sent=[(0, 0)] * len(requests),
        )
        self.parent_requests[parent_id] = parent
        for index, request in enumerate(requests):
            params = request.sampling_params
            self.request_states[request.request_id] = RequestState(
                request_id=request.request_id,
                parent=parent,
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer if params.detokenize else None,
                    request.prompt_token_ids,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                ),
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                stop_buffer_length=(
                    max(map(len, params.stop)) - 1 if params.stop and not params.include_stop_str_in_output else 0
                ),
                stats=RequestStateStats(arrival_time=request.arrival_time),
                logprobs=[] if params.logprobs is not None else None,
            )

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget user requests; return their engine-core request ids to abort in the core."""
        child_ids = []
        for parent_id in request_ids:
            parent = self.parent_requests.pop(parent_id, None)
            if parent is None:
                continue
            ids = [rid for rid, st in self.request_states.items() if st.parent is parent]
            for rid in ids:
                del self.request_states[rid]
            child_ids.extend(ids)
        return child_ids

    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], iteration_stats: IterationStats | None = None
    ) -> OutputProcessorOutput:
        """Turn one step's engine-core outputs into the users' `RequestOutput`s.

        Each output belongs to one engine-core request. One of a request this processor no
        longer holds is dropped: the user aborted it, or a stop string ended it here before the
        core saw the abort. For the others, first the prompt logprobs and the KV connector's
        `kv_transfer_params` (chapter 16; a final output carries them) go to the parent; then, in order:

        - count it in `iteration_stats`, if given (`IterationStats.update_from_output`);
        - append its token ids (and logprobs, if the request asked for them) to the request's
          state, and detokenize the new ones (`IncrementalDetokenizer.update`);
        - look for a stop string that the new text completes; it may have begun in an earlier
          step (`find_stop_string`). A hit finishes the request here, with finish reason "stop"
          and the stop string as stop reason, even if the core finished it for another reason
          in this step; its text ends before the stop string, or after it with
          `include_stop_str_in_output`;
        - record the completion in its parent (`ParentRequest`: the user's request, which
          `n > 1` children share): the text so far less a running request's held-back tail
          (`RequestState.visible_text`), every token id (and logprob) so far, the finish and
          stop reasons; the parent keeps the largest `num_cached_tokens` its children report;
        - free a finished request's state, and its parent's once every child has finished.

        Then one `RequestOutput` per user request that got output in this step, in the order
        of their first outputs (`_make_request_output`: DELTA sends what is new, CUMULATIVE
        everything so far); a FINAL_ONLY request gets only its final one, once all n
        completions are finished.

        `reqs_to_abort` lists the requests a stop string finished here while the core still
        runs them: the core would otherwise go on generating, and holding their KV blocks,
        until max_tokens. Not those the core finished itself: it has freed them already, and
        an ABORT sent after their id is reused would end the new request.
        """
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            if out.new_prompt_logprobs_tensors is not None:
                self._update_prompt_logprobs(state.parent, out.new_prompt_logprobs_tensors)
            if out.kv_transfer_params is not None:
                state.parent.kv_transfer_params = out.kv_transfer_params
        # BEGIN TASK ch09_t3: this step's text, stop strings and outputs per user request; what a stop string ends, the core must abort
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        touched: dict[str, ParentRequest] = {}  # the parents of this step's outputs, in order
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile, by the user or after a stop string
            parent = state.parent
            if iteration_stats is not None:
                iteration_stats.update_from_output(
                    len(out.new_token_ids), len(parent.prompt_token_ids), state.stats
                )
            state.token_ids.extend(out.new_token_ids)
            if state.logprobs is not None and out.new_logprobs:
                state.logprobs.extend(out.new_logprobs)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            delta = state.detokenizer.update(out.new_token_ids)
            text = state.detokenizer.output_text
            if state.stop and delta:
                hit = find_stop_string(text, len(delta), state.stop)
                if hit is not None:
                    stop_str, idx = hit
                    text = text[: idx + len(stop_str)] if state.include_stop_str_in_output else text[:idx]
                    finish_reason, stop_reason = "stop", stop_str
                    if not out.finished:
                        reqs_to_abort.append(out.request_id)  # the core still runs it
            text = state.visible_text(text, finished=finish_reason is not None)
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            parent.completions[state.index] = CompletionOutput(
                index=state.index,
                text=text,
                token_ids=state.token_ids,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                logprobs=state.logprobs,
            )
            touched[parent.request_id] = parent
            if finish_reason is not None:
                if iteration_stats is not None:
                    iteration_stats.update_from_finished_request(finish_reason)
                del self.request_states[out.request_id]
                if parent.finished():
                    del self.parent_requests[parent.request_id]
        for parent in touched.values():
            if parent.output_kind != RequestOutputKind.FINAL_ONLY or parent.finished():
                request_outputs.append(self._make_request_output(parent))
        return OutputProcessorOutput(request_outputs=request_outputs, reqs_to_abort=reqs_to_abort)
        # END TASK

    def _update_prompt_logprobs(self, parent: ParentRequest, prompt_logprobs_tensors: LogprobsTensors) -> None:
        """Turn the prompt logprobs from the engine core into `Logprob` dicts, one per prompt token
        after the first: its own token (with its rank) and the top ones (ranks 1, 2, ...), with
        their text. Only the first child's count: the `n` children share the prompt."""
        if parent.prompt_logprobs != [None]:
            return
        token_ids = prompt_logprobs_tensors.logprob_token_ids.tolist()
        logprobs = prompt_logprobs_tensors.logprobs.tolist()
        ranks = prompt_logprobs_tensors.selected_token_ranks.tolist()
        for ids, values, rank in zip(token_ids, logprobs, ranks):
            parent.prompt_logprobs.append(
                {
                    token_id: Logprob(logprob, r, None if self.tokenizer is None else self.tokenizer.decode([token_id]))
                    for token_id, logprob, r in zip(ids, values, itertools.chain((rank,), itertools.count(1)))
                }
            )

    def _make_request_output(self, parent: ParentRequest) -> RequestOutput:
        """The parent's output now: per completion, DELTA's new tokens and text since the last
        output, else everything so far."""
        completions = []
        for c in parent.completions:
            if c is None:
                continue
            num_tokens, num_chars = parent.num_sent[c.index] if parent.output_kind == RequestOutputKind.DELTA else (0, 0)
            parent.num_sent[c.index] = (len(c.token_ids), len(c.text))
            logprobs = c.logprobs[num_tokens:] if c.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    c.index, c.text[num_chars:], c.token_ids[num_tokens:], c.finish_reason, c.stop_reason, logprobs
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished(),
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=_pop_prompt_logprobs(parent),
            kv_transfer_params=parent.kv_transfer_params if parent.finished() else None,
        )


def _pop_prompt_logprobs(parent: ParentRequest) -> PromptLogprobs | None:
    """The parent's prompt logprobs for its next output: all of them, except that a DELTA stream
    gets them in its first output only (the step its first prefill completed), then []."""
    prompt_logprobs = parent.prompt_logprobs
    if parent.output_kind == RequestOutputKind.DELTA and prompt_logprobs:
        parent.prompt_logprobs = []
    return prompt_logprobs
