"""`LLM`: the offline front door. Give it prompts, get completions.

Mirrors vllm/entrypoints/llm.py (chapter 01).

Why a separate class over `LLMEngine`: offline use wants one blocking call that takes a
batch and returns results in input order. `generate` validates the whole batch before
queueing any of it (a bad prompt loses nothing), adds every request at once so the
scheduler can batch them, then steps the engine until all are done.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.llm_engine import LLMEngine
from nano_v1.engine.processor import PromptType
from nano_v1.metrics.reader import Metric
from nano_v1.outputs import RequestOutput
from nano_v1.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """An offline engine. `LLM()` loads the bundled demo model; `LLM(model=dir, **engine_args)`
    takes vLLM's engine-argument names (`block_size`, `max_num_seqs`, ...)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if model is not None:
            kwargs["model"] = model
        self._use_engine(LLMEngine.from_engine_args(EngineArgs.from_kwargs(**kwargs)))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, enable_multiprocessing: bool | None = None) -> LLM:
        """`LLM(**kwargs)` from an `EngineArgs`, saying where the engine core runs.

        vLLM's `LLM` has only its constructor, which follows VLLM_ENABLE_V1_MULTIPROCESSING.
        This door takes the choice as `LLMEngine.from_engine_args` does, so that a caller
        that needs the engine core in the calling process (the benchmarks hand functions to
        `collective_rpc`) says so without setting a variable for the whole process. `None`
        follows the variable, as the constructor does.
        """
        llm = cls.__new__(cls)
        llm._use_engine(LLMEngine.from_engine_args(engine_args, enable_multiprocessing))
        return llm

    def _use_engine(self, llm_engine: LLMEngine) -> None:
        self.llm_engine = llm_engine
        self.request_counter = itertools.count()  # request ids, unique within this LLM

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's counters since it started, under vLLM's names:
        `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` (tokens), and with
        speculative decoding `vllm:spec_decode_num_accepted_tokens` and the rest (see
        nano_v1/metrics/reader.py)."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (chapter 03); False if some are still held by running requests."""
        return self.llm_engine.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = ()) -> list[Any]:
        """Run a worker method (by name) or a function `f(worker, *args)` on every worker; one result each.

        vLLM's hook for reaching into the workers; the benchmarks time steps with it
        (`collective_rpc("start_step_timing")`). A function works only with the engine core
        in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, or `from_engine_args(...,
        enable_multiprocessing=False)`): it cannot be sent to another.
        """
        return self.llm_engine.collective_rpc(method, args)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; return one `RequestOutput` per prompt, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; pass one, or one per prompt."
            )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts.")

        # Validate everything first: an error here leaves the engine exactly as it was.
        engine = self.llm_engine
        processed = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            request_id = str(next(self.request_counter))
            try:
                prompt_text, requests = engine.process_request(
                    request_id, prompt, params, priority=priority[i] if priority else 0
                )
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
            processed.append((request_id, prompt_text, requests))
        for request_id, prompt_text, requests in processed:
            engine.add_processed_request(request_id, prompt_text, requests)
        order = {request_id: i for i, (request_id, _, _) in enumerate(processed)}
        outputs = self._run_engine(use_tqdm, total=len(processed))
        return sorted(outputs, key=lambda o: order[o.request_id])

    def _run_engine(self, use_tqdm: bool, total: int) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: list[RequestOutput] = []
        bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    finished.append(output)
                    num_in += len(output.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {num_in / elapsed:.0f} tok/s, output: {num_out / elapsed:.0f} tok/s")
                    bar.update(1)
        except BaseException:
            # Leave the engine clean for the next call: drop what this call left running.
            running = list(engine.output_processor.parent_requests)
            if running:
                engine.abort_request(running)
            raise
        finally:
            bar.close()
        return finished
