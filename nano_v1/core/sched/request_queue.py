"""The waiting queue: first-come-first-served, or by priority.

Mirrors vllm/v1/core/sched/request_queue.py (chapter 04).

Why two queues behind one interface: the scheduler only ever peeks at the head, pops it
once its blocks are allocated, and pushes a preempted request back to the head. FCFS
is a deque; priority is a heap keyed on (priority, arrival_time), so "the head" is the
most urgent request and a preempted request simply rejoins the heap.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from nano_v1.request import Request


class FCFSRequestQueue(deque):
    """Arrival order; a preempted request goes back to the front."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put `requests` back in front, as vLLM v0.11.0 does with the requests a step skipped."""
        self.extendleft(reversed(list(requests)))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        kept = [r for r in self if id(r) not in gone]
        self.clear()
        self.extend(kept)


class PriorityRequestQueue:
    """Lowest (priority, arrival_time) first; ties broken by arrival."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0  # keeps heap entries comparable when keys tie

    def add_request(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._counter, request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    # A preempted request keeps its key, so "to the front" is just "back into the heap".
    prepend_request = add_request

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "fcfs":
        return FCFSRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected 'fcfs' or 'priority'.")
