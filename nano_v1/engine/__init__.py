"""Messages between the frontend and the engine core.

Mirrors vllm/v1/engine/__init__.py (chapter 09).

Why plain records: the frontend (tokenizer, detokenizer, user API) and the engine core
(scheduler + model runner) talk only through these. In-process they are passed as
objects; chapter 09 puts the core in its own process and sends the same records as
msgpack over ZMQ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nano_v1.metrics.stats import SchedulerStats
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


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    """One step's outputs."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Counts the frontend aggregates (chapter 10); None when the step has none.
    scheduler_stats: SchedulerStats | None = None
