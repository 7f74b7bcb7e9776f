"""What flows out of the engine: per-step worker output and per-request user output.

Mirrors two vLLM files (chapters 01 and 04):
- vllm/v1/outputs.py: `ModelRunnerOutput`, what the model runner hands back to the
  scheduler after one step, `AsyncModelRunnerOutput`, the same output still on its
  way from the device (async scheduling, chapter 14), `LogprobsTensors`, the logprobs in
  it, and `KVConnectorOutput`, the KV transfers it finished (chapter 16);
- vllm/outputs.py: `RequestOutput` / `CompletionOutput`, what `LLM.generate` returns.

What differs from v0.11.0: `LogprobsTensors` is a dataclass (msgspec sends it to the
frontend by its type hints, chapter 09), not a NamedTuple, and `tolists` builds the
sample logprobs' `{token_id: logprob}` dicts directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from nano_v1.logprobs import PromptLogprobs


# ---------------------------------------------------------------- worker side (vllm/v1/outputs.py)
@dataclass(slots=True)
class LogprobsTensors:
    """Per row (a request's sampled token, or a prompt position): the row's token first, then
    the top `num_logprobs` tokens; and the row's token's rank in the vocabulary (1: the most likely)."""

    logprob_token_ids: torch.Tensor  # [num_rows, 1 + num_logprobs] integer
    logprobs: torch.Tensor  # [num_rows, 1 + num_logprobs] float32
    selected_token_ranks: torch.Tensor  # [num_rows] integer

    def tolists(self, num_logprobs: list[int | None]) -> list[list[dict[int, float]]]:
        """Per row: [{token_id: logprob}] of the sampled token and the row's own top `num_logprobs[row]`
        ([] where that is None: the row asked for none, or its sample was discarded)."""
        token_ids = self.logprob_token_ids.tolist()
        logprobs = self.logprobs.tolist()
        return [
            [] if n is None else [dict(zip(ids[: 1 + n], values[: 1 + n]))]
            for ids, values, n in zip(token_ids, logprobs, num_logprobs)
        ]

    @staticmethod
    def empty_cpu(num_positions: int, num_tokens_per_position: int) -> LogprobsTensors:
        """Uninitialised host tensors for a whole prompt, which a chunked prefill fills chunk by chunk."""
        logprob_token_ids = torch.empty((num_positions, num_tokens_per_position), dtype=torch.int32)
        return LogprobsTensors(
            logprob_token_ids=logprob_token_ids,
            logprobs=torch.empty_like(logprob_token_ids, dtype=torch.float32),
            selected_token_ranks=torch.empty(num_positions, dtype=torch.int32),
        )


@dataclass(slots=True)
class KVConnectorOutput:
    """Asynchronous KV transfers the workers' connectors finished since the last step (chapter 16)."""

    # Requests whose KV was saved or sent: the scheduler may free their blocks now.
    finished_sending: set[str] | None = None
    # Requests whose KV was loaded: the scheduler may schedule them now.
    finished_recving: set[str] | None = None

    def is_empty(self) -> bool:
        return not self.finished_sending and not self.finished_recving


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's results, indexed like the persistent batch.

    `sampled_token_ids[req_id_to_index[r]]` holds the tokens request `r` gained this
    step: one for a decode or a prefill that reached its last prompt token, none for a
    prefill chunk that stopped short (its sample is discarded), and up to 1 + k with
    k speculative tokens.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    # Per request, per sampled token: {token_id: logprob} for the top `logprobs`
    # tokens plus the sampled one. None when no request asked for logprobs.
    logprobs: list[list[dict[int, float]]] | None = None
    # Request id -> its whole prompt's logprobs, for each request asking for them whose
    # prefill completed this step (position i predicts prompt token i + 1).
    prompt_logprobs_dict: dict[str, LogprobsTensors | None] = field(default_factory=dict)
    # What the KV connector finished (chapter 16); None without a connector.
    kv_connector_output: KVConnectorOutput | None = None


class AsyncModelRunnerOutput(ABC):
    """A step's output whose sampled tokens may still be on their way to the host (chapter 14).

    With async scheduling the model runner returns this instead of waiting for the step's
    tokens; whoever sends the output (the worker's output thread, or the in-process
    executor) calls `get_output` once.
    """

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait for the step's tokens to reach the host; return the output. Call once."""


@dataclass(slots=True)
class DraftTokenIds:
    """Draft tokens the proposer made after a step, for the scheduler to schedule next (chapter 10)."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]  # per request; [] for none


@dataclass(slots=True)
class StepTiming:
    """One `execute_model` call, as recorded between `start_step_timing` and `stop_step_timing`.

    The one hook benchmarks time steps with (reached through `LLM.collective_rpc`), so that no
    benchmark needs to wrap the runner's methods.
    """

    num_scheduled_tokens: int
    num_sampled_reqs: int  # requests that gained at least one token this step
    # The whole call; it ends with the step's device -> host sync, except with async scheduling
    # on CUDA, where it returns with the step's tokens still being copied (chapter 14).
    execute_model_s: float
    forward_s: float  # the model's forward call as seen by the host: launches, or graph replays
    encoder_s: float = 0.0  # the vision encoder on this step's images, as seen by the host (chapter 11)
    num_encoder_tokens: int = 0  # image tokens the encoder computed this step


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


# ---------------------------------------------------------------- user side (vllm/outputs.py)
@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything the user sees of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With `SamplingParams.prompt_logprobs`: per prompt token, its logprob and the top ones
    # (None for the first token); else None. A DELTA stream has them in one output only.
    prompt_logprobs: PromptLogprobs | None = None
    # In the final output, what the engine's KV connector says another engine needs to fetch
    # this request's KV (disaggregated prefill, chapter 16); None without.
    kv_transfer_params: dict[str, Any] | None = None
