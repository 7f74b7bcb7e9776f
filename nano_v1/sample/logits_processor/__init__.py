"""Logits processors: per-request edits of the logits that follow the persistent batch, the
builtin ones and the user's own.

Mirrors vllm/v1/sample/logits_processor/__init__.py (`build_logitsprocs`,
`AdapterLogitsProcessor`) (chapters 01 and 05).

Why it exists: a custom sampling rule (force a token, ban a phrase, a grammar) must run
inside the sampler, batched, on the worker, so the user hands the engine a class, not an
object: `LLM(..., logits_processors=[MyProcessor])` or `"my.module:MyProcessor"`.
`build_logitsprocs` makes one instance per worker with v0.11.0's constructor arguments; the
persistent batch then feeds it `BatchUpdate`s like the builtin ones, and each request opts
in through its `SamplingParams.extra_args`. A worker in another process (chapter 09)
unpickles its config, so there the class must be importable: pass its name.

What differs from v0.11.0: installed plugins are looked up under the entry-point group
"nano_v1.logits_processors" (a plugin for vLLM imports vLLM); there is no pooling model to
refuse; processors are a plain list (the sampler asks each `is_argmax_invariant`), not
v0.11.0's `LogitsProcessors` holder.
"""

from __future__ import annotations

import importlib
import inspect
from abc import abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

import torch

from nano_v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    process_dict_updates,
)
from nano_v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from nano_v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig

# Installed packages register processors under this entry-point group; every engine loads them.
LOGITSPROCS_GROUP = "nano_v1.logits_processors"

# Every engine's, in v0.11.0's order (the sampler keeps it within each kind).
BUILTIN_LOGITS_PROCESSORS: list[type[LogitsProcessor]] = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
]

# One request's own rule, v0.11.0's `vllm.logits_process.LogitsProcessor`:
# (output token ids, logits row) -> logits row, or (prompt ids, output ids, logits row) -> row.
RequestLogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor]
    | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)


def _load_logitsprocs_plugins() -> list[type[LogitsProcessor]]:
    """The processor classes installed packages register under `LOGITSPROCS_GROUP`."""
    classes = []
    for entrypoint in entry_points(group=LOGITSPROCS_GROUP):
        try:
            classes.append(entrypoint.load())
        except Exception as e:
            raise RuntimeError(f"Failed to load LogitsProcessor plugin {entrypoint}") from e
    return classes


def _load_logitsprocs_by_fqcns(
    logits_processors: Sequence[str | type[LogitsProcessor]] | None,
) -> list[type[LogitsProcessor]]:
    """Classes as given, names ("module.path:Class", v0.11.0's syntax) imported; each must
    subclass `LogitsProcessor`."""
    classes: list[type[LogitsProcessor]] = []
    for ldx, logitproc in enumerate(logits_processors or ()):
        if isinstance(logitproc, type):
            if not issubclass(logitproc, LogitsProcessor):
                raise ValueError(f"{logitproc.__name__} is not a subclass of LogitsProcessor")
            classes.append(logitproc)
            continue
        if not isinstance(logitproc, str) or logitproc.count(":") != 1:
            raise ValueError(
                f"logits processor {logitproc!r} is neither a LogitsProcessor subclass nor a fully "
                "qualified class name written 'module.path:ClassName'."
            )
        module_path, qualname = logitproc.split(":")
        try:
            module = importlib.import_module(module_path)
        except Exception as e:
            raise RuntimeError(f"Failed to load {ldx}th LogitsProcessor plugin {logitproc}") from e
        obj = module
        for attr in qualname.split("."):
            if not hasattr(obj, attr):
                raise ValueError(f"logits processor {logitproc!r}: {module_path} has no {qualname}.")
            obj = getattr(obj, attr)
        if not isinstance(obj, type):
            raise ValueError("Loaded logit processor must be a type.")
        if not issubclass(obj, LogitsProcessor):
            raise ValueError(f"{obj.__name__} must be a subclass of LogitsProcessor")
        classes.append(obj)
    return classes


def _load_custom_logitsprocs(
    logits_processors: Sequence[str | type[LogitsProcessor]] | None,
) -> list[type[LogitsProcessor]]:
    """The installed plugins' classes, then the user's (`ModelConfig.logits_processors`)."""
    return _load_logitsprocs_plugins() + _load_logitsprocs_by_fqcns(logits_processors)


def build_logitsprocs(
    vllm_config: VllmConfig | None,
    device: torch.device,
    is_pin_memory: bool,
    custom_logitsprocs: Sequence[str | type[LogitsProcessor]] = (),
) -> list[LogitsProcessor]:
    """One instance of each builtin processor, then of each plugin and custom one, for one worker."""
    classes = BUILTIN_LOGITS_PROCESSORS + _load_custom_logitsprocs(custom_logitsprocs)
    return [cls(vllm_config, device, is_pin_memory) for cls in classes]


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch-level processor made of per-request functions (`RequestLogitsProcessor`).

    A subclass says which requests get a function, and which (`new_req_logits_processor`);
    this class keeps row -> function across the batch's changes and applies each to its row.
    Simple, but one Python call per row and step: a processor meant for many rows should
    edit the whole batch in one tensor operation instead.
    """

    def __init__(self, vllm_config: VllmConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        # Row -> the request's function with its token lists bound (by reference: it always
        # sees the latest output tokens).
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's function, or None to leave its rows alone."""

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> partial[torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        takes_prompt = len(inspect.signature(req_lp).parameters) == 3
        return partial(req_lp, prompt_ids, output_ids) if takes_prompt else partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, req_lp in self.req_info.items():
            row_logits = logits[row]
            new_logits = req_lp(row_logits)
            if new_logits is not row_logits:
                logits[row] = new_logits
        return logits


__all__ = [
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "BUILTIN_LOGITS_PROCESSORS",
    "LOGITSPROCS_GROUP",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "build_logitsprocs",
]
