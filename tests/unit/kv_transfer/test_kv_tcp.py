"""The KV data port (kv_transfer/tcp.py): tickets over a real grpc.aio server on 127.0.0.1,
blocks raw over a real TCP connection, into a real cache tensor."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import kv_transfer.pull_ways as pull_ways_module
import kv_transfer.tcp as tcp_module
from kv_transfer import MAX_TCP_STREAMS
from kv_transfer.connector import GrpcPullConnector
from kv_transfer.handle import LoadResult
from kv_transfer.protocol import KvTransferError
from kv_transfer.raw_pulls import pull_blocks_tcp
from kv_transfer.tcp import (
    TICKET_BYTES,
    KvDataServer,
    TcpTransferError,
    TcpUnavailable,
    receive_blocks,
    stripes,
)
from tests.unit.kv_transfer.test_kv_grpc_transport import (
    BLOCK_IDS,
    HASHES,
    NUM_TOKENS,
    TIMEOUT_S,
    DictSink,
    Worker,
    handle_for,
    make_spec,
    spy_reads,
    start_worker,
)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await start_worker(data_port=True)
    yield w
    await w.stop()


def _cache_block(worker: Worker, block_id: int) -> torch.Tensor:
    return worker.source._kv_cache[:, :, block_id].view(torch.uint8)


async def _receive(worker: Worker, ticket: bytes, num_blocks: int,
                   batch_blocks: int = 2) -> list[torch.Tensor]:
    """The raw blocks a ticket brings, each as [num_layers, 2, bs, Hkv, D] uint8."""
    spec = worker.source.spec
    staging = torch.empty(batch_blocks * spec.block_nbytes, dtype=torch.uint8)
    got: list[torch.Tensor] = []

    def on_batch(first: int, count: int) -> None:
        assert first == len(got)
        raw = staging[:count * spec.block_nbytes].clone()
        got.extend(raw.view(count, *spec.shape[:-1], -1).unbind(0))

    assert worker.data is not None
    await asyncio.to_thread(receive_blocks, "127.0.0.1", worker.data.port, ticket, num_blocks,
                            spec.block_nbytes, staging, on_batch, TIMEOUT_S)
    return got


def test_stripes_split_blocks_into_contiguous_shares() -> None:
    assert stripes(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert stripes(2, 4) == [(0, 1), (1, 1)]  # never an empty stripe
    assert stripes(5, 0) == [(0, 5)]
    assert len(stripes(100, 99)) == MAX_TCP_STREAMS
    for n, k in ((1, 1), (7, 2), (64, 8), (65, 8)):
        parts = stripes(n, k)
        assert sum(c for _, c in parts) == n and all(c > 0 for _, c in parts)
        assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(parts))


@pytest.mark.parametrize(("first_block", "streams"), [(0, 1), (1, 1), (0, 3), (1, 2)])
async def test_connector_pulls_over_tcp_bit_for_bit_and_releases(
        worker: Worker, first_block: int, streams: int) -> None:
    """Batches of 2 blocks (the last one partial in tokens, full in bytes) land at the local
    ids, over one connection or a stripe per connection; a puller already holding the first
    block asks only for the rest."""
    lease = worker.grant()
    spec = worker.source.spec
    sink = DictSink(spec)
    connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=TIMEOUT_S,
                                  use_shm=False, tcp_streams=streams)
    connector._ways.staging = pull_ways_module.StagingPool(2 * spec.block_nbytes, pinned=False)
    local_ids = [0, 1, 4][first_block:]
    await asyncio.to_thread(connector.start_load_kv, "local-1", handle_for(worker), local_ids,
                            first_block)
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", True, transport="tcp")
    for local_id, remote_id in zip(local_ids, BLOCK_IDS[first_block:], strict=True):
        assert torch.equal(sink.cache[:, :, local_id].view(torch.uint8),
                           _cache_block(worker, remote_id))
    assert torch.count_nonzero(sink.cache[:, :, [2, 3]].view(torch.uint8)) == 0
    assert worker.released == [lease]
    assert worker.address not in connector._no_tcp


async def test_a_ticket_opens_one_connection_for_its_own_blocks(worker: Worker) -> None:
    worker.grant()
    spec = worker.source.spec
    pull = await pull_blocks_tcp(worker.address, "req-1", spec, len(BLOCK_IDS), TIMEOUT_S,
                                 first_block=1)
    assert (pull.num_tokens, pull.block_hashes, pull.kv_scales) == (NUM_TOKENS, HASHES, None)
    blocks = await _receive(worker, pull.tickets[0], 2, batch_blocks=1)
    for got, block_id in zip(blocks, BLOCK_IDS[1:], strict=True):
        assert torch.equal(got.reshape(-1), _cache_block(worker, block_id).reshape(-1))
    with pytest.raises(TcpTransferError, match="closed after 0 of"):
        await _receive(worker, pull.tickets[0], 2)  # used
    with pytest.raises(TcpTransferError, match="closed after 0 of"):
        await _receive(worker, bytes(TICKET_BYTES), 2)  # never issued
    fresh = await pull_blocks_tcp(worker.address, "req-1", spec, len(BLOCK_IDS), TIMEOUT_S)
    assert len(await _receive(worker, fresh.tickets[0], 3)) == 3  # the server still serves


async def test_a_ticket_of_a_released_or_changed_lease_sends_nothing(worker: Worker) -> None:
    worker.grant()
    spec = worker.source.spec
    pull = await pull_blocks_tcp(worker.address, "req-1", spec, len(BLOCK_IDS), TIMEOUT_S)
    worker.source.release("req-1")
    with pytest.raises(TcpTransferError, match="closed after 0 of"):
        await _receive(worker, pull.tickets[0], 3)
    worker.grant()
    pull = await pull_blocks_tcp(worker.address, "req-1", spec, len(BLOCK_IDS), TIMEOUT_S)
    worker.source.release("req-1")
    worker.leases.grant("req-1", [1, 2, 3], HASHES, NUM_TOKENS, worker.clock() + 30)  # reused id
    with pytest.raises(TcpTransferError, match="closed after 0 of"):
        await _receive(worker, pull.tickets[0], 3)


async def test_tickets_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    w = await start_worker(data_port=True, ticket_ttl_s=0.05)
    try:
        w.grant()
        pull = await pull_blocks_tcp(w.address, "req-1", w.source.spec, 3, TIMEOUT_S)
        await asyncio.sleep(0.2)
        with pytest.raises(TcpTransferError, match="closed after 0 of"):
            await _receive(w, pull.tickets[0], 3)
    finally:
        await w.stop()


async def test_silent_connections_are_closed_and_surplus_ones_wait_their_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that sends no ticket is closed after TICKET_WAIT_S; past max_connections a
    ticketed one is not refused but served once a slot is free (many pullers, one worker)."""
    monkeypatch.setattr(tcp_module, "TICKET_WAIT_S", 0.5)
    w = await start_worker(data_port=True, max_connections=1)
    try:
        assert w.data is not None
        w.grant()
        first = await pull_blocks_tcp(w.address, "req-1", w.source.spec, 3, TIMEOUT_S)
        second = await pull_blocks_tcp(w.address, "req-1", w.source.spec, 3, TIMEOUT_S)
        idle = socket.create_connection(("127.0.0.1", w.data.port), timeout=10)
        try:
            both = await asyncio.gather(_receive(w, first.tickets[0], 3, batch_blocks=1),
                                        _receive(w, second.tickets[0], 3, batch_blocks=1))
            assert [len(blocks) for blocks in both] == [3, 3]
            assert await asyncio.to_thread(idle.recv, 1) == b""  # closed: no ticket in time
        finally:
            idle.close()
    finally:
        await w.stop()


