"""Prefix-cache tiers below the GPU, keyed by block hash (docs/architecture.md, "Shared contracts").

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
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from redis import asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from kv_transfer.wire import BlockSpec, KvWireError, verify_block

log = logging.getLogger(__name__)

DEFAULT_MAX_VALUE_BYTES = 64 << 20


class PinnedSlots:
    """Fixed-size host slots for the CPU tier's entries, carved from power-of-two slabs.

    torch's caching host allocator rounds every pinned allocation up to a power of two, so an
    8B model's encoded block (2 MiB + 108 bytes) took 4 MiB on its own (measured on the H200
    host: 100 entries, 400 MB of RSS). A slab of SLAB_BYTES (or the next power of two above one
    slot) holds as many slots as fit. A slot handed out by `take` comes back when the last
    reference to its view is gone (a weakref callback): a tier load may still be reading an
    entry the tier has evicted, and that memory must not be refilled under it.

    allocate: bytes -> a uint8 CPU tensor (default: pinned). Thread-safe.
    """

    SLAB_BYTES = 64 << 20

    def __init__(self, slot_bytes: int, max_slots: int,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        if slot_bytes <= 0 or max_slots < 0:
            raise ValueError("slot_bytes must be > 0 and max_slots >= 0")
        self.slot_bytes = slot_bytes
        self.max_slots = max_slots
        self._slab_bytes = max(self.SLAB_BYTES, 1 << (slot_bytes - 1).bit_length())
        self._per_slab = self._slab_bytes // slot_bytes
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8,
                                                            pin_memory=True))
        self._lock = threading.RLock()  # weakref callbacks may run while it is held
        self._slabs: list[torch.Tensor] = []
        self._free: list[tuple[int, int]] = []  # (slab, offset)
        # A live view's weak reference -> its (slab, offset); hashed while the view lives.
        self._out: dict[weakref.ref[torch.Tensor], tuple[int, int]] = {}

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return len(self._slabs) * self._slab_bytes

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._out)

    def take(self) -> torch.Tensor | None:
        """A free slot (a uint8 view of slot_bytes), or None when max_slots are in use."""
        with self._lock:
            if not self._free:
                if len(self._slabs) * self._per_slab >= self.max_slots:
                    return None
                slab = len(self._slabs)
                self._slabs.append(self._allocate(self._slab_bytes))
                count = min(self._per_slab, self.max_slots - slab * self._per_slab)
                self._free.extend((slab, i * self.slot_bytes) for i in reversed(range(count)))
            slab, offset = self._free.pop()
            view = self._slabs[slab][offset:offset + self.slot_bytes]
            self._out[weakref.ref(view, self._on_dead)] = (slab, offset)
            return view

    def _on_dead(self, ref: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            self._free.append(self._out.pop(ref))


class CpuTier:
    """LRU of encoded blocks bounded by total bytes, in pinned memory when CUDA is available
    (so a later host->device copy can be asynchronous): fixed-size slots of `PinnedSlots`, so
    the pinned memory is the capacity, not twice it.

    Thread-safe: every method holds the tier's lock for its whole body. `get` mutates the LRU
    order; `put` may evict least recently used blocks.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool | None = None,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        """allocate: the slots' slab allocator (default: pinned memory); given, it implies
        slotted entries even without CUDA (tests)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._pin = (allocate is not None or
                     (torch.cuda.is_available() if pin_memory is None else pin_memory))
        self._allocate = allocate
        self._slots: PinnedSlots | None = None  # made at the first put (it sets the size)
        self._lock = threading.Lock()
        # hash -> encoded block (bytes, or a slot's uint8 tensor [n]); last = most recent.
        self._blocks: OrderedDict[bytes, bytes | torch.Tensor] = OrderedDict()
        self._used_bytes = 0
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "evictions": 0, "rejected": 0}

    @property
    def slots(self) -> PinnedSlots | None:
        return self._slots

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
        found = self.get_prefix([block_hash])
        return found[0] if found else None

    def get_prefix(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Encoded blocks of the longest cached prefix of block_hashes (copies)."""
        return [_as_bytes(value) for value in self.get_prefix_entries(block_hashes)]

    def get_prefix_entries(self, block_hashes: Sequence[bytes]) -> list[bytes | torch.Tensor]:
        """`get_prefix` without copies: the stored values themselves (slot tensors when
        pinning). An entry is never written while anyone holds it (a `put` takes another slot,
        and an evicted entry's slot comes back only when its last holder lets go): hold the
        entry itself, not only views of it, for as long as they are read."""
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
        """Insert (or refresh) a block, evicting LRU blocks to fit; False if it can never fit
        (or, pinning, every slot is held by readers of evicted entries)."""
        size = len(data)
        with self._lock:
            if size > self.capacity_bytes:
                self.stats["rejected"] += 1
                return False
            # No local name keeps a dropped entry alive: its slot must be free for _store.
            if block_hash in self._blocks:
                self._drop(self._blocks.pop(block_hash))
            while self._used_bytes + size > self.capacity_bytes:
                self._drop(self._blocks.popitem(last=False)[1])
                self.stats["evictions"] += 1
            value = self._store(data)
            if value is None:
                self.stats["rejected"] += 1
                return False
            self._blocks[block_hash] = value
            self._used_bytes += size
        return True

    def _drop(self, value: bytes | torch.Tensor) -> None:
        # A slot's view goes with the last reference to it: this one, or a reader's.
        self._used_bytes -= _nbytes(value)

    def _store(self, data: bytes) -> bytes | torch.Tensor | None:
        if not self._pin:
            return bytes(data)
        if self._slots is None:
            self._slots = PinnedSlots(len(data), self.capacity_bytes // len(data),
                                      self._allocate)
        if len(data) != self._slots.slot_bytes:  # one spec per tier: not expected
            return bytes(data)
        slot = self._slots.take()
        if slot is not None:
            slot.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return slot


def _as_bytes(value: bytes | torch.Tensor) -> bytes:
    return value if isinstance(value, bytes) else value.numpy().tobytes()


def _nbytes(value: bytes | torch.Tensor) -> int:
    return len(value) if isinstance(value, bytes) else value.numel()


class RedisTier:
    """Cluster-wide tier: one Redis key per block, `<key_prefix>:<fingerprint hex16>:<hash hex>`,
    written with SET EX ttl_s through non-transactional pipelines (docs/architecture.md, "Conventions").

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

    async def put_many(self, items: Sequence[tuple[bytes, bytes]],
                       encoded_here: bool = False) -> None:
        """Store (hash, encoded block) pairs in every tier. Each block is verified first (so a
        bug cannot poison the cluster-wide cache): one whose header disagrees with the spec or
        its hash (a partial block has none) is skipped and counted in stats["rejected_puts"].
        encoded_here: the caller just encoded them (`encode_block` computed the checksum over
        those very bytes): the header is checked, the checksum is not computed again."""
        good = [(h, data) for h, data in items if self._valid(h, data, not encoded_here)]
        for block_hash, data in good:
            self.cpu.put(block_hash, data)
        if good and self.redis is not None:
            await self.redis.put_many(good)

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
