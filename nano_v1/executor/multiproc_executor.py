"""One worker process per tensor-parallel rank, driven through shared-memory queues.

Mirrors vllm/v1/executor/multiproc_executor.py (`MultiprocExecutor`, `WorkerProc`,
`WorkerProcHandle`) (chapter 13).

Why it exists: with tensor parallelism every rank must run every step, and each rank
needs its own process (its own GPU, its own torch.distributed rank); rank 0 too, so the
engine core's process only schedules. The executor starts the processes, and for each
call puts one message `(method, args, kwargs, unique_reply_rank)` on a broadcast
`MessageQueue` that every worker reads; each worker answers on its own response queue,
and for `execute_model` only rank 0 answers (every rank samples the same tokens).

    engine core ── enqueue ──▶ rpc_broadcast_mq (shared memory) ──▶ WorkerProc rank 0 ─┐ all-reduce,
                                                               └──▶ WorkerProc rank 1 ─┘ all-gather (gloo / NCCL)
                ◀── dequeue ── worker_response_mq of rank 0 (and of every rank, for other calls)

Failure is fail-stop: a worker that raises reports the error (if it answers that call)
and exits, because its peers may be waiting for it inside a collective and its state
may no longer match theirs. A monitor thread waits on every worker's process sentinel;
when one dies it stops the others, cancels every wait on the queues, and tells the
engine core (`register_failure_callback`), so the caller gets `EngineDeadError` within
a fraction of a second instead of a hang, naming the rank that died and how (its exit
code, or the signal that killed it). Each worker also watches a death pipe from this
process and exits when it closes, so no worker outlives its executor.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from nano_v1.config import VllmConfig
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.distributed.device_communicators.shm_broadcast import Handle, MessageQueue, QueueCancelledError
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.executor.abstract import Executor, FailureCallback, RpcMethod
from nano_v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
from nano_v1.utils import (
    describe_exit,
    exit_when_parent_dies,
    get_distributed_init_method,
    get_loopback_ip,
    get_mp_context,
    get_open_port,
    run_method,
    start_process,
)
from nano_v1.worker.gpu_worker import Worker

logger = logging.getLogger(__name__)

# The longest one step may take before the executor gives up on the workers (vLLM:
# VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS). A dead worker is noticed at once; this bounds a live one that hangs.
EXECUTE_MODEL_TIMEOUT_S = 300.0
# Starting a worker: imports, torch.distributed rendezvous, loading its shard of the weights.
WORKER_READY_TIMEOUT_S = 600.0
# At shutdown, how long each worker gets to exit after its death pipe closes, and then after SIGTERM.
WORKER_EXIT_GRACE_S = 2.0
# When a worker reports a failure, how long to wait for a peer's death that caused it (a killed
# rank breaks the others' collectives within milliseconds; a rank's own bug waits this long in vain).
PEER_DEATH_GRACE_S = 0.5


class MultiprocExecutor(Executor):
    """`world_size` worker processes, rank 0 included; this process only sends and receives."""

    def _init_executor(self) -> None:
        self.world_size = self.parallel_config.world_size
        self.shutdown_event = threading.Event()  # set at shutdown: cancels every wait on the queues
        self.failure_reason: str | None = None  # set when the executor fails for good
        self._fail_lock = threading.Lock()
        self._ranks_that_reported: set[int] = set()  # workers that sent their own error (and exit after it)
        self.failure_callback: FailureCallback | None = None
        # With steps in flight (async scheduling, chapter 14), one thread reads every answer,
        # so that they are taken in the order the calls were sent; made once the workers are up.
        self.io_thread_pool: ThreadPoolExecutor | None = None
        # A ring of 8 chunks of 1 MiB: a SchedulerOutput larger than a chunk spans several.
        self.rpc_broadcast_mq = MessageQueue(self.world_size)
        self.workers: list[WorkerProcHandle] = []
        # Runs shutdown when the executor is collected or at exit, without keeping it alive.
        self._finalizer = weakref.finalize(
            self, _shutdown, self.workers, self.rpc_broadcast_mq, self.shutdown_event
        )
        distributed_init_method = get_distributed_init_method(get_loopback_ip(), get_open_port())
        # On the CPU the ranks are the devices: they share this process's torch threads.
        num_threads = max(1, torch.get_num_threads() // self.world_size)
        try:
            for rank in range(self.world_size):
                self.workers.append(
                    WorkerProc.make_worker_process(
                        self.vllm_config, rank, rank, distributed_init_method,
                        self.rpc_broadcast_mq.export_handle(), num_threads,
                    )
                )  # fmt: skip
            WorkerProc.wait_for_ready(self.workers)
        except BaseException:
            self.shutdown()  # no worker outlives a failed start
            raise
        self.start_worker_monitor()
        if self.max_concurrent_batches > 1:
            self.io_thread_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mp_exec_io")

    @cached_property
    def max_concurrent_batches(self) -> int:
        """2 with async scheduling: step N + 1 is sent while step N runs (chapter 14)."""
        return 2 if self.vllm_config.scheduler_config.async_scheduling else 1

    def start_worker_monitor(self) -> None:
        """A thread that waits on every worker's sentinel and fails the executor when one dies."""
        workers, self_ref = self.workers, weakref.ref(self)

        def monitor_workers() -> None:
            multiprocessing.connection.wait([handle.proc.sentinel for handle in workers])
            executor = self_ref()
            if executor is None or executor.shutdown_event.is_set():
                return  # we are shutting down: the workers are meant to exit
            executor._fail()

        threading.Thread(target=monitor_workers, daemon=True, name="MultiprocWorkerMonitor").start()

    def _fail(self, reason: str | None = None) -> None:
        """Fail for good: stop every worker, wake every wait, tell the engine core. Once, though the
        monitor and the caller's thread may both get here: the second returns when the first is done.

        The reason given names every worker that has died (which rank, how), since a death causes
        whatever else fails; `reason` stands when none has. A worker that reported its own error
        exits because of it, so its death is not named: the thread that read the error fails with
        it, and `reason` None (the monitor's call) then leaves the failing to that thread.
        """
        with self._fail_lock:
            if self.failure_reason is not None:
                return
            # Under the lock: a worker's exit code is read from its sentinel, by one thread at a time.
            deaths = [
                _death_of(handle)
                for handle in self.workers
                if handle.rank not in self._ranks_that_reported
                and multiprocessing.connection.wait([handle.proc.sentinel], timeout=0)
            ]
            if not deaths and reason is None:
                return
            self.failure_reason = "; ".join(deaths) or reason
            logger.error("the executor failed: %s; stopping the workers", self.failure_reason)
            self.shutdown_event.set()
            _stop_workers(self.workers)
            callback, self.failure_callback = self.failure_callback, None
        if callback is not None:
            callback()

    def register_failure_callback(self, callback: FailureCallback) -> None:
        if self.failure_reason is not None:
            callback()
        else:
            self.failure_callback = callback

    def collective_rpc(
        self, method: RpcMethod, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None,
        unique_reply_rank: int | None = None, non_block: bool = False,
    ) -> list[Any]:  # fmt: skip
        """Broadcast one call to every worker; wait (up to `timeout` s) for the answers of every
        rank, or of `unique_reply_rank` alone. A function `method` travels by reference
        (pickle), so it must be importable by name: a module-level function, not a lambda.
        `non_block` (only with steps in flight): return a `Future` per answer instead."""
        self._check_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.rpc_broadcast_mq.enqueue(
                (method, args, kwargs or {}, unique_reply_rank), timeout, self.shutdown_event
            )
        except (QueueCancelledError, TimeoutError) as e:
            raise self._call_error(method, e) from None
        repliers = self.workers if unique_reply_rank is None else [self.workers[unique_reply_rank]]
        if self.io_thread_pool is None:
            if non_block:
                raise RuntimeError("non_block can only be used when max_concurrent_batches > 1")
            return [self._get_response(handle, method, deadline) for handle in repliers]
        futures = [
            self.io_thread_pool.submit(self._get_response, handle, method, deadline) for handle in repliers
        ]
        return futures if non_block else [future.result() for future in futures]

    def _call_error(self, method: RpcMethod, error: QueueCancelledError | TimeoutError) -> Exception:
        """What a call that was cancelled (shutdown, a dead worker) or timed out raises."""
        if isinstance(error, TimeoutError):
            self._fail(f"{method!r} took longer than its timeout")
        if self.failure_reason is None:
            return RuntimeError("the executor was shut down during the call.")
        with self._fail_lock:  # held by the thread failing the executor until the workers are stopped
            return EngineDeadError(self.failure_reason)

    def _get_response(self, handle: WorkerProcHandle, method: RpcMethod, deadline: float | None) -> Any:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            status, result = handle.worker_response_mq.dequeue(remaining, self.shutdown_event)
        except (QueueCancelledError, TimeoutError) as e:
            raise self._call_error(method, e) from None
        if status == WorkerProc.ResponseStatus.FAILURE:
            error = f"worker rank {handle.rank} failed in {getattr(method, '__name__', method)}: {result}"
            self._ranks_that_reported.add(handle.rank)
            # A collective that fails here is most often a peer's death that has not reached this
            # process yet: that death, not this rank's broken all-reduce, is the cause to report.
            peers = [h.proc.sentinel for h in self.workers if h.rank not in self._ranks_that_reported]
            multiprocessing.connection.wait(peers, timeout=PEER_DEATH_GRACE_S)
            self._fail(error)
            # The first cause (a peer's death, say) and this worker's own error, whichever came first.
            raise EngineDeadError(
                error if self.failure_reason == error else f"{self.failure_reason}; {error}"
            )
        return result

    def _check_alive(self) -> None:
        if self.failure_reason is not None:
            raise EngineDeadError(self.failure_reason)
        if self.shutdown_event.is_set():
            raise RuntimeError("the executor has been shut down.")

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Every rank runs the step; only rank 0 sends its output back. `non_block`: return
        as soon as the step is sent, with a `Future` of the output."""
        return self.collective_rpc(
            "execute_model", EXECUTE_MODEL_TIMEOUT_S, args=(scheduler_output,), unique_reply_rank=0,
            non_block=non_block,
        )[0]  # fmt: skip

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.collective_rpc("take_draft_token_ids", unique_reply_rank=0)[0]

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=10)

    def shutdown(self) -> None:
        """Stop the workers and remove the queues' shared memory (idempotent)."""
        self._finalizer()
        if self.io_thread_pool is not None:  # the wait it may be in was cancelled just now
            self.io_thread_pool.shutdown(wait=False, cancel_futures=True)


