"""Mutual TLS between the services (rpc/tls.py): a real CA and certificates made with the
`openssl` command, real gRPC servers on 127.0.0.1, and the whole stack under `splitserve up`."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer.connector import GrpcPullConnector
from kv_transfer.handle import LoadResult
from kv_transfer.pull_client import pull_all
from kv_transfer.raw_pulls import pull_blocks_tcp
from kv_transfer.servicer import KvTransferServicer
from kv_transfer.tcp import TcpTransferError, TcpUnavailable, receive_blocks
from protos.splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from rpc import tls
from tests.e2e.test_up import ROOT, _alive, _free_ports, complete_greedy
from tests.support.fake_block_source import CacheBlockSource
from tests.support.fake_lease import LeaseTable
from tests.support.pki import ca_and_leaf
from tests.unit.kv_transfer.test_kv_grpc_transport import (
    BLOCK_IDS,
    HASHES,
    NUM_TOKENS,
    DictSink,
    FakeClock,
    handle_for,
    make_cache,
    make_spec,
    start_worker,
)

SERVER_NAME = tls.DEFAULT_SERVER_NAME


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca_and_leaf(root / "cluster", SERVER_NAME)
    ca_and_leaf(root / "rogue", SERVER_NAME)  # the right name, from a CA nobody trusts
    return {"cluster": root / "cluster", "rogue": root / "rogue"}


def _tls_env(folder: Path) -> dict[str, str]:
    return {tls.TLS_CERT_ENV: str(folder / "leaf.pem"), tls.TLS_KEY_ENV: str(folder / "leaf.key"),
            tls.TLS_CA_ENV: str(folder / "ca.pem")}


def _use(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key in (tls.TLS_CERT_ENV, tls.TLS_KEY_ENV, tls.TLS_CA_ENV, tls.TLS_SERVER_NAME_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
async def tls_worker(pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
                     ) -> AsyncIterator[str]:
    """A prefill worker's KvTransfer service bound with mutual TLS; yields its address."""
    _use(monkeypatch, _tls_env(pki["cluster"]))
    spec = make_spec()
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    leases.grant("req-1", BLOCK_IDS, HASHES, NUM_TOKENS, clock() + 30.0)
    server = grpc.aio.server()
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(
        KvTransferServicer(CacheBlockSource(make_cache(spec), spec, leases)), server)
    port = tls.add_internal_port(server, "127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_kv_pull_over_mutual_tls_and_nothing_else(
        tls_worker: str, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cluster's certificates a KV pull works; a plaintext client, and a client whose
    certificate comes from another CA, do not get a single byte."""
    spec = make_spec()
    blocks = await pull_all(tls_worker, "req-1", spec, len(BLOCK_IDS), 10.0,
                            num_tokens_expected=NUM_TOKENS)
    assert [b.num_tokens for b in blocks] == [4, 4, 2]

    release = kv_transfer_pb2.ReleaseRequest(request_id="nobody")
    async with grpc.aio.insecure_channel(tls_worker) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv_transfer_pb2_grpc.KvTransferStub(plain).Release(release, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    _use(monkeypatch, _tls_env(pki["rogue"]))
    async with tls.internal_channel(tls_worker) as rogue:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv_transfer_pb2_grpc.KvTransferStub(rogue).Release(release, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_kv_data_port_over_mutual_tls_and_nothing_else(
        pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With TLS configured the data port speaks mutual TLS with the same certificates: the
    connector's pull comes by it, bit for bit; a plaintext client with a valid ticket, and a
    client whose certificate comes from another CA, do not get a single byte."""
    _use(monkeypatch, _tls_env(pki["cluster"]))
    paths = tls.tls_paths_from_env()
    assert paths is not None and paths.server_name == SERVER_NAME
    w = await start_worker(data_port=True, tls=paths.server_context())
    # start_worker binds its gRPC port in plaintext; the TLS under test is the data port's.
    for module in ("kv_transfer.pull_client", "rpc.channels"):
        monkeypatch.setattr(f"{module}.internal_channel",
                            lambda target, **kw: grpc.aio.insecure_channel(target, **kw))
    try:
        assert w.data is not None
        spec = w.source.spec
        w.grant()
        sink = DictSink(spec)
        connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=10,
                                      use_shm=False)
        connector.start_load_kv("a", handle_for(w), [0, 1, 4])
        assert await connector.wait_for_load("a") == LoadResult("a", True, transport="tcp")
        assert torch.equal(sink.cache[:, :, 4].view(torch.uint8),
                           w.source._kv_cache[:, :, BLOCK_IDS[2]].view(torch.uint8))

        staging = torch.empty(3 * spec.block_nbytes, dtype=torch.uint8)
        w.grant("req-2")
        pull = await pull_blocks_tcp(w.address, "req-2", spec, 3, 10)
        with pytest.raises(TcpTransferError):  # plaintext: the server's handshake fails
            await asyncio.to_thread(receive_blocks, "127.0.0.1", w.data.port, pull.tickets[0], 3,
                                    spec.block_nbytes, staging, lambda a, b: None, 10)
        # A client that trusts the cluster's CA but presents another CA's certificate: the
        # server refuses it (TLS 1.3 tells the client at its first read).
        rogue = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        rogue.load_cert_chain(pki["rogue"] / "leaf.pem", pki["rogue"] / "leaf.key")
        rogue.load_verify_locations(cafile=pki["cluster"] / "ca.pem")
        pull = await pull_blocks_tcp(w.address, "req-2", spec, 3, 10)
        with pytest.raises(TcpTransferError):
            await asyncio.to_thread(receive_blocks, "127.0.0.1", w.data.port, pull.tickets[0], 3,
                                    spec.block_nbytes, staging, lambda a, b: None, 10,
                                    rogue, SERVER_NAME)
        _use(monkeypatch, _tls_env(pki["rogue"]))  # and a client trusting only the rogue CA
        rogue_paths = tls.tls_paths_from_env()
        assert rogue_paths is not None
        pull = await pull_blocks_tcp(w.address, "req-2", spec, 3, 10)
        with pytest.raises(TcpUnavailable, match="TLS"):
            await asyncio.to_thread(receive_blocks, "127.0.0.1", w.data.port, pull.tickets[0], 3,
                                    spec.block_nbytes, staging, lambda a, b: None, 10,
                                    rogue_paths.client_context(), rogue_paths.server_name)
        # Nothing above was served: the cluster's client still gets req-2 with a fresh ticket.
        _use(monkeypatch, _tls_env(pki["cluster"]))
        pull = await pull_blocks_tcp(w.address, "req-2", spec, 3, 10)
        await asyncio.to_thread(receive_blocks, "127.0.0.1", w.data.port, pull.tickets[0], 3,
                                spec.block_nbytes, staging, lambda a, b: None, 10,
                                paths.client_context(), SERVER_NAME)
        assert torch.equal(staging[:spec.block_nbytes],
                           w.source._kv_cache[:, :, BLOCK_IDS[0]].contiguous()
                           .view(torch.uint8).reshape(-1))
    finally:
        await w.stop()


