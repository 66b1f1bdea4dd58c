"""The ways a decode worker pulls one lease into its KV cache (`PullWays`), each ending with the
lease released: CUDA IPC (a device-to-device copy out of the prefill worker's cache, mapped on
this GPU), the prefill worker's KV data port (TCP), a shared-memory segment (one host), or the
gRPC stream. `GrpcPullConnector` (kv_transfer/connector.py) picks the way; here each one moves
the blocks and checks them against the handle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any, Protocol, cast

import grpc
import torch

from kv_transfer import WRITE_BATCH_BLOCKS
from kv_transfer.cuda_ipc import CacheImporter, IpcUnavailable, device_uuid, local_device, reachable
from kv_transfer.handle import KvHandle, LoadResult, hash_matches
from kv_transfer.protocol import MAX_FRAGMENT_BYTES, KvTransferError, channel_options
from kv_transfer.pull_client import pull_blocks, release
from kv_transfer.raw_pulls import pull_blocks_ipc, pull_blocks_shm, pull_blocks_tcp
from kv_transfer.tcp import TcpTransferError, TcpUnavailable, receive_blocks, stripes
from kv_transfer.wire import BlockSpec
from rpc.auth import lease_ticket_metadata
from rpc.channels import ChannelCache
from rpc.tls import tls_paths_from_env

# The connector's logger: a pull's log lines (its stages at DEBUG, which
# tools/gpu/summarize_pull_stages.py reads) stay under the one name operators set.
log = logging.getLogger("kv_transfer.connector")


class KvBlockSink(Protocol):
    """Destination of loaded blocks: the decode worker's KV cache."""

    def write_blocks(self, block_ids: list[int], tensors: torch.Tensor) -> None:
        """Copy tensors [n, num_layers, 2, block_size, num_kv_heads, head_dim] (CPU) into
        local blocks `block_ids`. Called in a worker thread (it may wait for the device)."""
        ...


class DeviceKvBlockSink(KvBlockSink, Protocol):
    """A sink on a GPU that can also copy blocks device to device (same-GPU pulls)."""

    @property
    def device(self) -> torch.device: ...

    def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                         src_block_ids: list[int]) -> None:
        """Copy blocks `src_block_ids` of `src_cache` ([L, 2, num_blocks, block_size, Hkv, D],
        on this sink's device, the cache dtype) into local blocks `block_ids`; returns when the
        copy is complete. Called in a worker thread."""
        ...


