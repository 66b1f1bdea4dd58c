"""A prefill worker (the random `dummy:tiny` model) drained as on SIGTERM: health says
NOT_SERVING and new requests are refused with UNAVAILABLE at once, while the lease it holds is
honoured (pulled or released) before it exits; its own /metrics show it all, labelled with
the model's name."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import CacheConfig, EngineConfig, LoadConfig, RunnerConfig, SchedulerConfig
from prefill_service.server import start_prefill_worker
from protos.splitserve.v1 import (
    common_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from worker.server import MetricsOptions

MODEL = "dummy:tiny"


def _config() -> EngineConfig:
    return EngineConfig(load=LoadConfig(model=MODEL, dtype="float32"),
                        cache=CacheConfig(block_size=16, num_gpu_blocks=64),
                        scheduler=SchedulerConfig(role="prefill", max_model_len=256,
                                                  kv_lease_ms=60_000),
                        runner=RunnerConfig(device="cpu"))


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert lines, f"{name} not in /metrics"
    assert f'model_name="{MODEL}"' in lines[0] and 'role="prefill"' in lines[0], lines[0]
    return float(lines[0].rsplit(" ", 1)[1])


async def _scrape(url: str) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(url, timeout=10)).text


async def test_drain_refuses_new_work_and_honours_leases() -> None:
    handle = await start_prefill_worker(_config(), "127.0.0.1", 0, kv_data_port=None,
                                        metrics=MetricsOptions("127.0.0.1", 0, MODEL))
    assert handle.load_task is not None and handle.metrics is not None
    url = f"http://127.0.0.1:{handle.metrics.port}/metrics"
    drain: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(handle.load_task, 120)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            prefill = prefill_pb2_grpc.PrefillStub(channel)
            request = prefill_pb2.PrefillRequest(
                request_id="leased", prompt_token_ids=list(range(3, 40)),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4))
            answer = await prefill.Prefill(request, timeout=60)
            assert answer.HasField("kv_handle")  # a lease for a decode worker to pull
            text = await _scrape(url)
            assert _metric(text, "splitserve:engine_kv_leases") == 1
            assert _metric(text, "splitserve:engine_draining") == 0
            assert _metric(text, "splitserve:engine_prefix_cache_queries_total") > 0

            drain = asyncio.create_task(handle.drain(timeout_s=30))
            await asyncio.sleep(0.2)
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            refused = None
            try:
                await prefill.Prefill(prefill_pb2.PrefillRequest(
                    request_id="late", prompt_token_ids=[5, 6, 7],
                    sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=10)
            except grpc.aio.AioRpcError as err:
                refused = err.code()
            assert refused == grpc.StatusCode.UNAVAILABLE
            assert _metric(await _scrape(url), "splitserve:engine_draining") == 1
            assert not drain.done()  # the lease is still held

            started = time.monotonic()
            released = await kv_transfer_pb2_grpc.KvTransferStub(channel).Release(
                kv_transfer_pb2.ReleaseRequest(request_id="leased"), timeout=10)
            assert released.released  # KV transfers stay open while draining
            await asyncio.wait_for(drain, 10)
            assert time.monotonic() - started < 5
    finally:
        if drain is None:
            await handle.stop(1.0)
        elif not drain.done():
            drain.cancel()
            await handle.stop(1.0)