async def test_idle_connections_neither_delay_a_pull_nor_pile_up() -> None:
    """64 connections that never send a ticket (a scan, a flood) hold no sending slot: a real
    pull behind them is served at once, and only the newest `max_unauthenticated` of them are
    kept open (each for TICKET_WAIT_S at most)."""
    w = await start_worker(data_port=True, max_connections=2, max_unauthenticated=8)
    idle: list[socket.socket] = []
    try:
        assert w.data is not None
        w.grant()
        for _ in range(64):
            idle.append(socket.create_connection(("127.0.0.1", w.data.port), timeout=10))
        pull = await pull_blocks_tcp(w.address, "req-1", w.source.spec, 3, TIMEOUT_S)
        t0 = asyncio.get_running_loop().time()
        assert len(await _receive(w, pull.tickets[0], 3)) == 3
        assert asyncio.get_running_loop().time() - t0 < 1.0  # was: behind the idle ones' 5 s

        def closed(sock: socket.socket) -> bool:
            sock.settimeout(0.05)
            try:
                return sock.recv(1) == b""
            except (TimeoutError, OSError):
                return False

        assert sum(await asyncio.to_thread(lambda: [closed(s) for s in idle])) >= 64 - 8
    finally:
        for sock in idle:
            sock.close()
        await w.stop()


