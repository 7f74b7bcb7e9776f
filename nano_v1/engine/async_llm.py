"""The asyncio engine behind the API server: many concurrent streams over one engine core.

Mirrors vllm/v1/engine/async_llm.py (chapter 09).

Why a second frontend: `LLMEngine` serves one caller who steps it in a loop. A server
has many callers arriving at any time, each awaiting its own stream. Here the engine
core always runs in its own process (`AsyncMPClient`), and one background task, the
output handler, is the only reader of its outputs: it detokenizes each step's outputs
(`OutputProcessor`), puts each request's `RequestOutput` on that request's queue, where
`generate()` is waiting, and hands the step's statistics to the stat loggers.
Tokenizing new prompts runs in a thread of its own, so that a long prompt never stalls
the event loop that every stream shares; detokenizing and the HTTP work run in this
process while the core computes the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncGenerator, Sequence

from nano_v1.config import VllmConfig
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.core_client import AsyncMPClient, EngineCoreClient
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.engine.llm_engine import fan_out
from nano_v1.engine.output_processor import OutputProcessor
from nano_v1.engine.processor import Processor, PromptType, load_tokenizer
from nano_v1.metrics.loggers import StatLoggerBase
from nano_v1.metrics.stats import IterationStats
from nano_v1.outputs import RequestOutput
from nano_v1.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineShutdownError(Exception):
    """The server stops at once (a second Ctrl-C): a request it still had ends with this, unfinished."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; the request was not finished")


class AsyncLLM:
    """Create inside a running event loop (`AsyncLLM.from_engine_args(...)`)."""

    def __init__(self, vllm_config: VllmConfig, stat_loggers: Sequence[StatLoggerBase] = ()) -> None:
        self.vllm_config = vllm_config
        self.tokenizer = load_tokenizer(vllm_config.model_config)
        self.processor = Processor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers)
        # One thread: requests are tokenized in arrival order, and a Hugging Face tokenizer is
        # never entered by two threads at once. The tokenizers library releases the GIL meanwhile.
        self.tokenizer_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="Tokenizer")
        self.engine_core: AsyncMPClient = EngineCoreClient.make_client(
            multiprocess_mode=True, asyncio_mode=True, vllm_config=vllm_config
        )
        # Per user request: the queue its `generate()` awaits (outputs, or the error that ended it).
        self.request_queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self.dead_error: EngineDeadError | None = None
        self.output_handler = asyncio.create_task(self._run_output_handler(), name="AsyncLLMOutputHandler")

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: Sequence[StatLoggerBase] = ()
    ) -> "AsyncLLM":
        return cls(engine_args.create_engine_config(), stat_loggers)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def errored(self) -> bool:
        """True once the engine core is dead: nothing more can be served (vLLM's name)."""
        return self.dead_error is not None or self.engine_core.resources.engine_dead

    async def run_in_tokenizer_thread(self, fn, *args):
        """`fn(*args)` in the tokenizer's thread: tokenizer work off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_executor, fn, *args)

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> asyncio.Queue[RequestOutput | Exception]:
        """Validate (raising ValueError), then queue the request in the core; return its output queue.

        All or nothing: if anything fails once the request is registered (the core died, the
        caller was cancelled, a message could not be encoded), the registration is undone and
        whatever reached the core is aborted, so a failed request leaves no state anywhere.
        """
        if self.errored:
            raise self.dead_error or EngineDeadError()
        prompt_text, request = await self.run_in_tokenizer_thread(
            self.processor.process_inputs, request_id, prompt, params
        )
        requests = fan_out(request)
        self.output_processor.add_request(request_id, prompt_text, requests)  # ValueError for a duplicate id
        request_queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.request_queues[request_id] = request_queue
        try:
            for child in requests:
                await self.engine_core.add_request_async(child)
        except BaseException:
            await self.abort(request_id)
            raise
        return request_queue

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as they come (deltas with `output_kind=DELTA`).

        If the caller stops iterating (a client disconnected, its task was cancelled), the
        request is aborted in the core, so its KV blocks go back to the pool at once.
        """
        request_queue = await self.add_request(request_id, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                output = await request_queue.get()
                if isinstance(output, Exception):
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request (no error if it already finished)."""
        self.request_queues.pop(request_id, None)
        await self.engine_core.abort_requests_async(self.output_processor.abort_requests([request_id]))

    async def _run_output_handler(self) -> None:
        """The one reader of the core's outputs: detokenize, count, route, abort stop-string hits."""
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                iteration_stats = IterationStats() if self.stat_loggers else None
                processed = self.output_processor.process_outputs(outputs.outputs, iteration_stats)
                # Counted before anyone is woken: a response never gets ahead of its own metrics.
                for stat_logger in self.stat_loggers:
                    stat_logger.record(outputs.scheduler_stats, iteration_stats)
                for output in processed.request_outputs:
                    request_queue = self.request_queues.get(output.request_id)
                    if request_queue is not None:
                        request_queue.put_nowait(output)
                    if output.finished:
                        self.request_queues.pop(output.request_id, None)
                await self.engine_core.abort_requests_async(processed.reqs_to_abort)
        except Exception as e:
            # The core is gone (or the output path broke): fail every waiting and future request.
            self.dead_error = e if isinstance(e, EngineDeadError) else EngineDeadError(repr(e))
            logger.error("AsyncLLM output handler stopped: %s", self.dead_error)
            self.end_requests(self.dead_error)

    def end_requests(self, error: Exception) -> int:
        """End every open request's `generate()` with `error` (which then aborts it in the core);
        return how many there were."""
        request_queues = list(self.request_queues.values())
        for request_queue in request_queues:
            request_queue.put_nowait(error)
        self.request_queues.clear()
        return len(request_queues)

    def get_num_unfinished_requests(self) -> int:
        """User requests the frontend still holds state for (queues, detokenizers); 0 when idle."""
        return len(self.request_queues.keys() | self.output_processor.parent_requests.keys())

    def do_log_stats(self) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.log()

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine core is gone."""
        if self.dead_error is not None:
            raise self.dead_error
        self.engine_core.ensure_alive()

    def shutdown(self) -> None:
        self.output_handler.cancel()
        self.tokenizer_executor.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown()
