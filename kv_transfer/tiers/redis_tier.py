"""The cluster-wide Redis tier: one key per block, `<key_prefix>:<fingerprint hex16>:<hash hex>`,
written with SET EX ttl_s through non-transactional pipelines.

Built to hold under load (a 1,559-token SmolLM2 prompt is ~76 MB of float32 KV):
- reads and writes use separate clients (connection pools), so a lookup never waits behind a
  long write on the same socket;
- both move at most `chunk_bytes` per pipeline, each within a deadline sized by its bytes
  (`base_timeout_s + bytes / min_bytes_per_s`), not one fixed socket timeout for any size;
- every block handed to `put_many` is either acknowledged by Redis (counted written) or
  dropped with a reason (timeout, connection, full, budget, oversize, backoff, error), never
  counted as saved on hope; a timed-out chunk counts as dropped even if Redis applied part of it;
- a breaker per direction backs off per kind of failure (`breaker.py`): a full Redis stops
  writes only, a refused connection stops both, a timeout pauses briefly;
- `max_bytes` bounds the Redis server's memory from this side: a write that would take its
  `used_memory` (INFO memory, polled) past it is dropped (reason `budget`). Keys also expire
  after `ttl_s`; the server's own `maxmemory` with an eviction policy is the hard bound
  (docs/deploy.md, "Prefix tiers").

Nothing read is trusted: a value that fails `wire.verify_block` (corrupt, another model's or
another salt's block, another block's bytes) is a miss counted as `corrupt`.
Not thread-safe: use it from one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from opentelemetry.context import Context
from redis import asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kv_transfer.tiers.breaker import Breaker, Failure
from kv_transfer.tiers.counters import ReadCost, TierCounters
from kv_transfer.wire import BlockSpec, KvWireError, verify_block
from rpc import tracing

log = logging.getLogger(__name__)

DEFAULT_MAX_VALUE_BYTES = 64 << 20
# The length of the leading run of KEYS that exist (`held_prefix`).
HELD_PREFIX_LUA = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return i - 1 end
end
return #KEYS
"""
READS_AT_ONCE = 2


@dataclass(frozen=True, slots=True)
class RedisLimits:
    """How much one Redis call may carry and how long it may take."""

    chunk_bytes: int = 8 << 20        # per pipeline (at least one block)
    base_timeout_s: float = 0.5       # deadline of an empty call
    min_bytes_per_s: float = 20e6     # deadlines assume at least this bandwidth
    max_bytes: int = 0                # budget on the server's used_memory; 0: none
    budget_check_s: float = 2.0       # how often INFO memory is asked

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.base_timeout_s <= 0 or self.min_bytes_per_s <= 0:
            raise ValueError("chunk_bytes, base_timeout_s and min_bytes_per_s must be > 0")
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")

    def timeout_for(self, nbytes: int) -> float:
        return self.base_timeout_s + nbytes / self.min_bytes_per_s


def classify(exc: BaseException) -> Failure:
    """The breaker's kind of a Redis failure."""
    if isinstance(exc, (RedisTimeoutError, TimeoutError)):
        return Failure.TIMEOUT
    if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError)
                                              and str(exc).startswith("OOM")):
        return Failure.FULL
    if isinstance(exc, (RedisConnectionError, OSError)):
        return Failure.CONNECTION
    return Failure.ERROR


