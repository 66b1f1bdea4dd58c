"""The CPU/Redis prefix tiers under a prefill worker (worker/tier_cache.py): two real prefill
workers on 127.0.0.1 with separate GPU caches and CPU tiers, sharing the real Redis.

Worker A prefills a prompt and saves its full blocks; worker B, which never saw the prompt,
loads them from Redis instead of computing them, and answers exactly as A did (first token and
its logprob). A corrupt Redis value is a miss (B recomputes, still right), and a plan whose GPU
blocks vanished before the load is refused (the engine recomputes)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from redis import asyncio as aioredis

from engine.config import (
    CacheConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    RunnerConfig,
    SchedulerConfig,
)
from engine.handoff import KvLoad
from engine.llm_engine import LLMEngine
from engine.loader import load_model_source
from engine_api.request_options import RemoteKv
from protos.splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.support.e2e_stack import start_worker
from worker import tier_cache
from worker.server import WorkerHandle
from worker.tier_cache import TierBlocks, TierConfig, TierPrefixCache

REDIS_URL = "redis://127.0.0.1:6379/0"
BLOCK_SIZE = 4
TIMEOUT_S = 60.0


def _config(path: Path, role: str = "prefill", lora: LoRAConfig | None = None) -> EngineConfig:
    return EngineConfig(
        load=LoadConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=256),
        scheduler=SchedulerConfig(role=role, max_model_len=256,  # type: ignore[arg-type]
                                  kv_lease_ms=60_000),
        runner=RunnerConfig(device="cpu"), lora=lora or LoRAConfig())


@pytest_asyncio.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix of this test's own, deleted afterwards."""
    prefix = f"splitserve-test-tiers-{uuid.uuid4().hex[:12]}"
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as e:  # the suite's Redis is required: say so plainly
        pytest.fail(f"Redis at {REDIS_URL} is required by the tier tests: {e}")
    yield prefix
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def _worker(path: Path, tiers: TierConfig, role: str = "prefill",
                  lora: LoRAConfig | None = None) -> WorkerHandle:
    handle = await start_worker(_config(path, role, lora), "127.0.0.1", 0, tiers=tiers,
                                engine_factory=lambda c: LLMEngine(c, detokenize=False))
    assert handle.load_task is not None
    await asyncio.wait_for(asyncio.shield(handle.load_task), TIMEOUT_S)
    return handle


async def _prefill(handle: WorkerHandle, rid: str, ids: list[int]) -> prefill_pb2.PrefillResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        request = prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, logprobs=1))
        response: prefill_pb2.PrefillResponse = await prefill_pb2_grpc.PrefillStub(
            channel).Prefill(request, timeout=TIMEOUT_S)
        return response


async def _load_report(handle: WorkerHandle) -> common_pb2.LoadReport:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        report: common_pb2.LoadReport = await prefill_pb2_grpc.PrefillStub(channel).GetLoad(
            common_pb2.LoadRequest(), timeout=TIMEOUT_S)
        return report


def _tiers_of(handle: WorkerHandle) -> TierPrefixCache:
    assert handle.aengine is not None
    loader = handle.aengine.kv_loader
    owner = getattr(loader, "__self__", None) or getattr(loader, "tiers", None)  # decode role
    assert isinstance(owner, TierPrefixCache), "the worker must load through its tiers"
    return owner


