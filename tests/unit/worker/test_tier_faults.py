"""A real colocated worker whose only tier is a Redis of this test's own, put through the
faults one after the other (and a prefill rate that makes fetching slower than computing):
garbage and foreign blocks under its keys, paused (SIGSTOP) longer
than the deadlines, full (`maxmemory`, noeviction), killed. Every answer equals the answer of
the first run (which no tier served); the tier counters say why each request recomputed."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from redis import asyncio as aioredis

from kv_transfer.wire import BlockSpec, encode_block
from tests.support.redis_server import RedisServer, redis_server
from tests.unit.worker.test_tier_cache import (
    _decode,
    _evict_gpu_prefix_cache,
    _tiers_of,
    _worker,
)
from worker.server import WorkerHandle
from worker.tier_cache import TierConfig

PROMPT = [(13 * i + 7) % 300 + 1 for i in range(33)]  # 8 full blocks + 1 token


@pytest_asyncio.fixture
async def stack(tiny_model_dirs: dict[str, Path]
                ) -> AsyncIterator[tuple[WorkerHandle, RedisServer]]:
    with redis_server() as server:
        handle = await _worker(tiny_model_dirs["llama"], TierConfig(redis_url=server.url),
                               role="colocated")
        try:
            yield handle, server
        finally:
            await handle.stop(grace_s=1.0)


async def _again(handle: WorkerHandle, rid: str, rate: float = 1.0) -> list[int]:
    """The prompt once more, after the GPU cache lost it: from Redis, or recomputed. `rate`:
    the prefill rate the cost model assumes (by default so slow that it fetches all; the
    split between computing and fetching is test_tier_overlap.py's)."""
    _tiers_of(handle).cost.prefill_tokens_per_s = rate
    await _tiers_of(handle).wait_for_saves()
    await _evict_gpu_prefix_cache(handle)
    tokens, _ = await _decode(handle, rid, PROMPT)
    await _tiers_of(handle).wait_for_saves()
    return tokens


@pytest.mark.asyncio
async def test_every_answer_is_right_through_redis_faults_and_the_counters_say_why(
        stack: tuple[WorkerHandle, RedisServer]) -> None:
    handle, server = stack
    tiers = _tiers_of(handle)
    redis = tiers.store.redis
    assert redis is not None
    c = redis.counters
    client = aioredis.Redis.from_url(server.url)
    try:
        reference, _ = await _decode(handle, "ref", PROMPT)  # Redis empty: computed
        assert await _again(handle, "hit") == reference
        assert tiers.stats.loaded_blocks == 8 and c.hits == 8

        # A worker whose prefill outruns its Redis (as a GPU's would) computes instead.
        assert await _again(handle, "cheaper", rate=1e12) == reference
        assert c.cost_skips == 1 and tiers.stats.loaded_blocks == 8

        # Garbage, another model's and another salt's blocks under our keys: misses.
        keys = sorted([k async for k in client.scan_iter()])
        assert keys
        spec = tiers.store.spec
        other = BlockSpec(hashlib.sha256(b"other").digest(), spec.num_layers, spec.block_size,
                          spec.num_kv_heads, spec.head_dim, spec.dtype)
        zeros = torch.zeros(spec.shape, dtype=spec.dtype)
        for i, key in enumerate(keys):
            block_hash = bytes.fromhex(key.split(b":")[-1].decode())
            await client.set(key, (
                encode_block(other, block_hash, spec.block_size, zeros),  # another model's
                encode_block(spec, hashlib.sha256(block_hash + b"salt").digest(),  # another
                             spec.block_size, zeros),                      # salt's block
                b"\x00garbage")[i % 3])
        assert await _again(handle, "garbage") == reference
        assert c.read_errors["corrupt"] == 1 and tiers.stats.loaded_blocks == 8

        # Paused longer than the read deadline: a timeout, the request recomputes.
        server.pause()
        try:
            assert await asyncio.wait_for(_again(handle, "paused"), 30) == reference
        finally:
            server.resume()
        assert c.read_errors["timeout"] == 1
        assert c.saves_dropped["timeout"] + c.saves_dropped["backoff"] >= 1

        # Full (noeviction): reads go on, writes are dropped as `full`.
        await asyncio.sleep(0.6)  # past the timeouts' pause
        await client.flushdb()
        used = int((await client.info("memory"))["used_memory"])
        await client.config_set("maxmemory", used + 4096)
        assert await _again(handle, "full") == reference
        assert c.saves_dropped["full"] >= 1

        # Killed: a connection failure, then a pause; still right.
        server.kill()
        assert await _again(handle, "killed") == reference
        assert c.read_errors["connection"] + c.read_errors["backoff"] >= 1
        assert c.saves_queued == c.saves_written + sum(c.saves_dropped.values())
        assert tiers.stats.failed_loads == 0
    finally:
        await client.aclose()
