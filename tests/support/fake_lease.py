"""Test fake: a stand-alone lease table for transport tests (the engine's scheduler holds the
real leases). Leases: KV blocks a prefill worker holds for a decode worker to pull.

Pure Python, no torch. The table only records which blocks a request's lease covers and until
when; freeing blocks in the engine is the caller's job (it gets the Lease back from `release`
or `expire`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class LeaseError(ValueError):
    """A lease could not be granted (duplicate request id or inconsistent fields)."""


@dataclass(frozen=True, slots=True)
class Lease:
    """Blocks held for one request until `deadline_monotonic` (time.monotonic seconds).

    block_ids: engine block ids in prompt order (full blocks, then the last partial one).
    block_hashes: hashes of the full blocks, in order (len <= len(block_ids)).
    num_tokens: prompt tokens whose KV the blocks hold.
    """

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    deadline_monotonic: float

    def expired(self, now: float) -> bool:
        return now >= self.deadline_monotonic


class LeaseTable:
    """request_id -> Lease. Every method takes the table's lock for its whole (short) body,
    so it may be called from the event loop and from the engine thread alike.

    `clock` returns monotonic seconds (injectable for tests; default time.monotonic).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}

    def now(self) -> float:
        return self._clock()

    def grant(
        self,
        request_id: str,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        num_tokens: int,
        deadline_monotonic: float,
    ) -> Lease:
        """Add a lease (mutates the table). Raises LeaseError if request_id already holds one
        or the fields disagree (more hashes than blocks, num_tokens beyond the blocks)."""
        if not request_id:
            raise LeaseError("lease request_id must be non-empty")
        if len(block_hashes) > len(block_ids):
            raise LeaseError(f"lease {request_id!r}: {len(block_hashes)} hashes for "
                             f"{len(block_ids)} blocks")
        if num_tokens <= 0 or not block_ids:
            raise LeaseError(f"lease {request_id!r}: needs num_tokens > 0 and at least one block")
        lease = Lease(request_id, tuple(block_ids), tuple(block_hashes), num_tokens,
                      deadline_monotonic)
        with self._lock:
            if request_id in self._leases:
                raise LeaseError(f"request {request_id!r} already holds a lease")
            self._leases[request_id] = lease
        return lease

    def get(self, request_id: str) -> Lease | None:
        """The live lease, or None if absent or past its deadline (read-only: an expired lease
        stays in the table until `expire` or `release` hands it back for freeing)."""
        with self._lock:
            lease = self._leases.get(request_id)
        if lease is None or lease.expired(self._clock()):
            return None
        return lease

    def release(self, request_id: str) -> Lease | None:
        """Remove and return the lease whatever its deadline (the caller frees its blocks);
        None if there was none."""
        with self._lock:
            return self._leases.pop(request_id, None)

    def expire(self, now: float | None = None) -> list[Lease]:
        """Remove and return every lease whose deadline is <= now (default: the clock)."""
        now = self._clock() if now is None else now
        with self._lock:
            dead = [lease for lease in self._leases.values() if lease.expired(now)]
            for lease in dead:
                del self._leases[lease.request_id]
        return dead

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._leases
