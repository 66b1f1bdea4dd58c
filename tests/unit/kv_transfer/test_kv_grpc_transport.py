"""KvTransfer over a real grpc.aio server on 127.0.0.1 backed by a real KV cache tensor."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import pytest
import torch

import kv_transfer.pull_ways as pull_ways_module
from engine_api.hashing import prompt_hash
from kv_transfer import servicer as servicer_module
from kv_transfer.connector import GrpcPullConnector
from kv_transfer.cuda_ipc import CacheExport, CacheImporter, device_uuid, local_device
from kv_transfer.handle import KvHandle, LoadResult
from kv_transfer.protocol import MAX_FRAGMENT_BYTES, KvTransferError, channel_options
from kv_transfer.pull_client import pull_all, pull_blocks, release
from kv_transfer.raw_pulls import pull_blocks_ipc, pull_blocks_shm
from kv_transfer.servicer import KvTransferServicer
from kv_transfer.shm import SHM_DIR, SHM_PREFIX, ShmError, ShmSegment
from kv_transfer.tcp import KvDataServer
from kv_transfer.wire import BlockSpec, DecodedBlock, encode_block
from protos.splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from rpc.channels import ChannelCache
from tests.support.fake_block_source import CacheBlockSource
from tests.support.fake_lease import Lease, LeaseError, LeaseTable

FP = hashlib.sha256(b"model-a").digest()
NUM_CACHE_BLOCKS = 8
BLOCK_IDS = [5, 2, 7]          # lease order differs from cache order on purpose
NUM_TOKENS = 10                # block_size 4: two full blocks and a partial one of 2 tokens
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
TIMEOUT_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_spec(dtype: torch.dtype = torch.bfloat16, fp: bytes = FP) -> BlockSpec:
    return BlockSpec(fingerprint=fp, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8,
                     dtype=dtype)


def make_cache(spec: BlockSpec) -> torch.Tensor:
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    shape = (spec.num_layers, 2, NUM_CACHE_BLOCKS, spec.block_size, spec.num_kv_heads,
             spec.head_dim)
    g = torch.Generator().manual_seed(0)
    if spec.dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    return torch.randn(shape, generator=g).to(spec.dtype)


class Worker:
    """A prefill worker's KV side: cache + lease table + servicer on an ephemeral port."""

    def __init__(self, source: CacheBlockSource, leases: LeaseTable, clock: FakeClock,
                 server: grpc.aio.Server, address: str,
                 data: KvDataServer | None = None) -> None:
        self.source, self.leases, self.clock = source, leases, clock
        self.server, self.address, self.data = server, address, data
        self.released: list[Lease] = []

    async def stop(self) -> None:
        await self.server.stop(None)
        if self.data is not None:
            self.data.close()

    def grant(self, request_id: str = "req-1") -> Lease:
        return self.leases.grant(request_id, BLOCK_IDS, HASHES, NUM_TOKENS, self.clock() + 30.0)


