"""The synchronous engine: frontend (tokenize, detokenize) around an engine core.

Mirrors vllm/v1/engine/llm_engine.py (chapters 01 and 09).

Why this layering: the engine core works only in token ids and knows nothing of text
or of `n`; this class owns the tokenizer, validates input (`Processor`), fans out
`n > 1` into independent core requests, and turns core outputs back into
`RequestOutput`s (`OutputProcessor`). With `multiprocess_mode` the core runs in its own
process (chapter 09): `step()` then only waits for the core's next outputs and
detokenizes them, while the core is already computing the step after.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from nano_v1 import envs
from nano_v1.config import VllmConfig
from nano_v1.engine import EngineCoreRequest
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.core_client import EngineCoreClient
from nano_v1.engine.output_processor import OutputProcessor
from nano_v1.engine.processor import Processor, PromptType, load_tokenizer
from nano_v1.metrics.reader import Metric, prefix_cache_metrics, spec_decoding_metrics
from nano_v1.metrics.stats import PrefixCacheStats, SchedulerStats
from nano_v1.outputs import RequestOutput
from nano_v1.sampling_params import SamplingParams
from nano_v1.spec_decode.metrics import SpecDecodingStats


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """One core request per completion: `n > 1` becomes n independent `"{index}_{id}"` requests."""
    n = request.sampling_params.n
    if n == 1:
        return [request]
    children = []
    for index in range(n):
        child_params = copy.copy(request.sampling_params)
        child_params.n = 1
        if child_params.seed is not None:
            child_params.seed += index  # distinct but reproducible streams
        child_id = f"{index}_{request.request_id}"
        children.append(dataclasses.replace(request, request_id=child_id, sampling_params=child_params))
    return children


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, multiprocess_mode: bool = False) -> None:
        self.vllm_config = vllm_config
        self.tokenizer = load_tokenizer(vllm_config.model_config)
        self.processor = Processor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCoreClient.make_client(
            multiprocess_mode=multiprocess_mode, asyncio_mode=False, vllm_config=vllm_config
        )
        # Running totals of the core's per-step statistics, read by get_metrics().
        self.prefix_cache_stats = PrefixCacheStats()
        speculative_config = vllm_config.speculative_config
        self.spec_decoding_stats = (
            None if speculative_config is None else SpecDecodingStats.new(speculative_config.num_speculative_tokens)
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, enable_multiprocessing: bool | None = None) -> "LLMEngine":
        """`enable_multiprocessing=None` follows VLLM_ENABLE_V1_MULTIPROCESSING (default: on)."""
        if enable_multiprocessing is None:
            enable_multiprocessing = envs.enable_v1_multiprocessing()
        return cls(engine_args.create_engine_config(), multiprocess_mode=enable_multiprocessing)

    def get_tokenizer(self):
        return self.tokenizer

    def process_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0,
    ) -> tuple[str | None, list[EngineCoreRequest]]:
        """Validate and tokenize; return the prompt text and one core request per completion.

        Nothing is queued yet, so a caller can validate a whole batch before adding any of it.
        """
        if request_id in self.output_processor.parent_requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        prompt_text, request = self.processor.process_inputs(request_id, prompt, params, arrival_time, priority)
        return prompt_text, fan_out(request)

    def add_processed_request(self, request_id: str, prompt_text: str | None, requests: list[EngineCoreRequest]) -> None:
        self.output_processor.add_request(request_id, prompt_text, requests)
        for request in requests:
            self.engine_core.add_request(request)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        prompt_text, requests = self.process_request(request_id, prompt, params, arrival_time, priority)
        self.add_processed_request(request_id, prompt_text, requests)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        unknown = [r for r in request_ids if r not in self.output_processor.parent_requests]
        if unknown:
            raise ValueError(f"unknown or already finished request id(s): {unknown}.")
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        if outputs.scheduler_stats is not None:
            self._record_stats(outputs.scheduler_stats)
        return processed.request_outputs

    def _record_stats(self, scheduler_stats: SchedulerStats) -> None:
        self.prefix_cache_stats.add(scheduler_stats.prefix_cache_stats)
        if scheduler_stats.spec_decoding_stats is not None:
            self.spec_decoding_stats.add(scheduler_stats.spec_decoding_stats)

    def get_metrics(self) -> list[Metric]:
        """Totals since the engine started, as vLLM names them: the prefix-cache counters,
        then speculative decoding's, when it is on (vLLM registers those only then)."""
        metrics = prefix_cache_metrics(self.prefix_cache_stats)
        if self.spec_decoding_stats is not None:
            metrics += spec_decoding_metrics(self.spec_decoding_stats)
        return metrics

    def reset_prefix_cache(self) -> bool:
        """`EngineCore.reset_prefix_cache`, wherever the engine core runs (vLLM's name)."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = ()) -> list[Any]:
        """`EngineCore.collective_rpc`, wherever the engine core runs (a function only in-process)."""
        return self.engine_core.call_utility("collective_rpc", method, tuple(args))

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parent_requests)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def shutdown(self) -> None:
        """Stop the engine-core process, if there is one."""
        self.engine_core.shutdown()
