"""The scheduler's queues under its policy: first come, first served, or by request priority.

`SchedulerConfig.policy` = "priority" (vLLM's `--scheduling-policy priority`): each request
carries an integer `priority`, lower served first, arrival order among equals. The waiting queue
is kept in that order and so is the running list, so that the step's token budget reaches the
most urgent requests first and a preemption takes the least urgent, newest one (the list's
end), as it takes the newest under FCFS. "fcfs" keeps arrival order: a request that is
preempted, or whose KV transfer failed, goes back to the front.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from engine.config import SchedulingPolicy
from engine.request import Request


def priority_key(req: Request) -> tuple[int, float, int]:
    """Most urgent first: lower priority value, then earlier arrival, then admission order."""
    return req.priority, req.metrics.arrival_time, req.queue_seq


class WaitingQueue:
    """Requests not yet running, in the order the scheduler admits them."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._sorted: list[Request] = []  # ascending `priority_key` (priority policy)
        self._keys: list[tuple[int, float, int]] = []

    def add(self, req: Request) -> None:
        """A new request: at the back (FCFS) or at its priority's place."""
        if self.policy == "fcfs":
            self._fifo.append(req)
        else:
            self._insert(req)

    def requeue(self, req: Request) -> None:
        """A request that was admitted before (preempted, its KV pull failed): at the front
        (FCFS), or at its priority's place (it keeps its arrival time, so it goes ahead of
        later requests of its priority)."""
        if self.policy == "fcfs":
            self._fifo.appendleft(req)
        else:
            self._insert(req)

    def _insert(self, req: Request) -> None:
        key = priority_key(req)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._sorted.insert(i, req)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._sorted[0]

    def pop(self) -> Request:
        if self.policy == "fcfs":
            return self._fifo.popleft()
        self._keys.pop(0)
        return self._sorted.pop(0)

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(req)
            return
        i = self._sorted.index(req)
        del self._sorted[i]
        del self._keys[i]

    def __contains__(self, req: object) -> bool:
        return req in (self._fifo if self.policy == "fcfs" else self._sorted)

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._sorted)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        return iter(self._fifo if self.policy == "fcfs" else self._sorted)


def insert_running(running: list[Request], req: Request, policy: SchedulingPolicy) -> None:
    """Add `req` to the running list: at the end (FCFS: admission order), or at its priority's
    place (the end stays the least urgent, newest request: the next to preempt)."""
    if policy == "fcfs":
        running.append(req)
        return
    key = priority_key(req)
    i = len(running)
    while i > 0 and priority_key(running[i - 1]) > key:
        i -= 1
    running.insert(i, req)