async def _decode(handle: WorkerHandle, rid: str, ids: list[int], max_tokens: int = 8,
                  lora_name: str = "") -> tuple[list[int], list[float]]:
    """A colocated worker's Decode without a KV handle: (token ids, their logprobs); the
    completion's cached prompt tokens go to `_last_cached`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        request = decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               logprobs=1, ignore_eos=True),
            lora_name=lora_name)
        tokens: list[int] = []
        logprobs: list[float] = []
        async for response in decode_pb2_grpc.DecodeStub(channel).Decode(request,
                                                                        timeout=TIMEOUT_S):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
                logprobs.extend(lp.logprob for lp in response.chunk.logprobs)
            elif response.HasField("complete"):
                _last_cached[handle.port] = response.complete.num_cached_tokens
        return tokens, logprobs


_last_cached: dict[int, int] = {}  # worker port -> the last Decode's num_cached_tokens


async def _evict_gpu_prefix_cache(handle: WorkerHandle) -> None:
    assert handle.aengine is not None
    assert await handle.aengine.call(handle.aengine.engine.scheduler.kv.reset_prefix_cache)


def _count_computed(handle: WorkerHandle) -> list[int]:
    """Spy on the real scheduler: the tokens each step computes are appended to the list."""
    assert handle.aengine is not None
    scheduler = handle.aengine.engine.scheduler
    schedule = scheduler.schedule
    counts: list[int] = []

    def counting() -> Any:
        out = schedule()
        counts.append(out.num_batched_tokens)
        return out

    scheduler.schedule = counting  # type: ignore[method-assign]
    return counts


@pytest_asyncio.fixture
async def two_workers(tiny_model_dirs: dict[str, Path], redis_prefix: str
                      ) -> AsyncIterator[tuple[WorkerHandle, WorkerHandle]]:
    """Two prefill workers of the tiny model, each with its own CPU tier, sharing Redis."""
    path = tiny_model_dirs["llama"]
    tiers = TierConfig(cpu_bytes=8 << 20, redis_url=REDIS_URL, redis_key_prefix=redis_prefix)
    a, b = await _worker(path, tiers), await _worker(path, tiers)
    try:
        yield a, b
    finally:
        for h in (a, b):
            await h.stop(grace_s=1.0)


@pytest.mark.asyncio
async def test_second_worker_loads_the_prompt_from_redis(
        two_workers: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, b = two_workers
    prompt = [(7 * i + 3) % 300 + 1 for i in range(37)]  # 9 full blocks + 1 token
    first = await _prefill(a, "a1", prompt)
    ta = _tiers_of(a)
    await ta.wait_for_saves()
    assert ta.stats.saved_blocks == 9 and ta.store.stats["redis_writes"] >= 1

    computed = _count_computed(b)
    second = await _prefill(b, "b1", prompt)
    tb = _tiers_of(b)
    assert tb.stats.planned_blocks == 9 and tb.stats.loaded_blocks == 9
    assert tb.stats.failed_loads == 0
    # B computed only the last partial block's token (37 - 36), not the prompt.
    assert sum(computed) == 1
    assert second.first_token_id == first.first_token_id
    assert second.logprob.logprob == pytest.approx(first.logprob.logprob, abs=1e-5)
    # B's KV handle names the same blocks: the decode side can pull them as from A.
    assert list(second.kv_handle.block_hashes) == list(first.kv_handle.block_hashes)
    # The load reports carry the tier counters (the gateway exports them to Prometheus).
    report_a, report_b = await _load_report(a), await _load_report(b)
    # Block writes that landed, per tier: 9 in A's CPU tier and 9 in Redis.
    assert report_a.tier_saved_blocks == 18 and report_a.tier_hit_tokens == 0
    tiers_a = {t.tier: t for t in report_a.kv_tiers}
    assert tiers_a["redis"].saves_queued == tiers_a["redis"].saves_written == 9
    assert not tiers_a["redis"].saves_dropped and tiers_a["cpu"].saves_written == 9
    assert report_b.tier_hit_tokens == 9 * BLOCK_SIZE
    tiers_b = {t.tier: t for t in report_b.kv_tiers}
    assert tiers_b["redis"].hit_blocks == 9 and tiers_b["cpu"].hit_blocks == 0
    assert sum(tiers_b["redis"].read_seconds.counts) == 1  # one chunk


@pytest.mark.asyncio
async def test_corrupt_redis_value_is_a_miss_and_the_prompt_is_recomputed(
        two_workers: tuple[WorkerHandle, WorkerHandle], redis_prefix: str) -> None:
    a, b = two_workers
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        prompt = [(11 * i + 5) % 300 + 1 for i in range(21)]  # 5 full blocks + 1 token
        first = await _prefill(a, "a1", prompt)
        ta = _tiers_of(a)
        await ta.wait_for_saves()
        keys = sorted([k async for k in client.scan_iter(match=f"{redis_prefix}:*")])
        assert len(keys) == 5
        # Flip one payload byte of every stored block: each fails its checksum.
        for key in keys:
            value = bytearray(await client.get(key))
            value[-1] ^= 0xFF
            await client.set(key, bytes(value))
        computed = _count_computed(b)
        second = await _prefill(b, "b1", prompt)
        tb = _tiers_of(b)
        assert tb.stats.planned_blocks == 0 and tb.store.stats["redis_corrupt"] >= 1
        assert sum(computed) == len(prompt)
        assert second.first_token_id == first.first_token_id
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_load_refuses_a_plan_the_gpu_cache_no_longer_covers(
        tiny_model_dirs: dict[str, Path]) -> None:
    """The plan counted on GPU blocks 0..1 and fetched 2..3; if the engine then found fewer GPU
    blocks (evicted meanwhile), the tiers hold no copy of the missing ones: refuse."""
    handle = await _worker(tiny_model_dirs["llama"], TierConfig(cpu_bytes=1 << 20))
    try:
        cache = _tiers_of(handle)
        plan = TierBlocks(first=2, blocks=(b"x", b"y"), hashes=tuple(bytes([i]) * 32
                                                                     for i in range(4)))
        request = _FakeRequest(RemoteKv(num_tokens=16, handle=plan))
        refused = await cache.load(KvLoad(request, [10, 11, 12], 16, first_block=1))  # type: ignore[arg-type]
        assert refused is False and cache.stats.failed_loads == 1
        # A block whose bytes are not a valid block of this model is refused too.
        garbled = await cache.load(KvLoad(request, [12, 13], 16, first_block=2))  # type: ignore[arg-type]
        assert garbled is False and cache.stats.failed_loads == 2
    finally:
        await handle.stop(grace_s=1.0)


class _FakeRequest:
    """Only what `TierPrefixCache.load` reads of a request."""

    def __init__(self, remote_kv: RemoteKv) -> None:
        self.remote_kv = remote_kv
        self.request_id = "fake"


@pytest.mark.asyncio
async def test_colocated_worker_finds_an_evicted_conversation_in_its_cpu_tier(
        tiny_model_dirs: dict[str, Path]) -> None:
    """A colocated worker (no leases) saves a finished request's prompt and output blocks from
    its prefix cache; once the GPU cache has lost them, the same prompt, and the next turn
    (prompt + answer + more), load them from the CPU tier instead of computing them, and answer
    exactly as before."""
    handle = await _worker(tiny_model_dirs["llama"], TierConfig(cpu_bytes=8 << 20),
                           role="colocated")
    try:
        tiers = _tiers_of(handle)
        prompt = [(7 * i + 3) % 300 + 1 for i in range(37)]  # 9 full blocks + 1 token
        first, first_lp = await _decode(handle, "c1", prompt)
        assert _last_cached[handle.port] == 0
        await tiers.wait_for_saves()
        # 37 prompt + 8 output tokens, the last one's KV never computed: 44 tokens, 11 blocks.
        assert tiers.stats.saved_blocks == 11
        assert handle.aengine is not None
        await handle.aengine.call(handle.aengine.engine.scheduler.check_integrity)  # no pin left
        await _evict_gpu_prefix_cache(handle)

        computed = _count_computed(handle)
        again, again_lp = await _decode(handle, "c2", prompt)
        assert tiers.stats.loaded_blocks == 9 and tiers.stats.failed_loads == 0
        # The prompt's last token, then 7 decodes (8 tokens): not the 37 of the prompt.
        assert sum(computed) == 1 + 7
        assert again == first
        assert again_lp == pytest.approx(first_lp, abs=1e-5)
        assert _last_cached[handle.port] == 9 * BLOCK_SIZE  # tier hits count as cached

        await tiers.wait_for_saves()
        await _evict_gpu_prefix_cache(handle)
        next_turn = [*prompt, *first, 5, 6, 7]  # 48 tokens: the saved 44 + 4 new
        computed.clear()
        await _decode(handle, "c3", next_turn, max_tokens=2)
        assert tiers.stats.loaded_blocks == 9 + 11
        assert sum(computed) == (len(next_turn) - 44) + 1
        # c3's own save (its 12th block: tokens 44..47) runs behind its response: wait for it,
        # or the report may be taken before it counts.
        await tiers.wait_for_saves()
        report = await _colocated_load_report(handle)
        assert report.tier_hit_tokens == (9 + 11) * BLOCK_SIZE
        assert report.tier_saved_blocks == tiers.stats.saved_blocks == 12
    finally:
        await handle.stop(grace_s=1.0)


@pytest.mark.asyncio
async def test_an_adapters_kv_is_tiered_under_its_own_hashes(
        tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A LoRA adapter's conversation comes back from the CPU tier for that adapter, and the
    base model asking for the same prompt finds none of it (another model's KV)."""
    from tests.unit.engine.test_lora import write_adapter

    path = tiny_model_dirs["llama"]
    cfg = load_model_source(LoadConfig(model=str(path))).config
    write_adapter(tmp_path / "ad", cfg, ("q_proj", "v_proj", "down_proj"), 4, 8, 5)
    handle = await _worker(path, TierConfig(cpu_bytes=8 << 20), role="colocated",
                           lora=LoRAConfig(modules=(("ad", str(tmp_path / "ad")),)))
    try:
        tiers = _tiers_of(handle)
        prompt = [(3 * i + 2) % 300 + 1 for i in range(21)]  # 5 full blocks + 1 token
        first, _ = await _decode(handle, "a1", prompt, lora_name="ad")
        await tiers.wait_for_saves()
        saved = tiers.stats.saved_blocks
        assert saved == 7  # 21 + 8 tokens, the last one's KV never computed: 28 tokens
        await _evict_gpu_prefix_cache(handle)
        base, _ = await _decode(handle, "b1", prompt)
        assert tiers.stats.loaded_blocks == 0 and _last_cached[handle.port] == 0
        assert base != first
        await tiers.wait_for_saves()
        await _evict_gpu_prefix_cache(handle)
        again, _ = await _decode(handle, "a2", prompt, lora_name="ad")
        assert tiers.stats.loaded_blocks == 5 and tiers.stats.failed_loads == 0
        assert again == first and _last_cached[handle.port] == 5 * BLOCK_SIZE
    finally:
        await handle.stop(grace_s=1.0)