class PullWays:
    """How one lease's blocks get into `sink`, by each way; a load's result is reported, and a
    way that cannot be used here raises KvTransferError with its "*_unavailable" reason.

    kv_scales: local per-layer scales [num_layers, 2] for 1-byte KV; incoming blocks must carry
    equal scales. metadata: sent with every release (the cluster's credential). channels: the
    connector's, to the prefill workers (used on its loop only). ipc_device: the sink's GPU
    when it can copy device to device (None: no CUDA IPC).
    """

    def __init__(self, spec: BlockSpec, sink: KvBlockSink, channels: ChannelCache,
                 timeout_s: float, kv_scales: torch.Tensor | None,
                 metadata: tuple[tuple[str, str], ...], use_ipc: bool,
                 tcp_streams: int) -> None:
        self._spec = spec
        self._metadata = metadata
        self._sink = sink
        self._channels = channels
        self._timeout_s = timeout_s
        self._kv_scales = kv_scales
        self._tcp_streams = tcp_streams
        self._tls: tuple[ssl.SSLContext | None, str | None] | None = None  # see _tls_client
        device = getattr(sink, "device", None)
        on_gpu = (use_ipc and isinstance(device, torch.device) and device.type == "cuda"
                  and hasattr(sink, "copy_blocks_from"))
        self.ipc_device: torch.device | None = device if on_gpu else None
        self._ipc_sink = cast(DeviceKvBlockSink, sink) if on_gpu else None
        # Once: the sink's GPU does not change.
        self._ipc_uuid = device_uuid(self.ipc_device) if self.ipc_device is not None else b""
        self._importer = CacheImporter()
        # Pinned when the sink is on a GPU (whether or not IPC is allowed): its copies then
        # read page-locked memory.
        self.staging = StagingPool(WRITE_BATCH_BLOCKS * spec.block_nbytes,
                                   pinned=isinstance(device, torch.device)
                                   and device.type == "cuda", keep=2 * tcp_streams)

    def _channel(self, handle: KvHandle,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        return self._channels.get(handle.worker_address, options)

    def check_lease(self, handle: KvHandle, first_block: int, num_tokens: int,
                    kv_scales: torch.Tensor | None, block_hashes: Sequence[bytes]) -> str | None:
        """What the prefill worker says it holds against the handle: None if it matches, else
        the failure reason (the lease holds other tokens than the handle names, or KV under
        other scales: never use it as this prompt's KV)."""
        if num_tokens != handle.num_tokens:
            return "count_mismatch"
        if self._kv_scales is not None and (kv_scales is None
                                            or not torch.equal(kv_scales, self._kv_scales)):
            return "scales_mismatch"
        for index in range(first_block, handle.num_blocks):
            got = block_hashes[index] if index < len(block_hashes) else None
            if not hash_matches(handle, index, got):
                return "hash_mismatch"
        return None

    async def ipc(self, request_id: str, handle: KvHandle, block_ids: list[int],
                  first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        """Same GPU, or a peer GPU of this host: map the prefill worker's cache (once, on its
        GPU) and copy the lease's blocks device to device. Raises
        KvTransferError("ipc_unavailable") when another way must be used."""
        device, sink = self.ipc_device, self._ipc_sink
        assert device is not None and sink is not None
        marks = [time.perf_counter()]  # stage ends, for the debug log of a pull's time
        pull = await pull_blocks_ipc(self._channel(handle), handle.request_id, self._spec,
                                     handle.num_blocks, self._timeout_s, self._ipc_uuid,
                                     first_block, metadata)
        problem = self.check_lease(handle, first_block, pull.num_tokens, pull.kv_scales,
                                   pull.block_hashes)
        if problem:
            return LoadResult(request_id, False, problem)
        src_device = local_device(pull.device_uuid)
        if src_device is None:
            raise KvTransferError("ipc_unavailable", "the prefill worker's GPU is not visible here")
        if not reachable(src_device, device):
            raise KvTransferError("ipc_unavailable", f"{device} has no peer access to the "
                                  f"prefill worker's GPU ({src_device})")
        marks.append(time.perf_counter())
        try:
            src = await asyncio.to_thread(self._importer.open, pull.export, src_device,
                                          self._spec.dtype, self._spec.shape,
                                          handle.worker_address)
        except IpcUnavailable as exc:
            raise KvTransferError("ipc_unavailable", str(exc)) from exc
        except ValueError as exc:
            log.warning("KV load %s: bad CUDA IPC export: %s", request_id, exc)
            return LoadResult(request_id, False, "protocol")
        marks.append(time.perf_counter())
        try:
            await asyncio.to_thread(sink.copy_blocks_from, block_ids, src, pull.block_ids)
        except (ValueError, RuntimeError, IndexError) as exc:
            log.error("KV load %s: device copy failed: %s", request_id, exc)
            return LoadResult(request_id, False, "sink_error")
        finally:
            del src
        marks.append(time.perf_counter())
        # The copy read the prefill worker's cache directly: only a release that finds the
        # lease still live proves no other request was given those blocks before it ended.
        if not await self.release_lease(handle):
            log.warning("KV load %s: the lease ended before the device copy did", request_id)
            return LoadResult(request_id, False, "lease_lost")
        marks.append(time.perf_counter())
        if log.isEnabledFor(logging.DEBUG):  # where a pull's time goes, stage by stage
            log.debug("KV IPC load %s: %d blocks; lease %.2f ms, map %.2f ms, copy %.2f ms, "
                      "release %.2f ms", request_id, len(block_ids),
                      *((b - a) * 1e3 for a, b in itertools.pairwise(marks)))
        return LoadResult(request_id, True)

    async def shm(self, request_id: str, handle: KvHandle, block_ids: list[int],
                  first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        """Same host: the blocks arrive raw in a shared-memory segment, then go into the sink
        in batches. Raises KvTransferError("shm_unavailable") when the stream must be used."""
        pull = await pull_blocks_shm(self._channel(handle), handle.request_id, self._spec,
                                     handle.num_blocks, self._timeout_s, first_block, metadata)
        try:
            problem = self.check_lease(handle, first_block, pull.num_tokens, pull.kv_scales,
                                       pull.block_hashes)
            if problem:
                return LoadResult(request_id, False, problem)
            for i in range(0, len(block_ids), WRITE_BATCH_BLOCKS):
                await self._write(block_ids[i:i + WRITE_BATCH_BLOCKS],
                                  pull.blocks[i:i + WRITE_BATCH_BLOCKS])
        except (ValueError, RuntimeError, IndexError) as exc:  # raised by the sink
            log.error("KV load %s: sink failed: %s", request_id, exc)
            return LoadResult(request_id, False, "sink_error")
        finally:
            del pull.blocks  # views the segment
            pull.segment.close()
        await self.release_lease(handle)
        return LoadResult(request_id, True)

    async def tcp(self, request_id: str, handle: KvHandle, block_ids: list[int],
                  first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        """Any host: tickets over gRPC, then the blocks raw from the worker's data port over
        up to `tcp_streams` connections at once (a contiguous stripe each), each batch into
        the sink as it lands. Raises KvTransferError("tcp_unavailable") when another way must
        be used (no data port, or no connection could be made: nothing was written)."""
        pull = await pull_blocks_tcp(self._channel(handle), handle.request_id, self._spec,
                                     handle.num_blocks, self._timeout_s, first_block, metadata,
                                     streams=self._tcp_streams)
        problem = self.check_lease(handle, first_block, pull.num_tokens, pull.kv_scales,
                                   pull.block_hashes)
        if problem:
            return LoadResult(request_id, False, problem)
        spec, sink, staging_pool = self._spec, self._sink, self.staging
        host = handle.worker_address.rsplit(":", 1)[0].strip("[]")
        tls, server_name = self._tls_client()
        stop = threading.Event()  # set: the load ended (failed, cancelled): write nothing more

        def receive(ticket: bytes, start: int, count: int) -> None:  # one stripe, in a thread
            staging = staging_pool.take()

            def write(first: int, n: int) -> None:
                if stop.is_set():
                    raise TcpTransferError("the load ended")
                blocks = staging[:n * spec.block_nbytes].view(spec.dtype)
                ids = block_ids[start + first:start + first + n]
                sink.write_blocks(ids, blocks.view(n, *spec.shape))

            try:
                receive_blocks(host, pull.data_port, ticket, count, spec.block_nbytes, staging,
                               write, self._timeout_s, tls, server_name)
            except BaseException:
                stop.set()  # the other stripes stop at their next batch
                raise
            finally:
                staging_pool.give(staging)  # here: only once this thread is done with it

        parts = stripes(len(block_ids), len(pull.tickets))
        try:
            outcomes = await asyncio.gather(
                *(asyncio.to_thread(receive, ticket, start, count)
                  for ticket, (start, count) in zip(pull.tickets, parts, strict=True)),
                return_exceptions=True)
        finally:
            stop.set()
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors and all(isinstance(e, TcpUnavailable) for e in outcomes):
            raise KvTransferError("tcp_unavailable", str(errors[0])) from errors[0]
        if errors:
            return self._tcp_failure(request_id, errors)
        await self.release_lease(handle)
        return LoadResult(request_id, True)

    def _tls_client(self) -> tuple[ssl.SSLContext | None, str | None]:
        """The data port's TLS client side (context, server name), built at the first TCP pull
        and kept: building it reads the PEM files."""
        if self._tls is None:
            paths = tls_paths_from_env()
            self._tls = (paths.client_context(), paths.server_name) if paths else (None, None)
        return self._tls

    def _tcp_failure(self, request_id: str, errors: list[BaseException]) -> LoadResult:
        """The failed load of a TCP pull, named by its first telling error (a stripe stopped
        because another failed says nothing)."""
        telling = [e for e in errors
                   if not (isinstance(e, TcpTransferError) and str(e) == "the load ended")]
        exc = (telling or errors)[0]
        if isinstance(exc, TimeoutError):
            log.warning("KV load %s over TCP timed out: %s", request_id, exc)
            return LoadResult(request_id, False, "deadline_exceeded")
        if isinstance(exc, (TcpTransferError, TcpUnavailable)):
            log.warning("KV load %s over TCP failed: %s", request_id, exc)
            return LoadResult(request_id, False, "unavailable")
        if isinstance(exc, (ValueError, RuntimeError, IndexError)):  # raised by the sink
            log.error("KV load %s: sink failed: %s", request_id, exc)
            return LoadResult(request_id, False, "sink_error")
        raise exc

    async def stream(self, request_id: str, handle: KvHandle, block_ids: list[int],
                     first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        blocks = pull_blocks(self._channel(handle, channel_options(MAX_FRAGMENT_BYTES)),
                             handle.request_id, self._spec,
                             handle.num_blocks, self._timeout_s,
                             num_tokens_expected=handle.num_tokens, first_block=first_block,
                             metadata=metadata)
        ids: list[int] = []
        tensors: list[torch.Tensor] = []
        try:
            async with aclosing(blocks):
                async for index, block in blocks:
                    if self._kv_scales is not None and (block.scales is None or
                                                        not torch.equal(block.scales,
                                                                        self._kv_scales)):
                        return LoadResult(request_id, False, "scales_mismatch")
                    if not hash_matches(handle, index, block.block_hash):
                        # The lease holds other tokens than the handle names (the lease id was
                        # reused, or a mix-up upstream): never use them as this prompt's KV.
                        return LoadResult(request_id, False, "hash_mismatch")
                    ids.append(block_ids[index - first_block])
                    tensors.append(block.tensor)
                    if len(ids) == WRITE_BATCH_BLOCKS:
                        await self._write(ids, torch.stack(tensors))
                        ids, tensors = [], []
            if ids:
                await self._write(ids, torch.stack(tensors))
        except KvTransferError as exc:
            log.warning("KV load %s failed: %s", request_id, exc)
            return LoadResult(request_id, False, exc.reason)
        except (ValueError, RuntimeError, IndexError) as exc:  # raised by the sink
            log.error("KV load %s: sink failed: %s", request_id, exc)
            return LoadResult(request_id, False, "sink_error")
        await self.release_lease(handle)
        return LoadResult(request_id, True)

    async def _write(self, ids: list[int], tensors: torch.Tensor) -> None:
        """Into the sink, off the event loop (a GPU write waits for the device)."""
        await asyncio.to_thread(self._sink.write_blocks, ids, tensors)

    async def release_lease(self, handle: KvHandle) -> bool:
        """Release the lease; whether it was still live (False too when the call failed)."""
        try:
            return await release(self._channel(handle), handle.request_id, self._timeout_s,
                                 (*self._metadata, *lease_ticket_metadata(handle.lease_ticket)))
        except KvTransferError as exc:  # the lease expires on its own; the data is already here
            log.info("release of KV lease %s failed: %s", handle.request_id, exc)
            return False


class StagingPool:
    """Reused host buffers for TCP pulls: fresh large allocations cost page faults (a first
    touch ran at ~0.5 GB/s on the 2-core development VM against ~5 GB/s into touched memory),
    and pinned ones make a GPU sink's copies asynchronous-capable. Keeps at most `keep`."""

    def __init__(self, nbytes: int, pinned: bool, keep: int = 4) -> None:
        self._nbytes, self._pinned, self._keep = nbytes, pinned, keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.empty(self._nbytes, dtype=torch.uint8, pin_memory=self._pinned)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)

