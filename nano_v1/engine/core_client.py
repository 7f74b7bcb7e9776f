"""How the frontend reaches the engine core: in this process, or in its own over ZMQ.

Mirrors vllm/v1/engine/core_client.py (chapter 09).

Why an interface: `LLMEngine` and `AsyncLLM` talk to "an engine core" through a few
calls (add_request, get_output, abort_requests, call_utility, shutdown). `InprocClient`
calls an `EngineCore` in this process, so each `get_output()` runs one step here.
`SyncMPClient` (for `LLM`) and `AsyncMPClient` (for the API server) start an
`EngineCoreProc` in a child process and exchange msgpack messages with it:

    frontend process                          engine-core process
    ROUTER (bind) --[type, msgpack]-->  DEALER -> input thread -> input queue
                                                                     | busy loop: step()
    PULL   (bind) <--[msgpack outputs]-- PUSH  <- output thread <- output queue

The ROUTER/DEALER pair is vLLM's: a ROUTER addresses each engine by the identity it
announced, which is how vLLM's data-parallel frontend talks to several cores at once.
A monitor thread waits on the child's process sentinel: if the core dies, every waiting
call fails with `EngineDeadError` at once instead of waiting forever.

What differs from v0.11.0: the error says why the core died. A core whose busy loop failed
sends the cause (the exception, or which tensor-parallel worker died and how) on its
handshake pipe before it sends ENGINE_CORE_DEAD; v0.11.0's error points to the core's log.
The core's multiprocessing temporary directory is made inside our IPC directory, which we
remove, so a killed core leaves no fork-server socket behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import queue
import shutil
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from nano_v1 import envs
from nano_v1.config import VllmConfig
from nano_v1.engine import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from nano_v1.engine.exceptions import EngineDeadError
from nano_v1.engine.core import EngineCore, EngineCoreProc
from nano_v1.utils import get_mp_context, make_zmq_socket, start_process

logger = logging.getLogger(__name__)


class EngineCoreClient:
    """The frontend's handle on an engine core."""

    @staticmethod
    def make_client(
        multiprocess_mode: bool, asyncio_mode: bool, vllm_config: VllmConfig
    ) -> "EngineCoreClient":
        if asyncio_mode:
            if not multiprocess_mode:
                raise ValueError("the asyncio client needs the engine core in its own process.")
            return AsyncMPClient(vllm_config)
        if multiprocess_mode:
            return SyncMPClient(vllm_config)
        return InprocClient(vllm_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call `EngineCore.<method>(*args)` wherever the core runs; return its result."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The engine core in this process: `get_output()` runs one step."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.engine_core = EngineCore(vllm_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.engine_core.step_fn()
        return EngineCoreOutputs() if outputs is None else outputs

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


@dataclass
class BackgroundResources:
    """What an MP client owns outside Python's reach: the process, sockets, the IPC directory.

    Kept apart from the client so that `weakref.finalize` can release them when a client is
    garbage collected, and so that threads hold these instead of the client itself.
    """

    ctx: Any  # zmq.Context
    ipc_dir: str
    proc: multiprocessing.process.BaseProcess | None = None
    # The handshake pipe; after READY, the cause of a failed busy loop arrives on it (`death_error`).
    parent_conn: multiprocessing.connection.Connection | None = None
    sockets: list[Any] = field(default_factory=list)
    engine_dead: bool = False
    shutting_down: bool = False
    death_cause: str | None = None
    conn_lock: threading.Lock = field(default_factory=threading.Lock)

    def validate_alive(self, frame: bytes) -> None:
        if frame == EngineCoreProc.ENGINE_CORE_DEAD:
            self.engine_dead = True
            raise self.death_error("the engine core hit an exception in its busy loop")

    def death_error(self, otherwise: str = "") -> EngineDeadError:
        """The error for the dead engine core: the cause it sent if its busy loop failed (a worker's
        death, say), else `otherwise`. The core sends the cause before ENGINE_CORE_DEAD and before
        it exits, so whichever of those two told us it died, the cause is already in the pipe."""
        with self.conn_lock:
            if self.death_cause is None and self.parent_conn is not None and not self.parent_conn.closed:
                with contextlib.suppress(EOFError, OSError):  # EOF: it exited without a word (killed)
                    if self.parent_conn.poll():
                        _, self.death_cause = self.parent_conn.recv()
        return EngineDeadError(self.death_cause or otherwise)

    def __call__(self) -> None:
        """Shut down: stop the process, close our sockets, end the context, remove the IPC files."""
        self.shutting_down = True
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        if self.parent_conn is not None:
            with self.conn_lock:
                self.parent_conn.close()
        for socket in self.sockets:
            socket.close(linger=0)
        # Ends the context; a thread blocked on one of its sockets gets ContextTerminated and closes it.
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class MPClient(EngineCoreClient):
    """Base of the multiprocess clients: start the engine-core process and connect to it."""

    def __init__(self, asyncio_mode: bool, vllm_config: VllmConfig) -> None:
        import zmq
        import zmq.asyncio

        from nano_v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        sync_ctx = zmq.Context()
        self.ctx = zmq.asyncio.Context(sync_ctx) if asyncio_mode else sync_ctx
        ipc_dir = tempfile.mkdtemp(prefix="nano_v1_")
        self.resources = BackgroundResources(ctx=sync_ctx, ipc_dir=ipc_dir)
        self._finalizer = weakref.finalize(self, self.resources)
        # IPC sockets are files: nothing leaves this machine, and no port can collide.
        input_address, output_address = f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"
        self.input_socket = make_zmq_socket(self.ctx, input_address, zmq.ROUTER, bind=True)
        self.output_socket = make_zmq_socket(self.ctx, output_address, zmq.PULL, bind=True)
        self.resources.sockets += [self.input_socket, self.output_socket]
        self.utility_results: dict[int, Any] = {}  # call id -> future
        try:
            proc = self._start_engine_core(vllm_config, input_address, output_address)
            # The DEALER's hello tells the ROUTER the engine's identity, the address of every message.
            sync_input = zmq.Socket.shadow(self.input_socket.underlying)
            if not sync_input.poll(timeout=60_000):
                raise RuntimeError("the engine core process started but never connected to its input socket.")
            self.core_engine, _ = sync_input.recv_multipart()
        except BaseException:
            self._finalizer()  # don't leave a process or sockets behind
            raise
        self._start_engine_core_monitor(proc)

    def _start_engine_core(self, vllm_config: VllmConfig, input_address: str, output_address: str):
        """Start the engine-core process; return once it reports READY (or raise what it raised)."""
        ctx = get_mp_context()
        parent_conn, child_conn = ctx.Pipe()
        forked = ctx.get_start_method() == "fork"
        proc = ctx.Process(
            target=EngineCoreProc.run_engine_core,
            args=(
                vllm_config,
                input_address,
                output_address,
                child_conn,
                parent_conn if forked else None,
                torch.get_num_threads(),
                self.resources.ipc_dir,
            ),
            name="EngineCore",
            daemon=True,
        )
        start_process(proc)
        child_conn.close()
        self.resources.proc, self.resources.parent_conn = proc, parent_conn
        logger.info("EngineCore process started (%s, pid %d)", ctx.get_start_method(), proc.pid)
        # Wait for the handshake, or for the process to die before it could send one.
        multiprocessing.connection.wait([parent_conn, proc.sentinel])
        if not parent_conn.poll():
            raise RuntimeError(
                f"the engine core process exited during startup (exit code {proc.exitcode}) before it could "
                "report why; its own error, if it printed one, is above."
            )
        status, payload = parent_conn.recv()
        if status == "FAILED":
            raise payload
        vllm_config.cache_config.num_gpu_blocks = payload  # sized in the child; the frontend reports it
        return proc

    def _start_engine_core_monitor(self, proc) -> None:
        resources, on_engine_dead = self.resources, self._on_engine_dead_callback()

        def monitor_engine_core() -> None:
            multiprocessing.connection.wait([proc.sentinel])
            if resources.shutting_down:
                return
            resources.engine_dead = True
            logger.error("the engine core process died unexpectedly (exit code %s)", proc.exitcode)
            on_engine_dead(resources.death_error(f"exit code {proc.exitcode}"))

        threading.Thread(target=monitor_engine_core, daemon=True, name="EngineCoreMonitor").start()

    def _on_engine_dead_callback(self) -> Callable[[EngineDeadError], None]:
        """A function (holding no reference to the client) that wakes everyone waiting on the core."""
        raise NotImplementedError

    def ensure_alive(self) -> None:
        if self.resources.engine_dead:
            raise self.resources.death_error()

    def _encode_input(self, request_type: EngineCoreRequestType, request: Any) -> list[bytes]:
        self.ensure_alive()
        return [self.core_engine, request_type.value, self.encoder.encode(request)]

    def _format_exception(self, e: Exception) -> Exception:
        """Whatever broke the output path, once the core is dead the user sees why."""
        if isinstance(e, EngineDeadError) or not self.resources.engine_dead:
            return e
        return self.resources.death_error()

    def shutdown(self) -> None:
        self._finalizer()


def _route_output(
    frame: bytes, resources: BackgroundResources, decoder, outputs_queue, utility_results: dict[int, Any]
) -> None:
    """One message from the core: a step's outputs go to the queue, a utility answer to its future."""
    resources.validate_alive(frame)
    outputs: EngineCoreOutputs = decoder.decode(frame)
    utility: UtilityOutput | None = outputs.utility_output
    if utility is None:
        outputs_queue.put_nowait(outputs)
        return
    future = utility_results.pop(utility.call_id, None)
    if future is None or future.done():
        return  # the caller gave up waiting (VLLM_RPC_TIMEOUT); nobody wants the answer now
    if utility.failure_message is not None:
        future.set_exception(RuntimeError(utility.failure_message))
    else:
        future.set_result(utility.result)


def _utility_timeout(method: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(
        f"the engine core did not answer {method}() within {timeout_s:g} s (VLLM_RPC_TIMEOUT, in ms); "
        "it may be stuck in a step or stopped"
    )


class SyncMPClient(MPClient):
    """For `LLM`/`LLMEngine`: a thread reads the output socket into a queue; `get_output` blocks on it."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        super().__init__(asyncio_mode=False, vllm_config=vllm_config)
        import zmq

        # The thread gets what it needs, not the client, so the client can still be collected.
        output_socket, decoder, resources = self.output_socket, self.decoder, self.resources
        outputs_queue, utility_results = self.outputs_queue, self.utility_results

        def process_outputs_socket() -> None:
            try:
                while True:
                    _route_output(output_socket.recv(), resources, decoder, outputs_queue, utility_results)
            except zmq.ContextTerminated:
                pass  # shutdown
            except Exception as e:
                outputs_queue.put_nowait(e)
            finally:
                output_socket.close(linger=0)

        threading.Thread(target=process_outputs_socket, daemon=True, name="EngineCoreOutputQueue").start()
        self.resources.sockets.remove(output_socket)  # the thread closes it now

    def _on_engine_dead_callback(self) -> Callable[[EngineDeadError], None]:
        outputs_queue, utility_results = self.outputs_queue, self.utility_results

        def on_engine_dead(error: EngineDeadError) -> None:
            outputs_queue.put_nowait(error)
            for future in list(utility_results.values()):
                future.set_exception(error)
            utility_results.clear()

        return on_engine_dead

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.outputs_queue.get()
        if isinstance(outputs, Exception):
            raise self._format_exception(outputs) from None
        return outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.input_socket.send_multipart(self._encode_input(EngineCoreRequestType.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self.input_socket.send_multipart(self._encode_input(EngineCoreRequestType.ABORT, request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = uuid.uuid4().int >> 64
        future: Future = Future()
        self.utility_results[call_id] = future
        self.input_socket.send_multipart(
            self._encode_input(EngineCoreRequestType.UTILITY, (call_id, method, args))
        )
        timeout_s = envs.rpc_timeout_s()
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.utility_results.pop(call_id, None)
            raise _utility_timeout(method, timeout_s) from None


class AsyncMPClient(MPClient):
    """For `AsyncLLM`: the same sockets, read by an asyncio task instead of a thread.

    Must be created inside the event loop that will use it.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.loop = asyncio.get_running_loop()
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        super().__init__(asyncio_mode=True, vllm_config=vllm_config)
        output_socket, decoder, resources = self.output_socket, self.decoder, self.resources
        outputs_queue, utility_results = self.outputs_queue, self.utility_results

        async def process_outputs_socket() -> None:
            try:
                while True:
                    _route_output(
                        await output_socket.recv(), resources, decoder, outputs_queue, utility_results
                    )
            except Exception as e:
                outputs_queue.put_nowait(e)

        self.output_task = asyncio.create_task(process_outputs_socket(), name="EngineCoreOutputQueueTask")

    def _on_engine_dead_callback(self) -> Callable[[EngineDeadError], None]:
        loop, outputs_queue, utility_results = self.loop, self.outputs_queue, self.utility_results

        def fail_all(error: EngineDeadError) -> None:  # runs in the event loop
            outputs_queue.put_nowait(error)
            for future in list(utility_results.values()):
                if not future.done():
                    future.set_exception(error)
            utility_results.clear()

        def on_engine_dead(error: EngineDeadError) -> None:  # runs in the monitor thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(fail_all, error)

        return on_engine_dead

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            raise self._format_exception(outputs) from None
        return outputs

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.input_socket.send_multipart(self._encode_input(EngineCoreRequestType.ADD, request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            await self.input_socket.send_multipart(
                self._encode_input(EngineCoreRequestType.ABORT, request_ids)
            )

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id = uuid.uuid4().int >> 64
        future = self.loop.create_future()
        self.utility_results[call_id] = future
        await self.input_socket.send_multipart(
            self._encode_input(EngineCoreRequestType.UTILITY, (call_id, method, args))
        )
        timeout_s = envs.rpc_timeout_s()
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            self.utility_results.pop(call_id, None)
            raise _utility_timeout(method, timeout_s) from None

    def shutdown(self) -> None:
        self.output_task.cancel()
        super().shutdown()