def test_tls_configuration_errors_name_the_variable(
        pki: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, {})
    assert tls.tls_from_env() is None
    env = _tls_env(pki["cluster"])
    _use(monkeypatch, {tls.TLS_CERT_ENV: env[tls.TLS_CERT_ENV]})
    with pytest.raises(tls.TlsConfigError, match=f"missing: {tls.TLS_KEY_ENV}, {tls.TLS_CA_ENV}"):
        tls.tls_from_env()
    (tmp_path / "not.pem").write_text("hello")
    _use(monkeypatch, {**env, tls.TLS_CA_ENV: str(tmp_path / "not.pem")})
    with pytest.raises(tls.TlsConfigError, match=f"{tls.TLS_CA_ENV}: .* is not a PEM file"):
        tls.tls_from_env()
    _use(monkeypatch, {**env, tls.TLS_KEY_ENV: str(tmp_path / "absent.key")})
    with pytest.raises(tls.TlsConfigError, match=f"{tls.TLS_KEY_ENV}: cannot read"):
        tls.tls_from_env()
    _use(monkeypatch, {**env, tls.TLS_SERVER_NAME_ENV: "workers.internal"})
    files = tls.tls_from_env()
    assert files is not None and files.server_name == "workers.internal"


@pytest.mark.timeout(400)
def test_the_whole_stack_over_mutual_tls(pki: dict[str, Path], tmp_path: Path) -> None:
    """`splitserve up` with the cluster's certificates: the gateway reaches the workers and the
    decode worker pulls the prompt's KV from the prefill worker, all over mutual TLS; a
    plaintext call to a worker fails."""
    rest, grpc_port, prefill, decode = _free_ports(4)
    env = {**os.environ, **_tls_env(pki["cluster"])}
    cmd = [sys.executable, "-m", "splitserve", "up", "--port", str(rest), "--grpc-port",
           str(grpc_port), "--prefill-port", str(prefill), "--decode-port", str(decode),
           "--log-dir", str(tmp_path / "logs"), "--max-model-len", "1024"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    marker = f"--port {prefill}"
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "ready" in line or "exited" in line:
                break
        assert any("ready" in ln for ln in lines), "".join(lines)
        assert complete_greedy(rest)["usage"]["completion_tokens"] == 4
        decode_log = (tmp_path / "logs" / "decode.log").read_text()
        assert "KV from 127.0.0.1:" in decode_log  # the prompt's KV came from the prefill worker
        # The exec probe for TLS workers: SERVING with the certificates, refused without.
        probe = [sys.executable, "-m", "splitserve", "health", "--address",
                 f"127.0.0.1:{prefill}"]
        ok = subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
        plain_env = {k: v for k, v in env.items() if not k.startswith("SPLITSERVE_TLS_")}
        refused = subprocess.run(probe, cwd=ROOT, env=plain_env, capture_output=True, text=True,
                                 timeout=60)
        assert (refused.returncode, refused.stdout.strip()) == (1, "UNAVAILABLE")
        with grpc.insecure_channel(f"127.0.0.1:{prefill}") as plain, \
                pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        deadline = time.monotonic() + 30
        while _alive(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in _alive(marker):
            os.kill(int(pid), signal.SIGKILL)


async def test_health_probe_reads_the_status_over_tls(
        pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from grpc_health.v1 import health

    from splitserve.health import check

    _use(monkeypatch, _tls_env(pki["cluster"]))
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = tls.add_internal_port(server, "127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await check(address) == "NOT_SERVING"
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await check(address) == "SERVING"
        assert await check(address, service="no.such.Service") == "NOT_FOUND"
        _use(monkeypatch, {})
        assert await check(address, timeout_s=2) == "UNAVAILABLE"
    finally:
        await server.stop(None)
