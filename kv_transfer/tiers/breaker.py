"""A circuit breaker that backs off per kind of failure.

A Redis that refused a connection is likely down: back off long. One that timed out is busy:
back off briefly and try again soon. One that is full (`maxmemory` under `noeviction`) answers
reads fine: only writes back off. Each kind's pause doubles with each consecutive failure of
that kind, up to its cap; a success closes the breaker and resets every kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum


class Failure(StrEnum):
    CONNECTION = "connection"   # refused, reset, unreachable
    TIMEOUT = "timeout"         # no answer within the deadline sized for the bytes
    FULL = "full"               # Redis out of memory (OOM command not allowed)
    ERROR = "error"             # any other error reply


# (first pause, cap) in seconds, per kind.
BACKOFF_S: dict[Failure, tuple[float, float]] = {
    Failure.CONNECTION: (1.0, 30.0),
    Failure.TIMEOUT: (0.25, 8.0),
    Failure.FULL: (2.0, 60.0),
    Failure.ERROR: (1.0, 30.0),
}


class Breaker:
    """Closed (calls go through) or open until a time. Not thread-safe: one event loop."""

    def __init__(self, backoff_s: dict[Failure, tuple[float, float]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._backoff = backoff_s or BACKOFF_S
        self._clock = clock
        self._streak: dict[Failure, int] = {}
        self._open_until = 0.0
        self.open_reason: Failure | None = None  # the failure that opened it last

    def allow(self) -> bool:
        """True when a call may go through (closed, or its pause is over: a trial call)."""
        return self._clock() >= self._open_until

    def failure(self, kind: Failure) -> float:
        """Open for this kind's next pause; returns the pause in seconds."""
        streak = self._streak.get(kind, 0)
        first, cap = self._backoff[kind]
        pause = min(cap, first * (2 ** streak))
        self._streak[kind] = streak + 1
        self._open_until = max(self._open_until, self._clock() + pause)
        self.open_reason = kind
        return pause

    def success(self) -> None:
        self._streak.clear()
        self._open_until = 0.0
        self.open_reason = None
