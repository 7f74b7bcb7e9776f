"""Process and socket helpers shared by the frontend, the engine core and the executor.

Mirrors vllm/utils/__init__.py (`make_zmq_socket`, `get_mp_context`, `_maybe_force_spawn`,
`cuda_is_initialized`, `get_open_port`, `get_loopback_ip`, `get_distributed_init_method`,
`run_method`) (chapters 09 and 13).

Why it exists: both ends of the engine-core connection must make their sockets the same
way (a queue limit on one side alone still drops messages); the engine-core process
(chapter 09) and the worker processes of the multiprocess executor (chapter 13) are
started the same way and watch their parent the same way; and the executors call a
worker method by name or as a function the same way. Each of those is written once, here.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.util
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)

def get_loopback_ip() -> str:
    """The address the ranks of one machine meet on: nothing leaves the host."""
    return "127.0.0.1"


def get_open_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; a tiny race is accepted, as in vLLM)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((get_loopback_ip(), 0))
        return s.getsockname()[1]


def get_distributed_init_method(ip: str, port: int) -> str:
    """`tcp://ip:port`: where torch.distributed's ranks rendezvous."""
    return f"tcp://{ip}:{port}"


def make_zmq_socket(ctx: Any, path: str, socket_type: int, bind: bool, linger: int | None = None) -> Any:
    """A ZMQ socket of `socket_type` bound to (or connected to) `path`, with no queue limit.

    libzmq's default high-water mark is 1,000 messages per peer. Past it a ROUTER drops
    what it is asked to send, without an error, and a PUSH blocks: a burst of 2,000
    requests (or one request with n=2000) would lose half of them and wait forever for
    their outputs. vLLM sets the limit to 0, unlimited; the frontend then bounds what can
    queue (request sizes, `n`), not the socket.
    """
    import zmq

    sock = ctx.socket(socket_type)
    if socket_type in (zmq.PULL, zmq.DEALER, zmq.ROUTER):
        sock.setsockopt(zmq.RCVHWM, 0)
    if socket_type in (zmq.PUSH, zmq.DEALER, zmq.ROUTER):
        sock.setsockopt(zmq.SNDHWM, 0)
    if linger is not None:
        sock.setsockopt(zmq.LINGER, linger)
    if bind:
        sock.bind(path)
    else:
        sock.connect(path)
    return sock


def cuda_is_initialized() -> bool:
    import torch

    return torch.cuda._is_compiled() and torch.cuda.is_initialized()


def _maybe_force_spawn(method: str) -> str:
    """`fork` after CUDA is initialised gives the child a CUDA context it cannot use: spawn, as vLLM does."""
    if method == "fork" and cuda_is_initialized():
        logger.warning(
            "VLLM_WORKER_MULTIPROC_METHOD=fork, but CUDA is already initialised in this process and a forked "
            "child cannot use it; starting the engine core with 'spawn' instead."
        )
        return "spawn"
    return method


def get_mp_context() -> multiprocessing.context.BaseContext:
    """How to start the engine-core and worker processes: `forkserver` unless VLLM_WORKER_MULTIPROC_METHOD says otherwise.

    `fork` is what vLLM uses when it can, and it is fast, but it copies the parent's
    threads' state without the threads: once the parent has run a multi-threaded torch op,
    OpenMP's pool is such state, and we measured a forked child hang in its first matmul
    (one torch thread in the child survives; two hang). No test of the parent tells
    whether that pool exists (tokenizers and ZMQ start native threads too), so `fork` is
    used only when asked for. A `forkserver` child is forked from a clean server process
    that imported the engine once: as safe as `spawn`, and only the first start pays the
    imports.
    """
    from nano_v1 import envs

    ctx = multiprocessing.get_context(_maybe_force_spawn(envs.worker_multiproc_method() or "forkserver"))
    if ctx.get_start_method() == "forkserver":
        # What every child needs: the engine, the workers, and transformers' config classes
        # (each child unpickles a VllmConfig holding one), so that no child imports them again.
        ctx.set_forkserver_preload(
            ["nano_v1.engine.core", "nano_v1.executor.multiproc_executor", "transformers.models"]
        )
    return ctx


def start_process(proc: BaseProcess) -> None:
    """`proc.start()`, without the child importing this process's main module first.

    A `spawn` or `forkserver` child first re-runs the parent's `__main__` (the script, or
    the module of `python -m`), so that objects defined there can be unpickled. A script
    without an `if __name__ == "__main__":` guard, README's first example saved as a file
    or a notebook run with `python`, would then build a second engine inside the child,
    which multiprocessing forbids, and the child dies. The engine core needs nothing from
    `__main__` (its target and arguments are nano_v1's), so the main module is hidden
    while the child starts, as it is under `python -c`. `fork` children are unaffected.
    """
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    # multiprocessing reads `__spec__.name` (python -m) first, then `__file__` (a script).
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        proc.start()
    finally:
        main.__dict__.update(saved)


def use_mp_temp_dir_in(parent: str) -> None:
    """Make this process's multiprocessing temporary directory (`pymp-*`, where a fork server
    binds its socket) inside `parent` instead of in $TMPDIR.

    A process removes its `pymp-*` directory when it exits, but not when it is killed;
    inside a directory that another process removes, it goes anyway. No effect in a process
    that already has one (a forked child shares its parent's).
    """
    saved, tempfile.tempdir = tempfile.tempdir, parent
    try:
        multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def exit_when_parent_dies(conn: Connection) -> None:
    """Block on a death pipe; when the parent's end closes (it exited or died), exit at once.

    Run in a daemon thread of a child process, so that a child never outlives its parent
    as an orphan, whatever the child's main thread is blocked on.
    """
    try:
        conn.recv()
    except EOFError:
        pass
    os._exit(0)


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from multiprocessing's `exitcode` (-N: killed by signal N)."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        names = {int(s): s.name for s in signal.Signals}
        return f"was killed by signal {-exitcode} ({names.get(-exitcode, 'a real-time signal')})"
    return f"exited with code {exitcode}"


def run_method(obj: Any, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """`obj.<method>(*args, **kwargs)` for a method name, or `method(obj, *args, **kwargs)` for a function."""
    if isinstance(method, str):
        return getattr(obj, method)(*args, **kwargs)
    return method(obj, *args, **kwargs)