async def test_an_unreachable_data_port_falls_back_to_the_stream(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data port the puller cannot reach (another network, a firewall): the lease is still
    held, the stream pulls it whole, and the data port is not tried again for that worker."""
    worker.grant()
    worker.grant("req-2")
    spec = worker.source.spec
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    assert worker.data is not None
    monkeypatch.setattr(worker.data, "port", closed_port)
    sink = DictSink(spec)
    connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=TIMEOUT_S,
                                  use_shm=False)
    tickets: list[str] = []
    real = pull_ways_module.pull_blocks_tcp

    async def counted(*args: Any, **kwargs: Any) -> Any:
        tickets.append(args[1])
        return await real(*args, **kwargs)

    monkeypatch.setattr(pull_ways_module, "pull_blocks_tcp", counted)
    for rid in ("req-1", "req-2"):
        connector.start_load_kv(rid, handle_for(worker, rid), [0, 1, 4])
        assert await connector.wait_for_load(rid) == LoadResult(rid, True, transport="stream")
    assert torch.equal(sink.cache[:, :, 4].view(torch.uint8), _cache_block(worker, BLOCK_IDS[2]))
    assert tickets == ["req-1"] and worker.address in connector._no_tcp


async def test_a_worker_without_a_data_port_is_pulled_over_the_stream() -> None:
    w = await start_worker()  # no data port
    try:
        w.grant()
        spec = w.source.spec
        with pytest.raises(KvTransferError) as exc:
            await pull_blocks_tcp(w.address, "req-1", spec, 3, TIMEOUT_S)
        assert exc.value.reason == "tcp_unavailable"
        connector = GrpcPullConnector(spec, DictSink(spec), asyncio.get_running_loop(),
                                      timeout_s=TIMEOUT_S, use_shm=False)
        connector.start_load_kv("local-1", handle_for(w), [0, 1, 4])
        assert await connector.wait_for_load("local-1") == LoadResult(
            "local-1", True, transport="stream")
        assert w.address in connector._no_tcp
    finally:
        await w.stop()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
async def test_one_byte_kv_comes_with_its_scales(dtype: torch.dtype) -> None:
    """Scales come in the ticket's answer; a puller under other scales refuses the KV before a
    byte is read (nothing written), one under the same scales gets the blocks bit for bit."""
    spec = make_spec(dtype)
    scales = torch.tensor([[0.5, 0.25]] * spec.num_layers, dtype=torch.float32)
    w = await start_worker(spec=spec, kv_scales=scales, data_port=True)
    try:
        loop = asyncio.get_running_loop()
        w.grant("other")
        sink = DictSink(spec)
        wrong = GrpcPullConnector(spec, sink, loop, timeout_s=TIMEOUT_S, use_shm=False,
                                  kv_scales=scales * 2)
        wrong.start_load_kv("x", handle_for(w, "other"), [0, 1, 4])
        assert await wrong.wait_for_load("x") == LoadResult("x", False, "scales_mismatch")
        assert torch.count_nonzero(sink.cache.view(torch.uint8)) == 0
        w.grant()
        right = GrpcPullConnector(spec, sink, loop, timeout_s=TIMEOUT_S, use_shm=False,
                                  kv_scales=scales.clone())
        right.start_load_kv("y", handle_for(w), [0, 1, 4])
        assert await right.wait_for_load("y") == LoadResult("y", True, transport="tcp")
        for local_id, remote_id in zip([0, 1, 4], BLOCK_IDS, strict=True):
            assert torch.equal(sink.cache[:, :, local_id].view(torch.uint8),
                               w.source._kv_cache[:, :, remote_id].view(torch.uint8))
    finally:
        await w.stop()


async def test_a_hash_mismatch_is_refused_before_reading(worker: Worker) -> None:
    worker.grant()
    spec = worker.source.spec
    sink = DictSink(spec)
    connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=TIMEOUT_S,
                                  use_shm=False)
    other = dataclasses.replace(handle_for(worker), block_hashes=(HASHES[1], HASHES[0]))
    connector.start_load_kv("local-1", other, [0, 1, 4])
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", False,
                                                                  "hash_mismatch")
    assert torch.count_nonzero(sink.cache.view(torch.uint8)) == 0


async def test_a_transfer_cut_short_fails_the_load(worker: Worker,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill worker fails mid-lease (its read raises after the first slice): the puller
    sees the connection end early and reports the load failed (the engine recomputes)."""
    monkeypatch.setattr(tcp_module, "SEND_SLICE_BLOCKS", 1)
    worker.grant()
    spec = worker.source.spec

    def fail_after_the_first(n: int) -> None:
        if n > 1:
            raise RuntimeError("device lost")

    spy_reads(worker, monkeypatch, "read_blocks", fail_after_the_first)
    connector = GrpcPullConnector(spec, DictSink(spec), asyncio.get_running_loop(),
                                  timeout_s=TIMEOUT_S, use_shm=False, tcp_streams=1)
    connector.start_load_kv("local-1", handle_for(worker), [0, 1, 4])
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", False, "unavailable")
    assert worker.released == []  # the lease stays until it expires or the engine releases it


async def test_a_lease_that_ends_mid_transfer_fails_the_load(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease expires (here: is released) after the first block was read: the later blocks
    may already belong to another request, so the status byte after the blocks says so and the
    load fails (the engine recomputes) although every byte arrived."""
    monkeypatch.setattr(tcp_module, "SEND_SLICE_BLOCKS", 1)
    worker.grant()
    spec = worker.source.spec
    reads = spy_reads(worker, monkeypatch, "read_blocks",
                      lambda n: n == 1 and worker.source.release("req-1"))
    connector = GrpcPullConnector(spec, DictSink(spec), asyncio.get_running_loop(),
                                  timeout_s=TIMEOUT_S, use_shm=False, tcp_streams=1)
    connector.start_load_kv("local-1", handle_for(worker), [0, 1, 4])
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", False, "unavailable")
    assert len(reads) == 3


async def test_one_failing_stripe_fails_the_load_and_stops_the_others(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three connections, one stripe each: the prefill side fails reading the last stripe's
    block; the load fails as a whole (the engine recomputes), and the lease stays."""
    worker.grant()
    spec = worker.source.spec
    real = worker.source.read_blocks

    async def failing(block_ids: list[int]) -> torch.Tensor:
        if block_ids == [BLOCK_IDS[2]]:
            raise RuntimeError("device lost")
        return await real(block_ids)

    monkeypatch.setattr(worker.source, "read_blocks", failing)
    sink = DictSink(spec)
    connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=TIMEOUT_S,
                                  use_shm=False, tcp_streams=3)
    connector.start_load_kv("local-1", handle_for(worker), [0, 1, 4])
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", False, "unavailable")
    assert worker.released == [] and worker.address not in connector._no_tcp


def test_receive_blocks_checks_its_arguments_and_reports_a_refused_port() -> None:
    staging = torch.empty(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ticket"):
        receive_blocks("127.0.0.1", 1, b"short", 1, 64, staging, lambda a, b: None, 1.0)
    with pytest.raises(ValueError, match="staging"):
        receive_blocks("127.0.0.1", 1, bytes(TICKET_BYTES), 1, 128, staging,
                       lambda a, b: None, 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TcpUnavailable, match="cannot connect"):
        receive_blocks("127.0.0.1", port, bytes(TICKET_BYTES), 1, 64, staging,
                       lambda a, b: None, 1.0)


async def test_data_server_validates_and_closes() -> None:
    loop = asyncio.get_running_loop()
    w = await start_worker()
    try:
        with pytest.raises(ValueError):
            KvDataServer(w.source, loop, "127.0.0.1", ticket_ttl_s=0)
        server = KvDataServer(w.source, loop, "127.0.0.1")
        server.close()
        server.close()  # twice is fine
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2)
    finally:
        await w.stop()


async def _resetting_proxy(upstream_port: int, pass_bytes: int) -> asyncio.Server:
    """A TCP proxy to the data port that forwards `pass_bytes` of the blocks, then resets the
    puller's connection (RST: SO_LINGER 0), as a middlebox or a dying host does."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)

        async def ticket_up() -> None:
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()

        forward = asyncio.create_task(ticket_up())
        sent = 0
        while sent < pass_bytes and (data := await up_reader.read(pass_bytes - sent)):
            writer.write(data)
            await writer.drain()
            sent += len(data)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        forward.cancel()
        up_writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_connection_reset_mid_transfer_fails_the_load_at_once(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data connection is reset after one block and a half: the load fails at once (not
    at its timeout), nothing claims the partial blocks, and the lease stays held for its owner
    to release (the decode worker recomputes the prompt and releases it)."""
    monkeypatch.setattr(tcp_module, "SEND_SLICE_BLOCKS", 1)
    worker.grant()
    spec = worker.source.spec
    assert worker.data is not None
    proxy = await _resetting_proxy(worker.data.port, spec.block_nbytes * 3 // 2)
    monkeypatch.setattr(worker.data, "port", proxy.sockets[0].getsockname()[1])
    try:
        connector = GrpcPullConnector(spec, DictSink(spec), asyncio.get_running_loop(),
                                      timeout_s=TIMEOUT_S, use_shm=False, tcp_streams=1)
        started = asyncio.get_running_loop().time()
        connector.start_load_kv("local-1", handle_for(worker), [0, 1, 4])
        result = await connector.wait_for_load("local-1")
        assert result == LoadResult("local-1", False, "unavailable")
        assert asyncio.get_running_loop().time() - started < TIMEOUT_S / 2
        assert worker.released == [] and worker.source.lookup("req-1") is not None
    finally:
        proxy.close()
        await proxy.wait_closed()
