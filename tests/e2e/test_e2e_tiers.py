"""The new user's scenario, bounded: prefill and decode workers with a CPU tier and a Redis
tier (a redis-server of the test's own) serve a long prompt five times, each under its own
`cache_salt`; then the workers are replaced by fresh ones (new engines: empty GPU caches, empty
CPU tiers; Redis is all that is left) and the five prompts come back while other requests load
the same workers. All five are Redis hits, and each answer equals the first one.

A tiny model and a 21-block prompt instead of SmolLM2 and 1,559 tokens: the mechanism (one
Redis write per prompt of many blocks, behind responses, under concurrent load; then reads of
them from a process with nothing of its own) is the same, the test is seconds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from protos.splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.support.redis_server import RedisServer, redis_server
from tests.unit.worker.test_tier_cache import BLOCK_SIZE, TIMEOUT_S, _tiers_of, _worker
from worker.server import WorkerHandle
from worker.tier_cache import TierConfig

PROMPT = [(29 * i + 11) % 300 + 1 for i in range(86)]  # 21 full blocks + 2 tokens
SALTS = [f"user-{i}" for i in range(5)]
LOAD = [[(31 * i + k) % 300 + 1 for i in range(40)] for k in range(6)]  # other users
MAX_TOKENS = 6


async def _generate(prefill: WorkerHandle, decode: WorkerHandle, rid: str, ids: list[int],
                    salt: str = "") -> tuple[list[int], int]:
    """Prefill then decode over gRPC, as the gateway does: (tokens, prefill's cached tokens)."""
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{prefill.port}") as pc, \
            grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as dc:
        first: prefill_pb2.PrefillResponse = await prefill_pb2_grpc.PrefillStub(pc).Prefill(
            prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                       cache_salt=salt), timeout=TIMEOUT_S)
        tokens = [first.first_token_id]
        request = decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, output_token_ids=tokens, sampling=sampling,
            kv_handle=first.kv_handle, cache_salt=salt)
        async for response in decode_pb2_grpc.DecodeStub(dc).Decode(request, timeout=TIMEOUT_S):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
        return tokens, first.num_cached_tokens


async def _pair(path: Path, url: str) -> tuple[WorkerHandle, WorkerHandle]:
    tiers = TierConfig(cpu_bytes=4 << 20, redis_url=url)
    return await _worker(path, tiers), await _worker(path, tiers, role="decode")


async def _stop(*handles: WorkerHandle) -> None:
    for h in handles:
        await h.stop(grace_s=1.0)


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.mark.asyncio
async def test_five_of_five_fresh_worker_requests_are_redis_hits_under_load(
        tiny_model_dirs: dict[str, Path], server: RedisServer) -> None:
    path = tiny_model_dirs["llama"]
    prefill, decode = await _pair(path, server.url)
    try:
        load = [_generate(prefill, decode, f"seed-load{k}", ids) for k, ids in enumerate(LOAD)]
        seeded = await asyncio.gather(
            *(_generate(prefill, decode, f"seed{i}", PROMPT, salt)
              for i, salt in enumerate(SALTS)), *load)
        await _tiers_of(prefill).wait_for_saves()
        redis = _tiers_of(prefill).store.redis
        assert redis is not None
        c = redis.counters
        assert not c.saves_dropped, c.saves_dropped  # every block handed over landed
        assert c.saves_written == 5 * 21 + len(LOAD) * 10, _tiers_of(prefill).stats
    finally:
        await _stop(prefill, decode)

    prefill, decode = await _pair(path, server.url)  # fresh: only Redis remembers
    try:
        load = [_generate(prefill, decode, f"load{k}", ids) for k, ids in enumerate(LOAD)]
        again = await asyncio.gather(
            *(_generate(prefill, decode, f"again{i}", PROMPT, salt)
              for i, salt in enumerate(SALTS)), *load)
        hits = [cached for _, cached in again[:5]]
        assert hits == [21 * BLOCK_SIZE] * 5, hits  # 5 of 5: every full block from Redis
        assert [tokens for tokens, _ in again] == [tokens for tokens, _ in seeded]
        redis = _tiers_of(prefill).store.redis
        assert redis is not None and redis.counters.hits >= 5 * 21
        assert not redis.counters.read_errors
    finally:
        await _stop(prefill, decode)
