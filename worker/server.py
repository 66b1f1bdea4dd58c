"""gRPC worker bootstrap shared by the prefill and decode services: one engine, the services'
servicers, health, reflection, the cluster's credential, `/metrics` and draining.

Health says NOT_SERVING until the engine is loaded (loading runs in a thread so the server
answers probes meanwhile) and flips back to NOT_SERVING when draining starts (SIGTERM:
`WorkerHandle.drain`): new calls are refused with UNAVAILABLE (worker/drain.py), calls in
progress finish and leases are pulled or expire, bounded by the drain timeout; then
`server.stop(grace)` and the engine stops. Each service (prefill_service/server.py,
decode_service/server.py) says which servicers it registers and what it wires up once the
engine is loaded; this module owns neither an entry point nor a role of its own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protos.splitserve.v1 import common_pb2
from rpc.auth import INTERNAL_TOKEN_ENV, BearerAuthInterceptor
from rpc.health import HealthServicer
from rpc.limits import message_size_options
from rpc.request_decoding import DecodeErrorInterceptor
from rpc.servers import SERVER_OPTIONS
from rpc.tls import add_internal_port
from worker.drain import DEFAULT_DRAIN_TIMEOUT_S, DrainGate, wait_drained
from worker.metrics import MetricsServer, WorkerCollector

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], LLMEngine]
# What a service registers on the server, given the port it was bound to: it adds its servicers
# and returns their full names (for health and reflection).
Register = Callable[[grpc.aio.Server, int], list[str]]
# What a service does once the engine is loaded: wrap it (KV loaders, tiers), bind its
# servicers, open its data ports. Returns the started AsyncEngine.
OnLoaded = Callable[[LLMEngine, "WorkerHandle"], Awaitable[AsyncEngine]]
# The worker's load report now (None while its engine loads), for /metrics.
ReportNow = Callable[[], common_pb2.LoadReport | None]


@dataclass(frozen=True, slots=True)
class MetricsOptions:
    """Where a worker serves /metrics (port 0: a free one) and its `model_name` label."""

    host: str
    port: int
    model_name: str


@dataclass
class WorkerHandle:
    """A started worker: its gRPC server and, once loaded, its engine. `stop` undoes it all."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    services: list[str]
    gate: DrainGate
    aengine: AsyncEngine | None = None
    metrics: MetricsServer | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    load_task: asyncio.Future[None] | None = None
    # A decode worker's speculation step-cost calibration, run while idle (its steps run).
    calibration: asyncio.Task[int] | None = None
    # Run in order after the server and the engine stopped (data ports, kept channels).
    on_stop: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)
    # The role's servicer (its counters and settings, for probes and tests).
    servicer: object | None = None

    async def drain(self, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """Scale-in (SIGTERM): health NOT_SERVING and new calls refused at once, then wait (at
        most `timeout_s`) for the calls in progress to end and the leases to be pulled or to
        expire, then `stop`."""
        self.gate.draining = True
        await self.health.enter_graceful_shutdown()
        started = time.monotonic()
        logger.info("draining: %d calls in progress, %d leases", self.gate.active,
                    self._num_leases())
        drained = await wait_drained(self.gate, self._num_leases, timeout_s)
        took = time.monotonic() - started
        if drained:
            logger.info("drained in %.1fs", took)
        else:
            logger.warning("drain timeout (%.0fs): cutting off %d calls, %d leases", timeout_s,
                           self.gate.active, self._num_leases())
        await self.stop(grace_s=1.0)

    def _num_leases(self) -> int:
        return 0 if self.aengine is None else self.aengine.stats().num_leases

    async def stop(self, grace_s: float = 10.0) -> None:
        self.gate.draining = True
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
                              ticketed_methods: Collection[str] = (),
                              metrics: MetricsOptions | None = None,
                              report: ReportNow | None = None) -> WorkerHandle:
    """Bind `host:port` (mutual TLS when configured), register the service's servicers, start
    serving NOT_SERVING, and load the engine in the background; `handle.ready` is set once
    `on_loaded` returned and health says SERVING.

    auth_token: the cluster's shared secret (rpc/auth.py). With it, every call but a health
    check must carry it, or (`ticketed_methods`: the KvTransfer service's) a lease ticket that
    the servicer checks. metrics: serve /metrics (worker/metrics.py) from `report`."""
    opts = [*message_size_options(), *SERVER_OPTIONS]
    gate = DrainGate()
    # Authentication first: a call without the credential is refused as such, draining or not;
    # then the drain gate; undecodable request bytes are INVALID_ARGUMENT
    # (rpc/request_decoding.py).
    interceptors: list[grpc.aio.ServerInterceptor] = [gate, DecodeErrorInterceptor()]
    if auth_token is not None:
        interceptors.insert(0, BearerAuthInterceptor(auth_token, INTERNAL_TOKEN_ENV,
                                                      ticketed_methods=ticketed_methods))
    server = grpc.aio.server(options=opts, interceptors=interceptors)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_internal_port(server, f"{host}:{port}")  # mutual TLS; PortBindError if taken
    services = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME, *register(server, bound)]
    reflection.enable_server_reflection(services, server)
    handle = WorkerHandle(server, bound, health_servicer, services, gate)
    for name in ["", *services]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    role = config.scheduler.role
    if metrics is not None:
        collector = WorkerCollector(report or (lambda: None), gate, metrics.model_name, role,
                                    asyncio.get_running_loop())
        handle.metrics = MetricsServer(collector, metrics.host, metrics.port)
        handle.on_stop.append(handle.metrics.close)
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
