"""The engine core's busy loop without a model or sockets: its two queues, a stand-in scheduler,
and the input loop in a thread (chapter 09; the async-scheduling tests reuse it, chapter 14).
"""

from __future__ import annotations

import queue
import threading
import types

from nano_v1.engine import EngineCoreRequestType
from nano_v1.engine.core import EngineCoreProc


class QueueOnlyCore(EngineCoreProc):
    """The busy loop's pieces over its two queues, with a stand-in scheduler and no model:
    `add_request` makes the core busy, `abort_requests` and utility calls are recorded."""

    def __init__(self) -> None:  # no model, no sockets, no IO threads
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.scheduler = types.SimpleNamespace(has_unfinished_requests=lambda: bool(self.added))
        self.batch_queue = None  # no step in flight (chapter 14)

    def add_request(self, request) -> None:
        self.added.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def double(self, x: int) -> int:
        return 2 * x


class LoopOnlyCore(QueueOnlyCore):
    """Handles ADD and ABORT itself, so that the input loop's tests (ch09_t1) do not depend
    on `_handle_client_request` (ch09_t2)."""

    def _handle_client_request(self, request_type: EngineCoreRequestType, request) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self.added.append(request)
        else:
            self.aborted += request


def start_input_loop(core: QueueOnlyCore) -> tuple[threading.Thread, list[BaseException]]:
    """`core._process_input_queue()` in a thread; what it raises lands in the list."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            core._process_input_queue()
        except BaseException as error:  # noqa: BLE001  (re-raised in the test's own thread)
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def wait(thread: threading.Thread, errors: list[BaseException], seconds: float) -> None:
    thread.join(timeout=seconds)
    if errors:
        raise errors[0]
