"""The prefill worker's server: `splitserve.v1.Prefill` and `splitserve.v1.KvTransfer` on one
gRPC port, the KV data port (kv_transfer/tcp.py) beside it, and CPU/Redis prefix tiers under
the engine's cache when configured. `splitserve.v1.Decode` on the same port runs whole requests
(prompt and every token) on this engine: the gateway sends them there only while no decode
worker is healthy (its prefill_only mode, gateway/serving_mode.py)."""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager
from typing import Any

import grpc
from opentelemetry.trace import Span

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kv_transfer.servicer import KvTransferServicer
from kv_transfer.tcp import KvDataServer
from prefill_service.servicer import PrefillServicer
from protos.splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from rpc import tracing
from rpc.auth import LeaseTickets
from rpc.tls import tls_paths_from_env
from worker.decode_servicer import DecodeServicer
from worker.kv import EngineBlockSource
from worker.metrics import report_now
from worker.server import (
    EngineFactory,
    MetricsOptions,
    WorkerHandle,
    advertised_address,
    start_worker_server,
)
from worker.tier_cache import TierConfig, attach_tiers

DEFAULT_PORT = 50061
# KvTransfer's methods: a call may carry its lease's ticket instead of the cluster's secret.
_KV_METHODS = frozenset(
    f"/{kv_transfer_pb2.DESCRIPTOR.services_by_name['KvTransfer'].full_name}/{m.name}"
    for m in kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].methods)


async def start_prefill_worker(config: EngineConfig, host: str, port: int, *,
                               advertise_address: str | None = None,
                               engine_factory: EngineFactory | None = None,
                               auth_token: str | None = None,
                               tiers: TierConfig | None = None,
                               kv_data_port: int | None = 0,
                               metrics: MetricsOptions | None = None) -> WorkerHandle:
    """Start a prefill worker; returns once the port is bound (`handle.ready`: loaded).

    advertise_address: the host:port decode workers pull KV from (default: the bind address).
    tiers: CPU/Redis prefix tiers (worker/tier_cache.py). kv_data_port: the KV data port on
    `host`; 0 picks a free one (decode workers learn it per pull), None serves none.
    metrics: serve /metrics (worker/metrics.py)."""
    if config.scheduler.role != "prefill":
        raise ValueError(f"a prefill worker needs role 'prefill', not {config.scheduler.role!r}")
    servicer: PrefillServicer | None = None
    kv_servicer = _LazyKvServicer()
    decode_servicer = DecodeServicer(pulls_kv=False)  # whole requests: no KV to pull
    tickets = LeaseTickets()  # decode workers' KV calls carry these, not the cluster's secret

    def register(server: grpc.aio.Server, bound: int) -> list[str]:
        nonlocal servicer
        servicer = PrefillServicer(advertised_address(host, bound, advertise_address), tickets)
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(kv_servicer, server)
        decode_pb2_grpc.add_DecodeServicer_to_server(decode_servicer, server)
        return [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
                kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name,
                decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name]

    async def on_loaded(engine: LLMEngine, handle: WorkerHandle) -> AsyncEngine:
        assert servicer is not None
        aengine = AsyncEngine(engine)
        servicer.tiers = attach_tiers(aengine, tiers)
        if servicer.tiers is not None:
            handle.on_stop.append(servicer.tiers.close)
        aengine.start()
        servicer.bind(aengine)
        decode_servicer.bind(aengine)
        source = EngineBlockSource(aengine)
        data_server = None
        if kv_data_port is not None:
            tls = tls_paths_from_env()
            data_server = KvDataServer(source, asyncio.get_running_loop(), host, kv_data_port,
                                       tls=tls.server_context() if tls else None)
            handle.on_stop.append(data_server.close)
        # A GPU engine's cache also goes out by CUDA IPC to decode workers on its GPU (not a
        # tensor-parallel one's: each rank holds a share of every block's heads).
        kv = engine.kv_access
        kv_servicer.bind(KvTransferServicer(source, kv_scales=kv.kv_scales,
                                            ipc_cache=kv.ipc_cache, data_server=data_server,
                                            tickets=tickets))
        return aengine

    def report() -> common_pb2.LoadReport | None:
        return None if servicer is None or servicer.aengine is None else report_now(servicer,
                                                                                   "prefill")

    return await start_worker_server(config, host, port, register, on_loaded,
                                     engine_factory=engine_factory, auth_token=auth_token,
                                     ticketed_methods=_KV_METHODS, metrics=metrics,
                                     report=report)


class _LazyKvServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """Answers UNAVAILABLE until the engine (and so the block source) exists."""

    def __init__(self) -> None:
        self._inner: KvTransferServicer | None = None

    def bind(self, inner: KvTransferServicer) -> None:
        self._inner = inner

    async def _ready(self, context: grpc.aio.ServicerContext) -> KvTransferServicer:
        if self._inner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        assert self._inner is not None
        return self._inner

    async def PullBlocks(self, request, context):  # type: ignore[no-untyped-def]
        inner = await self._ready(context)
        # A server span under the decode worker's `kv_pull` (traceparent in the metadata).
        fragments = payload = 0
        with tracing.server_span("splitserve.kv_serve", context, {
                "splitserve.request_id": request.request_id,
                "splitserve.kv.first_block": request.first_block}) as span:
            async for frag in inner.PullBlocks(request, context):
                fragments += 1
                payload += len(frag.data)
                yield frag
            span.set_attribute("splitserve.kv.fragments", fragments)
            span.set_attribute("splitserve.kv.bytes", payload)

    async def PullBlocksShm(self, request, context):  # type: ignore[no-untyped-def]
        inner = await self._ready(context)
        with _serve_span(request, context, "shm") as span:
            response = await inner.PullBlocksShm(request, context)
            span.set_attribute("splitserve.kv.bytes", request.shm_bytes)
            return response

    async def PullBlocksIpc(self, request, context):  # type: ignore[no-untyped-def]
        inner = await self._ready(context)
        with _serve_span(request, context, "cuda_ipc"):
            return await inner.PullBlocksIpc(request, context)

    async def PullBlocksTcp(self, request, context):  # type: ignore[no-untyped-def]
        inner = await self._ready(context)
        with _serve_span(request, context, "tcp") as span:
            response = await inner.PullBlocksTcp(request, context)
            span.set_attribute("splitserve.kv.bytes", response.num_blocks * inner.block_nbytes)
            return response

    async def Release(self, request, context):  # type: ignore[no-untyped-def]
        inner = await self._ready(context)
        return await inner.Release(request, context)


def _serve_span(request: Any, context: grpc.aio.ServicerContext,
                transport: str) -> AbstractContextManager[Span]:
    """The server span of one raw KV pull, under the decode worker's `kv_pull` (traceparent in
    the call's metadata)."""
    return tracing.server_span("splitserve.kv_serve", context, {
        "splitserve.request_id": request.request_id,
        "splitserve.kv.first_block": request.first_block,
        "splitserve.kv.transport": transport})
