"""Worker discovery and health in the gateway's pools, against a real DNS server (dnsmasq) and
real gRPC peers on distinct loopback addresses sharing one port (as pods behind a headless
Service): DNS names become pool members, members that leave DNS leave routing, a new one enters
only once its health check says SERVING, and late load polls alone take no worker out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig, GatewayConfigError
from gateway.discovery import DiscoveryError, DnsTarget, PoolDiscovery, parse_dns_target
from gateway.router import WorkerPool
from gateway.worker_health import HealthPolicy
from protos.splitserve.v1 import common_pb2, decode_pb2_grpc
from tests.support.dnsmasq import DOMAIN, Dnsmasq, free_udp_port

NAME = f"decode.{DOMAIN}"


def test_dns_targets_parse_as_grpc_writes_them() -> None:
    assert parse_dns_target("dns:decode:50062") == DnsTarget("decode", 50062)
    assert parse_dns_target("dns:///decode.ns.svc:50062") == DnsTarget("decode.ns.svc", 50062)
    assert parse_dns_target("dns://10.0.0.10/decode:1") == DnsTarget("decode", 1,
                                                                     ("10.0.0.10", 53))
    assert parse_dns_target("dns://127.0.0.1:5353/d:2").server == ("127.0.0.1", 5353)
    assert parse_dns_target("dns://[::1]:5353/d:2").server == ("::1", 5353)
    for bad in ("dns:decode", "dns:decode:0", "dns://resolver.local/decode:1", "dns:a/b:1",
                "dns:decode:99999"):
        with pytest.raises(DiscoveryError):
            parse_dns_target(bad)
    GatewayConfig(decode_addresses=("dns:decode:50062", "10.0.0.1:50062"), colocated=True)
    for bad in ("dns:decode", "decode"):
        with pytest.raises(GatewayConfigError, match="decode_addresses"):
            GatewayConfig(decode_addresses=(bad,), colocated=True)


class _Peer:
    """A decode peer: a real health service and `Decode.GetLoad`, answering after `delay_s`."""

    def __init__(self, host: str, port: int) -> None:
        self.address = f"{host}:{port}"
        self.delay_s = 0.0
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        get_load = grpc.unary_unary_rpc_method_handler(
            self.get_load, request_deserializer=common_pb2.LoadRequest.FromString,
            response_serializer=common_pb2.LoadReport.SerializeToString)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "splitserve.v1.Decode", {"GetLoad": get_load})])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        assert self.server.add_insecure_port(self.address) == port

    async def get_load(self, request: common_pb2.LoadRequest,
                       context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        await asyncio.sleep(self.delay_s)
        return common_pb2.LoadReport(role="decode")

    async def start(self, serving: bool = True) -> None:
        await self.set_serving(serving)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        await self.health.set("", status.SERVING if serving else status.NOT_SERVING)


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path, ttl_s=2)
    yield server
    server.stop()


def _healthy(pool: WorkerPool) -> list[str]:
    return sorted(w.address for w in pool.workers if w.healthy)


async def test_pool_follows_dns_and_admits_only_serving_workers(dnsmasq: Dnsmasq) -> None:
    port = free_udp_port("127.0.0.2")
    peers = [_Peer(f"127.0.0.{i}", port) for i in (2, 3, 4)]
    for peer in peers[:2]:
        await peer.start()
    await peers[2].start(serving=False)  # loading
    a, b, c = (p.address for p in peers)
    dnsmasq.start({NAME: ["127.0.0.2", "127.0.0.3"]})
    pool = WorkerPool("decode", [f"dns://{dnsmasq.server}/{NAME}:{port}"], poll_interval_s=60,
                      discovery_interval_s=60)
    try:
        await pool.start()
        assert _healthy(pool) == [a, b]
        # The answer's TTL (2 s) is shorter than the interval: the next lookup comes sooner.
        assert await pool._discovery.refresh() == 2.0

        dnsmasq.set_records({NAME: ["127.0.0.3", "127.0.0.4"]})
        await pool._discovery.refresh()
        assert sorted(w.address for w in pool.workers) == [b, c]
        assert [w.address for w in pool.leaving] == [a]
        await pool.poll_once()
        assert pool.leaving == []  # no call was on it: its channel is closed
        assert _healthy(pool) == [b]  # c is listed but its health check says NOT_SERVING
        assert pool.pick().address == b

        await peers[2].set_serving(True)
        await pool.poll_once()
        assert _healthy(pool) == [b, c]

        dnsmasq.stop()  # no answer: the pool keeps its members
        await pool._discovery.refresh()
        assert sorted(w.address for w in pool.workers) == [b, c]
    finally:
        await pool.close()
        for peer in peers:
            await peer.server.stop(0)


async def test_a_worker_leaving_dns_keeps_its_calls_in_flight(dnsmasq: Dnsmasq) -> None:
    port = free_udp_port("127.0.0.2")
    peers = [_Peer(f"127.0.0.{i}", port) for i in (2, 3)]
    for peer in peers:
        await peer.start()
    dnsmasq.start({NAME: ["127.0.0.2", "127.0.0.3"]})
    pool = WorkerPool("decode", [f"dns://{dnsmasq.server}/{NAME}:{port}"], poll_interval_s=60,
                      discovery_interval_s=60)
    try:
        await pool.start()
        busy = next(w for w in pool.workers if w.address == peers[0].address)
        busy.in_flight += 1  # a call of this gateway is on it
        dnsmasq.set_records({NAME: ["127.0.0.3"]})
        await pool._discovery.refresh()
        assert pool.leaving == [busy] and not busy.healthy
        assert all(pool.pick().address == peers[1].address for _ in range(4))
        await pool.poll_once()
        assert pool.leaving == [busy]  # still in use: its channel stays open
        reply = await decode_pb2_grpc.DecodeStub(busy.channel).GetLoad(
            common_pb2.LoadRequest(), timeout=5)
        assert reply.role == "decode"
        pool.done(busy)
        await pool.poll_once()
        assert pool.leaving == []
    finally:
        await pool.close()
        for peer in peers:
            await peer.server.stop(0)


async def test_late_load_polls_do_not_take_a_live_worker_out() -> None:
    """Issue 44 item 3: a busy host answers `GetLoad` late; the worker stays in routing while
    its health check says SERVING, and leaves at once when it says NOT_SERVING."""
    peer = _Peer("127.0.0.1", free_udp_port())
    await peer.start()
    pool = WorkerPool("decode", [peer.address], poll_interval_s=60, poll_timeout_s=0.05,
                      health=HealthPolicy(max_missed_polls=3, liveness_timeout_s=2.0))
    try:
        await pool.start()
        worker = pool.workers[0]
        assert worker.healthy
        peer.delay_s = 0.5  # every poll misses its deadline
        for missed in range(1, 6):
            await pool.poll_once()
            assert worker.missed_polls == missed and worker.healthy, missed
        await peer.set_serving(False)  # draining
        started = time.monotonic()
        await pool.poll_once()
        assert not worker.healthy and time.monotonic() - started < 2.0
        peer.delay_s = 0.0
        await pool.poll_once()
        assert not worker.healthy  # NOT_SERVING: not admitted back
        await peer.set_serving(True)
        await pool.poll_once()
        assert worker.healthy and worker.missed_polls == 0
    finally:
        await pool.close()
        await peer.server.stop(0)


async def test_discovery_without_dns_entries_is_static() -> None:
    seen: list[list[str]] = []
    discovery = PoolDiscovery(["10.0.0.1:1", "10.0.0.2:1"], seen.append, interval_s=1.0)
    assert not discovery.dynamic and discovery.initial_members() == ["10.0.0.1:1", "10.0.0.2:1"]
    await discovery.start()
    assert seen == []  # nothing to look up, no task
    await discovery.close()
