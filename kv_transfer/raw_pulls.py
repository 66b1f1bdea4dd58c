"""The decode worker's raw ways to pull a lease, besides the stream (kv_transfer/pull_client.py):
into a shared-memory segment (`PullBlocksShm`, one host), tickets for the prefill worker's KV
data port (`PullBlocksTcp`), or its cache's CUDA IPC handle (`PullBlocksIpc`, same or peer GPU).
Each raises `KvTransferError` with an "*_unavailable" reason when that way cannot be used here,
so the caller tries the next one."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from kv_transfer.cuda_ipc import CacheExport
from kv_transfer.protocol import KvTransferError, num_blocks_for, rpc_failure
from kv_transfer.pull_client import call_channel
from kv_transfer.shm import ShmError, ShmSegment
from kv_transfer.tcp import TICKET_BYTES, stripes
from kv_transfer.wire import BlockSpec
from protos.splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


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
        async with call_channel(target) as channel:
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
        async with call_channel(target) as channel:
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
        async with call_channel(target) as channel:
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


def _raw_pull_failure(err: grpc.aio.AioRpcError, unavailable: str) -> KvTransferError:
    """A raw pull's (shm, tcp, ipc) RPC error: `unavailable` (the caller tries the next way)
    when the worker cannot serve that way here, else the usual failure."""
    if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        return KvTransferError(unavailable, err.details() or "", err.code())
    return rpc_failure(err)


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
