"""Decode-side tiers: a decode worker saves the blocks its answer filled (not the prompt's,
which the prefill worker saved), so the next turn's prefill loads the whole conversation from
Redis; and a decode request that brings no KV (a resumed or re-routed one) plans from the tiers
like a colocated worker. Every answer equals the one computed without tiers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from redis import asyncio as aioredis

from protos.splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.support.redis_server import RedisServer, redis_server
from tests.unit.worker.test_tier_cache import (
    BLOCK_SIZE,
    TIMEOUT_S,
    _count_computed,
    _decode,
    _evict_gpu_prefix_cache,
    _prefill,
    _tiers_of,
    _worker,
)
from worker.server import WorkerHandle
from worker.tier_cache import TierConfig

PROMPT = [(17 * i + 5) % 300 + 1 for i in range(26)]  # 6 full blocks + 2 tokens
MAX_TOKENS = 8


@pytest_asyncio.fixture
async def pair(tiny_model_dirs: dict[str, Path]
               ) -> AsyncIterator[tuple[WorkerHandle, WorkerHandle, RedisServer]]:
    with redis_server() as server:
        tiers = TierConfig(redis_url=server.url)  # Redis only: every hit is a Redis hit
        prefill = await _worker(tiny_model_dirs["llama"], tiers)
        decode = await _worker(tiny_model_dirs["llama"], tiers, role="decode")
        try:
            yield prefill, decode, server
        finally:
            for h in (prefill, decode):
                await h.stop(grace_s=1.0)


async def _decode_with_handle(decode: WorkerHandle, rid: str, ids: list[int],
                              handle: common_pb2.KvHandle, first: int) -> list[int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        request = decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, output_token_ids=[first], kv_handle=handle,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True))
        tokens = [first]
        async for response in decode_pb2_grpc.DecodeStub(channel).Decode(request,
                                                                        timeout=TIMEOUT_S):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
        return tokens


async def _resume(decode: WorkerHandle, rid: str, ids: list[int], sent: list[int]
                  ) -> list[int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        request = decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, output_token_ids=sent,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True))
        tokens: list[int] = []
        async for response in decode_pb2_grpc.DecodeStub(channel).Decode(request,
                                                                        timeout=TIMEOUT_S):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
        return tokens


@pytest.mark.asyncio
async def test_decode_worker_saves_its_answer_and_serves_requests_without_kv_from_redis(
        pair: tuple[WorkerHandle, WorkerHandle, RedisServer]) -> None:
    prefill, decode, server = pair
    client = aioredis.Redis.from_url(server.url)
    tp, td = _tiers_of(prefill), _tiers_of(decode)
    rp, rd = tp.store.redis, td.store.redis
    assert rp is not None and rd is not None
    # The reference: the decode worker alone, no KV from anywhere (Redis is empty).
    reference, _ = await _decode(decode, f"ref-{uuid.uuid4().hex[:6]}", PROMPT, MAX_TOKENS)
    await td.wait_for_saves()
    assert rd.counters.saves_written == (len(PROMPT) + MAX_TOKENS - 1) // BLOCK_SIZE
    await client.flushdb()  # the disaggregated turn starts from nothing
    await _evict_gpu_prefix_cache(decode)
    written = rd.counters.saves_written

    # Turn 1, disaggregated: the prefill worker saves the prompt's 6 blocks; the decode worker
    # only the blocks its answer filled (26 + 7 tokens with KV: blocks 6 and 7).
    first = await _prefill(prefill, "t1", PROMPT)
    answer = await _decode_with_handle(decode, "t1", PROMPT, first.kv_handle,
                                       first.first_token_id)
    assert answer == reference
    await tp.wait_for_saves()
    await td.wait_for_saves()
    assert rp.counters.saves_written == len(PROMPT) // BLOCK_SIZE
    assert rd.counters.saves_written - written == 2

    # Turn 2 on the prefill worker, its GPU cache emptied: prompt and answer come from Redis.
    await _evict_gpu_prefix_cache(prefill)
    turn2 = [*PROMPT, *answer[:-1], 9, 8, 7]  # 36 tokens: 8 blocks in Redis + 4 new tokens
    computed = _count_computed(prefill)
    second = await _prefill(prefill, "t2", turn2)
    assert tp.stats.loaded_blocks == 8 and sum(computed) == len(turn2) - 8 * BLOCK_SIZE
    await tp.wait_for_saves()  # turn 2's own 9th block (tokens 32..35)
    # A request without KV on the decode worker (resumed elsewhere, say): from Redis too.
    await _evict_gpu_prefix_cache(decode)
    computed = _count_computed(decode)
    again, _ = await _decode(decode, "t2-nokv", turn2, MAX_TOKENS)
    assert td.stats.loaded_blocks == 9
    assert sum(computed) <= BLOCK_SIZE + MAX_TOKENS  # at most the last block recomputed
    assert again[0] == second.first_token_id
    # A resumed stream (the tokens sent so far given, no KV handle): the prompt from Redis,
    # decoding goes on exactly where it left off.
    await td.wait_for_saves()
    await _evict_gpu_prefix_cache(decode)
    loaded = td.stats.loaded_blocks
    resumed = await _resume(decode, "t2-resumed", turn2, again[:3])
    assert td.stats.loaded_blocks == loaded + 9
    assert [*again[:3], *resumed] == again
    # And exactly what the decode worker computes without any tier (its cache emptied).
    await td.wait_for_saves()
    await client.flushdb()
    await _evict_gpu_prefix_cache(decode)
    alone, _ = await _decode(decode, "t2-alone", turn2, MAX_TOKENS)
    assert alone == again and td.stats.loaded_blocks == loaded + 9
    await client.aclose()
