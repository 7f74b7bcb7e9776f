"""Process and socket helpers shared by the frontend and the engine-core process.

Mirrors vllm/utils/__init__.py (`make_zmq_socket`, `get_mp_context`, `_maybe_force_spawn`,
`cuda_is_initialized`) (chapter 09).

Why it exists: both ends of the engine-core connection must make their sockets the same
way (a queue limit on one side alone still drops messages), and every child process must
be started the same way. Each of those is written once, here.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import sys
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)


def make_zmq_socket(ctx: Any, path: str, socket_type: int, bind: bool, linger: int | None = None) -> Any:
    """A ZMQ socket of `socket_type` bound to (or connected to) `path`, with no queue limit.

    libzmq's default high-water mark is 1,000 messages per peer. Past it a ROUTER drops
    what it is asked to send, without an error, and a PUSH blocks: a burst of 2,000
    requests (or one request with n=2000) would lose half of them and wait forever for
    their outputs. vLLM sets the limit to 0, unlimited; the frontend then bounds what can
    queue (request sizes, `n`), not the socket.
    """
    import zmq

    socket = ctx.socket(socket_type)
    if socket_type in (zmq.PULL, zmq.DEALER, zmq.ROUTER):
        socket.setsockopt(zmq.RCVHWM, 0)
    if socket_type in (zmq.PUSH, zmq.DEALER, zmq.ROUTER):
        socket.setsockopt(zmq.SNDHWM, 0)
    if linger is not None:
        socket.setsockopt(zmq.LINGER, linger)
    if bind:
        socket.bind(path)
    else:
        socket.connect(path)
    return socket


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
    """How to start the engine-core process: `forkserver` unless VLLM_WORKER_MULTIPROC_METHOD says otherwise.

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
        ctx.set_forkserver_preload(["nano_v1.engine.core"])
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
