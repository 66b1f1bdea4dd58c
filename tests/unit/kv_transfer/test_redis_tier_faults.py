"""The Redis tier against a redis-server of each test's own (tests/support/redis_server.py)
that is killed mid-write, paused longer than the deadlines, restarted, full, or fed garbage:
no call raises or hangs, every block handed over is counted written or dropped with the
reason, and nothing wrong is ever returned as a hit."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import pytest
import torch
from redis import asyncio as aioredis

from kv_transfer.tiers import CpuTier, RedisLimits, RedisTier, TieredStore, WriteQueue
from kv_transfer.wire import BlockSpec, encode_block
from tests.support.redis_server import RedisServer, redis_server

FP = hashlib.sha256(b"fault-model").digest()
# 128 KiB blocks: a few dozen make a write that takes a while, not a memory hog.
SPEC = BlockSpec(fingerprint=FP, num_layers=4, block_size=16, num_kv_heads=4, head_dim=64,
                 dtype=torch.float32)
FAST = RedisLimits(chunk_bytes=512 << 10, base_timeout_s=0.3, min_bytes_per_s=50e6)


def chain(n: int, root: bytes = FP) -> list[bytes]:
    hashes, parent = [], root
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        hashes.append(parent)
    return hashes


def block(block_hash: bytes, spec: BlockSpec = SPEC) -> bytes:
    tensor = torch.full(spec.shape, float(block_hash[0]), dtype=spec.dtype)
    return encode_block(spec, block_hash, spec.block_size, tensor)


def items(hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
    return [(h, block(h)) for h in hashes]


def accounted(tier: RedisTier) -> int:
    c = tier.counters
    return c.saves_written + sum(c.saves_dropped.values())


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    with redis_server() as s:
        yield s


async def test_killed_mid_write_every_block_is_written_or_dropped_then_recovers(
        server: RedisServer) -> None:
    tier = RedisTier(SPEC, server.url, ttl_s=60, limits=FAST)
    try:
        hashes = chain(48)  # 6 MiB in 12 chunks
        write = asyncio.ensure_future(tier.put_many(items(hashes)))
        deadline = time.monotonic() + 10
        while tier.counters.saves_written == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        server.kill()
        landed = await asyncio.wait_for(write, 10)
        c = tier.counters
        assert 0 < landed < len(hashes) and c.saves_written == landed
        assert accounted(tier) == len(hashes)  # none lost from the books, none saved on hope
        assert set(c.saves_dropped) <= {"connection", "timeout", "backoff"}
        assert await tier.get_prefix(hashes) == []  # down: a miss, not an exception
        # Restarted (empty): after the pause the tier writes and reads again.
        server.start()
        await asyncio.sleep(1.1)  # the connection failure's first pause is 1 s
        assert await tier.put_many(items(hashes[:4])) == 4
        assert await tier.get_prefix(hashes[:4]) == [block(h) for h in hashes[:4]]
    finally:
        await tier.close()


async def test_paused_longer_than_the_deadlines_reads_and_writes_give_up_in_time(
        server: RedisServer) -> None:
    tier = RedisTier(SPEC, server.url, ttl_s=60, limits=FAST)
    try:
        hashes = chain(4)
        assert await tier.put_many(items(hashes)) == 4
        server.pause()
        try:
            start = time.monotonic()
            assert await tier.get_prefix(hashes) == []
            read_s = time.monotonic() - start
            assert await tier.put_many(items(chain(4, b"other"))) == 0
            elapsed = time.monotonic() - start
        finally:
            server.resume()
        # Each gave up by its deadline sized for its bytes (+ slack for a loaded machine).
        assert read_s < FAST.timeout_for(4 * SPEC.encoded_nbytes) + 1.0
        assert elapsed < read_s + FAST.timeout_for(4 * SPEC.encoded_nbytes) + 1.0
        c = tier.counters
        # The write's first chunk (3 blocks) timed out; the pause it opened dropped the last.
        assert c.read_errors["timeout"] == 1
        assert c.saves_dropped == {"timeout": 3, "backoff": 1}
        await asyncio.sleep(0.3)  # a timeout pauses briefly (0.25 s), not for seconds
        assert await tier.get_prefix(hashes) == [block(h) for h in hashes]
    finally:
        await tier.close()


async def test_full_redis_drops_writes_as_full_and_still_serves_reads(
        server: RedisServer) -> None:
    client = aioredis.Redis.from_url(server.url)
    tier = RedisTier(SPEC, server.url, ttl_s=60, limits=FAST)
    try:
        kept = chain(2)
        assert await tier.put_many(items(kept)) == 2
        used = int((await client.info("memory"))["used_memory"])
        await client.config_set("maxmemory", used + (1 << 20))  # ~8 more blocks, noeviction
        more = chain(24, b"more")
        landed = await tier.put_many(items(more))
        c = tier.counters
        assert 0 < landed < 24 and c.saves_dropped["full"] >= 1
        assert accounted(tier) == 2 + 24
        # Full stops writes only: reads go on (their own breaker and connection).
        assert await tier.get_prefix(kept) == [block(h) for h in kept]
        assert await tier.put_many(items(chain(1, b"again"))) == 0
        assert c.saves_dropped["backoff"] >= 1
    finally:
        await tier.close()
        await client.aclose()


async def test_evicting_redis_loses_old_blocks_as_plain_misses() -> None:
    with redis_server("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru") as server:
        tier = RedisTier(SPEC, server.url, ttl_s=60, limits=FAST)
        client = aioredis.Redis.from_url(server.url)
        try:
            hashes = chain(40)  # 5 MiB into a 3 MiB server
            for start in range(0, 40, 4):
                assert await tier.put_many(items(hashes[start:start + 4])) == 4
            assert int((await client.info("memory"))["used_memory"]) <= 3 << 20
            held = await tier.get_many(hashes)
            assert 0 < sum(v is not None for v in held) < 40  # some were evicted...
            assert held[-1] == block(hashes[-1])  # ...not the last one written
            assert all(v is None or v == block(h) for h, v in zip(hashes, held, strict=True))
            assert not tier.counters.read_errors and not tier.counters.saves_dropped
        finally:
            await tier.close()
            await client.aclose()


async def test_own_budget_and_ttl_bound_the_tier(server: RedisServer) -> None:
    """Issue 44 item 8: the tier stops writing where the server's memory would pass its
    budget (dropped as `budget`), and every key it writes expires."""
    client = aioredis.Redis.from_url(server.url)
    used = int((await client.info("memory"))["used_memory"])
    limits = RedisLimits(chunk_bytes=512 << 10, base_timeout_s=0.3, min_bytes_per_s=50e6,
                         max_bytes=used + (1 << 20), budget_check_s=0.0)
    tier = RedisTier(SPEC, server.url, ttl_s=30, limits=limits)
    try:
        landed = await tier.put_many(items(chain(24)))
        c = tier.counters
        assert 0 < landed <= 8 and c.saves_dropped["budget"] == 24 - landed
        assert int((await client.info("memory"))["used_memory"]) <= limits.max_bytes
        ttl = await client.ttl(tier.key(chain(1)[0]))
        assert 0 < ttl <= 30
    finally:
        await tier.close()
        await client.aclose()


async def test_garbage_and_foreign_blocks_under_our_keys_are_counted_misses(
        server: RedisServer) -> None:
    client = aioredis.Redis.from_url(server.url)
    tier = RedisTier(SPEC, server.url, ttl_s=60, limits=FAST)
    try:
        h = chain(4)
        other_model = BlockSpec(hashlib.sha256(b"other-model").digest(), 4, 16, 4, 64,
                                torch.float32)
        other_salt = chain(4, hashlib.sha256(FP + b"salt").digest())
        await client.set(tier.key(h[0]), block(h[0]))
        await client.set(tier.key(h[1]), block(h[1], other_model))   # another model's block
        await client.set(tier.key(h[2]), block(other_salt[2]))      # another salt's block
        await client.set(tier.key(h[3]), b"garbage" * 100)
        assert await tier.get_many(h) == [block(h[0]), None, None, None]
        assert tier.counters.read_errors["corrupt"] == 3 and tier.counters.hits == 1
        assert await tier.get_prefix(h) == [block(h[0])]
    finally:
        await tier.close()
        await client.aclose()


async def test_reads_do_not_wait_behind_a_long_write(server: RedisServer) -> None:
    tier = RedisTier(SPEC, server.url, ttl_s=60,
                     limits=RedisLimits(chunk_bytes=32 << 20, base_timeout_s=5.0))
    try:
        (small,) = chain(1, b"small")
        assert await tier.put_many(items([small])) == 1
        write = asyncio.ensure_future(tier.put_many(items(chain(240))))  # one 30 MiB pipeline
        await asyncio.sleep(0)  # the write is on its way
        assert await tier.get_prefix([small]) == [block(small)]
        assert not write.done()  # the read came back first, on its own connection
        assert await write == 240
    finally:
        await tier.close()


async def test_write_queue_drops_the_oldest_past_its_bound_and_counts_them(
        server: RedisServer) -> None:
    tier = RedisTier(SPEC, server.url, ttl_s=60, limits=FAST)
    queue = WriteQueue(tier, max_bytes=6 * SPEC.encoded_nbytes)
    try:
        hashes = chain(10)
        queue.submit(items(hashes))
        queue.submit(items(hashes[-2:]))  # already waiting: not queued twice
        await queue.flush()
        c = tier.counters
        assert c.saves_queued == 10 and c.saves_dropped == {"queue_full": 4}
        assert c.saves_written == 6
        assert await tier.get_many(hashes) == [None] * 4 + [block(h) for h in hashes[4:]]
    finally:
        await queue.close()
        await tier.close()


async def test_store_saves_never_wait_on_a_dead_redis(server: RedisServer) -> None:
    store = TieredStore(SPEC, CpuTier(16 * SPEC.encoded_nbytes, pin_memory=False),
                        RedisTier(SPEC, server.url, ttl_s=60, limits=FAST))
    try:
        server.pause()
        hashes = chain(4)
        start = time.monotonic()
        assert await store.put_many(items(hashes)) == 4  # in the CPU tier at once
        assert time.monotonic() - start < 0.2
        assert await store.get_many(hashes) == [block(h) for h in hashes]  # CPU hits
        await asyncio.wait_for(store.flush(), 5)
        assert store.redis is not None
        assert store.redis.counters.saves_dropped == {"timeout": 3, "backoff": 1}
    finally:
        server.resume()
        await store.close()
