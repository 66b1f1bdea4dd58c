"""The decode worker's server: `splitserve.v1.Decode` on one gRPC port, for the decode role (KV
pulled from prefill workers over the transports allowed) and the colocated role (prefill and
decode in one engine), either with CPU/Redis prefix tiers under its cache when configured."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kv_transfer import DEFAULT_TCP_STREAMS
from kv_transfer.peers import KvPeers
from protos.splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from worker.decode_servicer import DecodeServicer
from worker.kv import GrpcKvLoader
from worker.metrics import report_now
from worker.server import EngineFactory, MetricsOptions, WorkerHandle, start_worker_server
from worker.tier_cache import TierConfig, attach_tiers

DEFAULT_PORT = 50062
KV_TRANSPORTS = ("ipc", "tcp", "shm", "stream")


async def start_decode_worker(config: EngineConfig, host: str, port: int, *,
                              engine_factory: EngineFactory | None = None,
                              auth_token: str | None = None,
                              tiers: TierConfig | None = None,
                              kv_transports: Sequence[str] = KV_TRANSPORTS,
                              kv_tcp_streams: int = DEFAULT_TCP_STREAMS,
                              kv_peers: KvPeers | None = None,
                              metrics: MetricsOptions | None = None) -> WorkerHandle:
    """Start a decode (or colocated) worker; returns once the port is bound (`handle.ready`:
    loaded).

    auth_token: what calls to this worker must carry (its KV pulls and lease releases carry
    each lease's own ticket instead). tiers: CPU/Redis prefix tiers (worker/tier_cache.py; a
    decode worker plans from them for requests without KV and saves the blocks its outputs
    filled). kv_transports: how a decode
    worker may pull KV ("ipc", "tcp", "shm"; the gRPC stream always). kv_tcp_streams:
    connections one data-port pull opens. kv_peers: the only addresses a KV handle may name
    (kv_transfer/peers.py; None: any). metrics: serve /metrics (worker/metrics.py)."""
    role = config.scheduler.role
    if role not in ("decode", "colocated"):
        raise ValueError(f"a decode worker needs role 'decode' or 'colocated', not {role!r}")
    # This worker's own KV calls (pulls, releases) go to the address each handle names: they
    # carry the lease's ticket from the handle, never the cluster's secret (rpc/auth.py).
    kv_metadata: tuple[tuple[str, str], ...] = ()
    servicer = DecodeServicer(kv_metadata=kv_metadata, kv_peers=kv_peers)

    def register(server: grpc.aio.Server, bound: int) -> list[str]:
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        return [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name]

    async def on_loaded(engine: LLMEngine, handle: WorkerHandle) -> AsyncEngine:
        if role == "decode":
            # A tensor-parallel engine's cache is split over its ranks: its KV comes by the data
            # port, shared memory or the stream, not into one cache through an IPC handle.
            loader = GrpcKvLoader(engine, kv_metadata=kv_metadata,
                                  use_ipc=("ipc" in kv_transports
                                           and not engine.kv_access.tensor_parallel),
                                  use_shm="shm" in kv_transports,
                                  use_tcp="tcp" in kv_transports, tcp_streams=kv_tcp_streams)
            handle.on_stop.append(loader.aclose)  # its kept channels to the prefill workers
            aengine = AsyncEngine(engine, kv_loader=loader)
            servicer.tiers = attach_tiers(aengine, tiers, pull=loader)
        else:
            aengine = AsyncEngine(engine)
            servicer.tiers = attach_tiers(aengine, tiers)
        if servicer.tiers is not None:
            handle.on_stop.append(servicer.tiers.close)
        aengine.start()
        servicer.bind(aengine)
        # Its step cost for the gateway's speculation policy, measured while it is idle: the
        # worker is ready at once (the policy has a fallback until the numbers come).
        task = asyncio.create_task(aengine.calibrate_speculation(),
                                   name="speculation-calibration")
        handle.calibration = task

        def stop_calibration() -> None:
            task.cancel()

        handle.on_stop.insert(0, stop_calibration)
        return aengine

    def report() -> common_pb2.LoadReport | None:
        return None if servicer.aengine is None else report_now(servicer, role)

    handle = await start_worker_server(config, host, port, register, on_loaded,
                                       engine_factory=engine_factory, auth_token=auth_token,
                                       metrics=metrics, report=report)
    handle.servicer = servicer
    return handle
