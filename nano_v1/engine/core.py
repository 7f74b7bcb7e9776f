"""The engine core: scheduler + executor, and the step that joins them.

Mirrors vllm/v1/engine/core.py (chapters 02, 04, 09, 13 and 14).

Why it is this small: everything clever lives in the scheduler (what to run) and the
model runner (how to run it). One `step()` is schedule -> execute -> update, and data
only flows forward: `SchedulerOutput` -> `ModelRunnerOutput` -> `EngineCoreOutputs`.
The core reaches the workers only through an executor (chapter 13): one worker in this
process, or one worker process per tensor-parallel rank.
Chapter 09 wraps this class in a process with a busy loop (`EngineCoreProc`): two IO
threads move messages between ZMQ sockets and in-process queues, so that socket and
(de)serialization work overlaps the model, and the busy loop touches only queues.
Chapter 14 overlaps the scheduler with the model too: with async scheduling the
executor runs two steps at once (`max_concurrent_batches`), and `step_with_batch_queue`
schedules step N + 1 while step N runs (`AsyncScheduler`).

What differs from v0.11.0: `step` returns the outputs alone and takes the drafts itself
(`post_step`); `step_with_batch_queue` returns the outputs or None (v0.11.0: a pair with
whether the model ran, for `post_step`, which async scheduling never needs).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch

from nano_v1.config import VllmConfig
from nano_v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks_per_request,
    get_request_block_hasher,
)
from nano_v1.core.sched.async_scheduler import AsyncScheduler
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.executor import Executor
from nano_v1.kv_cache_interface import KVCacheConfig
from nano_v1.outputs import ModelRunnerOutput
from nano_v1.request import Request, RequestStatus
from nano_v1.structured_output import StructuredOutputManager
from nano_v1.utils import exit_when_parent_dies, make_zmq_socket, use_mp_temp_dir_in

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        # Starts the workers, initialises their devices and loads the model on each.
        self.model_executor = Executor.get_class(vllm_config)(vllm_config)
        try:
            kv_cache_config = self._initialize_kv_caches()
        except BaseException:
            self.model_executor.shutdown()  # no worker process outlives a failed start
            raise
        scheduler_cls = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        # Grammars compile in the manager's threads; the scheduler builds each step's bitmask (chapter 15).
        self.structured_output_manager = StructuredOutputManager(vllm_config)
        self.scheduler: Scheduler = scheduler_cls(vllm_config, kv_cache_config, self.structured_output_manager)
        # Steps in flight at once (chapter 14): with more than one, `step_with_batch_queue`
        # schedules the next step before the last one's output is back.
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] | None = None
        if self.batch_queue_size > 1:
            logger.info("Batch queue is enabled with size %d", self.batch_queue_size)
            self.batch_queue = deque(maxlen=self.batch_queue_size)
        self.step_fn: Callable[[], EngineCoreOutputs | None] = (
            self.step if self.batch_queue is None else self.step_with_batch_queue
        )
        # Block hashes key the prefix cache (chapter 03) and a KV connector's blocks (chapter 16).
        cache_config = vllm_config.cache_config
        self.request_block_hasher = (
            get_request_block_hasher(cache_config.block_size)
            if cache_config.enable_prefix_caching or self.scheduler.connector is not None
            else None
        )

    def _initialize_kv_caches(self) -> KVCacheConfig:
        """Size the paged KV cache from the memory left after the model (chapters 02 and 12),
        then allocate it on every rank and compile (chapter 08).

        Each worker says what its layers need (`get_kv_cache_spec`: a rank counts only its
        own KV heads) and how much memory is left; `get_kv_cache_configs` groups the layers
        and counts the blocks that fit (or takes `num_gpu_blocks_override`, and then nothing
        is profiled). Every rank holds the same block ids, so the block count is what the
        tightest rank can hold.
        """
        vllm_config = self.vllm_config
        cache_config = vllm_config.cache_config
        start = time.perf_counter()
        kv_cache_specs = self.model_executor.get_kv_cache_specs()
        if cache_config.num_gpu_blocks_override is not None:
            available_memory = [0] * len(kv_cache_specs)  # unused: the override sets the block count
        else:
            available_memory = self.model_executor.determine_available_memory()
        kv_cache_configs = get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory)
        kv_cache_config = kv_cache_configs[0]  # the scheduler's view: every rank's groups and block count
        # Block 0 is the null block, never handed out: one request of max_model_len must fit in the rest.
        if get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config) < 1:
            raise ValueError(
                f"the KV cache holds {max(kv_cache_config.num_blocks - 1, 0)} usable blocks of "
                f"{cache_config.block_size} tokens, fewer than the "
                f"{get_num_blocks_per_request(vllm_config, kv_cache_config)} that one request of "
                f"max_model_len={vllm_config.model_config.max_model_len} needs: lower max_model_len or give the "
                "cache more memory (gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)."
            )
        cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.model_executor.initialize_from_config(kv_cache_configs)
        logger.info(
            "KV cache: %d blocks x %d tokens in %d group(s) (%.1f MiB per rank) in %.2f s",
            kv_cache_config.num_blocks,
            cache_config.block_size,
            len(kv_cache_config.kv_cache_groups),
            sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors) / 2**20,
            time.perf_counter() - start,
        )
        return kv_cache_config

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already running.")
        req = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            block_hasher=self.request_block_hasher,
            mm_features=request.mm_features,
        )
        if req.use_structured_output:
            # Compiles in a thread; the scheduler passes the request over until it is done.
            self.structured_output_manager.grammar_init(req)
        self.scheduler.add_request(req)

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

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        """Schedule and launch a step without waiting for it, if the queue has room; then wait
        for the oldest step only if nothing more can be launched (chapter 14).

        Returns the outputs of the step it waited for, or None when it only launched one.
        Speculative decoding is refused with async scheduling, so there are no drafts to
        take (`post_step`). The rules, in order:
        - While the scheduler `has_requests()` (unfinished ones, or finished ones whose ids
          the runner has not been sent yet, which `has_unfinished_requests()` leaves out),
          schedule a step and launch it without waiting:
          `execute_model(scheduler_output, non_block=True)` returns a `Future`. The queue
          holds `(future, scheduler_output)` pairs, the newest on the left.
        - Return None at once, waiting for nothing, if the step just launched computes
          tokens, the queue still has room, and the oldest step has not finished yet.
        - Otherwise (the queue is full, the step is empty, there was nothing to schedule, or
          the oldest step is already done) wait for the oldest step, the one launched first,
          and return what `update_from_output` makes of its output.
        - With nothing to schedule and nothing in flight, return None.
        """
        batch_queue = self.batch_queue
        assert batch_queue is not None and len(batch_queue) < self.batch_queue_size
        # BEGIN TASK ch14_t3: schedule and launch without blocking while there is room; else wait for the oldest step and update from it
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            future = self.model_executor.execute_model(scheduler_output, non_block=True)
            batch_queue.appendleft((future, scheduler_output))
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if model_executed and len(batch_queue) < self.batch_queue_size and not batch_queue[-1][0].done():
                return None
        elif not batch_queue:
            return None
        future, scheduler_output = batch_queue.pop()
        return self.scheduler.update_from_output(scheduler_output, future.result())
        # END TASK

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

        `method` is a `Worker` method's name, or a function called as `method(worker, *args)`
        (with worker processes it travels by reference, so a module-level function). One
        entry per tensor-parallel rank.
        """
        return self.model_executor.collective_rpc(method, args=args)

    def shutdown(self) -> None:
        """Stop the workers (their processes, if any), the grammar compiler's threads and the KV connector."""
        self.model_executor.shutdown()
        self.structured_output_manager.clear_backend()
        self.scheduler.shutdown()

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
        if vllm_config.parallel_config.distributed_executor_backend == "external_launcher":
            # Requests reach this loop whenever they arrive, so the ranks' engines could schedule
            # different steps (nano_v1/executor/abstract.py::ExecutorWithExternalLauncher).
            raise ValueError(
                "distributed_executor_backend='external_launcher' runs each rank's engine core in the rank's "
                "own process: use LLM (it keeps the core in-process), not the server or an engine-core process."
            )
        super().__init__(vllm_config)
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | bytes] = queue.Queue()
        # A worker that dies while this loop is idle (blocked on the input queue) must still end it.
        self.model_executor.register_failure_callback(
            lambda: self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, None))
        )
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
        parent_conn: Connection | None, num_threads: int, ipc_dir: str,
    ) -> None:
        """Entry point of the engine-core process: start, report over `conn`, then loop forever.

        `conn` is the handshake and the death pipe: READY (with the KV cache size, which only
        this process knows) or the startup exception goes back through it, and then a thread
        waits on it; if the frontend dies, its end closes and this process exits instead of
        living on as an orphan. If the busy loop fails, the cause goes back through it too
        (`_send_engine_dead`). `parent_conn` is the frontend's end, which a forked child
        inherits and must close, or it would never see that EOF. `num_threads`: torch's CPU
        threads in the frontend, which a new process would not inherit. `ipc_dir`: the
        frontend's directory for this engine's sockets, which the frontend removes however
        this process ends; multiprocessing's temporary directory goes inside it, so that even
        a killed engine core leaves nothing behind (with workers, that directory holds the
        socket of the fork server that starts them).

        The frontend starts this process as a daemon (it is terminated if the frontend exits
        without shutting it down), but a daemon may not start processes of its own, and with
        tensor parallelism the executor here starts the workers (as vLLM's engine core does).
        So the process clears its own daemon flag; the frontend still treats it as one. A
        SIGTERM (the client's shutdown) becomes SystemExit in the main thread, even while the
        loop sleeps (`EngineCoreProc._wake_on_sigterm`), so the workers are stopped and the
        queues' shared memory and semaphores removed on the way out.
        """
        if parent_conn is not None:
            parent_conn.close()
        use_mp_temp_dir_in(ipc_dir)
        multiprocessing.current_process().daemon = False
        signal.signal(signal.SIGTERM, _raise_system_exit)
        torch.set_num_threads(num_threads)
        threading.Thread(target=exit_when_parent_dies, args=(conn,), daemon=True, name="DeathPipe").start()
        try:
            engine_core = EngineCoreProc(vllm_config, input_address, output_address)
        except BaseException as e:
            # A ValueError (say, a KV cache too small for max_model_len) reaches the user as one.
            conn.send(("FAILED", e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")))
            raise
        engine_core._wake_on_sigterm()
        conn.send(("READY", vllm_config.cache_config.num_gpu_blocks))
        try:
            engine_core.run_busy_loop()
        except SystemExit:
            pass  # terminated by the client: a normal shutdown
        except BaseException as e:
            logger.exception("the engine core failed; telling the client")
            engine_core._send_engine_dead(conn, e)
            raise
        finally:
            engine_core.shutdown()

    def _wake_on_sigterm(self) -> None:
        """Wake the idle busy loop when a SIGTERM arrives, so that its handler runs.

        CPython's C-level handler only flags a signal; the Python handler runs in the main
        thread when that thread next runs bytecode. Idle, the main thread sleeps on the input
        queue, and the signal does not reliably wake it: the kernel may give it to any of our
        threads, and we measured about one client shutdown in four leave the loop asleep. The
        client then killed the process 5 s later, before it could stop its workers, and
        Python's resource tracker reported their shared memory and semaphores as leaked.
        Whichever thread takes the signal writes its number to the wakeup fd; this thread then
        puts an empty abort (a no-op) on the input queue, and the woken main thread runs the
        handler before it handles the abort.
        """
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        input_queue = self.input_queue

        def wake_on_sigterm() -> None:
            while signal.SIGTERM not in os.read(read_fd, 64):
                pass
            input_queue.put_nowait((EngineCoreRequestType.ABORT, []))

        threading.Thread(target=wake_on_sigterm, daemon=True, name="EngineCoreSigterm").start()

    def run_busy_loop(self) -> None:
        """Drain the input queue (blocking only when idle), step, push outputs; forever."""
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        """Handle the client's messages (`_handle_client_request`) before a step, in order.

        Idle (no unfinished request and no step in flight): block on the input queue until
        there is work, handling each message (an abort leaves the core idle), without
        spinning. Busy: take every message already queued, and never wait for more.
        """
        # BEGIN TASK ch09_t1: idle, wait for work without spinning; busy, take all that is queued, never wait
        # Idle: block until a request arrives (no spinning). Busy: take what is there, don't wait.
        # A step still in flight (chapter 14) is work: its output must be collected.
        while not self.scheduler.has_unfinished_requests() and not self.batch_queue:
            self._handle_client_request(*self.input_queue.get())
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())
        # END TASK

    def _process_engine_step(self) -> None:
        outputs = self.step_fn()
        # A prefill chunk that samples nothing has nothing to say, unless the step has
        # statistics: those must reach the frontend too (as in vLLM). None: a step was
        # only launched (chapter 14).
        if outputs is not None and (outputs.outputs or outputs.scheduler_stats is not None):
            self.output_queue.put_nowait(outputs)

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        """Do what one client message asks.

        ADD adds the request and ABORT aborts the listed ids: neither is answered (an abort
        that empties the batch sends the scheduler's stats, as no step will). UTILITY
        `(call_id, method_name, args)` calls the core's method by name and answers with a
        `UtilityOutput` under its call id: the result, or, if the call raised, a
        `failure_message` that names the method. A failed call is answered, not fatal: the
        core goes on. EXECUTOR_FAILED raises EngineDeadError.
        """
        # BEGIN TASK ch09_t2: add, abort, or call a method by name; a failed call is answered, not fatal
        if request_type == EngineCoreRequestType.ADD:
            self.add_request(request)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(request)
            if not self.scheduler.has_unfinished_requests():
                # No step follows to report the emptied batch and the freed blocks: say it now,
                # or the frontend's gauges (running requests, KV usage) would stay at their last value.
                self.output_queue.put_nowait(EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats()))
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            raise EngineDeadError("the executor failed: a worker process died (see its log above)")
        else:
            call_id, method_name, args = request
            output = UtilityOutput(call_id)
            try:
                output.result = getattr(self, method_name)(*args)
            except Exception as e:  # noqa: BLE001  (whatever a call raises, the client hears it)
                output.failure_message = f"call to {method_name} failed: {e!r}"
            self.output_queue.put_nowait(EngineCoreOutputs(utility_output=output))
        # END TASK

    def _send_engine_dead(self, conn: Connection, error: BaseException) -> None:
        """Tell the client that the busy loop failed, and why: a worker's death if the executor
        failed (which rank, how), else `error`. The cause goes over `conn` before anything else,
        so that the client finds it there once ENGINE_CORE_DEAD, or this process's exit, reaches it."""
        with contextlib.suppress(OSError):  # the client is gone: nobody to tell
            conn.send(("DEAD", self.model_executor.failure_reason or f"{type(error).__name__}: {error}"))
        self.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
        self.output_thread.join(timeout=5.0)  # let the IO thread get it onto the wire

    def process_input_sockets(self, input_address: str, ready: threading.Event) -> None:
        """Input IO thread: socket -> decode -> input queue."""
        import zmq

        from nano_v1.serial_utils import MsgpackDecoder

        add_request_decoder = MsgpackDecoder(EngineCoreRequest)
        generic_decoder = MsgpackDecoder()
        with zmq.Context() as ctx, make_zmq_socket(ctx, input_address, zmq.DEALER, bind=False) as socket:
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
        with zmq.Context() as ctx, make_zmq_socket(ctx, output_address, zmq.PUSH, False, 4000) as socket:
            while True:
                outputs = self.output_queue.get()
                if outputs == EngineCoreProc.ENGINE_CORE_DEAD:
                    socket.send(outputs)
                    return
                socket.send(encoder.encode(outputs))


def _raise_system_exit(signum: int, frame: Any) -> None:
    # Once: a second SIGTERM must not cut short the shutdown that the first one starts.
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(f"terminated by signal {signum}")