@pytest.mark.asyncio
async def test_saves_beyond_the_pending_limit_are_skipped_not_queued(
        tiny_model_dirs: dict[str, Path]) -> None:
    handle = await _worker(tiny_model_dirs["llama"], TierConfig(cpu_bytes=8 << 20),
                           role="colocated")
    try:
        tiers = _tiers_of(handle)
        prompt = [(5 * i + 1) % 300 + 1 for i in range(21)]  # 5 full blocks + 1 token
        await _decode(handle, "s0", prompt, max_tokens=1)
        await tiers.wait_for_saves()
        for _ in range(tier_cache.MAX_PENDING_SAVES + 3):  # none has started yet
            tiers.spawn_save_tokens(prompt)
        assert tiers.stats.skipped_saves == 3
        await tiers.wait_for_saves()
        assert handle.aengine is not None
        await handle.aengine.call(handle.aengine.engine.scheduler.check_integrity)
        assert not handle.aengine.engine.scheduler.pins
    finally:
        await handle.stop(grace_s=1.0)


async def _colocated_load_report(handle: WorkerHandle) -> common_pb2.LoadReport:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        report: common_pb2.LoadReport = await decode_pb2_grpc.DecodeStub(channel).GetLoad(
            common_pb2.LoadRequest(), timeout=TIMEOUT_S)
        return report


def test_tier_config_validation() -> None:
    assert not TierConfig().enabled and TierConfig(cpu_bytes=1).enabled
    assert TierConfig(redis_url=REDIS_URL).enabled
    with pytest.raises(ValueError, match="cpu_bytes"):
        TierConfig(cpu_bytes=-1)
    with pytest.raises(ValueError, match="min_blocks"):
        TierConfig(min_blocks=0)

