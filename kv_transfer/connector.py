"""The seam between the engine and KV transports/tiers, split by side (as vLLM v1 does):

    scheduler side (engine thread)                 worker side (owns the KV cache)
    ──────────────────────────────                 ─────────────────────────────────
    get_num_new_matched_tokens(request) ─ how many prompt tokens can be loaded, not computed
    update_state_after_alloc(request, block_ids) ─ blocks for them exist → start_load_kv(...)
                                                   get_finished_loads() → ok / failed per request
    request_finished(request, block_ids) ─ True: keep the blocks (e.g. under a lease)
                                                   save_kv(...) ─ push KV out (push transports)

`GrpcPullConnector` is the worker side of the decode role over `grpc_transport`: it pulls a
prefill worker's leased blocks into local blocks through a `KvBlockSink` (in batches of
`WRITE_BATCH_BLOCKS`), then releases the lease. Between workers of one GPU, or of peer GPUs of
one host, it copies the blocks device to device out of the prefill worker's cache, mapped
through CUDA IPC; otherwise raw over the prefill worker's KV data port (TCP), which measured
faster than a shared-memory segment between workers of one host (docs/performance.md, "KV
between hosts"); where the data port cannot be reached, through shared memory (one host), else
over the gRPC stream.
A failed load is reported, never raised: the engine recomputes the prompt or fails the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import ipaddress
import itertools
import logging
import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc
import torch

from engine_api.hashing import HASH_BYTES
from kv_transfer import DEFAULT_TCP_STREAMS, WRITE_BATCH_BLOCKS
from kv_transfer.cuda_ipc import (
    CacheImporter,
    IpcUnavailable,
    device_uuid,
    local_device,
    reachable,
)
from kv_transfer.grpc_transport import (
    MAX_FRAGMENT_BYTES,
    KvTransferError,
    channel_options,
    num_blocks_for,
    pull_blocks,
    pull_blocks_ipc,
    pull_blocks_shm,
    pull_blocks_tcp,
    release,
)
from kv_transfer.shm import shm_available
from kv_transfer.tcp import TcpTransferError, TcpUnavailable, receive_blocks, stripes
from kv_transfer.wire import BlockSpec
from protos.splitserve.v1 import common_pb2
from rpc.channels import ChannelCache
from rpc.tls import tls_paths_from_env

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class KvHandle:
    """Where a request's prompt KV is held (mirror of `splitserve.v1.KvHandle`)."""

    worker_address: str          # host:port of the prefill worker's KvTransfer service
    request_id: str              # key of the lease there
    num_tokens: int              # prompt tokens whose KV is held
    num_blocks: int              # full blocks + the last partial one
    fingerprint: bytes           # model fingerprint the KV was computed under
    block_size: int
    block_hashes: tuple[bytes, ...] = ()   # hashes of the full blocks
    lease_deadline_unix_ms: int = 0
    prompt_hash: bytes = b""     # engine_api.hashing.prompt_hash of the whole prompt (b"": unset)

    @classmethod
    def from_proto(cls, msg: common_pb2.KvHandle) -> KvHandle:
        """Raises ValueError naming the field when the handle is not self-consistent."""
        handle = cls(msg.worker_address, msg.request_id, msg.num_tokens, msg.num_blocks,
                     bytes(msg.fingerprint), msg.block_size, tuple(msg.block_hashes),
                     msg.lease_deadline_unix_ms, bytes(msg.prompt_hash))
        handle.validate()
        return handle

    def to_proto(self) -> common_pb2.KvHandle:
        return common_pb2.KvHandle(
            worker_address=self.worker_address, request_id=self.request_id,
            block_hashes=list(self.block_hashes), num_tokens=self.num_tokens,
            num_blocks=self.num_blocks, lease_deadline_unix_ms=self.lease_deadline_unix_ms,
            fingerprint=self.fingerprint, block_size=self.block_size,
            prompt_hash=self.prompt_hash)

    def validate(self) -> None:
        if not self.worker_address or not self.request_id:
            raise ValueError("KvHandle.worker_address and KvHandle.request_id must be set")
        if self.num_tokens <= 0 or self.block_size <= 0:
            raise ValueError("KvHandle.num_tokens and KvHandle.block_size must be > 0")
        if self.num_blocks != num_blocks_for(self.num_tokens, self.block_size):
            raise ValueError(f"KvHandle.num_blocks is {self.num_blocks}; {self.num_tokens} tokens "
                             f"in blocks of {self.block_size} need "
                             f"{num_blocks_for(self.num_tokens, self.block_size)}")
        if len(self.block_hashes) > self.num_tokens // self.block_size:
            raise ValueError("KvHandle.block_hashes has more entries than full blocks")
        if self.prompt_hash and len(self.prompt_hash) != HASH_BYTES:
            raise ValueError(f"KvHandle.prompt_hash has {len(self.prompt_hash)} bytes; it must be "
                             f"empty or {HASH_BYTES} (SHA-256)")


