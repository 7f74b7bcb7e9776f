"""A one-writer, many-reader message queue in shared memory: how each step reaches every worker.

Mirrors vllm/distributed/device_communicators/shm_broadcast.py (`ShmRingBuffer`,
`Handle`, `MessageQueue`) (chapter 13).

Why it exists: every step, the executor sends the same `SchedulerOutput` to every worker
process. Through pipes that would be one pickle and one kernel copy per worker; here it is
one pickle written once into a ring of chunks in shared memory, which every reader reads
in place. The same class, with one reader, carries each worker's answer back.

The ring has `max_chunks` chunks of `max_chunk_bytes`; a message larger than one chunk
spans several consecutive chunks (each chunk starts with its payload length and a
"more follows" flag), so no message is too large, and memory stays bounded.

Where it differs from vLLM's: vLLM's readers and writer spin on per-chunk flag bytes in
the shared memory (`sched_yield` between looks), which answers in microseconds and costs a
CPU core per waiting process; a GPU server has cores to spare. Here the CPU cores are
the devices: a rank spinning while it waits for the next step would take the core its
neighbour computes on. So the ring is guarded by two counting semaphores per reader,
the classic bounded buffer: `written[i]` counts chunks reader i may read, `free[i]`
chunks the writer may overwrite as far as reader i is concerned. Waiting on a semaphore
sleeps in the kernel and wakes as soon as it is released, and its release and acquire
order the memory writes, so no flag protocol is needed. vLLM also sends messages too big
for a chunk over a ZMQ socket; chunk spanning needs no second channel (and no pyzmq,
which the GPU image lacks).

Semaphores can only be handed to a child when it is started, so the creator makes every
queue (the broadcast and each worker's response queue) and passes the handles as
process arguments; the creator also removes the shared memory when it closes its queue.
"""

from __future__ import annotations

import pickle
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.synchronize import Semaphore
from typing import Any
from unittest.mock import patch

from nano_v1.utils import get_mp_context

# Each chunk starts with: payload bytes in this chunk (uint32), 1 if the message goes on in the next chunk.
CHUNK_HEADER = struct.Struct("<IB")
# How often a blocked wait looks at its cancel event and deadline (a release wakes it at once).
POLL_INTERVAL_S = 0.1


class QueueCancelledError(RuntimeError):
    """A wait on the queue was cancelled (the executor is shutting down or a peer died)."""


class ShmRingBuffer:
    """`max_chunks` chunks of `max_chunk_bytes` in one shared-memory segment, and the semaphores that guard them.

    Pickles (only as a process argument, because of the semaphores) into an attachment to
    the same segment; only the creator removes it.
    """

    def __init__(self, n_reader: int, max_chunk_bytes: int, max_chunks: int) -> None:
        if max_chunk_bytes <= CHUNK_HEADER.size or max_chunks < 1:
            raise ValueError(
                f"a ring needs chunks larger than their {CHUNK_HEADER.size}-byte header and at least one chunk, "
                f"got max_chunk_bytes={max_chunk_bytes}, max_chunks={max_chunks}."
            )
        ctx = get_mp_context()
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.shared_memory = shared_memory.SharedMemory(create=True, size=max_chunk_bytes * max_chunks)
        self.is_creator = True
        # Invariant per reader i: written[i] + free[i] + (chunks i or the writer is working on) = max_chunks.
        self.written: list[Semaphore] = [ctx.Semaphore(0) for _ in range(n_reader)]
        self.free: list[Semaphore] = [ctx.Semaphore(max_chunks) for _ in range(n_reader)]

    def __reduce__(self):
        return (
            ShmRingBuffer._attach,
            (
                self.n_reader,
                self.max_chunk_bytes,
                self.max_chunks,
                self.shared_memory.name,
                self.written,
                self.free,
            ),
        )

    @classmethod
    def _attach(
        cls, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str,
        written: list[Semaphore], free: list[Semaphore],
    ) -> ShmRingBuffer:  # fmt: skip
        self = cls.__new__(cls)
        self.n_reader, self.max_chunk_bytes, self.max_chunks = n_reader, max_chunk_bytes, max_chunks
        # Python's resource tracker would adopt a segment merely opened here and remove it when
        # this process exits, under the creator's feet (https://bugs.python.org/issue39959);
        # vLLM opens it with the same patch.
        with patch("multiprocessing.resource_tracker.register", lambda *args, **kwargs: None):
            self.shared_memory = shared_memory.SharedMemory(name=name)
        self.is_creator = False
        self.written, self.free = written, free
        return self

    @contextmanager
    def get_data(self, index: int) -> Iterator[memoryview]:
        """Chunk `index` of the ring, as a writable view (released on exit, so the segment can close)."""
        start = index * self.max_chunk_bytes
        with self.shared_memory.buf[start : start + self.max_chunk_bytes] as buf:
            yield buf

    def close(self) -> None:
        self.shared_memory.close()
        if self.is_creator:
            self.shared_memory.unlink()
            self.is_creator = False


