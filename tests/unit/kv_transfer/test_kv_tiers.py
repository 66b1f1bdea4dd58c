"""CPU and Redis prefix-cache tiers against a real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator

import pytest
import torch
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from kv_transfer.tiers import CpuTier, PinnedSlots, RedisLimits, RedisTier, TieredStore
from kv_transfer.wire import BlockSpec, encode_block

REDIS_URL = "redis://127.0.0.1:6379/0"
FP = hashlib.sha256(b"model-a").digest()
SPEC = BlockSpec(fingerprint=FP, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                 dtype=torch.float16)


def chain(n: int, salt: bytes = b"") -> list[bytes]:
    """n chained block hashes, as the engine computes them."""
    hashes, parent = [], FP + salt
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([i])).digest()
        hashes.append(parent)
    return hashes


def block(block_hash: bytes, spec: BlockSpec = SPEC) -> bytes:
    seed = int.from_bytes(block_hash[:4], "little")
    tensor = torch.randn(spec.shape, generator=torch.Generator().manual_seed(seed))
    return encode_block(spec, block_hash, spec.block_size, tensor.to(spec.dtype))


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=False, socket_timeout=2)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        pytest.skip(f"Redis at {REDIS_URL} is unreachable ({exc}); tier tests need it")
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    key_prefix = f"test-kv-{uuid.uuid4().hex}"
    yield key_prefix
    keys = [key async for key in redis_client.scan_iter(match=f"{key_prefix}:*")]
    if keys:
        await redis_client.delete(*keys)


@pytest.fixture
async def redis_tier(redis_client: aioredis.Redis, prefix: str) -> AsyncIterator[RedisTier]:
    tier = RedisTier(SPEC, REDIS_URL, ttl_s=120, key_prefix=prefix)
    yield tier
    await tier.close()


async def test_redis_put_get_and_ttl(redis_tier: RedisTier, redis_client: aioredis.Redis,
                                     prefix: str) -> None:
    hashes = chain(3)
    assert await redis_tier.put_many([(h, block(h)) for h in hashes]) == 3
    assert await redis_tier.get_many(hashes) == [block(h) for h in hashes]
    key = redis_tier.key(hashes[0])
    assert key == f"{prefix}:{FP.hex()[:16]}:{hashes[0].hex()}".encode()
    ttl = await redis_client.ttl(key)
    assert 0 < ttl <= 120
    assert redis_tier.stats["hits"] == 3 and redis_tier.stats["writes"] == 3


async def test_redis_corrupt_and_foreign_values_are_misses(
        redis_tier: RedisTier, redis_client: aioredis.Redis) -> None:
    h0, h1, h2, h3 = chain(4)
    good = block(h0)
    flipped = bytearray(block(h1))
    flipped[-5] ^= 0x10
    await redis_client.set(redis_tier.key(h0), good)
    await redis_client.set(redis_tier.key(h1), bytes(flipped))    # corrupt payload
    await redis_client.set(redis_tier.key(h2), block(h0))         # another block's bytes
    await redis_client.set(redis_tier.key(h3), b"\x80garbage")    # not a block at all
    assert await redis_tier.get_many([h0, h1, h2, h3]) == [good, None, None, None]
    assert redis_tier.stats["corrupt"] == 3


async def test_redis_foreign_fingerprint_is_a_miss(redis_tier: RedisTier,
                                                   redis_client: aioredis.Redis) -> None:
    other = BlockSpec(hashlib.sha256(b"model-b").digest(), 2, 4, 2, 8, torch.float16)
    (h0,) = chain(1)
    await redis_client.set(redis_tier.key(h0), block(h0, other))
    assert await redis_tier.get_many([h0]) == [None]
    assert redis_tier.stats["corrupt"] == 1


async def test_redis_down_is_a_miss_not_an_exception() -> None:
    tier = RedisTier(SPEC, "redis://127.0.0.1:1/0", ttl_s=60, key_prefix="unused",
                     limits=RedisLimits(base_timeout_s=0.5))
    try:
        hashes = chain(2)
        assert await tier.put_many([(h, block(h)) for h in hashes]) == 0
        # The refused connection paused reads too: no second connect attempt.
        assert await tier.get_many(hashes) == [None, None]
        assert tier.stats["errors"] == 2
        assert tier.counters.saves_dropped == {"connection": 2}
        assert tier.counters.read_errors == {"backoff": 1}
    finally:
        await tier.close()


async def test_redis_refuses_oversize_values(redis_client: aioredis.Redis, prefix: str) -> None:
    tier = RedisTier(SPEC, REDIS_URL, ttl_s=60, key_prefix=prefix, max_value_bytes=100)
    try:
        (h0,) = chain(1)
        assert await tier.put_many([(h0, block(h0))]) == 0
        await redis_client.set(tier.key(h0), block(h0))
        assert await tier.get_many([h0]) == [None]
        assert tier.stats["oversize"] == 2
    finally:
        await tier.close()


def test_cpu_tier_lru_eviction_by_bytes() -> None:
    h0, h1, h2 = chain(3)
    size = SPEC.encoded_nbytes
    cpu = CpuTier(capacity_bytes=2 * size + size // 2, pin_memory=False)
    assert cpu.put(h0, block(h0)) and cpu.put(h1, block(h1))
    assert cpu.get(h0) == block(h0)          # h0 is now the most recently used
    assert cpu.put(h2, block(h2))            # evicts h1, the least recently used
    assert h0 in cpu and h1 not in cpu and h2 in cpu
    assert cpu.used_bytes == 2 * size and cpu.stats["evictions"] == 1
    assert not CpuTier(capacity_bytes=size - 1).put(h0, block(h0))  # can never fit
    assert cpu.put(h2, block(h2)) and cpu.used_bytes == 2 * size   # refresh, no double count


def _plain(n: int) -> torch.Tensor:
    """A slab allocator without pinning (this machine has no CUDA)."""
    return torch.empty(n, dtype=torch.uint8)


def test_slots_come_from_power_of_two_slabs_and_return_with_their_last_reader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PinnedSlots, "SLAB_BYTES", 1024)
    allocated: list[int] = []

    def counting(n: int) -> torch.Tensor:
        allocated.append(n)
        return _plain(n)

    pool = PinnedSlots(slot_bytes=100, max_slots=15, allocate=counting)
    views = [pool.take() for _ in range(15)]
    assert all(v is not None and v.numel() == 100 for v in views)
    assert pool.take() is None  # max_slots held
    assert allocated == [1024, 1024] and pool.reserved_bytes == 2048  # 10 + 5 slots
    starts = {v.data_ptr() for v in views if v is not None}
    assert len(starts) == 15  # no two slots overlap
    reader = views[3][10:20]  # noqa: F841 - a view of the view does not hold the slot...
    held = views[4]  # ...but a reference to the view itself does
    del views
    assert pool.slots_in_use == 1 and held is not None
    again = [pool.take() for _ in range(14)]
    assert pool.take() is None
    assert held.data_ptr() not in {v.data_ptr() for v in again if v is not None}
    del held
    assert pool.take() is not None
    assert allocated == [1024, 1024]  # every slot reused, no slab added
    huge = PinnedSlots(slot_bytes=3000, max_slots=1, allocate=counting)
    assert huge.take() is not None and allocated[-1] == 4096  # one slot, the next power of two


def test_cpu_tier_never_refills_an_entry_a_reader_holds() -> None:
    """Slotted entries (pinned on a GPU host): an evicted entry that a tier load still reads
    keeps its slot; with every slot held a put is refused instead of overwriting it."""
    size = SPEC.encoded_nbytes
    cpu = CpuTier(capacity_bytes=2 * size, allocate=_plain)
    h = chain(4)
    assert cpu.put(h[0], block(h[0])) and cpu.put(h[1], block(h[1]))
    held = cpu.get_prefix_entries(h[:2])
    assert all(isinstance(e, torch.Tensor) for e in held)
    assert not cpu.put(h[2], block(h[2]))  # evicts h0, whose slot is still read; h1 has one
    assert cpu.stats["rejected"] == 1 and h[0] not in cpu and list(cpu.get_prefix(h[1:2]))
    assert [e.numpy().tobytes() for e in held if isinstance(e, torch.Tensor)] == [
        block(h[0]), block(h[1])]
    del held
    assert cpu.put(h[2], block(h[2])) and cpu.put(h[3], block(h[3]))
    assert cpu.get(h[2]) == block(h[2]) and cpu.get(h[3]) == block(h[3])
    slots = cpu.slots
    assert slots is not None and slots.reserved_bytes == PinnedSlots.SLAB_BYTES  # not 2x
    assert cpu.used_bytes == 2 * size


async def test_entries_are_the_stored_values_without_copies(redis_tier: RedisTier) -> None:
    """`get_entries` (what a tier load reads) gives the CPU tier's own values (pinned tensors
    on a GPU host, bytes here), stops at the first miss like `get_many`, and takes Redis's
    verified values after them; an entry stays whole after the tier evicted it."""
    hashes = chain(4)
    cpu = CpuTier(capacity_bytes=3 * SPEC.encoded_nbytes, pin_memory=False)
    store = TieredStore(SPEC, cpu, redis_tier)
    await store.put_many([(h, block(h)) for h in hashes[:2]])
    await redis_tier.put_many([(hashes[2], block(hashes[2]))])
    entries = await store.get_entries(hashes)
    assert entries == [block(h) for h in hashes[:3]] + [None]
    assert cpu.get_prefix_entries(hashes[:1])[0] is entries[0]  # the same object: no copy
    assert hashes[2] in cpu and cpu.stats["hits"] == 3
    for h in chain(3, salt=b"other"):  # push every earlier entry out of the tier
        cpu.put(h, block(h))
    assert hashes[0] not in cpu and entries[0] == block(hashes[0])


async def test_tiered_store_stops_at_first_miss_and_promotes(redis_tier: RedisTier) -> None:
    hashes = chain(5)
    cpu = CpuTier(capacity_bytes=10 * SPEC.encoded_nbytes, pin_memory=False)
    store = TieredStore(SPEC, cpu, redis_tier)
    # CPU holds 0,1; Redis holds 2 and 4 (3 is missing, so 4 must not be returned).
    await store.put_many([(h, block(h)) for h in hashes[:2]])
    await redis_tier.put_many([(hashes[2], block(hashes[2])), (hashes[4], block(hashes[4]))])
    result = await store.get_many(hashes)
    assert result == [block(h) for h in hashes[:3]] + [None, None]
    assert hashes[2] in cpu and hashes[4] not in cpu          # promoted up to the first miss
    assert store.stats["promotions"] == 1
    # Second lookup is served by the CPU tier alone for the first three blocks.
    hits_before = redis_tier.stats["hits"]
    assert (await store.get_many(hashes[:3])) == [block(h) for h in hashes[:3]]
    assert redis_tier.stats["hits"] == hits_before


async def test_tiered_store_write_through_and_rejects_bad_puts(redis_tier: RedisTier) -> None:
    h0, h1 = chain(2)
    cpu = CpuTier(capacity_bytes=10 * SPEC.encoded_nbytes, pin_memory=False)
    store = TieredStore(SPEC, cpu, redis_tier)
    partial = encode_block(SPEC, None, 2, torch.zeros(SPEC.shape, dtype=SPEC.dtype))
    await store.put_many([(h0, block(h0)), (h1, partial)])
    assert store.stats["rejected_puts"] == 1
    await store.flush()  # the Redis writes are queued behind put_many
    assert await redis_tier.get_many([h0, h1]) == [block(h0), None]
    fresh = TieredStore(SPEC, CpuTier(10 * SPEC.encoded_nbytes, pin_memory=False), redis_tier)
    assert await fresh.get_many([h0, h1]) == [block(h0), None]
    # Blocks this process just encoded skip the second checksum, never the header checks.
    await store.put_many([(h1, partial)], encoded_here=True)
    assert store.stats["rejected_puts"] == 2
    flipped = bytearray(block(h1))
    flipped[-1] ^= 0xFF  # a payload byte: only the checksum would notice
    await store.put_many([(h1, bytes(flipped))])
    assert store.stats["rejected_puts"] == 3 and h1 not in cpu
    await store.put_many([(h1, bytes(flipped))], encoded_here=True)
    assert store.stats["rejected_puts"] == 3 and h1 in cpu


async def test_tiered_store_without_redis() -> None:
    h0, h1 = chain(2)
    store = TieredStore(SPEC, CpuTier(10 * SPEC.encoded_nbytes, pin_memory=False))
    await store.put_many([(h1, block(h1))])
    assert await store.get_many([h0, h1]) == [None, None]  # h1 alone is useless without h0


async def test_held_prefix_is_the_leading_run_in_one_round_trip(
        redis_tier: RedisTier, redis_client: aioredis.Redis) -> None:
    hashes = chain(6)
    # Redis holds 0, 1, 2 and 4: the plan may count on the first three only.
    await redis_tier.put_many([(h, block(h)) for i, h in enumerate(hashes) if i != 3])
    before = (await redis_client.info("commandstats")).get("cmdstat_exists", {}).get("calls", 0)
    assert await redis_tier.held_prefix(hashes) == 3
    assert await redis_tier.held_prefix(hashes[3:]) == 0
    assert await redis_tier.held_prefix(hashes[4:5]) == 1
    assert await redis_tier.held_prefix([]) == 0
    after = (await redis_client.info("commandstats")).get("cmdstat_exists", {}).get("calls", 0)
    # The script's EXISTS calls run inside Redis: 4 + 1 + 1 of them, none sent one by one.
    assert after - before == 6
    assert redis_tier.counters.misses == 2


async def test_held_prefix_falls_back_to_exists_where_scripts_are_refused(
        redis_client: aioredis.Redis, prefix: str) -> None:
    """A Redis user whose ACL denies scripting (as managed Redis offers): same answers."""
    user, password = f"splitserve-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await redis_client.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-@scripting")
    tier = RedisTier(SPEC, f"redis://{user}:{password}@127.0.0.1:6379/0", ttl_s=120,
                     key_prefix=prefix)
    try:
        hashes = chain(4)
        await tier.put_many([(h, block(h)) for h in hashes[:2]])
        assert await tier.held_prefix(hashes) == 2
        assert await tier.held_prefix(hashes) == 2  # the fallback, now chosen at once
        assert tier.counters.read_errors.get("error", 0) == 0
    finally:
        await tier.close()
        await redis_client.execute_command("ACL", "DELUSER", user)