class ConnectorRequest(Protocol):
    """What the scheduler side reads from the engine's Request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class KvConnectorScheduler(ABC):
    """Scheduler side: decides what is loaded instead of computed. Called from the engine
    thread only; implementations keep per-request state and are not thread-safe."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest) -> int:
        """Prompt tokens (from the start) whose KV this connector can provide; 0 if none.
        Must not mutate anything: the scheduler may ask again before it allocates."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int]) -> None:
        """Blocks for the matched tokens were allocated; remember them for the worker side."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        """The request is done. True: the connector keeps `block_ids` (the engine must not free
        them until the connector says so, e.g. a lease release); False: free them as usual."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one KV load. reason: a KvTransferError reason, "spec_mismatch",
    "scales_mismatch", "hash_mismatch", "sink_error" or "cancelled" when ok is False."""

    request_id: str
    ok: bool
    reason: str | None = None
    transport: str = ""  # the way a successful load came: "cuda_ipc", "shm", "tcp", "stream"


class KvConnectorWorker(ABC):
    """Worker side: moves KV between the local cache and elsewhere. Thread-safe: the engine
    thread starts loads and polls results while transfers run on an event loop."""

    @abstractmethod
    def start_load_kv(self, request_id: str, handle: KvHandle, block_ids: Sequence[int],
                      first_block: int = 0, metadata: Sequence[tuple[str, str]] = ()) -> None:
        """Begin filling local `block_ids` (prompt order, the handle's blocks from `first_block`
        on: the earlier ones are already held locally) with the KV `handle` names; returns at
        once. Bad handles are reported through get_finished_loads, not raised. metadata: sent
        with this load's pull (e.g. its trace context), besides the connector's own."""

    @abstractmethod
    def get_finished_loads(self) -> list[LoadResult]:
        """Loads that ended since the last call (removes them). On a failed load the local blocks
        hold partial data: the engine must recompute them before use."""

    @abstractmethod
    async def wait_for_load(self, request_id: str) -> LoadResult:
        """Await one load (on the connector's event loop). KeyError if it was never started or
        its result was already taken by get_finished_loads."""

    @abstractmethod
    def save_kv(self, request_id: str, block_ids: Sequence[int],
                block_hashes: Sequence[bytes]) -> None:
        """Offer computed blocks to the connector (push transports, tiers)."""


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


# Load failures that say the connection to the prefill worker is in doubt (not its answer).
_CONNECTION_FAILURES = frozenset({"unavailable", "deadline_exceeded", "rpc_error"})


class GrpcPullConnector(KvConnectorWorker):
    """Decode-role worker side over gRPC: pull blocks from the prefill worker as they arrive,
    write them into the sink in batches, then release the lease (best effort: it expires anyway).

    loop: the event loop transfers run on (the service's); start_load_kv may be called from any
    thread. kv_scales: local per-layer scales [num_layers, 2] for 1-byte KV; incoming blocks must
    carry equal scales. metadata: sent with every call (the cluster's credential). Mutates: its
    own in-flight/finished tables under `_lock`.
    """

    def __init__(self, spec: BlockSpec, sink: KvBlockSink, loop: asyncio.AbstractEventLoop,
                 timeout_s: float = 30.0, kv_scales: torch.Tensor | None = None,
                 metadata: Sequence[tuple[str, str]] = (), use_shm: bool = True,
                 use_ipc: bool = True, use_tcp: bool = True,
                 tcp_streams: int = DEFAULT_TCP_STREAMS) -> None:
        self._spec = spec
        self._metadata = tuple(metadata)
        self._sink = sink
        self._loop = loop
        self._timeout_s = timeout_s
        self._kv_scales = kv_scales
        # Pulls try CUDA IPC (same or peer GPU), the data port (TCP), shared memory (same
        # host), then the stream. A worker that answers a way "unavailable" is not asked that
        # way again.
        self._use_shm = use_shm and shm_available()
        self._use_tcp = use_tcp
        self._tcp_streams = tcp_streams
        self._tls: tuple[ssl.SSLContext | None, str | None] | None = None  # see _tls_client
        device = getattr(sink, "device", None)
        on_gpu = (use_ipc and isinstance(device, torch.device) and device.type == "cuda"
                  and hasattr(sink, "copy_blocks_from"))
        self._ipc_device: torch.device | None = device if on_gpu else None
        self._ipc_sink = cast(DeviceKvBlockSink, sink) if on_gpu else None
        # Once: the sink's GPU does not change.
        self._ipc_uuid = device_uuid(self._ipc_device) if self._ipc_device is not None else b""
        self._importer = CacheImporter()
        self._no_ipc: set[str] = set()  # worker addresses
        self._no_shm: set[str] = set()
        self._no_tcp: set[str] = set()
        # Pinned when the sink is on a GPU (whether or not IPC is allowed): its copies then
        # read page-locked memory.
        self._staging = _StagingPool(WRITE_BATCH_BLOCKS * spec.block_nbytes,
                                     pinned=isinstance(device, torch.device)
                                     and device.type == "cuda", keep=2 * tcp_streams)
        self._transports_seen: set[tuple[str, str]] = set()
        # Channels to the prefill workers, kept across pulls (made on `loop`, used there only).
        self._channels = ChannelCache()
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future[LoadResult]] = {}
        self._finished: list[LoadResult] = []

    def start_load_kv(self, request_id: str, handle: KvHandle, block_ids: Sequence[int],
                      first_block: int = 0, metadata: Sequence[tuple[str, str]] = ()) -> None:
        with self._lock:
            if request_id in self._futures:
                raise ValueError(f"a KV load for request {request_id!r} is already in flight")
        problem = self._check_handle(handle, block_ids, first_block)
        coro = self._fail(request_id, problem) if problem else self._load(
            request_id, handle, list(block_ids), first_block, (*self._metadata, *metadata))
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        with self._lock:
            self._futures[request_id] = future
        future.add_done_callback(lambda f: self._on_done(request_id, f))

    def _channel(self, handle: KvHandle,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        return self._channels.get(handle.worker_address, options)

    async def aclose(self) -> None:
        """Close the kept channels (on the connector's loop; loads still running may fail)."""
        await self._channels.aclose()

    def _check_handle(self, handle: KvHandle, block_ids: Sequence[int],
                      first_block: int = 0) -> str | None:
        try:
            handle.validate()
        except ValueError as exc:
            return str(exc)
        if handle.fingerprint != self._spec.fingerprint or handle.block_size != self._spec.block_size:
            return "handle fingerprint/block_size differ from the local spec"
        if not 0 <= first_block < handle.num_blocks:
            return f"first_block {first_block} outside the handle's {handle.num_blocks} blocks"
        if len(block_ids) != handle.num_blocks - first_block:
            return (f"{len(block_ids)} local blocks for blocks {first_block}.."
                    f"{handle.num_blocks - 1} of the handle")
        return None

    async def _fail(self, request_id: str, problem: str) -> LoadResult:
        log.warning("KV load %s refused: %s", request_id, problem)
        return LoadResult(request_id, False, "spec_mismatch")

    async def _load_ways(self, request_id: str, handle: KvHandle, block_ids: list[int],
                         first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        address = handle.worker_address
        local = is_local_address(address)
        # Ways in order of preference: (name, usable here, workers that refused it, its load,
        # the KvTransferError reason that means "use the next way"). IPC and shared memory
        # reach only this host.
        ways = (("cuda_ipc", self._ipc_device is not None and local, self._no_ipc,
                 self._load_ipc, "ipc_unavailable"),
                ("tcp", self._use_tcp, self._no_tcp, self._load_tcp, "tcp_unavailable"),
                ("shm", self._use_shm and local, self._no_shm, self._load_shm,
                 "shm_unavailable"))
        for name, usable, refused, load, unavailable in ways:
            if not usable or address in refused:
                continue
            try:
                result = await load(request_id, handle, block_ids, first_block, metadata)
            except KvTransferError as exc:
                if exc.reason != unavailable:
                    log.warning("KV load %s failed: %s", request_id, exc)
                    return LoadResult(request_id, False, exc.reason)
                log.info("KV load %s: %s with %s unavailable (%s); trying the next way",
                         request_id, name, address, exc)
            except Exception:  # a bug or an unexpected CUDA error: this way is not safe to use
                log.exception("KV load %s: %s with %s failed; not using it again",
                              request_id, name, address)
            else:
                return self._came_by(address, name, result)
            refused.add(address)  # the lease is still held: the next way pulls it whole
        result = await self._load_stream(request_id, handle, block_ids, first_block, metadata)
        return self._came_by(address, "stream", result)

    async def _load(self, request_id: str, handle: KvHandle, block_ids: list[int],
                    first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        result = await self._load_ways(request_id, handle, block_ids, first_block, metadata)
        if result.reason in _CONNECTION_FAILURES:
            # The worker may have restarted or be gone: the next load connects afresh rather
            # than through a channel waiting out its reconnection backoff.
            self._channels.drop(handle.worker_address)
        return result

    def _check_lease(self, handle: KvHandle, first_block: int, num_tokens: int,
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
            if not _hash_matches(handle, index, got):
                return "hash_mismatch"
        return None

    def _came_by(self, address: str, transport: str, result: LoadResult) -> LoadResult:
        """A load's result, naming its way when it succeeded; the first success from each
        worker by each way is logged (which one a deployment uses)."""
        if not result.ok:
            return result
        if (address, transport) not in self._transports_seen:
            self._transports_seen.add((address, transport))
            log.info("KV from %s comes by %s", address, transport)
        return dataclasses.replace(result, transport=transport)

    async def _load_ipc(self, request_id: str, handle: KvHandle, block_ids: list[int],
                        first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        """Same GPU, or a peer GPU of this host: map the prefill worker's cache (once, on its
        GPU) and copy the lease's blocks device to device. Raises
        KvTransferError("ipc_unavailable") when another way must be used."""
        device, sink = self._ipc_device, self._ipc_sink
        assert device is not None and sink is not None
        marks = [time.perf_counter()]  # stage ends, for the debug log of a pull's time
        pull = await pull_blocks_ipc(self._channel(handle), handle.request_id, self._spec,
                                     handle.num_blocks, self._timeout_s, self._ipc_uuid,
                                     first_block, metadata)
        problem = self._check_lease(handle, first_block, pull.num_tokens, pull.kv_scales,
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
        if not await self._release(handle):
            log.warning("KV load %s: the lease ended before the device copy did", request_id)
            return LoadResult(request_id, False, "lease_lost")
        marks.append(time.perf_counter())
        if log.isEnabledFor(logging.DEBUG):  # where a pull's time goes, stage by stage
            log.debug("KV IPC load %s: %d blocks; lease %.2f ms, map %.2f ms, copy %.2f ms, "
                      "release %.2f ms", request_id, len(block_ids),
                      *((b - a) * 1e3 for a, b in itertools.pairwise(marks)))
        return LoadResult(request_id, True)

    async def _load_shm(self, request_id: str, handle: KvHandle, block_ids: list[int],
                        first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        """Same host: the blocks arrive raw in a shared-memory segment, then go into the sink
        in batches. Raises KvTransferError("shm_unavailable") when the stream must be used."""
        pull = await pull_blocks_shm(self._channel(handle), handle.request_id, self._spec,
                                     handle.num_blocks, self._timeout_s, first_block, metadata)
        try:
            problem = self._check_lease(handle, first_block, pull.num_tokens, pull.kv_scales,
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
        await self._release(handle)
        return LoadResult(request_id, True)

    async def _load_tcp(self, request_id: str, handle: KvHandle, block_ids: list[int],
                        first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        """Any host: tickets over gRPC, then the blocks raw from the worker's data port over
        up to `tcp_streams` connections at once (a contiguous stripe each), each batch into
        the sink as it lands. Raises KvTransferError("tcp_unavailable") when another way must
        be used (no data port, or no connection could be made: nothing was written)."""
        pull = await pull_blocks_tcp(self._channel(handle), handle.request_id, self._spec,
                                     handle.num_blocks, self._timeout_s, first_block, metadata,
                                     streams=self._tcp_streams)
        problem = self._check_lease(handle, first_block, pull.num_tokens, pull.kv_scales,
                                    pull.block_hashes)
        if problem:
            return LoadResult(request_id, False, problem)
        spec, sink, staging_pool = self._spec, self._sink, self._staging
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
        await self._release(handle)
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

    async def _load_stream(self, request_id: str, handle: KvHandle, block_ids: list[int],
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
                    if not _hash_matches(handle, index, block.block_hash):
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
        await self._release(handle)
        return LoadResult(request_id, True)

    async def _write(self, ids: list[int], tensors: torch.Tensor) -> None:
        """Into the sink, off the event loop (a GPU write waits for the device)."""
        await asyncio.to_thread(self._sink.write_blocks, ids, tensors)

    async def _release(self, handle: KvHandle) -> bool:
        """Release the lease; whether it was still live (False too when the call failed)."""
        try:
            return await release(self._channel(handle), handle.request_id, self._timeout_s,
                                 self._metadata)
        except KvTransferError as exc:  # the lease expires on its own; the data is already here
            log.info("release of KV lease %s failed: %s", handle.request_id, exc)
            return False

    def _on_done(self, request_id: str, future: concurrent.futures.Future[LoadResult]) -> None:
        result = (LoadResult(request_id, False, "cancelled") if future.cancelled()
                  else future.result())
        with self._lock:
            self._finished.append(result)

    def get_finished_loads(self) -> list[LoadResult]:
        with self._lock:
            done, self._finished = self._finished, []
            for result in done:
                self._futures.pop(result.request_id, None)
        return done

    async def wait_for_load(self, request_id: str) -> LoadResult:
        with self._lock:
            future = self._futures[request_id]
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled():  # the load was cancelled, not this waiter
                return LoadResult(request_id, False, "cancelled")
            raise

    def cancel_load(self, request_id: str) -> bool:
        """Abort an in-flight load (request cancelled); its result reads "cancelled"."""
        with self._lock:
            future = self._futures.get(request_id)
        return future is not None and future.cancel()

    def save_kv(self, request_id: str, block_ids: Sequence[int],
                block_hashes: Sequence[bytes]) -> None:
        """Nothing to push: in the pull model the prefill worker keeps the blocks under a lease
        and its KvTransfer servicer serves them."""


class _StagingPool:
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


def is_local_address(address: str) -> bool:
    """Whether host:port names this host by a loopback address (shared memory reaches it)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _hash_matches(handle: KvHandle, index: int, block_hash: bytes | None) -> bool:
    """A full block the handle names by hash must arrive under that hash."""
    return index >= len(handle.block_hashes) or block_hash == handle.block_hashes[index]