async def start_worker(source_cls: type[CacheBlockSource] = CacheBlockSource,
                       spec: BlockSpec | None = None, fragment_bytes: int = 1 << 20,
                       kv_scales: torch.Tensor | None = None,
                       data_port: bool = False, port: int = 0, **data_options: Any) -> Worker:
    """data_port: also serve a KV data port (kv_transfer/tcp.py) with `data_options`; port: the
    gRPC port (0: any free one)."""
    spec = spec or make_spec()
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    released: list[Lease] = []
    source = source_cls(make_cache(spec), spec, leases, on_release=released.append)
    server = grpc.aio.server(options=channel_options(fragment_bytes))
    data = (KvDataServer(source, asyncio.get_running_loop(), "127.0.0.1", **data_options)
            if data_port else None)
    # The cache is offered for CUDA IPC as a GPU worker's is; on the CPU it must be refused.
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(
        KvTransferServicer(source, fragment_bytes=fragment_bytes, kv_scales=kv_scales,
                           ipc_cache=source._kv_cache, data_server=data), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    worker = Worker(source, leases, clock, server, f"127.0.0.1:{port}", data)
    worker.released = released
    return worker


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await start_worker()
    yield w
    await w.stop()


def spy_reads(worker: Worker, monkeypatch: pytest.MonkeyPatch, method: str,
              after: Callable[[int], object]) -> list[int]:
    """Wrap the worker source's `read_block` or `read_blocks`: after the n-th read (from 1)
    returns its data, `after(n)` runs (it may raise, or end the lease). Returns a list whose
    length is the number of reads so far."""
    real = getattr(worker.source, method)
    reads: list[int] = []

    async def spied(arg: Any) -> torch.Tensor:
        reads.append(len(reads) + 1)
        data = await real(arg)
        after(len(reads))
        return data

    monkeypatch.setattr(worker.source, method, spied)
    return reads


def assert_blocks_match(worker: Worker, blocks: Sequence[DecodedBlock]) -> None:
    cache = worker.source._kv_cache
    assert len(blocks) == len(BLOCK_IDS)
    for index, (block, block_id) in enumerate(zip(blocks, BLOCK_IDS, strict=True)):
        expected = cache[:, :, block_id]
        assert torch.equal(block.tensor.view(torch.uint8), expected.view(torch.uint8))
        assert block.block_hash == (HASHES[index] if index < 2 else None)
        assert block.num_tokens == (4 if index < 2 else 2)


async def test_pull_all_blocks_bitwise(worker: Worker) -> None:
    worker.grant()
    blocks = await pull_all(worker.address, "req-1", worker.source.spec, len(BLOCK_IDS),
                            TIMEOUT_S, num_tokens_expected=NUM_TOKENS)
    assert_blocks_match(worker, blocks)


async def test_pull_from_first_block_streams_only_the_tail(worker: Worker) -> None:
    """A puller holding the first blocks in its own prefix cache asks for the rest; indices
    stay the lease's, and a first_block past the lease is refused."""
    worker.grant()
    tail = [item async for item in pull_blocks(worker.address, "req-1", worker.source.spec,
                                               len(BLOCK_IDS), TIMEOUT_S,
                                               num_tokens_expected=NUM_TOKENS, first_block=1)]
    assert [index for index, _ in tail] == [1, 2]
    cache = worker.source._kv_cache
    for index, block in tail:
        assert torch.equal(block.tensor.view(torch.uint8),
                           cache[:, :, BLOCK_IDS[index]].view(torch.uint8))
    assert tail[0][1].block_hash == HASHES[1] and tail[1][1].block_hash is None
    with pytest.raises(ValueError, match="first_block"):
        await pull_all(worker.address, "req-1", worker.source.spec, len(BLOCK_IDS), TIMEOUT_S,
                       first_block=len(BLOCK_IDS))
    async with grpc.aio.insecure_channel(worker.address) as channel:  # a raw request past the end
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in kv_transfer_pb2_grpc.KvTransferStub(channel).PullBlocks(
                    kv_transfer_pb2.PullBlocksRequest(request_id="req-1",
                                                      fingerprint=worker.source.spec.fingerprint,
                                                      first_block=len(BLOCK_IDS))):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_fragments_smaller_than_a_block_over_an_open_channel() -> None:
    spec = make_spec(torch.float32)
    assert spec.encoded_nbytes > 3 * 500  # every block spans several fragments
    w = await start_worker(spec=spec, fragment_bytes=500)
    try:
        w.grant()
        async with grpc.aio.insecure_channel(w.address) as channel:
            pulled = [item async for item in pull_blocks(channel, "req-1", spec, 3, TIMEOUT_S)]
        assert [index for index, _ in pulled] == [0, 1, 2]
        assert_blocks_match(w, [block for _, block in pulled])
    finally:
        await w.server.stop(None)


async def test_int8_kv_carries_scales() -> None:
    spec = make_spec(torch.int8)
    scales = torch.tensor([[0.5, 0.25]] * spec.num_layers)
    w = await start_worker(spec=spec, kv_scales=scales)
    try:
        w.grant()
        blocks = await pull_all(w.address, "req-1", spec, 3, TIMEOUT_S)
        assert_blocks_match(w, blocks)
        assert all(b.scales is not None and torch.equal(b.scales, scales) for b in blocks)
    finally:
        await w.server.stop(None)


async def test_unknown_lease_is_not_found(worker: Worker) -> None:
    with pytest.raises(KvTransferError) as info:
        await pull_all(worker.address, "nope", worker.source.spec, 3, TIMEOUT_S)
    assert info.value.reason == "not_found"
    assert info.value.code == grpc.StatusCode.NOT_FOUND


async def test_fingerprint_mismatch_is_refused(worker: Worker) -> None:
    worker.grant()
    other = make_spec(fp=hashlib.sha256(b"model-b").digest())
    with pytest.raises(KvTransferError) as info:
        await pull_all(worker.address, "req-1", other, 3, TIMEOUT_S)
    assert info.value.reason == "fingerprint_mismatch"


async def test_bad_request_id_is_invalid_argument(worker: Worker) -> None:
    with pytest.raises(KvTransferError) as info:
        await pull_all(worker.address, "", worker.source.spec, 3, TIMEOUT_S)
    assert info.value.reason == "invalid_argument"


async def test_block_count_disagreement(worker: Worker) -> None:
    worker.grant()
    spec = worker.source.spec
    with pytest.raises(KvTransferError) as info:  # server sends a third block
        await pull_all(worker.address, "req-1", spec, 2, TIMEOUT_S)
    assert info.value.reason == "protocol"
    with pytest.raises(KvTransferError) as info:  # stream ends one block early
        await pull_all(worker.address, "req-1", spec, 4, TIMEOUT_S)
    assert info.value.reason == "count_mismatch"


async def test_release_then_pull_is_not_found(worker: Worker) -> None:
    lease = worker.grant()
    assert await release(worker.address, "req-1") is True
    assert worker.released == [lease]  # the engine hook freed the blocks
    assert await release(worker.address, "req-1") is False
    with pytest.raises(KvTransferError) as info:
        await pull_all(worker.address, "req-1", worker.source.spec, 3, TIMEOUT_S)
    assert info.value.reason == "not_found"


async def test_expired_lease_is_not_found(worker: Worker) -> None:
    lease = worker.grant()
    worker.clock.now = lease.deadline_monotonic
    with pytest.raises(KvTransferError) as info:
        await pull_all(worker.address, "req-1", worker.source.spec, 3, TIMEOUT_S)
    assert info.value.reason == "not_found"
    assert worker.leases.expire() == [lease]
    assert len(worker.leases) == 0


def test_lease_table_rules() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    lease = table.grant("r", [1, 2], [HASHES[0]], 6, deadline_monotonic=clock() + 1)
    with pytest.raises(LeaseError, match="already holds"):
        table.grant("r", [3], [], 1, clock() + 1)
    with pytest.raises(LeaseError, match="hashes"):
        table.grant("s", [3], HASHES, 4, clock() + 1)
    assert table.get("r") == lease and table.expire() == []
    clock.now += 1
    assert table.get("r") is None and "r" in table  # expired but not yet collected
    assert table.release("r") == lease and table.release("r") is None


async def test_release_of_an_expired_lease_frees_but_answers_false(worker: Worker) -> None:
    lease = worker.grant()
    worker.clock.now = lease.deadline_monotonic + 1
    assert await release(worker.address, "req-1") is False
    assert worker.released == [lease]


class GatedSource(CacheBlockSource):
    """Serves the first block, then blocks reading the second until `gate` is set."""

    reached: asyncio.Event
    gate: asyncio.Event

    async def read_block(self, block_id: int) -> torch.Tensor:
        if block_id != BLOCK_IDS[0]:
            GatedSource.reached.set()
            await GatedSource.gate.wait()
        return await super().read_block(block_id)


async def test_server_killed_mid_stream_raises_and_yields_no_partial_block() -> None:
    GatedSource.reached, GatedSource.gate = asyncio.Event(), asyncio.Event()
    w = await start_worker(GatedSource, fragment_bytes=256)
    w.grant()
    received: list[int] = []

    async def consume() -> None:
        async for index, _ in pull_blocks(w.address, "req-1", w.source.spec, 3, TIMEOUT_S):
            received.append(index)

    task = asyncio.create_task(consume())
    await GatedSource.reached.wait()
    await w.server.stop(None)  # kill: in-flight calls are cancelled
    with pytest.raises(KvTransferError) as info:
        await task
    assert info.value.reason in {"unavailable", "cancelled", "count_mismatch"}
    assert len(received) <= 1  # only the fully verified block 0, never a piece of block 1


async def test_deadline_exceeded() -> None:
    GatedSource.reached, GatedSource.gate = asyncio.Event(), asyncio.Event()
    w = await start_worker(GatedSource)
    try:
        w.grant()
        with pytest.raises(KvTransferError) as info:
            await pull_all(w.address, "req-1", w.source.spec, 3, timeout_s=0.5)
        assert info.value.reason == "deadline_exceeded"
    finally:
        GatedSource.gate.set()
        await w.server.stop(None)


class ScriptedServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """A misbehaving peer: streams exactly the given fragments."""

    def __init__(self, fragments: list[kv_transfer_pb2.KvFragment]) -> None:
        self.fragments = fragments

    async def PullBlocks(self, request: kv_transfer_pb2.PullBlocksRequest,
                         context: grpc.aio.ServicerContext,
                         ) -> AsyncIterator[kv_transfer_pb2.KvFragment]:
        for frag in self.fragments:
            yield frag

    async def Release(self, request: kv_transfer_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> kv_transfer_pb2.ReleaseResponse:
        return kv_transfer_pb2.ReleaseResponse(released=False)


def good_block_bytes(spec: BlockSpec) -> bytes:
    return encode_block(spec, None, 2, make_cache(spec)[:, :, 0])


def frag(data: bytes, offset: int, total: int, index: int = 0) -> kv_transfer_pb2.KvFragment:
    return kv_transfer_pb2.KvFragment(block_index=index, offset=offset, total_bytes=total,
                                      data=data)


def bad_streams(spec: BlockSpec) -> dict[str, tuple[str, list[kv_transfer_pb2.KvFragment]]]:
    data = good_block_bytes(spec)
    n = len(data)
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    return {
        "gap": ("protocol", [frag(data[:100], 0, n), frag(data[200:], 200, n)]),
        "overlap": ("protocol", [frag(data[:100], 0, n), frag(data[50:], 50, n)]),
        "overrun": ("protocol", [frag(data + b"xx", 0, n)]),
        "wrong_total": ("protocol", [frag(data, 0, n + 2)]),
        "huge_total": ("protocol", [frag(data[:10], 0, 2**31)]),
        "wrong_index": ("protocol", [frag(data, 0, n, index=1)]),
        "corrupt": ("wire", [frag(bytes(flipped), 0, n)]),
        "cut_short": ("count_mismatch", [frag(data[:100], 0, n)]),
    }


@pytest.mark.parametrize("case", ["gap", "overlap", "overrun", "wrong_total", "huge_total",
                                  "wrong_index", "corrupt", "cut_short"])
async def test_malformed_fragment_streams_are_rejected(case: str) -> None:
    spec = make_spec()
    reason, fragments = bad_streams(spec)[case]
    server = grpc.aio.server()
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(ScriptedServicer(fragments), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with pytest.raises(KvTransferError) as info:
            await pull_all(f"127.0.0.1:{port}", "req-1", spec, 1, TIMEOUT_S)
        assert info.value.reason == reason
    finally:
        await server.stop(None)


class DictSink:
    """A decode worker's local cache: [L, 2, num_blocks, bs, Hkv, D], written in batches."""

    def __init__(self, spec: BlockSpec) -> None:
        self.cache = torch.zeros(spec.num_layers, 2, NUM_CACHE_BLOCKS, spec.block_size,
                                 spec.num_kv_heads, spec.head_dim, dtype=spec.dtype)

    def write_blocks(self, block_ids: list[int], tensors: torch.Tensor) -> None:
        for block_id, tensor in zip(block_ids, tensors, strict=True):
            self.cache[:, :, block_id] = tensor


def handle_for(worker: Worker, request_id: str = "req-1") -> KvHandle:
    spec = worker.source.spec
    return KvHandle(worker.address, request_id, NUM_TOKENS, len(BLOCK_IDS), spec.fingerprint,
                    spec.block_size, tuple(HASHES),
                    prompt_hash=prompt_hash(spec.fingerprint, list(range(NUM_TOKENS))))


def _kv_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}


@pytest.mark.parametrize("use_shm", [True, False])
async def test_connector_pulls_into_local_blocks_and_releases(
        worker: Worker, use_shm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same host: through a shared-memory segment (then unlinked) or the gRPC stream."""
    lease = worker.grant()
    spec = worker.source.spec
    sink = DictSink(spec)
    shm_pulls: list[str] = []
    real = pull_ways_module.pull_blocks_shm

    async def counted(*args: Any, **kwargs: Any) -> Any:
        shm_pulls.append(args[1])
        return await real(*args, **kwargs)

    monkeypatch.setattr(pull_ways_module, "pull_blocks_shm", counted)
    before = _kv_segments()
    connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=TIMEOUT_S,
                                  use_shm=use_shm)
    local_ids = [0, 1, 4]
    way = "shm" if use_shm else "stream"
    handle = KvHandle.from_proto(handle_for(worker).to_proto())  # survives the proto round trip
    assert handle == handle_for(worker) and len(handle.prompt_hash) == 32
    # The engine thread starts the load; the transfer runs on this loop.
    await asyncio.to_thread(connector.start_load_kv, "local-1", handle, local_ids)
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", True, transport=way)
    for local_id, remote_id in zip(local_ids, BLOCK_IDS, strict=True):
        assert torch.equal(sink.cache[:, :, local_id].view(torch.uint8),
                           worker.source._kv_cache[:, :, remote_id].view(torch.uint8))
    assert worker.released == [lease]
    assert connector.get_finished_loads() == [LoadResult("local-1", True, transport=way)]
    assert connector.get_finished_loads() == []
    assert shm_pulls == (["req-1"] if use_shm else [])
    assert _kv_segments() == before


async def test_shm_pull_falls_back_to_the_stream_where_the_server_cannot_open_it(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that cannot open the segment (another host or container) answers
    FAILED_PRECONDITION; the connector streams instead, and from then on."""
    worker.grant()
    spec = worker.source.spec
    sink = DictSink(spec)

    def elsewhere(name: str, size: int) -> ShmSegment:
        raise ShmError(f"cannot open /dev/shm/{name}: not on this host")

    monkeypatch.setattr(servicer_module.ShmSegment, "open", staticmethod(elsewhere))
    connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=TIMEOUT_S)
    connector.start_load_kv("local-1", handle_for(worker), [0, 1, 4])
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", True, transport="stream")
    assert torch.equal(sink.cache[:, :, 4].view(torch.uint8),
                       worker.source._kv_cache[:, :, BLOCK_IDS[2]].view(torch.uint8))
    assert worker.address in connector._no_shm


async def test_shm_pull_returns_the_lease_and_refuses_foreign_names(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicer_module, "SHM_READ_BLOCKS", 1)  # one slice per block
    worker.grant()
    spec = worker.source.spec
    pull = await pull_blocks_shm(worker.address, "req-1", spec, len(BLOCK_IDS), TIMEOUT_S,
                                 first_block=1)
    try:
        assert pull.num_tokens == NUM_TOKENS and pull.block_hashes == HASHES
        for i, block_id in enumerate(BLOCK_IDS[1:]):
            assert torch.equal(pull.blocks[i].view(torch.uint8),
                               worker.source._kv_cache[:, :, block_id].view(torch.uint8))
    finally:
        name = pull.segment.name
        del pull.blocks
        pull.segment.close()
    assert name not in _kv_segments()
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        for bad in ("../etc/passwd", "splitserve-kv-xyz", "other-" + "0" * 32):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PullBlocksShm(kv_transfer_pb2.PullBlocksShmRequest(
                    request_id="req-1", fingerprint=spec.fingerprint, shm_name=bad,
                    shm_bytes=spec.block_nbytes))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def _pull_ok(connector: GrpcPullConnector, worker: Worker, name: str) -> None:
    worker.grant(name)
    connector.start_load_kv(name, handle_for(worker, name), [0, 1, 4])
    result = await connector.wait_for_load(name)
    assert result.ok, result


def _stream_connector(worker: Worker) -> GrpcPullConnector:
    spec = worker.source.spec
    return GrpcPullConnector(spec, DictSink(spec), asyncio.get_running_loop(),
                             timeout_s=TIMEOUT_S, use_shm=False)


async def _pull_fails_once_stopped(connector: GrpcPullConnector, worker: Worker) -> None:
    await worker.stop()
    connector.start_load_kv("down", handle_for(worker, "down"), [0, 1, 4])
    assert (await connector.wait_for_load("down")).reason == "unavailable"


async def test_pulls_keep_their_channels_until_the_connection_fails() -> None:
    worker = await start_worker()
    connector = _stream_connector(worker)
    try:
        await _pull_ok(connector, worker, "req-1")
        first = dict(connector._channels._channels)
        assert len(first) == 2  # the stream's (large messages) and the release's
        await _pull_ok(connector, worker, "req-2")
        connector.start_load_kv("gone", handle_for(worker, "no-such-lease"), [0, 1, 2])
        assert (await connector.wait_for_load("gone")).reason == "not_found"  # an answer
        assert dict(connector._channels._channels) == first  # the same channel objects
        await _pull_fails_once_stopped(connector, worker)
        assert len(connector._channels) == 0  # the next load connects afresh
    finally:
        await connector.aclose()
        await worker.stop()
    assert len(connector._channels) == 0


async def test_the_channel_cache_keys_bounds_and_closes(worker: Worker) -> None:
    cache = ChannelCache(max_channels=2, close_grace_s=1.0)
    a = cache.get(worker.address)
    assert cache.get(worker.address) is a
    big = cache.get(worker.address, channel_options(MAX_FRAGMENT_BYTES))
    assert big is not a and len(cache) == 2
    assert cache.get(worker.address) is a  # now the most recently used
    other = cache.get("127.0.0.1:1")  # past the bound: the least recently used (big) goes
    assert len(cache) == 2 and cache.get(worker.address) is a and other is not a
    worker.grant()
    assert await release(a, "req-1")  # a kept channel serves calls
    cache.drop(worker.address)
    assert len(cache) == 1 and cache.get(worker.address) is not a
    await cache.aclose()
    assert len(cache) == 0 and not cache._closing
    with pytest.raises(Exception):  # noqa: B017 - grpc raises its own usage error type
        await release(a, "req-1")


async def test_a_restarted_prefill_worker_is_pulled_from_at_once() -> None:
    """A kept channel reconnects to a worker restarted on the same address, with no wait for
    gRPC's reconnection backoff: the first pull after the restart succeeds."""
    worker = await start_worker()
    connector = _stream_connector(worker)
    try:
        await _pull_ok(connector, worker, "before")
        await _pull_fails_once_stopped(connector, worker)
        worker = await start_worker(port=int(worker.address.rsplit(":", 1)[1]))
        started = time.monotonic()
        await _pull_ok(connector, worker, "after")
        assert time.monotonic() - started < 2.0
    finally:
        await connector.aclose()
        await worker.stop()


async def test_connector_reports_failures_instead_of_raising(worker: Worker) -> None:
    spec = worker.source.spec
    connector = GrpcPullConnector(spec, DictSink(spec), asyncio.get_running_loop(),
                                  timeout_s=TIMEOUT_S)
    connector.start_load_kv("a", handle_for(worker, "unknown"), [0, 1, 2])
    assert await connector.wait_for_load("a") == LoadResult("a", False, "not_found")
    foreign = dataclasses.replace(handle_for(worker), fingerprint=bytes(32))
    connector.start_load_kv("b", foreign, [0, 1, 2])
    assert await connector.wait_for_load("b") == LoadResult("b", False, "spec_mismatch")
    connector.start_load_kv("c", handle_for(worker), [0, 1])  # wrong number of local blocks
    assert (await connector.wait_for_load("c")).reason == "spec_mismatch"
    assert {r.request_id for r in connector.get_finished_loads()} == {"a", "b", "c"}


def test_kv_handle_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KvHandle("h:1", "r", num_tokens=10, num_blocks=2, fingerprint=FP, block_size=4).validate()
    with pytest.raises(ValueError, match="prompt_hash"):
        KvHandle("h:1", "r", num_tokens=10, num_blocks=3, fingerprint=FP, block_size=4,
                 prompt_hash=b"short").validate()


def test_prompt_hash_covers_every_token_and_the_fingerprint() -> None:
    ids = list(range(100, 137))  # 2 full blocks of 16 + a partial one of 5
    want = hashlib.sha256(FP + b"".join(t.to_bytes(4, "little") for t in ids)).digest()
    assert prompt_hash(FP, ids) == want
    assert prompt_hash(FP, [*ids[:-1], ids[-1] + 1]) != want  # only the partial block differs
    assert prompt_hash(FP, ids[:-1]) != want
    assert prompt_hash(bytes(len(FP)), ids) != want


async def test_cuda_ipc_is_refused_off_the_gpu_and_the_connector_falls_back(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill worker whose cache is not on a GPU answers PullBlocksIpc FAILED_PRECONDITION; a
    puller without a GPU never asks; a sink on a GPU the prefill worker does not share falls
    back to shared memory for that worker, and does not ask it again. (The IPC copy itself
    needs two processes on one GPU: tools/probes/probe_kv_transport.py checks it on the H200.)"""
    worker.grant()
    spec = worker.source.spec
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PullBlocksIpc(kv_transfer_pb2.PullBlocksIpcRequest(
                request_id="req-1", fingerprint=spec.fingerprint, device_uuid=bytes(16)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not on a GPU" in (err.value.details() or "")
    with pytest.raises(KvTransferError) as exc:
        await pull_blocks_ipc(worker.address, "req-1", spec, len(BLOCK_IDS), TIMEOUT_S,
                              device_uuid(torch.device("cpu")))
    assert exc.value.reason == "ipc_unavailable"
    loop = asyncio.get_running_loop()
    assert GrpcPullConnector(spec, DictSink(spec), loop)._ways.ipc_device is None

    class GpuSink(DictSink):
        """Reports a GPU (this host has none, so no worker shares it)."""

        device = torch.device("cuda", 0)

        def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                             src_block_ids: list[int]) -> None:
            raise AssertionError("no cache was exported, nothing may be copied")

    ipc_pulls: list[str] = []
    real = pull_ways_module.pull_blocks_ipc

    async def counted(*args: Any, **kwargs: Any) -> Any:
        ipc_pulls.append(args[1])
        return await real(*args, **kwargs)

    monkeypatch.setattr(pull_ways_module, "pull_blocks_ipc", counted)
    sink = GpuSink(spec)
    connector = GrpcPullConnector(spec, sink, loop, timeout_s=TIMEOUT_S)
    assert connector._ways.ipc_device == torch.device("cuda", 0)
    for rid in ("req-1", "req-2"):
        if rid != "req-1":
            worker.grant(rid)
        connector.start_load_kv(f"local-{rid}", handle_for(worker, rid), [0, 1, 4])
        assert await connector.wait_for_load(f"local-{rid}") == LoadResult(
            f"local-{rid}", True, transport="shm")
        assert torch.equal(sink.cache[:, :, 4].view(torch.uint8),
                           worker.source._kv_cache[:, :, BLOCK_IDS[2]].view(torch.uint8))
    assert ipc_pulls == ["req-1"] and worker.address in connector._no_ipc
    assert worker.address not in connector._no_shm


def test_an_ipc_export_too_small_for_the_cache_is_refused() -> None:
    spec = make_spec()
    export = CacheExport(b"h" * 64, storage_bytes=spec.block_nbytes * 3, storage_offset_bytes=0,
                         ref_counter_handle=b"r", ref_counter_offset=0, event_handle=b"",
                         event_sync_required=False, tensor_offset=0, num_blocks=4)
    with pytest.raises(ValueError, match="does not fit"):
        CacheImporter().open(export, torch.device("cuda", 0), spec.dtype, spec.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_device_block_copy_between_caches(dtype: torch.dtype,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What a same-GPU pull does once the prefill cache is mapped (here both on the CPU):
    blocks land bit for bit at their new ids, in slices, and nothing else changes."""
    from engine.runner import block_io
    from engine.runner.block_io import copy_cache_blocks

    gen = torch.Generator().manual_seed(0)
    src = torch.randn(2, 2, 9, 4, 2, 8, generator=gen).to(dtype)
    dst = torch.zeros(2, 2, 7, 4, 2, 8).to(dtype)
    before = dst.clone()
    src_ids, dst_ids = [8, 0, 3, 5], [1, 6, 2, 4]
    monkeypatch.setattr(block_io, "_COPY_SLICE_BLOCKS", 3)  # two slices
    copy_cache_blocks(dst, dst_ids, src, src_ids)
    raw = lambda t: t.view(torch.uint8)  # noqa: E731 - fp8 has no equality kernel on the CPU
    for d, s in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(raw(dst[:, :, d]), raw(src[:, :, s]))
    for untouched in (0, 3, 5):
        assert torch.equal(raw(dst[:, :, untouched]), raw(before[:, :, untouched]))
    with pytest.raises(ValueError, match="does not match"):
        copy_cache_blocks(dst, [0], torch.zeros(2, 2, 3, 4, 1, 8).to(dtype), [0])
    with pytest.raises(ValueError, match="blocks to fill"):
        copy_cache_blocks(dst, [0, 1], src, [0])


async def test_an_unexpected_ipc_failure_falls_back_to_shared_memory(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug or CUDA error in the IPC way (not a clean "unavailable") must not lose the load:
    the lease is still held, so shared memory pulls it whole, and IPC is not tried again."""
    worker.grant()
    spec = worker.source.spec

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("_new_shared_cuda got an invalid combination of arguments")

    monkeypatch.setattr(pull_ways_module, "pull_blocks_ipc", broken)

    class GpuSink(DictSink):
        device = torch.device("cuda", 0)

        def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                             src_block_ids: list[int]) -> None:
            raise AssertionError("unreachable")

    sink = GpuSink(spec)
    connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=TIMEOUT_S)
    connector.start_load_kv("local-1", handle_for(worker), [0, 1, 4])
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", True, transport="shm")
    for local_id, remote_id in zip([0, 1, 4], BLOCK_IDS, strict=True):
        assert torch.equal(sink.cache[:, :, local_id].view(torch.uint8),
                           worker.source._kv_cache[:, :, remote_id].view(torch.uint8))
    assert worker.address in connector._no_ipc and worker.address not in connector._no_shm


def test_a_restarted_exporter_replaces_its_old_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """One mapping per exporting worker: the same export again reuses it (and hands the new
    reference slot back), a new allocation from the same worker (it restarted) replaces it, so
    a dead worker's cache is not kept alive. The CUDA calls are stood in for on the CPU; what is
    tested is the importer's bookkeeping."""
    mapped: list[bytes] = []
    returned: list[int] = []

    def new_shared(index: int, handle: bytes, size: int, *rest: Any) -> torch.UntypedStorage:
        mapped.append(handle)
        return torch.UntypedStorage(size)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared, raising=False)
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda handle, offset, device=None: returned.append(offset),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)

    def export(handle: bytes, slot: int) -> CacheExport:
        return CacheExport(handle, 64, 0, b"refs", slot, b"", False, 0, 1)

    importer = CacheImporter()
    first = importer.storage_for("prefill-a:1", export(b"h1", 0), 0)
    assert importer.storage_for("prefill-a:1", export(b"h1", 1), 0) is first
    assert mapped == [b"h1"] and returned == [1]
    other = importer.storage_for("prefill-b:1", export(b"h9", 2), 0)
    restarted = importer.storage_for("prefill-a:1", export(b"h2", 3), 0)
    assert restarted is not first and mapped == [b"h1", b"h9", b"h2"]
    assert {k: v[1] for k, v in importer._mapped.items()} == {"prefill-a:1": restarted,
                                                              "prefill-b:1": other}


def test_an_ipc_export_round_trips_through_its_message() -> None:
    """PullBlocksIpc sends a CacheExport as CudaIpcCache by field name (only a GPU worker
    exports one, so this is the CPU's check that the two keep the same fields)."""
    export = CacheExport(b"h" * 64, 1 << 30, 512, b"/torch_123", 7, b"e" * 64, True, 16, 4096)
    message = kv_transfer_pb2.CudaIpcCache(**dataclasses.asdict(export))
    wire = kv_transfer_pb2.CudaIpcCache.FromString(message.SerializeToString())
    assert CacheExport(**{f.name: getattr(wire, f.name)
                          for f in dataclasses.fields(CacheExport)}) == export


def test_an_exporters_gpu_is_found_by_uuid_or_not_at_all() -> None:
    """A peer pull maps the exporter's cache on the exporter's GPU, found here by its UUID
    (indices differ between processes); a GPU this process cannot see means another way."""
    assert local_device(bytes(range(16))) is None  # no such GPU here (this machine has none)
    assert local_device(b"short") is None
    assert local_device(device_uuid(torch.device("cpu"))) is None


@pytest.mark.parametrize("use_shm", [False, True])
async def test_a_lease_that_ends_during_a_pull_fails_it(worker: Worker, use_shm: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease is released (as by expiry) after the first read: the blocks read later may
    belong to another request by then, so the stream and the shared-memory pull end ABORTED
    after their last read, and the load fails rather than decoding from them."""
    monkeypatch.setattr(servicer_module, "SHM_READ_BLOCKS", 1)
    worker.grant()
    spec = worker.source.spec
    reads = spy_reads(worker, monkeypatch, "read_block",  # the stream's and shm's read
                      lambda n: n == 1 and worker.source.release("req-1"))
    connector = GrpcPullConnector(spec, DictSink(spec), asyncio.get_running_loop(),
                                  timeout_s=TIMEOUT_S, use_shm=use_shm, use_tcp=False)
    connector.start_load_kv("local-1", handle_for(worker), [0, 1, 4])
    assert await connector.wait_for_load("local-1") == LoadResult("local-1", False, "lease_lost")
    assert len(reads) == 3
