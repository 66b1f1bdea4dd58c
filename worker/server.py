"""gRPC worker bootstrap shared by the prefill and decode services: one engine, the services'
servicers, health, reflection, the cluster's credential and graceful shutdown.

Health says NOT_SERVING until the engine is loaded (loading runs in a thread so the server
answers probes meanwhile) and flips back to NOT_SERVING when shutdown starts; `server.stop(grace)`
then refuses new calls and lets in-flight ones finish. Each service (prefill_service/server.py,
decode_service/server.py) says which servicers it registers and what it wires up once the
engine is loaded; this module owns neither an entry point nor a role of its own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from rpc.auth import INTERNAL_TOKEN_ENV, BearerAuthInterceptor
from rpc.health import HealthServicer
from rpc.limits import message_size_options
from rpc.servers import SERVER_OPTIONS
from rpc.tls import add_internal_port
from rpc.request_decoding import DecodeErrorInterceptor

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], LLMEngine]
# What a service registers on the server, given the port it was bound to: it adds its servicers
# and returns their full names (for health and reflection).
Register = Callable[[grpc.aio.Server, int], list[str]]
# What a service does once the engine is loaded: wrap it (KV loaders, tiers), bind its
# servicers, open its data ports. Returns the started AsyncEngine.
OnLoaded = Callable[[LLMEngine, "WorkerHandle"], Awaitable[AsyncEngine]]


@dataclass
class WorkerHandle:
    """A started worker: its gRPC server and, once loaded, its engine. `stop` undoes it all."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    services: list[str]
    aengine: AsyncEngine | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    load_task: asyncio.Future[None] | None = None
    # Run in order after the server and the engine stopped (data ports, kept channels).
    on_stop: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)

    async def stop(self, grace_s: float = 10.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.aengine is not None:
            await self.aengine.stop()
        for close in self.on_stop:
            result = close()
            if asyncio.iscoroutine(result):
                await result


async def start_worker_server(config: EngineConfig, host: str, port: int, register: Register,
                              on_loaded: OnLoaded, *,
                              engine_factory: EngineFactory | None = None,
                              auth_token: str | None = None,
                              ticketed_methods: Collection[str] = ()) -> WorkerHandle:
    """Bind `host:port` (mutual TLS when configured), register the service's servicers, start
    serving NOT_SERVING, and load the engine in the background; `handle.ready` is set once
    `on_loaded` returned and health says SERVING.

    auth_token: the cluster's shared secret (rpc/auth.py). With it, every call but a health
    check must carry it, or (`ticketed_methods`: the KvTransfer service's) a lease ticket that
    the servicer checks."""
    opts = [*message_size_options(), *SERVER_OPTIONS]
    # Undecodable request bytes: INVALID_ARGUMENT (rpc/request_decoding.py), after the credential.
    interceptors: list[grpc.aio.ServerInterceptor] = [
        *([] if auth_token is None
          else [BearerAuthInterceptor(auth_token, INTERNAL_TOKEN_ENV,
                                      ticketed_methods=ticketed_methods)]),
        DecodeErrorInterceptor()]
    server = grpc.aio.server(options=opts, interceptors=interceptors)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_internal_port(server, f"{host}:{port}")  # mutual TLS; PortBindError if taken
    services = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME, *register(server, bound)]
    reflection.enable_server_reflection(services, server)
    handle = WorkerHandle(server, bound, health_servicer, services)
    for name in ["", *services]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    role = config.scheduler.role
    logger.info("%s worker listening on %s:%d", role, host, bound)

    async def load() -> None:
        factory = engine_factory or (lambda c: LLMEngine(c, detokenize=False))
        try:
            engine = await asyncio.to_thread(factory, config)
        except Exception:
            logger.exception("engine failed to load")
            raise
        handle.aengine = await on_loaded(engine, handle)
        for name in ["", *services]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        handle.ready.set()
        logger.info("%s worker serving (engine %s)", role, engine.info.device)

    handle.load_task = asyncio.ensure_future(load())
    return handle


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """The host:port other workers reach this one at: `advertise` when given, else the bind
    address (loopback for a wildcard bind)."""
    return advertise or f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


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
