"""The seam between the engine and KV transports, the worker side (as vLLM v1 splits it): the
engine thread starts a load of a prompt's KV into local blocks (`start_load_kv`) and polls
which loads ended, ok or failed (`get_finished_loads`).

`GrpcPullConnector` is the worker side of the decode role over the KvTransfer service: it pulls
a prefill worker's leased blocks into local blocks through a `KvBlockSink` (in batches of
`WRITE_BATCH_BLOCKS`), then releases the lease. Between workers of one GPU, or of peer GPUs of
one host, it copies the blocks device to device out of the prefill worker's cache, mapped
through CUDA IPC; otherwise raw over the prefill worker's KV data port (TCP), which measured
faster than a shared-memory segment between workers of one host (docs/performance.md, "KV
between hosts"); where the data port cannot be reached, through shared memory (one host), else
over the gRPC stream (the ways themselves: kv_transfer/pull_ways.py).
A failed load is reported, never raised: the engine recomputes the prompt or fails the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import ipaddress
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from kv_transfer import DEFAULT_TCP_STREAMS
from kv_transfer.handle import KvHandle, LoadResult
from kv_transfer.protocol import KvTransferError
from kv_transfer.pull_ways import KvBlockSink, PullWays
from kv_transfer.shm import shm_available
from kv_transfer.wire import BlockSpec
from rpc.auth import lease_ticket_metadata
from rpc.channels import ChannelCache

log = logging.getLogger(__name__)


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
        self._loop = loop
        # Pulls try CUDA IPC (same or peer GPU), the data port (TCP), shared memory (same
        # host), then the stream. A worker that answers a way "unavailable" is not asked that
        # way again.
        self._use_shm = use_shm and shm_available()
        self._use_tcp = use_tcp
        self._no_ipc: set[str] = set()  # worker addresses
        self._no_shm: set[str] = set()
        self._no_tcp: set[str] = set()
        self._transports_seen: set[tuple[str, str]] = set()
        # Channels to the prefill workers, kept across pulls (made on `loop`, used there only).
        self._channels = ChannelCache()
        self._ways = PullWays(spec, sink, self._channels, timeout_s, kv_scales, self._metadata,
                              use_ipc, tcp_streams)
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future[LoadResult]] = {}
        self._finished: list[LoadResult] = []

    def start_load_kv(self, request_id: str, handle: KvHandle, block_ids: Sequence[int],
                      first_block: int = 0, metadata: Sequence[tuple[str, str]] = ()) -> None:
        with self._lock:
            if request_id in self._futures:
                raise ValueError(f"a KV load for request {request_id!r} is already in flight")
        problem = self._check_handle(handle, block_ids, first_block)
        # The lease's own ticket goes with its calls (the connector's metadata carries no
        # cluster secret: the handle names where the calls go).
        coro = self._fail(request_id, problem) if problem else self._load(
            request_id, handle, list(block_ids), first_block,
            (*self._metadata, *metadata, *lease_ticket_metadata(handle.lease_ticket)))
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        with self._lock:
            self._futures[request_id] = future
        future.add_done_callback(lambda f: self._on_done(request_id, f))

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
        ways = (("cuda_ipc", self._ways.ipc_device is not None and local, self._no_ipc,
                 self._ways.ipc, "ipc_unavailable"),
                ("tcp", self._use_tcp, self._no_tcp, self._ways.tcp, "tcp_unavailable"),
                ("shm", self._use_shm and local, self._no_shm, self._ways.shm,
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
        result = await self._ways.stream(request_id, handle, block_ids, first_block, metadata)
        return self._came_by(address, "stream", result)

    async def _load(self, request_id: str, handle: KvHandle, block_ids: list[int],
                    first_block: int, metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        result = await self._load_ways(request_id, handle, block_ids, first_block, metadata)
        if result.reason in _CONNECTION_FAILURES:
            # The worker may have restarted or be gone: the next load connects afresh rather
            # than through a channel waiting out its reconnection backoff.
            self._channels.drop(handle.worker_address)
        return result

    def _came_by(self, address: str, transport: str, result: LoadResult) -> LoadResult:
        """A load's result, naming its way when it succeeded; the first success from each
        worker by each way is logged (which one a deployment uses)."""
        if not result.ok:
            return result
        if (address, transport) not in self._transports_seen:
            self._transports_seen.add((address, transport))
            log.info("KV from %s comes by %s", address, transport)
        return dataclasses.replace(result, transport=transport)

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


def is_local_address(address: str) -> bool:
    """Whether host:port names this host by a loopback address (shared memory reaches it)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

