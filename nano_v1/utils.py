"""Small process helpers shared by the engine core and the executor.

Mirrors vllm/utils/__init__.py (`get_open_port`, `get_loopback_ip`,
`get_distributed_init_method`, `get_mp_context`, `run_method`) (chapters 09 and 13).

Why it exists: the engine-core process (chapter 09) and the worker processes of the
multiprocess executor (chapter 13) are started the same way, watch their parent the same
way, and the executors call a worker method by name or as a function the same way; each
of those is written once, here.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import socket
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


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


def get_mp_context() -> multiprocessing.context.BaseContext:
    """How to start the engine-core and worker processes (VLLM_WORKER_MULTIPROC_METHOD overrides).

    `fork` is unsafe here: once the parent has run a multi-threaded torch op (OpenMP's
    thread pool exists) or touched CUDA, a forked child can deadlock in its first op; we
    measured exactly that hang on this CPU. vLLM therefore spawns on CPU, paying the import
    of torch in every child. We default to `forkserver`: a clean server process imports the
    engine once, and every child is forked from it, so it is as safe as `spawn` and only
    the first start pays the imports.
    """
    from nano_v1 import envs

    ctx = multiprocessing.get_context(envs.worker_multiproc_method() or "forkserver")
    if ctx.get_start_method() == "forkserver":
        # What every child needs: the engine, the workers, and transformers' config classes
        # (each child unpickles a VllmConfig holding one), so that no child imports them again.
        ctx.set_forkserver_preload(
            ["nano_v1.engine.core", "nano_v1.executor.multiproc_executor", "transformers.models"]
        )
    return ctx


def start_process(proc: BaseProcess) -> None:
    """`proc.start()`, without making the child re-run this process's main script.

    A `spawn` or `forkserver` child first runs the parent's main script (as `__mp_main__`) so
    that objects defined there can be unpickled. A script without an
    `if __name__ == "__main__":` guard, such as a notebook run with `python` or a user's
    two-line script, would then build a second engine inside the child, which fails. Our
    children need nothing from the main script (their targets and arguments live in
    nano_v1), so the script is hidden while the child starts, as it is under Jupyter or
    `python -c`.
    """
    main = sys.modules["__main__"]
    path = main.__dict__.pop("__file__", None)
    try:
        proc.start()
    finally:
        if path is not None:
            main.__file__ = path


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


def run_method(obj: Any, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """`obj.<method>(*args, **kwargs)` for a method name, or `method(obj, *args, **kwargs)` for a function."""
    if isinstance(method, str):
        return getattr(obj, method)(*args, **kwargs)
    return method(obj, *args, **kwargs)
