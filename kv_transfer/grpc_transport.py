"""KV block handoff over gRPC (service `splitserve.v1.KvTransfer`), pull model.

The prefill worker serves `PullBlocks(request_id, fingerprint)`: it streams every block of the
request's lease, each encoded by `wire.encode_block` and cut into `KvFragment`s of at most
`fragment_bytes`. The decode worker pulls with `pull_blocks` (streaming) or `pull_all`
(all-or-nothing), then calls `release` so the prefill worker drops the lease.

    block 0 bytes: [frag off=0][frag off=F][frag off=2F]...   block 1 bytes: [off=0]...
                   block_index=0, total_bytes=N0                block_index=1, total_bytes=N1

Any failure on the client (gRPC status, deadline, malformed fragments, a block that fails
`decode_block`) raises `KvTransferError`; the caller recomputes or fails (DESIGN.md §3.6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from kv_transfer.cuda_ipc import CacheExport, IpcUnavailable, device_uuid, export_cache
from kv_transfer.shm import SHM_PREFIX, ShmError, ShmSegment, valid_name
from kv_transfer.tcp import TICKET_BYTES, KvDataServer, stripes
from kv_transfer.wire import BlockSpec, DecodedBlock, KvWireError, decode_block, encode_block
from protos.splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from rpc.tls import internal_channel

DEFAULT_FRAGMENT_BYTES = 1 << 20
# PullBlocksShm reads a lease this many blocks at a time (128 MB of an 8B model's bf16 KV).
SHM_READ_BLOCKS = 64
MAX_FRAGMENT_BYTES = (4 << 20) - (64 << 10)  # stays below gRPC's default 4 MiB message cap
MAX_REQUEST_ID_CHARS = 256
_MESSAGE_SLACK = 64 << 10  # room for the KvFragment fields around `data`


def channel_options(max_fragment_bytes: int = DEFAULT_FRAGMENT_BYTES) -> list[tuple[str, int]]:
    """Options for a client channel or server carrying KvFragments of <= max_fragment_bytes."""
    limit = max_fragment_bytes + _MESSAGE_SLACK
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


@dataclass(frozen=True, slots=True)
class LeaseView:
    """What the server needs to stream one request's blocks.

    block_ids: engine block ids in prompt order; block_hashes: hashes of the full blocks (may be
    shorter than block_ids); num_tokens: prompt tokens held (the last block may be partial).
    """

    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int


class KvBlockSource(Protocol):
    """The engine side of a KvTransfer server (implemented over the runner's KV cache).

    The source guarantees a leased block is not reused while the lease lives; `read_block`
    must return a copy (or a tensor nobody writes while it is being encoded).
    """

    @property
    def spec(self) -> BlockSpec: ...

    def lookup(self, request_id: str) -> LeaseView | None:
        """The live lease of request_id, or None (unknown, released or expired)."""
        ...

    async def read_block(self, block_id: int) -> torch.Tensor:
        """CPU tensor [num_layers, 2, block_size, num_kv_heads, head_dim] of spec.dtype."""
        ...

    async def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """CPU tensor [n, num_layers, 2, block_size, num_kv_heads, head_dim] of spec.dtype."""
        ...

    def release(self, request_id: str) -> bool:
        """Drop the lease and free its blocks; False if there was no lease."""
        ...


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """Thin async servicer: validates, then streams the lease's blocks as fragments.

    kv_scales: the cache's per-layer scales [num_layers, 2] float32 for 1-byte KV dtypes (sent
    with every block), None otherwise. ipc_cache: the source's whole KV cache on its GPU
    ([L, 2, num_blocks, ...], the tensor the lease's block ids index), for `PullBlocksIpc`; None
    (a CPU engine) answers those calls FAILED_PRECONDITION. data_server: the worker's KV data
    port (`kv_transfer.tcp`), which `PullBlocksTcp` issues tickets for; None answers those calls
    FAILED_PRECONDITION.
    """

    def __init__(
        self,
        source: KvBlockSource,
        fragment_bytes: int = DEFAULT_FRAGMENT_BYTES,
        kv_scales: torch.Tensor | None = None,
        ipc_cache: torch.Tensor | None = None,
        data_server: KvDataServer | None = None,
    ) -> None:
        if not 1 <= fragment_bytes <= MAX_FRAGMENT_BYTES:
            raise ValueError(f"fragment_bytes must be in [1, {MAX_FRAGMENT_BYTES}], "
                             f"got {fragment_bytes}")
        self._source = source
        self._fragment_bytes = fragment_bytes
        self._kv_scales = kv_scales
        self._ipc_cache = ipc_cache if ipc_cache is not None and ipc_cache.is_cuda else None
        self._ipc_uuid = (device_uuid(self._ipc_cache.device) if self._ipc_cache is not None
                          else b"")
        self._data_server = data_server

    @property
    def block_nbytes(self) -> int:
        """Raw bytes of one block (what the raw ways send per block)."""
        return self._source.spec.block_nbytes

    async def PullBlocks(
        self,
        request: kv_transfer_pb2.PullBlocksRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[kv_transfer_pb2.KvFragment]:
        spec = self._source.spec
        await _check_request_id(request.request_id, context)
        if request.fingerprint != spec.fingerprint:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"fingerprint {request.fingerprint.hex()[:16]} differs from this worker's "
                f"{spec.fingerprint.hex()[:16]}: KV is not interchangeable")
        lease = self._source.lookup(request.request_id)
        if lease is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no live KV lease for request {request.request_id!r}")
            return  # abort() raises; never reached
        first = request.first_block
        if first >= len(lease.block_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"first_block {first} is past the lease's "
                                f"{len(lease.block_ids)} blocks")
        for index in range(first, len(lease.block_ids)):
            data = await self._encode(spec, lease, index)
            for offset in range(0, len(data), self._fragment_bytes):
                yield kv_transfer_pb2.KvFragment(
                    block_index=index, offset=offset, total_bytes=len(data),
                    data=data[offset:offset + self._fragment_bytes])
        await self._check_still_leased(request.request_id, lease, context)

    async def _check_still_leased(self, request_id: str, lease: LeaseView,
                                  context: grpc.aio.ServicerContext) -> None:
        """After a raw or streamed pull's last read: had the lease ended before it (expiry), its
        blocks could have gone to another request, so the call fails (ABORTED) rather than
        ending as if the bytes sent were this lease's KV."""
        now = self._source.lookup(request_id)
        if now is None or now.block_ids != lease.block_ids:
            await context.abort(grpc.StatusCode.ABORTED,
                                f"the KV lease of {request_id!r} ended during the transfer")

    async def _encode(self, spec: BlockSpec, lease: LeaseView, index: int) -> bytes:
        """Block `index` of the lease, serialized on the event loop. (Reading the next block
        and checksumming in a thread while this one is sent was measured: the pulls then took
        the prefill worker's interpreter from its engine, and first tokens came 4.5x later at
        16 concurrent requests on an H200, bench/results/h200/probe_disagg_1e28151.json.)"""
        num_tokens = block_num_tokens(index, lease.num_tokens, spec.block_size)
        full = num_tokens == spec.block_size
        block_hash = lease.block_hashes[index] if full and index < len(lease.block_hashes) else None
        tensor = await self._source.read_block(lease.block_ids[index])
        return encode_block(spec, block_hash, num_tokens, tensor, self._kv_scales)

    async def _lease(self, request_id: str, fingerprint: bytes, first_block: int,
                     context: grpc.aio.ServicerContext) -> LeaseView:
        """The live lease a raw pull (shared memory, CUDA IPC) asks for, after the checks every
        pull makes; aborts the call otherwise."""
        await _check_request_id(request_id, context)
        if fingerprint != self._source.spec.fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "fingerprint differs from this worker's: KV is not interchangeable")
        lease = self._source.lookup(request_id)
        if lease is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no live KV lease for request {request_id!r}")
            raise AssertionError("unreachable")  # abort() raises
        if first_block >= len(lease.block_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"first_block {first_block} is past the lease's "
                                f"{len(lease.block_ids)} blocks")
        return lease

    async def PullBlocksShm(
        self,
        request: kv_transfer_pb2.PullBlocksShmRequest,
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.PullBlocksShmResponse:
        spec = self._source.spec
        if not valid_name(request.shm_name):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"shm_name must be {SHM_PREFIX} and 32 hex digits")
        lease = await self._lease(request.request_id, request.fingerprint, request.first_block,
                                  context)
        ids = lease.block_ids[request.first_block:]
        size = len(ids) * spec.block_nbytes
        if request.shm_bytes != size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"shm_bytes is {request.shm_bytes}; {len(ids)} blocks need {size}")
        try:
            segment = ShmSegment.open(request.shm_name, size)
        except ShmError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise AssertionError("unreachable") from exc
        try:
            # In slices, so a long prompt's KV never sits in host memory twice at once.
            for i in range(0, len(ids), SHM_READ_BLOCKS):
                blocks = await self._source.read_blocks(ids[i:i + SHM_READ_BLOCKS])
                await asyncio.to_thread(_copy_into, segment, i * spec.block_nbytes, blocks)
        finally:
            segment.close()
        await self._check_still_leased(request.request_id, lease, context)
        scales = [] if self._kv_scales is None else self._kv_scales.reshape(-1).tolist()
        return kv_transfer_pb2.PullBlocksShmResponse(
            num_blocks=len(ids), num_tokens=lease.num_tokens,
            block_hashes=list(lease.block_hashes), kv_scales=scales)

    async def PullBlocksIpc(
        self,
        request: kv_transfer_pb2.PullBlocksIpcRequest,
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.PullBlocksIpcResponse:
        if self._ipc_cache is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker's KV cache is not on a GPU")
        if len(request.device_uuid) != 16:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the puller is not on a GPU (device_uuid must be 16 bytes)")
        lease = await self._lease(request.request_id, request.fingerprint, request.first_block,
                                  context)
        first = request.first_block
        assert self._ipc_cache is not None
        try:
            export = export_cache(self._ipc_cache)
        except (IpcUnavailable, RuntimeError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no CUDA IPC here: {exc}")
            raise AssertionError("unreachable") from exc
        scales = [] if self._kv_scales is None else self._kv_scales.reshape(-1).tolist()
        return kv_transfer_pb2.PullBlocksIpcResponse(
            block_ids=lease.block_ids[first:], num_tokens=lease.num_tokens,
            block_hashes=list(lease.block_hashes), kv_scales=scales,
            cache=kv_transfer_pb2.CudaIpcCache(**dataclasses.asdict(export)),
            device_uuid=self._ipc_uuid)

    async def PullBlocksTcp(
        self,
        request: kv_transfer_pb2.PullBlocksTcpRequest,
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.PullBlocksTcpResponse:
        if self._data_server is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker has no KV data port")
        assert self._data_server is not None
        lease = await self._lease(request.request_id, request.fingerprint, request.first_block,
                                  context)
        ids = lease.block_ids[request.first_block:]
        tickets = [self._data_server.issue(request.request_id, request.first_block + start,
                                           ids[start:start + count])
                   for start, count in stripes(len(ids), request.streams)]
        scales = [] if self._kv_scales is None else self._kv_scales.reshape(-1).tolist()
        return kv_transfer_pb2.PullBlocksTcpResponse(
            num_blocks=len(ids), num_tokens=lease.num_tokens,
            block_hashes=list(lease.block_hashes), kv_scales=scales,
            data_port=self._data_server.port, tickets=tickets)

    async def Release(
        self,
        request: kv_transfer_pb2.ReleaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.ReleaseResponse:
        await _check_request_id(request.request_id, context)
        return kv_transfer_pb2.ReleaseResponse(released=self._source.release(request.request_id))


async def _check_request_id(request_id: str, context: grpc.aio.ServicerContext) -> None:
    if not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters, "
                            f"got {len(request_id)}")


def _copy_into(segment: ShmSegment, offset: int, blocks: torch.Tensor) -> None:
    src = blocks.contiguous().view(torch.uint8).reshape(-1)
    dst = segment.tensor(torch.uint8, (segment.size,))
    dst[offset:offset + src.numel()].copy_(src)
    del dst  # the segment's buffer is exported while a tensor views it


def block_num_tokens(index: int, num_tokens: int, block_size: int) -> int:
    """Tokens in block `index` of a prompt of num_tokens: block_size except for the last one."""
    return min(block_size, num_tokens - index * block_size)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


# ----------------------------------------------------------------------------- client side


class KvTransferError(Exception):
    """A KV pull or release failed; never partial data. `reason` is one of:
    not_found, fingerprint_mismatch, invalid_argument, deadline_exceeded, unavailable,
    cancelled, lease_lost (the lease ended during the transfer), rpc_error (other status), protocol (malformed fragment stream), wire (a block
    failed verification), count_mismatch (not the expected blocks/tokens)."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"KV transfer failed ({reason}): {message}")
        self.reason = reason
        self.code = code


_REASONS = {
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.FAILED_PRECONDITION: "fingerprint_mismatch",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.ABORTED: "lease_lost",
}


def _rpc_failure(err: grpc.aio.AioRpcError) -> KvTransferError:
    code = err.code()
    return KvTransferError(_REASONS.get(code, "rpc_error"), f"{code.name}: {err.details()}", code)


class _Reassembler:
    """Rebuilds blocks from fragments; checks order, offsets and sizes before copying."""

    def __init__(self, spec: BlockSpec, num_blocks_expected: int, first_block: int = 0) -> None:
        self._spec = spec
        self._expected_bytes = spec.encoded_nbytes
        self._num_blocks = num_blocks_expected
        self.index = first_block  # block being received
        self._buf = bytearray()
        self._filled = 0

    def feed(self, frag: kv_transfer_pb2.KvFragment) -> bytearray | None:
        """Add one fragment; returns the block's bytes when its last fragment arrived (then
        `finish` them: verify and decode, which may run in another thread)."""
        if frag.block_index != self.index or self.index >= self._num_blocks:
            raise KvTransferError("protocol", f"fragment of block {frag.block_index}, expected "
                                  f"block {self.index} of {self._num_blocks}")
        if frag.total_bytes != self._expected_bytes:
            raise KvTransferError("protocol", f"block {self.index} declares {frag.total_bytes} "
                                  f"bytes; the local spec encodes to {self._expected_bytes}")
        size = len(frag.data)
        if frag.offset != self._filled or size == 0 or self._filled + size > frag.total_bytes:
            raise KvTransferError("protocol", f"block {self.index}: fragment at offset "
                                  f"{frag.offset} (+{size} B) after {self._filled} B received")
        if self._filled == 0:
            self._buf = bytearray(frag.total_bytes)  # bounded: equals spec.encoded_nbytes
        self._buf[self._filled:self._filled + size] = frag.data
        self._filled += size
        if self._filled < frag.total_bytes:
            return None
        data, self._buf, self._filled = self._buf, bytearray(), 0
        self.index += 1
        return data

    def finish(self, index: int, data: bytearray) -> DecodedBlock:
        """Verify (CRC) and decode block `index`'s bytes from `feed`."""
        try:
            return decode_block(data, self._spec)
        except KvWireError as exc:
            raise KvTransferError("wire", f"block {index}: {exc}") from exc

    def check_complete(self) -> None:
        if self._filled or self.index != self._num_blocks:
            raise KvTransferError("count_mismatch", f"stream ended after {self.index} of "
                                  f"{self._num_blocks} blocks ({self._filled} B of a partial one)")


def _check_tokens(index: int, block: DecodedBlock, spec: BlockSpec, num_blocks: int,
                  num_tokens_expected: int | None) -> None:
    """Only the last block may be partial; with num_tokens_expected, counts must match."""
    if num_tokens_expected is not None:
        want = block_num_tokens(index, num_tokens_expected, spec.block_size)
    else:
        want = block.num_tokens if index == num_blocks - 1 else spec.block_size
    if block.num_tokens != want:
        raise KvTransferError("count_mismatch", f"block {index} holds {block.num_tokens} "
                              f"tokens, expected {want}")


async def pull_blocks(
    target: str | grpc.aio.Channel,
    request_id: str,
    spec: BlockSpec,
    num_blocks_expected: int,
    timeout_s: float,
    num_tokens_expected: int | None = None,
    first_block: int = 0,
    metadata: Sequence[tuple[str, str]] = (),
) -> AsyncGenerator[tuple[int, DecodedBlock], None]:
    """Pull a lease's blocks, yielding (index, verified block) as each one completes.

    num_blocks_expected: blocks in the whole lease; first_block: pull from this index on (the
    caller already holds the earlier ones); indices stay the lease's.

    target: "host:port" (a channel is opened and closed here) or an open grpc.aio channel.
    timeout_s: deadline of the whole pull. metadata: sent with the call (the cluster's
    credential, rpc/auth.py). Raises KvTransferError on any failure, possibly after
    some blocks were yielded: the caller must then discard what it wrote (use `pull_all` to get
    nothing unless everything arrived).
    """
    if num_blocks_expected <= 0:
        raise ValueError(f"num_blocks_expected must be >= 1, got {num_blocks_expected}")
    if not 0 <= first_block < num_blocks_expected:
        raise ValueError(f"first_block must be in [0, {num_blocks_expected}), got {first_block}")
    if num_tokens_expected is not None and (
            num_blocks_for(num_tokens_expected, spec.block_size) != num_blocks_expected):
        raise ValueError(f"{num_tokens_expected} tokens do not fill {num_blocks_expected} "
                         f"blocks of {spec.block_size}")
    async with AsyncExitStack() as stack:
        channel = await stack.enter_async_context(
            _channel(target, channel_options(MAX_FRAGMENT_BYTES)))
        items = await stack.enter_async_context(aclosing(
            _pull(channel, request_id, spec, num_blocks_expected, timeout_s, num_tokens_expected,
                  first_block, metadata)))
        async for item in items:
            yield item


async def _pull(channel: grpc.aio.Channel, request_id: str, spec: BlockSpec, num_blocks: int,
                timeout_s: float, num_tokens_expected: int | None, first_block: int = 0,
                metadata: Sequence[tuple[str, str]] = (),
                ) -> AsyncGenerator[tuple[int, DecodedBlock], None]:
    stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
    request = kv_transfer_pb2.PullBlocksRequest(request_id=request_id,
                                                fingerprint=spec.fingerprint,
                                                first_block=first_block)
    call = stub.PullBlocks(request, timeout=timeout_s, metadata=tuple(metadata))
    reassembler = _Reassembler(spec, num_blocks, first_block)
    try:
        async for frag in call:
            data = reassembler.feed(frag)
            if data is not None:
                index = reassembler.index - 1
                # The checksum and copy in a thread: they release the GIL, and the event loop
                # serves the worker's other pulls and calls meanwhile.
                block = await asyncio.to_thread(reassembler.finish, index, data)
                _check_tokens(index, block, spec, num_blocks, num_tokens_expected)
                yield index, block
        reassembler.check_complete()
    except grpc.aio.AioRpcError as err:
        raise _rpc_failure(err) from err
    finally:
        call.cancel()  # no-op when the call already ended; stops the server on early exit


async def pull_all(
    target: str | grpc.aio.Channel,
    request_id: str,
    spec: BlockSpec,
    num_blocks_expected: int,
    timeout_s: float,
    num_tokens_expected: int | None = None,
    first_block: int = 0,
    metadata: Sequence[tuple[str, str]] = (),
) -> list[DecodedBlock]:
    """All blocks in order (from `first_block`), or KvTransferError: never a partial list."""
    blocks: list[DecodedBlock] = []
    async with aclosing(pull_blocks(target, request_id, spec, num_blocks_expected, timeout_s,
                                    num_tokens_expected, first_block, metadata)) as items:
        async for _, block in items:
            blocks.append(block)
    return blocks


@dataclass(slots=True)
class ShmPull:
    """The lease's blocks from `first_block`, raw in a shared-memory segment this side made.
    `blocks` views the segment: drop it before `segment.close()`."""

    segment: ShmSegment
    blocks: torch.Tensor          # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
    num_tokens: int
    block_hashes: list[bytes]
    kv_scales: torch.Tensor | None


async def pull_blocks_shm(target: str | grpc.aio.Channel, request_id: str, spec: BlockSpec, num_blocks: int,
                          timeout_s: float, first_block: int = 0,
                          metadata: Sequence[tuple[str, str]] = ()) -> ShmPull:
    """`PullBlocksShm` into a new segment. Raises KvTransferError (reason "shm_unavailable"
    when the server could not open the segment: another host, or a server without shared
    memory; the caller falls back to `pull_blocks`)."""
    n = num_blocks - first_block
    if n <= 0:
        raise ValueError(f"first_block {first_block} leaves no blocks of {num_blocks}")
    try:
        segment = ShmSegment.create(n * spec.block_nbytes)
    except ShmError as exc:
        raise KvTransferError("shm_unavailable", str(exc)) from exc
    try:
        async with _channel(target) as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
            response = await stub.PullBlocksShm(kv_transfer_pb2.PullBlocksShmRequest(
                request_id=request_id, fingerprint=spec.fingerprint, first_block=first_block,
                shm_name=segment.name, shm_bytes=segment.size),
                timeout=timeout_s, metadata=tuple(metadata))
        if response.num_blocks != n:
            raise KvTransferError("count_mismatch", f"the server wrote {response.num_blocks} "
                                  f"blocks, expected {n}")
        _check_lease_tokens(response.num_tokens, num_blocks, spec)
        scales = _scales(response.kv_scales, spec)
        blocks = segment.tensor(spec.dtype, (n, *spec.shape))
    except grpc.aio.AioRpcError as err:
        segment.close()
        raise _raw_pull_failure(err, "shm_unavailable") from err
    except BaseException:
        segment.close()
        raise
    return ShmPull(segment, blocks, response.num_tokens, list(response.block_hashes), scales)


@dataclass(frozen=True, slots=True)
class TcpPull:
    """Tickets for the lease's blocks from `first_block` on the worker's data port: ticket i
    sends `stripes(num_blocks - first_block, len(tickets))[i]` of them."""

    data_port: int
    tickets: list[bytes]
    num_tokens: int
    block_hashes: list[bytes]
    kv_scales: torch.Tensor | None


async def pull_blocks_tcp(target: str | grpc.aio.Channel, request_id: str, spec: BlockSpec, num_blocks: int,
                          timeout_s: float, first_block: int = 0,
                          metadata: Sequence[tuple[str, str]] = (), streams: int = 1) -> TcpPull:
    """`PullBlocksTcp`: tickets for `streams` connections at once (nothing is sent yet;
    `kv_transfer.tcp.receive_blocks` reads each stripe). Raises KvTransferError (reason
    "tcp_unavailable" when the worker has no data port; the caller falls back to the next
    way)."""
    n = num_blocks - first_block
    if n <= 0:
        raise ValueError(f"first_block {first_block} leaves no blocks of {num_blocks}")
    try:
        async with _channel(target) as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
            response = await stub.PullBlocksTcp(kv_transfer_pb2.PullBlocksTcpRequest(
                request_id=request_id, fingerprint=spec.fingerprint, first_block=first_block,
                streams=streams), timeout=timeout_s, metadata=tuple(metadata))
    except grpc.aio.AioRpcError as err:
        raise _raw_pull_failure(err, "tcp_unavailable") from err
    if response.num_blocks != n:
        raise KvTransferError("count_mismatch", f"the ticket sends {response.num_blocks} blocks, "
                              f"expected {n}")
    _check_lease_tokens(response.num_tokens, num_blocks, spec)
    tickets = [bytes(t) for t in response.tickets]
    if (not 1 <= response.data_port <= 65535 or len(tickets) != len(stripes(n, streams))
            or any(len(t) != TICKET_BYTES for t in tickets)):
        raise KvTransferError("protocol", "PullBlocksTcp answered without a usable data port "
                              "or one ticket per stripe")
    return TcpPull(response.data_port, tickets, response.num_tokens,
                   list(response.block_hashes), _scales(response.kv_scales, spec))


@dataclass(frozen=True, slots=True)
class IpcPull:
    """Where the lease's blocks from `first_block` sit in the exporting worker's KV cache."""

    export: CacheExport
    block_ids: list[int]          # in the exporter's cache, from first_block on
    num_tokens: int
    block_hashes: list[bytes]
    kv_scales: torch.Tensor | None
    device_uuid: bytes            # the exporter's GPU


async def pull_blocks_ipc(target: str | grpc.aio.Channel, request_id: str, spec: BlockSpec, num_blocks: int,
                          timeout_s: float, uuid: bytes, first_block: int = 0,
                          metadata: Sequence[tuple[str, str]] = ()) -> IpcPull:
    """`PullBlocksIpc`: the lease's block ids and the exporter's cache handle (nothing is copied
    yet), and the GPU it is on. uuid: the puller's GPU (`device_uuid`; b"": none). Raises
    KvTransferError (reason "ipc_unavailable" when the puller or the server has no GPU; the
    caller falls back to the next way)."""
    n = num_blocks - first_block
    if n <= 0:
        raise ValueError(f"first_block {first_block} leaves no blocks of {num_blocks}")
    if not uuid:
        raise KvTransferError("ipc_unavailable", "the puller is not on a GPU")
    try:
        async with _channel(target) as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
            response = await stub.PullBlocksIpc(kv_transfer_pb2.PullBlocksIpcRequest(
                request_id=request_id, fingerprint=spec.fingerprint, first_block=first_block,
                device_uuid=uuid), timeout=timeout_s, metadata=tuple(metadata))
    except grpc.aio.AioRpcError as err:
        raise _raw_pull_failure(err, "ipc_unavailable") from err
    if len(response.block_ids) != n:
        raise KvTransferError("count_mismatch", f"the lease has {len(response.block_ids)} blocks "
                              f"from {first_block}, expected {n}")
    _check_lease_tokens(response.num_tokens, num_blocks, spec)
    # The message's fields are the dataclass's, by name.
    export = CacheExport(**{f.name: getattr(response.cache, f.name)
                            for f in dataclasses.fields(CacheExport)})
    if any(not 0 <= b < export.num_blocks for b in response.block_ids):
        raise KvTransferError("protocol", f"block ids outside the exported cache's "
                              f"{export.num_blocks} blocks")
    return IpcPull(export, list(response.block_ids), response.num_tokens,
                   list(response.block_hashes), _scales(response.kv_scales, spec),
                   bytes(response.device_uuid))


@asynccontextmanager
async def _channel(target: str | grpc.aio.Channel, options: Sequence[tuple[str, Any]] = ()
                   ) -> AsyncIterator[grpc.aio.Channel]:
    """A channel for one call: `target` itself when it is one (the caller keeps it: see
    rpc/channels.py), else a new one to that address, closed afterwards."""
    if isinstance(target, str):
        async with internal_channel(target, options=options) as channel:
            yield channel
    else:
        yield target


def _raw_pull_failure(err: grpc.aio.AioRpcError, unavailable: str) -> KvTransferError:
    """A raw pull's (shm, tcp, ipc) RPC error: `unavailable` (the caller tries the next way)
    when the worker cannot serve that way here, else the usual failure."""
    if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        return KvTransferError(unavailable, err.details() or "", err.code())
    return _rpc_failure(err)


def _check_lease_tokens(num_tokens: int, num_blocks: int, spec: BlockSpec) -> None:
    if num_blocks_for(num_tokens, spec.block_size) != num_blocks:
        raise KvTransferError("count_mismatch", f"the lease holds {num_tokens} tokens, not "
                              f"{num_blocks} blocks of {spec.block_size}")


def _scales(values: Sequence[float], spec: BlockSpec) -> torch.Tensor | None:
    """The [num_layers, 2] KV scales of a response (None when it sends none)."""
    if not values:
        return None
    if len(values) != 2 * spec.num_layers:
        raise KvTransferError("protocol", f"{len(values)} KV scales for {spec.num_layers} layers")
    return torch.tensor(list(values), dtype=torch.float32).view(-1, 2)


async def release(target: str | grpc.aio.Channel, request_id: str, timeout_s: float = 5.0,
                  metadata: Sequence[tuple[str, str]] = ()) -> bool:
    """Ask the prefill worker to drop the lease; False if it had none (released or expired)."""
    async with _channel(target) as channel:
        return await _release(channel, request_id, timeout_s, metadata)


async def _release(channel: grpc.aio.Channel, request_id: str, timeout_s: float,
                   metadata: Sequence[tuple[str, str]]) -> bool:
    stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
    try:
        response = await stub.Release(kv_transfer_pb2.ReleaseRequest(request_id=request_id),
                                      timeout=timeout_s, metadata=tuple(metadata))
    except grpc.aio.AioRpcError as err:
        raise _rpc_failure(err) from err
    return response.released