def _shutdown(
    workers: list[WorkerProcHandle], broadcast_mq: MessageQueue, shutdown_event: threading.Event
) -> None:
    shutdown_event.set()
    _stop_workers(workers)
    for queue in [broadcast_mq, *(handle.worker_response_mq for handle in workers)]:
        queue.close()


def _death_of(handle: WorkerProcHandle) -> str:
    """Which worker died and how, for the error every caller gets: "worker rank 1 (pid 4242) was
    killed by signal 9 (SIGKILL)"."""
    handle.proc.join(WORKER_EXIT_GRACE_S)  # its sentinel is ready: this reaps it, to read its exit code
    return f"worker rank {handle.rank} (pid {handle.proc.pid}) {describe_exit(handle.proc.exitcode)}"


def _stop_workers(workers: list[WorkerProcHandle]) -> None:
    """Ask every worker to exit (close its death pipe), then SIGTERM, then SIGKILL; reap them all."""
    for handle in workers:
        handle.death_writer.close()
    for stop in (None, BaseProcess.terminate, BaseProcess.kill):
        alive = [handle.proc for handle in workers if handle.proc.is_alive()]
        for proc in alive:
            if stop is not None:
                stop(proc)
        deadline = time.monotonic() + WORKER_EXIT_GRACE_S
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
    for handle in workers:
        handle.proc.join()