@dataclass
class Handle:
    """What another process needs to use a queue: its ring (a process argument, never sent later)."""

    buffer: ShmRingBuffer


def _acquire(semaphore: Semaphore, deadline: float | None, cancel: threading.Event | None) -> None:
    """Take one unit of `semaphore`, sleeping until it is released, cancelled, or past `deadline`."""
    while not semaphore.acquire(timeout=POLL_INTERVAL_S):
        if cancel is not None and cancel.is_set():
            raise QueueCancelledError("the wait on the message queue was cancelled")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("timed out waiting on the message queue")


class MessageQueue:
    """Pickled messages from one writer to `n_reader` readers, each of whom receives every message in order.

    `reader_rank` is this end's role: None for the writer, i for reader i.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int = 1 << 20,
        max_chunks: int = 8,
        reader_rank: int | None = None,
    ) -> None:
        self.buffer = ShmRingBuffer(n_reader, max_chunk_bytes, max_chunks)
        self.reader_rank = reader_rank
        self.current_idx = 0  # the next chunk this end writes or reads

    def export_handle(self) -> Handle:
        return Handle(self.buffer)

    @staticmethod
    def create_from_handle(handle: Handle, reader_rank: int | None) -> MessageQueue:
        """Another end of the queue behind `handle`: the writer (`reader_rank=None`) or reader `reader_rank`."""
        self = MessageQueue.__new__(MessageQueue)
        self.buffer = handle.buffer
        self.reader_rank = reader_rank
        self.current_idx = 0
        return self

    def enqueue(self, obj: Any, timeout: float | None = None, cancel: threading.Event | None = None) -> None:
        """Send `obj` to every reader; block (up to `timeout` s) while a reader is a whole ring behind."""
        if self.reader_rank is not None:
            raise RuntimeError("only the writer can enqueue")
        deadline = None if timeout is None else time.monotonic() + timeout
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        payload_bytes = self.buffer.max_chunk_bytes - CHUNK_HEADER.size
        for start in range(0, len(data), payload_bytes):
            piece = data[start : start + payload_bytes]
            for free in self.buffer.free:  # every reader is done with the chunk we overwrite
                _acquire(free, deadline, cancel)
            with self.buffer.get_data(self.current_idx) as buf:
                CHUNK_HEADER.pack_into(buf, 0, len(piece), start + payload_bytes < len(data))
                buf[CHUNK_HEADER.size : CHUNK_HEADER.size + len(piece)] = piece
            for written in self.buffer.written:
                written.release()
            self.current_idx = (self.current_idx + 1) % self.buffer.max_chunks

    def dequeue(self, timeout: float | None = None, cancel: threading.Event | None = None) -> Any:
        """The next message; block (up to `timeout` s, forever if None) until it is written."""
        if self.reader_rank is None:
            raise RuntimeError("only a reader can dequeue")
        deadline = None if timeout is None else time.monotonic() + timeout
        pieces: list[bytes] = []
        more = True
        while more:
            _acquire(self.buffer.written[self.reader_rank], deadline, cancel)
            with self.buffer.get_data(self.current_idx) as buf:
                length, more = CHUNK_HEADER.unpack_from(buf, 0)
                with buf[CHUNK_HEADER.size : CHUNK_HEADER.size + length] as piece:
                    if not more and not pieces:
                        obj = pickle.loads(piece)  # one chunk: unpickled in place, no copy
                    else:
                        pieces.append(bytes(piece))
            self.buffer.free[self.reader_rank].release()
            self.current_idx = (self.current_idx + 1) % self.buffer.max_chunks
        return pickle.loads(b"".join(pieces)) if pieces else obj

    def close(self) -> None:
        """Detach from the shared memory (and, at the creating end, remove it)."""
        self.buffer.close()
