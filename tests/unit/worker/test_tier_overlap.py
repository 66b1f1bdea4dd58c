"""A prompt whose prefix only Redis holds: the cost model splits it, and the engine computes the
head while the tail is read (worker/tier_cache.py, engine/scheduler.py's tail loads). A real
colocated worker on the tiny model, a Redis of this test's own.

The tail's load is held back until the engine has computed the head: a worker that waits for
the load before computing anything never gets there, and the test times out. The answer equals
the computed one; the counters say how many blocks came from Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from engine.handoff import KvLoad
from kv_transfer.tiers import ReadCost
from tests.support.redis_server import redis_server
from tests.unit.worker.test_tier_cache import (
    BLOCK_SIZE,
    _decode,
    _evict_gpu_prefix_cache,
    _last_cached,
    _tiers_of,
    _worker,
)
from worker.server import WorkerHandle
from worker.tier_cache import TierConfig

PROMPT = [(17 * i + 5) % 300 + 1 for i in range(41)]  # 10 full blocks + 1 token


@pytest_asyncio.fixture
async def worker(tiny_model_dirs: dict[str, Path]) -> AsyncIterator[WorkerHandle]:
    with redis_server() as server:
        handle = await _worker(tiny_model_dirs["llama"], TierConfig(redis_url=server.url),
                               role="colocated")
        try:
            yield handle
        finally:
            await handle.stop(grace_s=1.0)


@pytest.mark.asyncio
async def test_the_head_computes_while_the_tail_loads_from_redis(worker: WorkerHandle) -> None:
    tiers = _tiers_of(worker)
    aengine = worker.aengine
    assert aengine is not None
    reference, ref_logprobs = await _decode(worker, "ref", PROMPT)
    await tiers.wait_for_saves()
    await _evict_gpu_prefix_cache(worker)

    # Redis as the cost model would see it over a slow link (1 block a second, no latency: the
    # reads it timed so far are forgotten), and a prefill rate at which computing 5 blocks
    # takes as long as reading 5: the split falls in the middle.
    redis = tiers.store.redis
    assert redis is not None
    block_bytes = tiers.store.spec.encoded_nbytes
    redis.counters.cost = ReadCost(0.0, float(block_bytes))
    for blocks in (1, 2):
        redis.counters.cost.observe(blocks * block_bytes, float(blocks))
    tiers.cost.prefill_tokens_per_s = BLOCK_SIZE / 1.0

    load_tiers = aengine.kv_loader
    assert load_tiers is not None
    head_done: list[int] = []

    async def after_the_head(load: KvLoad) -> bool:
        req = load.request
        head = load.first_block * BLOCK_SIZE
        async with asyncio.timeout(20):  # no overlap: the engine waits for this load forever
            while req.num_computed_tokens < head:
                await asyncio.sleep(0.005)
        head_done.append(head)
        return await load_tiers(load)

    aengine.kv_loader = after_the_head
    tokens, logprobs = await _decode(worker, "split", PROMPT)
    aengine.kv_loader = load_tiers

    assert tiers.cost.last_split is not None
    computed, fetched = tiers.cost.last_split
    assert 0 < computed < 10 and computed + fetched == 10
    assert head_done == [computed * BLOCK_SIZE]
    assert tokens == reference
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    assert tiers.stats.loaded_blocks == fetched and tiers.stats.overlapped_blocks == computed
    assert redis.counters.hits == fetched
    assert _last_cached[worker.port] == fetched * BLOCK_SIZE  # the tail, not the head
    assert tiers.cost.decisions["overlap"] == 1
    aengine.engine.scheduler.check_integrity()
