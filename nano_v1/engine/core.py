"""The engine core: scheduler + worker, and the step that joins them.

Mirrors vllm/v1/engine/core.py (chapters 02, 04 and 09).

Why it is this small: everything clever lives in the scheduler (what to run) and the
model runner (how to run it). One `step()` is schedule -> execute -> update, and data
only flows forward: `SchedulerOutput` -> `ModelRunnerOutput` -> `EngineCoreOutputs`.
Chapter 09 wraps this class in a process with a busy loop (`EngineCoreProc`): two IO
threads move messages between ZMQ sockets and in-process queues, so that socket and
(de)serialization work overlaps the model, and the busy loop touches only queues.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from nano_v1.config import VllmConfig
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, UtilityOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.worker.gpu_worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.model_executor = Worker(vllm_config)
        self.model_executor.init_device()
        self.model_executor.load_model()
        self._initialize_kv_caches()
        self.model_executor.compile_or_warm_up_model()
        self.scheduler = Scheduler(vllm_config)
        cache_config = vllm_config.cache_config
        self.request_block_hasher = (
            get_request_block_hasher(cache_config.block_size) if cache_config.enable_prefix_caching else None
        )

    def _initialize_kv_caches(self) -> None:
        """Size the paged KV cache from the memory left after the model (chapter 02)."""
        cache_config = self.vllm_config.cache_config
        max_model_len = self.vllm_config.model_config.max_model_len
        start = time.perf_counter()
        page_size = self.model_executor.get_kv_cache_page_size()  # bytes per block, all layers
        if cache_config.num_gpu_blocks_override is not None:
            num_blocks = cache_config.num_gpu_blocks_override
        else:
            num_blocks = self.model_executor.determine_available_memory() // page_size
        # Block 0 is the null block, never handed out: one request of max_model_len must fit in the rest.
        capacity = (num_blocks - 1) * cache_config.block_size
        if capacity < max_model_len:
            raise ValueError(
                f"the KV cache holds {max(capacity, 0)} tokens ({num_blocks} blocks of {cache_config.block_size}), "
                f"fewer than max_model_len={max_model_len}: lower max_model_len or give the cache more memory "
                "(gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)."
            )
        cache_config.num_gpu_blocks = num_blocks
        self.model_executor.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB) in %.2f s",
            num_blocks, cache_config.block_size, num_blocks * page_size / 2**20, time.perf_counter() - start,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already running.")
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                block_hasher=self.request_block_hasher,
                mm_features=request.mm_features,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update: one iteration of the engine."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.post_step(model_executed=scheduler_output.total_num_scheduled_tokens > 0)
        return engine_core_outputs

    def post_step(self, model_executed: bool) -> None:
        """Give the scheduler the drafts proposed during the step (speculative decoding, chapter 10).

        After `update_from_output`, so that the drafts follow the tokens just accepted.
        """
        if model_executed and self.vllm_config.speculative_config is not None:
            draft_token_ids = self.model_executor.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = ()) -> list[Any]:
        """Run `method` on every worker and return one result per worker (vLLM's name).

        `method` is a `Worker` method's name, or, in-process only, a function called as
        `method(worker, *args)`. With one worker the list has one entry.
        """
        if isinstance(method, str):
            return [getattr(self.model_executor, method)(*args)]
        return [method(self.model_executor, *args)]

    def get_kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (0.0 once every request has finished)."""
        return self.scheduler.kv_cache_manager.usage

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()


class EngineCoreProc(EngineCore):
    """The engine core in its own process: a busy loop fed by queues that IO threads fill.

    Sockets (the client binds both, we connect):
      input:  DEALER -> the client's ROUTER. Frames: [request type, msgpack payload].
      output: PUSH   -> the client's PULL.   Frames: [msgpack EngineCoreOutputs].
    """

    # Sent on the output socket instead of outputs when the busy loop fails.
    ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"

    def __init__(self, vllm_config: VllmConfig, input_address: str, output_address: str) -> None:
        super().__init__(vllm_config)
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | bytes] = queue.Queue()
        # The IO threads release the GIL while they block on a socket or a queue, and msgspec
        # releases it too, so their work runs while the busy loop is inside the model.
        ready = threading.Event()
        threading.Thread(
            target=self.process_input_sockets, args=(input_address, ready), daemon=True, name="EngineCoreInput"
        ).start()
        self.output_thread = threading.Thread(
            target=self.process_output_sockets, args=(output_address,), daemon=True, name="EngineCoreOutput"
        )
        self.output_thread.start()
        if not ready.wait(timeout=60):
            raise RuntimeError("the engine core's input thread did not connect its socket within 60 s.")

    @staticmethod
    def run_engine_core(
        vllm_config: VllmConfig, input_address: str, output_address: str, conn: Connection,
        parent_conn: Connection | None, num_threads: int,
    ) -> None:
        """Entry point of the engine-core process: start, report over `conn`, then loop forever.

        `conn` is the handshake and the death pipe: READY (with the KV cache size, which only
        this process knows) or the startup exception goes back through it, and then a thread
        waits on it; if the frontend dies, its end closes and this process exits instead of
        living on as an orphan. `parent_conn` is the frontend's end, which a forked child
        inherits and must close, or it would never see that EOF. `num_threads`: torch's CPU
        threads in the frontend, which a new process would not inherit.
        """
        if parent_conn is not None:
            parent_conn.close()
        torch.set_num_threads(num_threads)
        threading.Thread(target=_exit_when_parent_dies, args=(conn,), daemon=True, name="DeathPipe").start()
        try:
            engine_core = EngineCoreProc(vllm_config, input_address, output_address)
        except BaseException as e:
            # A ValueError (say, a KV cache too small for max_model_len) reaches the user as one.
            conn.send(("FAILED", e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")))
            raise
        conn.send(("READY", vllm_config.cache_config.num_gpu_blocks))
        try:
            engine_core.run_busy_loop()
        except BaseException:
            logger.exception("the engine core failed; telling the client")
            engine_core._send_engine_dead()
            raise

    def run_busy_loop(self) -> None:
        """Drain the input queue (blocking only when idle), step, push outputs; forever."""
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        # Idle: block until a request arrives (no spinning). Busy: take what is there, don't wait.
        while not self.scheduler.has_unfinished_requests():
            self._handle_client_request(*self.input_queue.get())
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        outputs = self.step()
        # A prefill chunk that samples nothing has nothing to say, unless the step has
        # statistics: those must reach the frontend too (as in vLLM).
        if outputs.outputs or outputs.scheduler_stats is not None:
            self.output_queue.put_nowait(outputs)

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self.add_request(request)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        else:
            call_id, method_name, args = request
            output = UtilityOutput(call_id)
            try:
                output.result = getattr(self, method_name)(*args)
            except Exception as e:
                output.failure_message = f"call to {method_name} failed: {e!r}"
            self.output_queue.put_nowait(EngineCoreOutputs(utility_output=output))

    def _send_engine_dead(self) -> None:
        self.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
        self.output_thread.join(timeout=5.0)  # let the IO thread get it onto the wire

    def process_input_sockets(self, input_address: str, ready: threading.Event) -> None:
        """Input IO thread: socket -> decode -> input queue."""
        import zmq

        from nano_v1.serial_utils import MsgpackDecoder

        add_request_decoder = MsgpackDecoder(EngineCoreRequest)
        generic_decoder = MsgpackDecoder()
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as socket:
            socket.connect(input_address)
            # A ROUTER can only send to a peer it has heard from: say hello first.
            socket.send(b"")
            ready.set()
            while True:
                type_frame, data = socket.recv_multipart()
                request_type = EngineCoreRequestType(type_frame)
                decoder = add_request_decoder if request_type == EngineCoreRequestType.ADD else generic_decoder
                self.input_queue.put_nowait((request_type, decoder.decode(data)))

    def process_output_sockets(self, output_address: str) -> None:
        """Output IO thread: output queue -> encode -> socket."""
        import zmq

        from nano_v1.serial_utils import MsgpackEncoder

        encoder = MsgpackEncoder()
        # linger: on exit, wait up to 4 s for ENGINE_CORE_DEAD to leave.
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as socket:
            socket.setsockopt(zmq.LINGER, 4000)
            socket.connect(output_address)
            while True:
                outputs = self.output_queue.get()
                if outputs == EngineCoreProc.ENGINE_CORE_DEAD:
                    socket.send(outputs)
                    return
                socket.send(encoder.encode(outputs))


def _exit_when_parent_dies(conn: Connection) -> None:
    """Block on the death pipe; when the frontend's end closes (it exited or died), exit."""
    try:
        conn.recv()
    except EOFError:
        pass
    os._exit(0)
