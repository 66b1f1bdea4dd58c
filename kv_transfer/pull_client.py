"""The decode worker's side of the KvTransfer service, streamed: `pull_blocks` (block by block,
each verified as it completes) or `pull_all` (all-or-nothing), then `release` so the prefill
worker drops the lease. The raw ways (shared memory, TCP, CUDA IPC) are kv_transfer/raw_pulls.py.

Any failure (gRPC status, deadline, malformed fragments, a block that fails `decode_block`)
raises `KvTransferError`; the caller recomputes or fails (docs/architecture.md, "Failure paths").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any

import grpc

from kv_transfer.protocol import (
    MAX_FRAGMENT_BYTES,
    KvTransferError,
    block_num_tokens,
    channel_options,
    num_blocks_for,
    rpc_failure,
)
from kv_transfer.wire import BlockSpec, DecodedBlock, KvWireError, decode_block
from protos.splitserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from rpc.tls import internal_channel


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
            call_channel(target, channel_options(MAX_FRAGMENT_BYTES)))
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
        raise rpc_failure(err) from err
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


@asynccontextmanager
async def call_channel(target: str | grpc.aio.Channel, options: Sequence[tuple[str, Any]] = ()
                       ) -> AsyncIterator[grpc.aio.Channel]:
    """A channel for one call: `target` itself when it is one (the caller keeps it: see
    rpc/channels.py), else a new one to that address, closed afterwards."""
    if isinstance(target, str):
        async with internal_channel(target, options=options) as channel:
            yield channel
    else:
        yield target


async def release(target: str | grpc.aio.Channel, request_id: str, timeout_s: float = 5.0,
                  metadata: Sequence[tuple[str, str]] = ()) -> bool:
    """Ask the prefill worker to drop the lease; False if it had none (released or expired)."""
    async with call_channel(target) as channel:
        return await _release(channel, request_id, timeout_s, metadata)


async def _release(channel: grpc.aio.Channel, request_id: str, timeout_s: float,
                   metadata: Sequence[tuple[str, str]]) -> bool:
    stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
    try:
        response = await stub.Release(kv_transfer_pb2.ReleaseRequest(request_id=request_id),
                                      timeout=timeout_s, metadata=tuple(metadata))
    except grpc.aio.AioRpcError as err:
        raise rpc_failure(err) from err
    return response.released
