"""Prefix-cache tiers below the GPU, keyed by block hash (DESIGN.md §1, §4).

Values are encoded blocks (`wire.encode_block` bytes). Lookups walk a prompt's chained hashes in
order and stop at the first miss: block i is only useful if blocks 0..i-1 are too.

    TieredStore.get_many([h0, h1, h2, h3])
      CpuTier    h0 ✓  h1 ✓  h2 ✗ ───────────┐
      RedisTier              h2 ✓  h3 ✗      │  (one pipelined round trip for h2.. )
      result     b0    b1    b2    None      └─ Redis hits are promoted into the CPU tier

Nothing read from Redis is trusted: a value that fails `wire.verify_block` (corrupt, foreign
fingerprint, another block's hash) is a miss and a counter, and so is Redis being down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from redis import asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from kv_transfer.wire import BlockSpec, KvWireError, verify_block

log = logging.getLogger(__name__)

DEFAULT_MAX_VALUE_BYTES = 64 << 20


class CpuTier:
    """LRU of encoded blocks bounded by total bytes, in pinned memory when CUDA is available
    (so a later host->device copy can be asynchronous).

    Thread-safe: every method holds the tier's lock for its whole body. `get` mutates the LRU
    order; `put` may evict least recently used blocks.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._lock = threading.Lock()
        # hash -> encoded block (bytes, or a pinned uint8 tensor [n]); last = most recent.
        self._blocks: OrderedDict[bytes, bytes | torch.Tensor] = OrderedDict()
        self._used_bytes = 0
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "evictions": 0, "rejected": 0}

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def get(self, block_hash: bytes) -> bytes | None:
        """The encoded block (a copy) and mark it most recently used; None on a miss."""
        with self._lock:
            value = self._blocks.get(block_hash)
            if value is None:
                self.stats["misses"] += 1
                return None
            self._blocks.move_to_end(block_hash)
            self.stats["hits"] += 1
        return value if isinstance(value, bytes) else value.numpy().tobytes()

    def get_prefix(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Encoded blocks of the longest cached prefix of block_hashes."""
        found: list[bytes] = []
        for block_hash in block_hashes:
            data = self.get(block_hash)
            if data is None:
                break
            found.append(data)
        return found

    def get_prefix_entries(self, block_hashes: Sequence[bytes]) -> list[bytes | torch.Tensor]:
        """`get_prefix` without copies: the stored values themselves (pinned uint8 tensors when
        pinning). An entry is never written in place (a `put` replaces it), so a caller may
        read it after it was evicted; it stays alive while referenced."""
        found: list[bytes | torch.Tensor] = []
        with self._lock:
            for block_hash in block_hashes:
                value = self._blocks.get(block_hash)
                if value is None:
                    self.stats["misses"] += 1
                    break
                self._blocks.move_to_end(block_hash)
                self.stats["hits"] += 1
                found.append(value)
        return found

    def put(self, block_hash: bytes, data: bytes) -> bool:
        """Insert (or refresh) a block, evicting LRU blocks to fit; False if it can never fit."""
        size = len(data)
        if size > self.capacity_bytes:
            with self._lock:
                self.stats["rejected"] += 1
            return False
        value = self._store(data)
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self._used_bytes -= _nbytes(old)
            while self._used_bytes + size > self.capacity_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self._used_bytes -= _nbytes(evicted)
                self.stats["evictions"] += 1
            self._blocks[block_hash] = value
            self._used_bytes += size
        return True

    def _store(self, data: bytes) -> bytes | torch.Tensor:
        if not self._pin:
            return bytes(data)
        pinned = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
        pinned.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return pinned


def _nbytes(value: bytes | torch.Tensor) -> int:
    return len(value) if isinstance(value, bytes) else value.numel()


class RedisTier:
    """Cluster-wide tier: one Redis key per block, `<key_prefix>:<fingerprint hex16>:<hash hex>`,
    written with SET EX ttl_s through non-transactional pipelines (DESIGN.md §8).

    Never raises for Redis trouble: corrupt or foreign values count in stats["corrupt"], values
    above max_value_bytes in stats["oversize"], connection/timeouts in stats["errors"]; after an
    error Redis is skipped for `retry_after_s` so a dead server does not add latency per call.
    Not thread-safe: use it from one event loop.
    """

    def __init__(
        self,
        spec: BlockSpec,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: int = 3600,
        key_prefix: str = "splitserve:kv",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        socket_timeout_s: float = 1.0,
        retry_after_s: float = 5.0,
        client: aioredis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        self._spec = spec
        self._ttl_s = ttl_s
        self._key_base = f"{key_prefix}:{spec.fingerprint.hex()[:16]}:"
        self._max_value_bytes = max_value_bytes
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._down_until = 0.0
        self._client = client or aioredis.Redis.from_url(
            url, decode_responses=False, socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s)
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "corrupt": 0, "oversize": 0,
                                      "errors": 0, "writes": 0}

    def key(self, block_hash: bytes) -> bytes:
        return (self._key_base + block_hash.hex()).encode()

    async def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """One pipelined GET per hash; each value verified against the spec and its hash."""
        if not block_hashes:
            return []
        values = await self._run("get", lambda pipe: [pipe.get(self.key(h)) for h in block_hashes])
        if values is None:
            self.stats["misses"] += len(block_hashes)
            return [None] * len(block_hashes)
        return [self._check(h, v) for h, v in zip(block_hashes, values, strict=True)]

    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """SET key value EX ttl for each (hash, encoded block); returns how many were sent."""
        items = [(h, v) for h, v in items if self._fits(v)]
        if not items:
            return 0
        done = await self._run("put", lambda pipe: [pipe.set(self.key(h), v, ex=self._ttl_s)
                                                    for h, v in items])
        if done is None:
            return 0
        self.stats["writes"] += len(items)
        return len(items)

    async def close(self) -> None:
        await self._client.aclose()

    def _fits(self, value: bytes) -> bool:
        if len(value) <= self._max_value_bytes:
            return True
        self.stats["oversize"] += 1
        return False

    def _check(self, block_hash: bytes, value: object) -> bytes | None:
        if value is None:
            self.stats["misses"] += 1
            return None
        if not isinstance(value, bytes) or not self._fits(value):
            self.stats["corrupt"] += 1
            return None
        try:
            verify_block(value, self._spec, expected_hash=block_hash)
        except KvWireError as exc:
            self.stats["corrupt"] += 1
            log.warning("redis tier: dropping bad value for %s: %s", block_hash.hex()[:16], exc)
            return None
        self.stats["hits"] += 1
        return value

    async def _run(self, what: str, queue: Callable[[Pipeline], object]) -> list[object] | None:
        """Execute one non-transactional pipeline; None (and a counter) if Redis failed."""
        if self._clock() < self._down_until:
            self.stats["errors"] += 1
            return None
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                queue(pipe)
                return list(await pipe.execute())
        except (RedisError, OSError) as exc:
            self.stats["errors"] += 1
            self._down_until = self._clock() + self._retry_after_s
            log.warning("redis tier %s failed (%s); skipping Redis for %.1fs", what, exc,
                        self._retry_after_s)
            return None


class TieredStore:
    """CPU tier, then Redis (optional). `get_many` stops at the first miss of the chain and
    promotes Redis hits into the CPU tier; `put_many` writes through to both.

    Mutates the tiers (LRU order, promotions, writes); no lock of its own (CpuTier locks).
    """

    def __init__(self, spec: BlockSpec, cpu: CpuTier, redis: RedisTier | None = None) -> None:
        self._spec = spec
        self.cpu = cpu
        self.redis = redis
        self._promotions = 0
        self._rejected_puts = 0

    async def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """len(block_hashes) entries: encoded blocks of the longest cached prefix, then None."""
        found: list[bytes | None] = list(self.cpu.get_prefix(block_hashes))
        found.extend(await self._redis_prefix(block_hashes[len(found):]))
        return found + [None] * (len(block_hashes) - len(found))

    async def get_entries(self, block_hashes: Sequence[bytes]
                          ) -> list[bytes | torch.Tensor | None]:
        """`get_many` without copying the CPU tier's entries (see `CpuTier.get_prefix_entries`):
        every entry was verified when it entered the store, so `wire.block_view` reads it."""
        found: list[bytes | torch.Tensor | None] = list(self.cpu.get_prefix_entries(block_hashes))
        found.extend(await self._redis_prefix(block_hashes[len(found):]))
        return found + [None] * (len(block_hashes) - len(found))

    async def _redis_prefix(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Redis's values (verified) of the longest prefix of block_hashes it holds, promoted
        into the CPU tier; [] without Redis."""
        found: list[bytes] = []
        if block_hashes and self.redis is not None:
            for block_hash, value in zip(block_hashes, await self.redis.get_many(block_hashes),
                                         strict=True):
                if value is None:
                    break
                self.cpu.put(block_hash, value)
                self._promotions += 1
                found.append(value)
        return found

    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store (hash, encoded block) pairs in every tier. Each block is verified first (so a
        bug cannot poison the cluster-wide cache): one whose header disagrees with the spec or
        its hash (a partial block has none) is skipped and counted in stats["rejected_puts"]."""
        good = [(h, data) for h, data in items if self._valid(h, data)]
        for block_hash, data in good:
            self.cpu.put(block_hash, data)
        if good and self.redis is not None:
            await self.redis.put_many(good)

    def _valid(self, block_hash: bytes, data: bytes) -> bool:
        try:
            verify_block(data, self._spec, expected_hash=block_hash)
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
