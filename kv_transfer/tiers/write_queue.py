"""Saves to Redis behind the responses: a queue bounded by bytes, drained by one task.

    submit(blocks) ──> [ oldest ... newest ]  (≤ max_bytes; past it the oldest are dropped,
                              │                 counted `queue_full`)
                              └─ one task: a chunk at a time ──> RedisTier.put_many
                                 (acknowledged: written; else dropped with its reason)

One writer at a time keeps a busy Redis from being hit by many concurrent ~MB pipelines, and
the reads go on their own connections meanwhile. A block already waiting is not queued twice.
Dropping the oldest keeps the newest prompts, the likeliest to come back soon.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Sequence

from kv_transfer.tiers.redis_tier import RedisTier


class WriteQueue:
    """Not thread-safe: submit from the event loop the tier runs on."""

    def __init__(self, tier: RedisTier, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self._tier = tier
        self._max_bytes = max_bytes
        self._queued: OrderedDict[bytes, bytes] = OrderedDict()
        self._queued_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._in_flight = 0  # blocks of the chunk being written (not yet counted either way)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def __len__(self) -> int:
        return len(self._queued)

    def submit(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        counters = self._tier.counters
        for block_hash, value in items:
            if block_hash in self._queued:
                continue
            self._queued[block_hash] = value
            self._queued_bytes += len(value)
            counters.saves_queued += 1
        while self._queued_bytes > self._max_bytes:
            _, value = self._queued.popitem(last=False)
            self._queued_bytes -= len(value)
            counters.saves_dropped["queue_full"] += 1
        if self._queued and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        chunk_bytes = self._tier.limits.chunk_bytes
        while self._queued:
            chunk: list[tuple[bytes, bytes]] = []
            size = 0
            while self._queued and (not chunk or size + len(next(iter(self._queued.values())))
                                    <= chunk_bytes):
                item = self._queued.popitem(last=False)
                chunk.append(item)
                size += len(item[1])
            self._queued_bytes -= size
            self._in_flight = len(chunk)
            await self._tier.put_many(chunk)
            self._in_flight = 0

    async def flush(self) -> None:
        """Wait until everything submitted so far was written or dropped."""
        while self._task is not None and not self._task.done():
            await asyncio.wait({self._task})

    async def close(self) -> None:
        """Stop writing; what is still queued is dropped (`shutdown`)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._tier.counters.saves_dropped["shutdown"] += len(self._queued) + self._in_flight
        self._in_flight = 0
        self._queued.clear()
        self._queued_bytes = 0