class RedisTier:
    """See the module docstring. `counters` holds the per-tier metrics."""

    def __init__(
        self,
        spec: BlockSpec,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: int = 3600,
        key_prefix: str = "splitserve:kv",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        limits: RedisLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        self._spec = spec
        self._ttl_s = ttl_s
        self._key_base = f"{key_prefix}:{spec.fingerprint.hex()[:16]}:"
        self._max_value_bytes = max_value_bytes
        self.limits = limits or RedisLimits()
        self._clock = clock
        self._chunk_blocks = max(1, self.limits.chunk_bytes // spec.encoded_nbytes)
        # Each socket operation's own bound: a whole chunk (plus one block) must fit in it.
        socket_timeout = self.limits.timeout_for(self.limits.chunk_bytes + spec.encoded_nbytes)
        self._reader = aioredis.Redis.from_url(
            url, decode_responses=False, socket_timeout=socket_timeout,
            socket_connect_timeout=self.limits.base_timeout_s)
        self._writer = aioredis.Redis.from_url(
            url, decode_responses=False, socket_timeout=socket_timeout,
            socket_connect_timeout=self.limits.base_timeout_s)
        # Reads at once: concurrent lookups share one process's parsing and the link, so a
        # deadline sized by bytes holds only for a read that has them to itself (or nearly).
        self._read_slots = asyncio.Semaphore(READS_AT_ONCE)
        self._read_breaker = Breaker(clock=clock)
        self._write_breaker = Breaker(clock=clock)
        self._budget_checked = float("-inf")
        self._used_bytes = 0  # the server's used_memory at the last check, plus writes since
        self.counters = TierCounters("redis", cost=ReadCost(0.001, 200e6))
        self._held_script: AsyncScript | None = self._reader.register_script(HELD_PREFIX_LUA)
        self._corrupt = self._oversize = self._errors = 0

    @property
    def chunk_blocks(self) -> int:
        """Blocks per read pipeline."""
        return self._chunk_blocks

    def key(self, block_hash: bytes) -> bytes:
        return (self._key_base + block_hash.hex()).encode()

    # ---- reads --------------------------------------------------------------------------

    async def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Every hash's verified value or None, read in chunks (no early stop)."""
        out: list[bytes | None] = []
        for chunk in _slices(block_hashes, self._chunk_blocks):
            start = time.perf_counter()
            values = await self._read(chunk, None)
            if values is None:
                out.extend([None] * len(chunk))
            else:
                checked = [self._check(h, v) for h, v in zip(chunk, values, strict=True)]
                self._observe_cost(checked, start)
                out.extend(checked)
        return out

    async def get_prefix(self, block_hashes: Sequence[bytes],
                         worth: Callable[[int], bool] | None = None,
                         parent: Context | None = None) -> list[bytes]:
        """Verified values of the longest prefix of `block_hashes` held, chunk by chunk; stops at
        the first miss, failure, or a chunk `worth(n_blocks)` says is cheaper to compute."""
        found: list[bytes] = []
        for chunk in _slices(block_hashes, self._chunk_blocks):
            if worth is not None and not worth(len(chunk)):
                self.counters.cost_skips += 1
                break
            start = time.perf_counter()
            values = await self._read(chunk, parent)
            if values is None:
                break
            checked = []
            for block_hash, value in zip(chunk, values, strict=True):
                data = self._check(block_hash, value)
                if data is None:
                    break
                checked.append(data)
            self._observe_cost(checked, start)
            found.extend(checked)
            if len(checked) < len(chunk):
                break
        return found

    def _observe_cost(self, values: Sequence[bytes | None], start: float) -> None:
        """The read cost the fetch-or-recompute model weighs (worker/tier_cost.py): from the
        request to the chunk's verified values, so the checks count, not the wire alone (on the
        H200 a whole fetch took ~1.7x its reads' time)."""
        got = sum(len(v) for v in values if v is not None)
        if got:
            self.counters.cost.observe(got, time.perf_counter() - start)

    async def held_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, Redis holds a value for (values unread:
        what a plan may count on before fetching in the background); 0 when Redis failed or is
        backed off (counted as for reads).

        One server-side script walks the keys and stops at the first missing one: a round trip
        whatever the count. A pipeline of one EXISTS per key cost the client ~67 us a key
        (redis-py builds and parses each command: 67 ms for a 16k-token prompt's 1,003 blocks,
        which made a Redis "hit" that computed everything 117 ms slower than a cold prefill on
        the H200). Where the server refuses scripts (an ACL without EVAL, a proxy), the
        pipeline is the fallback, chosen once."""
        if not block_hashes:
            return 0
        keys = [self.key(h) for h in block_hashes]
        async with self._read_slots:
            if not self._read_breaker.allow():
                self._errors += 1
                self.counters.read_errors["backoff"] += 1
                return 0
            try:
                async with asyncio.timeout(self.limits.base_timeout_s):
                    held = await self._held_count(keys)
            except (RedisError, OSError) as exc:
                self.counters.read_errors[self._failed("read", exc, self._read_breaker).value] += 1
                return 0
        self._read_breaker.success()
        self.counters.misses += held < len(block_hashes)
        return held

    async def _held_count(self, keys: list[bytes]) -> int:
        """The leading run of `keys` that exist: by the script, else by a pipeline."""
        if self._held_script is not None:
            try:
                return int(await self._held_script(keys=keys))
            except ResponseError as exc:
                if classify(exc) is not Failure.ERROR:
                    raise
                log.warning("Redis refused the held-prefix script (%s): one EXISTS per key "
                            "from now on", exc)
                self._held_script = None
        async with self._reader.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            replies = list(await pipe.execute(raise_on_error=False))
        return next((i for i, r in enumerate(replies) if r != 1), len(replies))

    async def _read(self, hashes: Sequence[bytes], parent: Context | None
                    ) -> list[object] | None:
        """One pipelined GET per hash; None (counted by reason) if Redis failed or is backed off."""
        async with self._read_slots:
            return await self._read_now(hashes, parent)

    async def _read_now(self, hashes: Sequence[bytes], parent: Context | None
                        ) -> list[object] | None:
        if not self._read_breaker.allow():
            self._errors += 1
            self.counters.read_errors["backoff"] += 1
            return None
        start = time.perf_counter()
        nbytes = len(hashes) * self._spec.encoded_nbytes
        deadline = self._read_deadline(nbytes)
        with tracing.traced_span("splitserve.kv_tier_read", parent=parent, attributes={
                "splitserve.kv_tier": "redis", "splitserve.kv_tier.blocks": len(hashes)}) as span:
            try:
                async with asyncio.timeout(deadline):
                    async with self._reader.pipeline(transaction=False) as pipe:
                        for block_hash in hashes:
                            pipe.get(self.key(block_hash))
                        values = list(await pipe.execute(raise_on_error=False))
            except (RedisError, OSError) as exc:  # TimeoutError is an OSError
                kind = self._failed("read", exc, self._read_breaker)
                self.counters.read_errors[kind.value] += 1
                tracing.record_error(span, f"{kind.value}: {exc}")
                return None
            elapsed = time.perf_counter() - start
            got = sum(len(v) for v in values if isinstance(v, bytes))
            span.set_attribute("splitserve.kv_tier.bytes", got)
        self._read_breaker.success()
        self.counters.reads.observe(elapsed)
        return values

    def _read_deadline(self, nbytes: int) -> float:
        """The limits' deadline, stretched to 3x the measured read time: on a host where reads
        are slow for everyone (a loaded CPU parsing the replies), a read that will arrive is
        still usually cheaper than recomputing (the cost model decides that), so it is not
        cut off by a bandwidth assumption."""
        return max(self.limits.timeout_for(nbytes), 3 * self.counters.cost.seconds(nbytes))

    def _check(self, block_hash: bytes, value: object) -> bytes | None:
        if value is None:
            self.counters.misses += 1
            return None
        reason = None
        if isinstance(value, Exception):
            reason = "error"
        elif not isinstance(value, bytes):
            reason = "corrupt"
        elif len(value) > self._max_value_bytes:
            reason = "oversize"
        else:
            try:
                verify_block(value, self._spec, expected_hash=block_hash)
            except KvWireError as exc:
                log.warning("redis tier: dropping bad value for %s: %s", block_hash.hex()[:16],
                            exc)
                reason = "corrupt"
        if reason is not None:
            self.counters.read_errors[reason] += 1
            self._corrupt += reason == "corrupt"
            self._oversize += reason == "oversize"
            return None
        assert isinstance(value, bytes)
        self.counters.hits += 1
        self.counters.hit_bytes += len(value)
        return value

    # ---- writes -------------------------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """SET key value EX ttl for each (hash, encoded block), chunk by chunk; returns how many
        Redis acknowledged. The rest are counted in `counters.saves_dropped` by reason."""
        dropped = self.counters.saves_dropped
        fitting = []
        for block_hash, value in items:
            if len(value) <= self._max_value_bytes:
                fitting.append((block_hash, value))
            else:
                dropped["oversize"] += 1
                self._oversize += 1
        landed = 0
        chunks = list(_chunks(fitting, self.limits.chunk_bytes))
        for i, chunk in enumerate(chunks):
            reason = None
            if not self._write_breaker.allow():
                reason = "backoff"
            elif await self._over_budget(sum(len(v) for _, v in chunk)):
                reason = "budget"
            if reason is not None:
                self._errors += reason == "backoff"
                dropped[reason] += sum(len(c) for c in chunks[i:])
                break
            landed += await self._write(chunk)
        return landed

    async def _write(self, chunk: list[tuple[bytes, bytes]]) -> int:
        nbytes = sum(len(v) for _, v in chunk)
        start = time.perf_counter()
        with tracing.traced_span("splitserve.kv_tier_write", parent=None, attributes={
                "splitserve.kv_tier": "redis", "splitserve.kv_tier.blocks": len(chunk),
                "splitserve.kv_tier.bytes": nbytes}) as span:
            try:
                async with asyncio.timeout(self.limits.timeout_for(nbytes)):
                    async with self._writer.pipeline(transaction=False) as pipe:
                        for block_hash, value in chunk:
                            pipe.set(self.key(block_hash), value, ex=self._ttl_s)
                        replies = list(await pipe.execute(raise_on_error=False))
            except (RedisError, OSError) as exc:
                kind = self._failed("write", exc, self._write_breaker)
                self.counters.saves_dropped[kind.value] += len(chunk)
                tracing.record_error(span, f"{kind.value}: {exc}")
                return 0
            failures = [r for r in replies if isinstance(r, Exception)]
            if failures:  # e.g. OOM part-way: the replies before it landed
                kind = self._failed("write", failures[0], self._write_breaker)
                self.counters.saves_dropped[kind.value] += len(failures)
                tracing.record_error(span, f"{kind.value}: {failures[0]}")
            else:
                self._write_breaker.success()
        landed = [(h, v) for (h, v), r in zip(chunk, replies, strict=True) if r is True]
        self.counters.saves_written += len(landed)
        written = sum(len(v) for _, v in landed)
        self.counters.written_bytes += written
        self._used_bytes += written
        self.counters.writes.observe(time.perf_counter() - start)
        return len(landed)

    async def _over_budget(self, nbytes: int) -> bool:
        """Whether writing nbytes more would take the server past `limits.max_bytes`."""
        if not self.limits.max_bytes:
            return False
        now = self._clock()
        if now - self._budget_checked >= self.limits.budget_check_s:
            try:
                async with asyncio.timeout(self.limits.base_timeout_s):
                    info = await self._writer.info("memory")
                self._used_bytes = int(info["used_memory"])
                self._budget_checked = now
            except (RedisError, OSError, KeyError, ValueError) as exc:
                log.debug("redis tier: INFO memory failed (%s)", exc)  # the write will tell
                return False
        return self._used_bytes + nbytes > self.limits.max_bytes

    def _failed(self, what: str, exc: BaseException, breaker: Breaker) -> Failure:
        kind = classify(exc)
        self._errors += 1
        pause = breaker.failure(kind)
        if kind is Failure.CONNECTION:  # the server is gone: neither direction should wait
            other = self._write_breaker if breaker is self._read_breaker else self._read_breaker
            other.failure(kind)
        log.warning("redis tier %s failed (%s: %s); %ss pause Redis %s", what, kind.value, exc,
                    f"{pause:.2f}", "reads and writes" if kind is Failure.CONNECTION else
                    f"{what}s")
        return kind

    async def close(self) -> None:
        await self._reader.aclose()
        await self._writer.aclose()

    @property
    def stats(self) -> dict[str, int]:
        """Totals: blocks hit, lookups that missed, corrupt and oversize values, failed or
        skipped calls (`errors`), blocks written."""
        return {"hits": self.counters.hits, "misses": self.counters.misses,
                "corrupt": self._corrupt, "oversize": self._oversize, "errors": self._errors,
                "writes": self.counters.saves_written}


def _slices(items: Sequence[bytes], size: int) -> Iterator[Sequence[bytes]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _chunks(items: list[tuple[bytes, bytes]], max_bytes: int
            ) -> Iterator[list[tuple[bytes, bytes]]]:
    """Consecutive runs of items of at most max_bytes each (at least one item each)."""
    chunk: list[tuple[bytes, bytes]] = []
    size = 0
    for item in items:
        if chunk and size + len(item[1]) > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += len(item[1])
    if chunk:
        yield chunk
