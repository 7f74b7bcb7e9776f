"""Messages between the frontend and the engine core.

Mirrors vllm/v1/engine/__init__.py (chapter 09).

Why plain records: the frontend (tokenizer, detokenizer, user API) and the engine core
(scheduler + model runner) talk only through these. In-process they are passed as
objects; chapter 09 puts the core in its own process and sends the same records as
msgpack over ZMQ (`nano_v1/serial_utils.py`).

vLLM declares them as `msgspec.Struct`s; ours are dataclasses, which msgspec encodes and
decodes by their type hints just the same, so the in-process engine (and the GPU image,
which lacks msgspec) never needs msgspec. A new field, even a nested dataclass, travels
over the wire as soon as it has a type hint.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from nano_v1.metrics.stats import SchedulerStats
from nano_v1.multimodal.inputs import MultiModalFeatureSpec
from nano_v1.outputs import LogprobsTensors
from nano_v1.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreRequest:
    """A request after tokenization: what the engine core needs to run it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    # The prompt's images, placeholders already expanded in prompt_token_ids (chapter 11).
    mm_features: list[MultiModalFeatureSpec] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # The whole prompt's logprobs, in the output of the step that completed its prefill
    # (only for requests with `prompt_logprobs`); tensors travel as raw bytes (serial_utils).
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    # In a finished request's last output: what the KV connector says another engine needs
    # to fetch its KV (chapter 16).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    """One step's outputs."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Counts the frontend aggregates (chapter 10); None when the step has none.
    scheduler_stats: SchedulerStats | None = None
    # The answer to one UTILITY call (set instead of `outputs`).
    utility_output: UtilityOutput | None = None


@dataclass(slots=True)
class UtilityOutput:
    """The result of an `EngineCore` method the client called by name (`call_utility`)."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreRequestType(enum.Enum):
    """The first frame of every message to the engine-core process: what the rest is."""

    ADD = b"\x00"  # an EngineCoreRequest
    ABORT = b"\x01"  # a list of request ids
    UTILITY = b"\x02"  # (call_id, method name, args)
    # Never on the wire: the executor's failure callback puts it on the input queue (chapter 13).
    EXECUTOR_FAILED = b"\x03"

