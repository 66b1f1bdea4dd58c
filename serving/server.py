"""gRPC worker bootstrap: one engine, its servicers, health, reflection, graceful shutdown.

Health says NOT_SERVING until the engine is loaded (loading runs in a thread so the server
answers probes meanwhile) and flips back to NOT_SERVING when shutdown starts; `server.stop(grace)`
then refuses new calls and lets in-flight ones finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Span

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kv_transfer import DEFAULT_TCP_STREAMS
from kv_transfer.grpc_transport import KvTransferServicer
from kv_transfer.tcp import KvDataServer
from protos.auth import INTERNAL_TOKEN_ENV, BearerAuthInterceptor, bearer_metadata
from protos.limits import message_size_options
from protos.splitserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from protos.tls import add_internal_port, tls_paths_from_env
from serving import tracing
from serving.tier_cache import TierConfig, TierPrefixCache

logger = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    aengine: AsyncEngine | None = None
    ready: asyncio.Event | None = None
    load_task: asyncio.Future[None] | None = None
    kv_data: KvDataServer | None = None  # a prefill worker's KV data port, once loaded

    async def stop(self, grace_s: float = 10.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.kv_data is not None:
            self.kv_data.close()
        if self.aengine is not None:
            await self.aengine.stop()
            from serving.kv import GrpcKvLoader  # as in `load` below

            loader = self.aengine.kv_loader
            if isinstance(loader, GrpcKvLoader):
                await loader.aclose()  # its kept channels to the prefill workers


async def start_worker(config: EngineConfig, host: str, port: int,
                       advertise_address: str | None = None,
                       engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
                       auth_token: str | None = None,
                       tiers: TierConfig | None = None,
                       kv_transports: Sequence[str] = ("ipc", "tcp", "shm", "stream"),
                       kv_data_port: int | None = 0,
                       kv_tcp_streams: int = DEFAULT_TCP_STREAMS,
                       ) -> WorkerHandle:
    """Start a worker for `config.scheduler.role`; returns once the port is bound. The engine
    loads in the background; `handle.ready` is set when it serves.

    auth_token: the cluster's shared secret (protos/auth.py). With it, every call but a health
    check must carry it, and a decode worker sends it with its KV pulls.
    tiers: a prefill or colocated worker's CPU/Redis prefix tiers (serving/tier_cache.py);
    ignored by the decode role. kv_transports: how a decode worker may pull KV ("ipc", "tcp",
    "shm"; the gRPC stream always). kv_data_port: a prefill worker's KV data port
    (kv_transfer/tcp.py) on `host`; 0 picks a free one (decode workers learn it per pull),
    None serves none. kv_tcp_streams: connections a decode worker's data-port pull opens."""
    from decode_service.servicer import DecodeServicer
    from prefill_service.servicer import PrefillServicer

    role = config.scheduler.role
    opts = [*message_size_options(), ("grpc.so_reuseport", 0)]
    interceptors = (None if auth_token is None
                    else [BearerAuthInterceptor(auth_token, INTERNAL_TOKEN_ENV)])
    server = grpc.aio.server(options=opts, interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME]
    bound = add_internal_port(server, f"{host}:{port}")  # mutual TLS when configured
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    handle = WorkerHandle(server, bound, health_servicer, ready=asyncio.Event())
    address = advertise_address or f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{bound}"

    prefill = PrefillServicer(address)
    kv_metadata = bearer_metadata(auth_token)  # what this worker's own KV calls carry
    decode = DecodeServicer(kv_metadata=kv_metadata)
    if role == "prefill":
        prefill_pb2_grpc.add_PrefillServicer_to_server(prefill, server)
        services.append(prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
        kv_servicer = _LazyKvServicer()
        kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(kv_servicer, server)
        services.append(kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name)
    else:  # decode or colocated: Decode computes locally when no KV handle is given
        decode_pb2_grpc.add_DecodeServicer_to_server(decode, server)
        services.append(decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name)
    reflection.enable_server_reflection(services, server)
    for name in ["", *services]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    logger.info("%s worker listening on %s:%d", role, host, bound)

    async def load() -> None:
        from serving.kv import EngineBlockSource, GrpcKvLoader, kv_scales

        factory = engine_factory or (lambda c: LLMEngine(c, detokenize=False))
        try:
            engine = await asyncio.to_thread(factory, config)
        except Exception:
            logger.exception("engine failed to load")
            raise
        # A tensor-parallel engine's cache is split over its ranks: its KV comes by the data
        # port, shared memory or the stream, not into one cache through an IPC handle.
        loader = (GrpcKvLoader(engine, kv_metadata=kv_metadata,
                               use_ipc="ipc" in kv_transports and engine.runner.tp is None, use_shm="shm" in kv_transports,
                               use_tcp="tcp" in kv_transports, tcp_streams=kv_tcp_streams)
                  if role == "decode" else None)
        aengine = AsyncEngine(engine, kv_loader=loader)
        if role in ("prefill", "colocated") and tiers is not None and tiers.enabled:
            cache = TierPrefixCache.from_config(aengine, tiers)
            aengine.kv_loader = cache.load
            if role == "prefill":
                prefill.tiers = cache
            else:
                decode.tiers = cache
        aengine.start()
        handle.aengine = aengine
        prefill.bind(aengine)
        decode.bind(aengine)
        if role == "prefill":
            source = EngineBlockSource(aengine)
            if kv_data_port is not None:
                tls = tls_paths_from_env()
                handle.kv_data = KvDataServer(source, asyncio.get_running_loop(), host,
                                              kv_data_port,
                                              tls=tls.server_context() if tls else None)
            # A GPU engine's cache also goes out by CUDA IPC to decode workers on its GPU
            # (not a tensor-parallel one's: each rank holds a share of every block's heads).
            ipc = engine.runner.kv_cache if engine.runner.tp is None else None
            kv_servicer.bind(KvTransferServicer(source, kv_scales=kv_scales(engine),
                                                ipc_cache=ipc,
                                                data_server=handle.kv_data))
        for name in ["", *services]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        assert handle.ready is not None
        handle.ready.set()
        logger.info("%s worker serving (engine %s)", role, engine.info.device)

    handle.load_task = asyncio.ensure_future(load())
    return handle


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


async def run_until_signal(stop: Callable[[], object], grace_s: float = 10.0,
                           watch: asyncio.Future[None] | None = None) -> None:
    """Block until SIGINT/SIGTERM, then call `stop` (an async function). If `watch` (the engine
    load) fails first, stop and re-raise: a worker that cannot load must exit, not linger
    NOT_SERVING until its orchestrator's start-up window runs out."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    waiter = asyncio.ensure_future(done.wait())
    pending = {waiter} | ({watch} if watch is not None else set())
    finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    failed = watch is not None and watch in finished and watch.exception() is not None
    if watch is not None and watch in finished and not failed:
        await waiter  # loaded fine: keep serving until a signal
    logger.info("shutting down (grace %.0fs)", grace_s)
    result = stop()
    if asyncio.iscoroutine(result):
        await result
    if failed:
        assert watch is not None
        raise RuntimeError("engine failed to load") from watch.exception()

