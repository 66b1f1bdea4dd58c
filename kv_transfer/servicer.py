"""The prefill worker's side of the KvTransfer service, pull model: a lease's blocks streamed
(`PullBlocks`: each encoded by `wire.encode_block` and cut into `KvFragment`s of at most
`fragment_bytes`), written raw into a puller's shared-memory segment (`PullBlocksShm`), exported
through CUDA IPC (`PullBlocksIpc`) or ticketed for the KV data port (`PullBlocksTcp`); and
`Release`, which drops the lease.

    block 0 bytes: [frag off=0][frag off=F][frag off=2F]...   block 1 bytes: [off=0]...
                   block_index=0, total_bytes=N0                block_index=1, total_bytes=N1
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from kv_transfer.cuda_ipc import IpcUnavailable, device_uuid, export_cache
from kv_transfer.protocol import (
    DEFAULT_FRAGMENT_BYTES,
    MAX_FRAGMENT_BYTES,
    MAX_REQUEST_ID_CHARS,
    block_num_tokens,
)
from kv_transfer.shm import SHM_PREFIX, ShmError, ShmSegment, valid_name
from kv_transfer.tcp import KvDataServer, stripes
from kv_transfer.wire import BlockSpec, encode_block
from protos.splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from rpc.auth import LeaseTickets, lease_ticket_of

# PullBlocksShm reads a lease this many blocks at a time (128 MB of an 8B model's bf16 KV).
SHM_READ_BLOCKS = 64


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
    FAILED_PRECONDITION. tickets: the lease tickets a call may carry in place of the cluster's
    secret (rpc/auth.py); a call carrying one must name the lease it was issued for.
    """

    def __init__(
        self,
        source: KvBlockSource,
        fragment_bytes: int = DEFAULT_FRAGMENT_BYTES,
        kv_scales: torch.Tensor | None = None,
        ipc_cache: torch.Tensor | None = None,
        data_server: KvDataServer | None = None,
        tickets: LeaseTickets | None = None,
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
        self._tickets = tickets

    async def _check_call(self, request_id: str, context: grpc.aio.ServicerContext) -> None:
        """The request id's form; and a lease ticket, when the call carries one (in place of
        the cluster's secret), must be the one of the lease this call names."""
        await _check_request_id(request_id, context)
        ticket = lease_ticket_of(context.invocation_metadata())
        if ticket is not None and (self._tickets is None
                                   or not self._tickets.valid(request_id, ticket)):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"the lease ticket is not the one of {request_id!r}'s lease")

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
        await self._check_call(request.request_id, context)
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
        await self._check_call(request_id, context)
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
        await self._check_call(request.request_id, context)
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
