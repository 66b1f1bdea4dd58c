"""The tiers together: the CPU tier, then Redis (optional).

    TieredStore.get_entries([h0, h1, h2, h3])
      CpuTier    h0 ✓  h1 ✓  h2 ✗ ───────────┐
      RedisTier              h2 ✓  h3 ✗      │  (chunked pipelined GETs from h2, each chunk
      result     b0    b1    b2    None      └─  only if `worth` it; hits promoted to the CPU tier)

Lookups walk a prompt's chained hashes in order and stop at the first miss: block i is only
useful if blocks 0..i-1 are too. `put_many` stores in the CPU tier at once and queues the Redis
write behind the caller (`write_queue.py`): a save never waits on Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from opentelemetry.context import Context

from kv_transfer.tiers.counters import ReadCost, TierCounters
from kv_transfer.tiers.cpu import CpuTier
from kv_transfer.tiers.redis_tier import RedisTier
from kv_transfer.tiers.write_queue import WriteQueue
from kv_transfer.wire import BlockSpec, KvWireError, verify_block

log = logging.getLogger(__name__)

# Redis writes waiting behind the responses, at most (the oldest are dropped past it).
DEFAULT_MAX_QUEUED_BYTES = 256 << 20

# worth(tier counters, blocks) -> whether reading that many blocks from the tier beats
# computing them (worker/tier_cost.py).
Worth = Callable[[TierCounters, int], bool]


class TieredStore:
    """CPU tier, then Redis. Mutates the tiers (LRU order, promotions, writes); no lock of its
    own (CpuTier locks). Use from one event loop."""

    def __init__(self, spec: BlockSpec, cpu: CpuTier, redis: RedisTier | None = None,
                 max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES) -> None:
        self._spec = spec
        self.cpu = cpu
        self.redis = redis
        self.cpu_counters = TierCounters("cpu", cost=ReadCost(1e-5, 5e9))
        self._queue = WriteQueue(redis, max_queued_bytes) if redis is not None else None
        self._promotions = 0
        self._rejected_puts = 0

    @property
    def spec(self) -> BlockSpec:
        return self._spec

    @property
    def tiers(self) -> list[TierCounters]:
        """Each tier's counters, CPU first (a tier of 0 bytes is absent)."""
        out = [self.cpu_counters] if self.cpu.capacity_bytes else []
        return out + ([self.redis.counters] if self.redis is not None else [])

    @property
    def queued_bytes(self) -> int:
        return self._queue.queued_bytes if self._queue is not None else 0

    async def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """len(block_hashes) entries: encoded blocks (copies) of the longest cached prefix,
        then None."""
        entries = await self.get_entries(block_hashes)
        return [e if e is None or isinstance(e, bytes) else e.numpy().tobytes()
                for e in entries]

    async def get_entries(self, block_hashes: Sequence[bytes], worth: Worth | None = None,
                          parent: Context | None = None) -> list[bytes | torch.Tensor | None]:
        """`get_many` without copying the CPU tier's entries (see `CpuTier.get_prefix_entries`):
        every entry was verified when it entered the store, so `wire.block_view` reads it.
        worth: asked before each Redis chunk (not asked for the CPU tier: a memory copy)."""
        start = time.perf_counter()
        found: list[bytes | torch.Tensor | None] = list(self.cpu.get_prefix_entries(block_hashes))
        if self.cpu.capacity_bytes:
            self.cpu_counters.read(len(found), len(found) * self._spec.encoded_nbytes,
                                   time.perf_counter() - start)
            self.cpu_counters.misses += len(found) < len(block_hashes)
        rest = block_hashes[len(found):]
        if rest and self.redis is not None:
            redis = self.redis
            fetch = None if worth is None else (lambda n: worth(redis.counters, n))
            for block_hash, value in zip(rest, await redis.get_prefix(rest, fetch, parent),
                                         strict=False):
                self.cpu.put(block_hash, value)
                self._promotions += 1
                found.append(value)
        return found + [None] * (len(block_hashes) - len(found))

    async def redis_held(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, Redis holds (values unread); 0 without
        Redis."""
        return 0 if self.redis is None else await self.redis.held_prefix(block_hashes)

    async def fetch_redis(self, block_hashes: Sequence[bytes],
                          parent: Context | None = None) -> list[bytes]:
        """Redis's verified values of the longest prefix of `block_hashes` it holds (all of them
        read: the caller decided they are worth it), promoted to the CPU tier."""
        if self.redis is None:
            return []
        found = await self.redis.get_prefix(block_hashes, None, parent)
        for block_hash, value in zip(block_hashes, found, strict=False):
            self.cpu.put(block_hash, value)
            self._promotions += 1
        return found

    async def put_many(self, items: Sequence[tuple[bytes, bytes]],
                       encoded_here: bool = False) -> int:
        """Store (hash, encoded block) pairs in the CPU tier and queue them for Redis; returns
        how many the CPU tier took. Each block is verified first (so a bug cannot poison the
        cluster-wide cache): one whose header disagrees with the spec or its hash (a partial
        block has none) is skipped and counted in stats["rejected_puts"].
        encoded_here: the caller just encoded them (`encode_block` computed the checksum over
        those very bytes): the header is checked, the checksum is not computed again."""
        good = [(h, data) for h, data in items if self._valid(h, data, not encoded_here)]
        stored = 0
        if self.cpu.capacity_bytes:
            counters = self.cpu_counters
            for block_hash, data in good:
                start = time.perf_counter()
                counters.saves_queued += 1
                if self.cpu.put(block_hash, data):
                    stored += 1
                    counters.saves_written += 1
                    counters.written_bytes += len(data)
                    counters.writes.observe(time.perf_counter() - start)
                else:
                    counters.saves_dropped["rejected"] += 1
        if good and self._queue is not None:
            self._queue.submit(good)
        return stored

    async def flush(self) -> None:
        """Wait for the queued Redis writes (tests, shutdown)."""
        if self._queue is not None:
            await self._queue.flush()

    async def close(self) -> None:
        if self._queue is not None:
            await self._queue.close()
        if self.redis is not None:
            await self.redis.close()

    def _valid(self, block_hash: bytes, data: bytes, checksum: bool = True) -> bool:
        try:
            verify_block(data, self._spec, expected_hash=block_hash, checksum=checksum)
        except KvWireError as exc:
            self._rejected_puts += 1
            log.warning("tiered store: refusing to cache block %s: %s", block_hash.hex()[:16], exc)
            return False
        return True

    @property
    def stats(self) -> dict[str, int]:
        merged = {f"cpu_{k}": v for k, v in self.cpu.stats.items()}
        if self.redis is not None:
            merged.update({f"redis_{k}": v for k, v in self.redis.stats.items()})
        merged["promotions"] = self._promotions
        merged["rejected_puts"] = self._rejected_puts
        return merged
