"""Structured outputs in the engine core: grammars compiled off the hot path, one bitmask per step.

Mirrors vllm/v1/structured_output/__init__.py (chapter 15).

The division of labour, as in vLLM v1: the scheduler process owns every request's
grammar matcher. When a request arrives, `grammar_init` starts compiling its grammar in
a thread pool (the request waits in `WAITING_FOR_FSM`, and other requests keep being
scheduled). Each step, `grammar_bitmask` writes one packed row per scheduled structured
request, plus one per draft token it verifies, into a single int32 array that travels
with the `SchedulerOutput`; the workers only apply it to the logits
(`utils.apply_grammar_bitmask`). After the step the scheduler advances each matcher by
the tokens accepted (`Scheduler.update_from_output`).

What differs from v0.11.0: one backend (xgrammar), no reasoning parser (so
`should_fill_bitmask` and `should_advance` reduce to "uses structured output"), the
tokenizer loaded on the first structured request rather than at start, bitmask rows
filled serially (v0.11.0 fills batches of over 128 requests in a thread pool), and a
grammar whose compilation fails aborts its request (v0.11.0 lets the error reach the
engine loop).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from nano_v1.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar

if TYPE_CHECKING:
    import torch

    from nano_v1.config import VllmConfig
    from nano_v1.request import Request


class StructuredOutputManager:
    """Engine-level manager for structured output requests."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.backend: StructuredOutputBackend | None = None
        self._grammar_bitmask: torch.Tensor | None = None
        # Compilation is CPU-bound C++ that releases the GIL: half the cores, never the step loop's.
        self.executor = ThreadPoolExecutor(max_workers=max(1, (multiprocessing.cpu_count() + 1) // 2))

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits in WAITING_FOR_FSM until done."""
        if request.structured_output_request is None:
            return
        if self.backend is None:
            from nano_v1.engine.processor import load_tokenizer
            from nano_v1.structured_output.backend_xgrammar import XgrammarBackend

            model_config = self.vllm_config.model_config
            self.backend = XgrammarBackend(
                self.vllm_config, tokenizer=load_tokenizer(model_config), vocab_size=model_config.get_vocab_size()
            )
        request.structured_output_request.grammar = self.executor.submit(self._async_create_grammar, request)

    def _async_create_grammar(self, request: Request) -> StructuredOutputGrammar:
        request_type, grammar_spec = request.structured_output_request.structured_output_key
        assert self.backend is not None
        return self.backend.compile_grammar(request_type, grammar_spec)

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        structured_output_request_ids: dict[str, int],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> np.ndarray | None:
        """The step's bitmask, [rows, ceil(vocab / 32)] int32, 32 tokens per word (bit t set: token t allowed).

        Rows are packed from row 0, the structured requests in scheduler order (by their index
        in `structured_output_request_ids`). Each request gets «a row per draft» token (the mask
        for that draft's position: the matcher advanced over the drafts before it) and «one for
        the bonus token» after them all; every draft is accepted by its matcher as it goes (drafts
        were validated on arrival), and the matcher is «rolled back» by as many before the next
        request: it moves only when the step's tokens arrive (`update_from_output`). A row whose
        grammar «is terminated» allows every token (all bits set, -1): the stop check ends the
        request. Returns the filled rows as numpy."""
        if not structured_output_request_ids:
            return None
        if self._grammar_bitmask is None:
            assert self.backend is not None
            speculative_config = self.vllm_config.speculative_config
            max_num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
            max_batch_size = self.vllm_config.scheduler_config.max_num_seqs
            self._grammar_bitmask = self.backend.allocate_token_bitmask(max_batch_size * (1 + max_num_spec_tokens))
        bitmask = self._grammar_bitmask

        # BEGIN TASK ch15_t1: per request in scheduler order, a row per draft (matcher advanced over the drafts before it) and one for the bonus token; roll back; terminated -> all allowed
        cumulative_index = 0
        for req_id, _ in sorted(structured_output_request_ids.items(), key=lambda item: item[1]):
            grammar = requests[req_id].structured_output_request.grammar
            num_advanced = 0
            for token in [*scheduled_spec_decode_tokens.get(req_id, ()), None]:
                if grammar.is_terminated():
                    bitmask[cumulative_index].fill_(-1)  # finished: the stop check ends it, mask nothing
                else:
                    grammar.fill_bitmask(bitmask, cumulative_index)
                    if token is not None:
                        accepted = grammar.accept_tokens(req_id, [token])  # not inside the assert: python -O drops those
                        assert accepted, "drafts were validated on arrival"
                        num_advanced += 1
                cumulative_index += 1
            if num_advanced:
                grammar.rollback(num_advanced)
        # numpy, not a tensor: it travels to the workers with the SchedulerOutput. A view of the
        # manager's array, as in v0.11.0: read before the next schedule() (the step is done by then).
        return bitmask[:cumulative_index].numpy()
        # END TASK

    def should_advance(self, request: Request) -> bool:
        """Whether the request's matcher follows its tokens (always, without a reasoning parser)."""
        return request.use_structured_output

    def clear_backend(self) -> None:
        if self.backend is not None:
            self.backend.destroy()
        self.executor.shutdown(wait=False, cancel_futures=True)