@dataclass
class WorkerProcHandle:
    """The executor's view of one worker process."""

    proc: BaseProcess
    rank: int
    worker_response_mq: MessageQueue  # the worker writes its answers, the executor reads
    ready_pipe: Connection  # READY or the startup error arrives here once
    death_writer: Connection  # closing it tells the worker to exit


class WorkerProc:
    """A `Worker` in its own process, running the calls that arrive on the broadcast queue."""

    class ResponseStatus(Enum):
        SUCCESS = "success"
        FAILURE = "failure"

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        input_shm_handle: Handle,
        output_shm_handle: Handle,
    ) -> None:
        self.rank = rank
        self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, reader_rank=rank)
        self.worker_response_mq = MessageQueue.create_from_handle(output_shm_handle, reader_rank=None)
        # Async scheduling (chapter 14): answers leave from a thread of their own, so that
        # waiting for step N's tokens, serializing and sending its output overlap step N + 1.
        self.use_async_scheduling = vllm_config.scheduler_config.async_scheduling
        if self.use_async_scheduling:
            self.async_output_queue: queue.Queue[tuple[WorkerProc.ResponseStatus, Any]] = queue.Queue()
            threading.Thread(
                target=self.async_output_busy_loop, daemon=True, name="WorkerAsyncOutputCopy"
            ).start()
        self.worker = Worker(vllm_config, local_rank, rank, distributed_init_method)
        self.worker.init_device()  # joins the other ranks: every worker must be starting at once
        self.worker.load_model()  # this rank's shard of every weight

    @staticmethod
    def make_worker_process(
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        input_shm_handle: Handle,
        num_threads: int,
    ) -> WorkerProcHandle:
        context = get_mp_context()
        response_mq = MessageQueue(1, max_chunks=2, reader_rank=0)
        ready_reader, ready_writer = context.Pipe(duplex=False)
        death_reader, death_writer = context.Pipe(duplex=False)
        proc = context.Process(
            target=WorkerProc.worker_main,
            kwargs={
                "vllm_config": vllm_config,
                "local_rank": local_rank,
                "rank": rank,
                "distributed_init_method": distributed_init_method,
                "input_shm_handle": input_shm_handle,
                "output_shm_handle": response_mq.export_handle(),
                "ready_pipe": ready_writer,
                "death_pipe": death_reader,
                # A forked child inherits our end of its death pipe and must close it, or it never sees EOF.
                "inherited_death_writer": death_writer if context.get_start_method() == "fork" else None,
                "num_threads": num_threads,
            },
            name=f"VllmWorker-{rank}",
            daemon=True,
        )
        start_process(proc)
        ready_writer.close()
        death_reader.close()
        return WorkerProcHandle(proc, rank, response_mq, ready_reader, death_writer)

    @staticmethod
    def wait_for_ready(workers: list[WorkerProcHandle]) -> None:
        """Wait until every worker says READY; raise the first startup error, or a worker's early death."""
        waiting = {handle.ready_pipe: handle for handle in workers}
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while waiting:
            sentinels = {handle.proc.sentinel: handle for handle in waiting.values()}
            ready = multiprocessing.connection.wait(
                [*waiting, *sentinels], timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise RuntimeError(
                    f"the worker processes were not ready within {WORKER_READY_TIMEOUT_S:.0f} s."
                )
            for pipe in [p for p in waiting if p in ready or waiting[p].proc.sentinel in ready]:
                handle = waiting.pop(pipe)
                try:
                    status, error = pipe.recv()
                except EOFError:  # it died before it could say anything
                    raise RuntimeError(
                        f"worker rank {handle.rank} exited during startup (exit code {handle.proc.exitcode})."
                    ) from None
                finally:
                    pipe.close()
                if status == "FAILED":
                    raise error

    @staticmethod
    def worker_main(
        ready_pipe: Connection, death_pipe: Connection, inherited_death_writer: Connection | None, num_threads: int,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        """Entry point of a worker process: start (`kwargs` are `WorkerProc`'s), say READY (or why not),
        then serve calls until told to exit."""
        if inherited_death_writer is not None:
            inherited_death_writer.close()
        threading.Thread(
            target=exit_when_parent_dies, args=(death_pipe,), daemon=True, name="WorkerDeathPipe"
        ).start()
        torch.set_num_threads(num_threads)
        try:
            worker = WorkerProc(**kwargs)
        except BaseException as e:
            # A ValueError (a checkpoint that does not fit, say) reaches the user as one.
            error = (
                e
                if isinstance(e, ValueError)
                else RuntimeError(f"worker rank {kwargs['rank']} failed to start: {type(e).__name__}: {e}")
            )
            ready_pipe.send(("FAILED", error))
            raise
        ready_pipe.send(("READY", None))
        ready_pipe.close()
        worker.worker_busy_loop()

    def enqueue_output(self, response: tuple[WorkerProc.ResponseStatus, Any]) -> None:
        """Send an answer; a step's output still on its way from the device is waited for first
        (`AsyncModelRunnerOutput.get_output`)."""
        status, output = response
        if isinstance(output, AsyncModelRunnerOutput):
            response = (status, output.get_output())
        self.worker_response_mq.enqueue(response)

    def handle_output(self, response: tuple[WorkerProc.ResponseStatus, Any]) -> None:
        """Send an answer: from this thread, or with async scheduling from the output thread, where
        waiting for a step's tokens and sending them overlaps the next step."""
        if self.use_async_scheduling:
            self.async_output_queue.put(response)
        else:
            self.enqueue_output(response)

    def async_output_busy_loop(self) -> None:
        """The output thread: send each answer in the order the busy loop produced them."""
        while True:
            self.enqueue_output(self.async_output_queue.get())
            self.async_output_queue.task_done()

    def worker_busy_loop(self) -> None:
        """Run each broadcast call; answer if this rank is asked to. An exception ends the process."""
        while True:
            method, args, kwargs, unique_reply_rank = self.rpc_broadcast_mq.dequeue()
            replies = unique_reply_rank is None or unique_reply_rank == self.rank
            try:
                output = run_method(self.worker, method, args, kwargs)
            except Exception as e:
                if replies:
                    self.handle_output((WorkerProc.ResponseStatus.FAILURE, f"{type(e).__name__}: {e}"))
                    if self.use_async_scheduling:
                        self.async_output_queue.join()  # the error leaves before the process ends
                raise  # fail-stop: the executor sees this process exit
            if replies:
                self.handle_output((WorkerProc.ResponseStatus.SUCCESS, output))
