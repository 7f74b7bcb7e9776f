"""A request as the engine core sees it: token ids, progress, status.

Mirrors vllm/v1/request.py (chapter 04).

The whole unified scheduler rests on two counters kept here: `num_tokens` (prompt plus
output so far) and `num_computed_tokens` (how many of those already have KV in the
cache). A prefill, a prefill chunk, a decode and a prefix-cache hit are all just
different gaps between the two.

What differs from v0.11.0: `append_output_token_ids` calls the block hasher only when
the tokens reach the end of the next block (v0.11.0 calls it on every token and lets it
find no full block); the hashes are the same.
"""

from __future__ import annotations

import enum
import sys
import time
from typing import TYPE_CHECKING, Any

from nano_v1.sampling_params import SamplingParams
from nano_v1.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from nano_v1.core.kv_cache_utils import BlockHash, RequestBlockHasher
    from nano_v1.multimodal.inputs import MultiModalFeatureSpec


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. Every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its grammar is still compiling (chapter 15)
    WAITING_FOR_REMOTE_KVS = enum.auto()  # a KV connector is loading its KV into its blocks (chapter 16)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # the user (or a disconnect) cancelled it

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request inside the engine core."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: "RequestBlockHasher | None" = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = priority
        self.status = RequestStatus.WAITING
        # Structured outputs (chapter 15): the grammar's state; the request waits for it to compile.
        self.structured_output_request: StructuredOutputRequest | None = None
        self.use_structured_output = sampling_params.structured_outputs is not None
        if self.use_structured_output:
            self.status = RequestStatus.WAITING_FOR_FSM
            self.structured_output_request = StructuredOutputRequest(sampling_params)
        self.stop_reason: int | str | None = None
        # Disaggregated prefill (chapter 16): what the KV connector needs to find this request's
        # KV elsewhere, or to let another engine fetch it (`SamplingParams.extra_args`); the
        # connector reads and writes it.
        self.kv_transfer_params: dict[str, Any] | None = None
        if sampling_params.extra_args is not None:
            self.kv_transfer_params = sampling_params.extra_args.get("kv_transfer_params")
        self.max_tokens = sampling_params.max_tokens

        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        # Draft tokens proposed for the next step (speculative decoding, chapter 10).
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Async scheduling (chapter 14): tokens scheduled in steps still running, whose
        # samples have not come back. They count as known to the scheduler (the next step
        # can be scheduled on them), never as tokens of the request: 0 under the
        # synchronous scheduler.
        self.num_output_placeholders = 0
        # Prompt tokens served from the prefix cache on first admission; None until then
        # (an admitted request, the only kind that has outputs, always has a count).
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0

        # Images in the prompt, in prompt order, each with its placeholder positions (chapter 11).
        self.mm_features = mm_features or []
        self.num_encoder_inputs = len(self.mm_features)
        self.has_encoder_inputs = self.num_encoder_inputs > 0

        # Hashes of the request's full blocks, extended as tokens arrive (chapter 03).
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        # How many tokens fill the next unhashed block (never reached without a hasher):
        # `append_output_token_ids` calls `update_block_hashes` only once there.
        self._num_tokens_next_full_block = sys.maxsize
        self.update_block_hashes()

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def get_num_encoder_tokens(self, input_id: int) -> int:
        """Placeholder positions (= encoder output rows) of the request's input `input_id`."""
        return self.mm_features[input_id].mm_position.length

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        # One comparison per token; the call, and the hasher, once per block.
        if len(self._all_token_ids) >= self._num_tokens_next_full_block:
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash any block that the latest tokens have just filled."""
        hasher = self._block_hasher
        if hasher is None:
            return
        if len(self._all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.block_hashes.extend(hasher(self))
        self._num_tokens_next_full_block = (len(self.block_hashes) + 1) * hasher.block_size

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
