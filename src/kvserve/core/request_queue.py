"""The waiting queue, ordered by the scheduling policy.

``fcfs``: arrival order; a preempted request goes back to the front, since it
was admitted before everything still waiting.

``priority``: by ``(priority, arrival order)``, lower first; a preempted
request simply rejoins at its place in that order.

The policy also picks preemption victims (:func:`preemption_key`): the running
request with the largest key is preempted first.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from kvserve.config.scheduler import SchedulingPolicy
from kvserve.core.request import Request


class RequestQueue(ABC):
    """Waiting requests in the order the scheduler should admit them."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Queue a request that was running and got preempted."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit (the queue must not be empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request to admit."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a queued request (abort)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Queued requests in admission order."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue(RequestQueue):
    """A heap on ``(priority, arrival_order)``; arrival orders are unique, so keys never tie."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_order, request))

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        # Aborts are rare next to pushes and pops: a linear removal is fine.
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1])))

    def __len__(self) -> int:
        return len(self._heap)


def make_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()


def preemption_key(policy: SchedulingPolicy, request: Request) -> tuple[int, int]:
    """Running requests are preempted largest key first.

    ``fcfs``: the newest. ``priority``: the largest priority value, then the newest.
    """
    if policy == "priority":
        return (request.priority, request.arrival_order)
    return (0, request.arrival_order)
