"""KV handoff bound to an engine: the prefill side's block source (over the engine's leases)
and the decode side's loader (pull over gRPC, write into the engine's blocks, acknowledge)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from engine.async_engine import AsyncEngine, KvLoadAbort
from engine.handoff import KvLoad
from engine.llm_engine import LLMEngine
from kv_transfer import DEFAULT_TCP_STREAMS
from kv_transfer.connector import GrpcPullConnector
from kv_transfer.handle import KvHandle, LoadResult
from kv_transfer.protocol import KvTransferError
from kv_transfer.pull_client import release
from kv_transfer.servicer import LeaseView
from kv_transfer.wire import BlockSpec
from protos.splitserve.v1 import common_pb2, decode_pb2
from rpc import tracing
from rpc.auth import lease_ticket_metadata

logger = logging.getLogger(__name__)


def block_spec(engine: LLMEngine) -> BlockSpec:
    """The engine's KV block on the wire: the cache dtype (fp8 or int8 for a quantized cache,
    whose blocks then carry `KvAccess.kv_scales`)."""
    cfg = engine.model_config
    return BlockSpec(fingerprint=engine.fingerprint, num_layers=cfg.num_hidden_layers,
                     block_size=engine.config.cache.block_size,
                     num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                     dtype=engine.kv_access.kv_dtype)


def count_runs(block_ids: list[int]) -> int:
    """Maximal runs of ascending consecutive ids in `block_ids` (a KV handoff copies at least
    one per run: engine/dma_copy.py `block_runs` pairs them with the other side's)."""
    return sum(1 for i, b in enumerate(block_ids) if i == 0 or b != block_ids[i - 1] + 1)


class EngineBlockSource:
    """`kv_transfer.servicer.KvBlockSource` over an engine's leases (prefill role).

    Leased blocks hold a reference in the engine's KV manager, so they are not reused until
    `release` (or expiry) — reading them from the event loop thread is safe.
    """

    def __init__(self, aengine: AsyncEngine) -> None:
        self._aengine = aengine
        self._engine = aengine.engine
        self._kv = aengine.engine.kv_access
        self._spec = block_spec(aengine.engine)

    @property
    def spec(self) -> BlockSpec:
        return self._spec

    def lookup(self, request_id: str) -> LeaseView | None:
        lease = self._kv.live_lease(request_id)
        if lease is None:
            return None
        return LeaseView(list(lease.block_ids), list(lease.block_hashes), lease.num_tokens)

    async def read_block(self, block_id: int) -> torch.Tensor:
        return (await self.read_blocks([block_id]))[0]

    async def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return await self._kv.read_held_blocks(block_ids)

    def release(self, request_id: str) -> bool:
        # Hide it from lookups at once; the engine thread frees the blocks between steps.
        if not self._kv.hide_lease(request_id):
            return False
        self._aengine.submit(self._engine.release_lease, request_id)
        return True


@dataclass(slots=True)
class TransportStats:
    """Cumulative successful KV pulls of one way (LoadReport.kv_transports)."""

    pulls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    block_runs: int = 0  # runs of consecutive ids the pulled blocks took here


@dataclass(slots=True)
class RemoteKvHandle:
    """What the decode servicer attaches to a request whose KV lives on a prefill worker."""

    handle: common_pb2.KvHandle
    policy: int                 # decode_pb2.KvFailurePolicy
    timeout_s: float
    failed: bool = False        # set when the pull failed (the request was recomputed)
    started: bool = False       # set when the loader began pulling (it then releases the lease)
    trace_parent: Context | None = None  # the decode request's span: parent of the KV pull's


class RunnerSink:
    """`kv_transfer.pull_ways.DeviceKvBlockSink` writing into an engine's KV cache. The blocks were
    allocated for this load and are not visible to any other request until the load succeeds."""

    def __init__(self, engine: LLMEngine) -> None:
        self._kv = engine.kv_access

    @property
    def device(self) -> torch.device:
        return self._kv.device

    def write_blocks(self, block_ids: list[int], tensors: torch.Tensor) -> None:
        self._kv.write_blocks(block_ids, tensors)

    def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                         src_block_ids: list[int]) -> None:
        self._kv.copy_blocks_from(block_ids, src_cache, src_block_ids)


class GrpcKvLoader:
    """Decode role: the engine's KV loader over `kv_transfer`'s GrpcPullConnector.

    The scheduler allocates blocks for a request's remote KV and emits a KvLoad; this fills them
    from the prefill worker (the connector releases the lease after a full pull) and reports
    success. On failure, policy `recompute` returns False (the engine recomputes the prompt) and
    policy `fail` raises KvLoadAbort (the request fails with UNAVAILABLE)."""

    def __init__(self, engine: LLMEngine, timeout_s: float = 30.0,
                 kv_metadata: Sequence[tuple[str, str]] = (), use_ipc: bool = True,
                 use_shm: bool = True, use_tcp: bool = True,
                 tcp_streams: int = DEFAULT_TCP_STREAMS) -> None:
        """kv_metadata: sent with every pull and release (the cluster's credential). use_ipc /
        use_shm: whether same-GPU / same-host pulls may use CUDA IPC / shared memory; use_tcp:
        whether pulls may use the prefill worker's KV data port, over tcp_streams connections."""
        self._use_ipc, self._use_shm, self._use_tcp = use_ipc, use_shm, use_tcp
        self._tcp_streams = tcp_streams
        self._spec = block_spec(engine)
        self._metadata = tuple(kv_metadata)
        self._kv_scales = engine.kv_access.kv_scales
        self._sink = RunnerSink(engine)
        self._timeout_s = timeout_s
        self._connector: GrpcPullConnector | None = None
        self.blocks_pulled = 0   # transferred from prefill workers
        self.blocks_reused = 0   # found in this engine's prefix cache instead
        # Successful pulls per way ("cuda_ipc", "shm", "tcp", "stream"): count, bytes, seconds.
        self.transport_stats: dict[str, TransportStats] = {}

    def _get_connector(self) -> GrpcPullConnector:
        if self._connector is None:  # needs the running loop
            self._connector = GrpcPullConnector(self._spec, self._sink, asyncio.get_running_loop(),
                                                timeout_s=self._timeout_s,
                                                kv_scales=self._kv_scales,
                                                metadata=self._metadata,
                                                use_ipc=self._use_ipc, use_shm=self._use_shm,
                                                use_tcp=self._use_tcp,
                                                tcp_streams=self._tcp_streams)
        return self._connector

    async def aclose(self) -> None:
        """Close the connector's kept channels (the worker is stopping)."""
        if self._connector is not None:
            await self._connector.aclose()

    async def __call__(self, load: KvLoad) -> bool:
        remote = load.request.remote_kv
        assert remote is not None and isinstance(remote.handle, RemoteKvHandle)
        h = remote.handle
        h.started = True
        # Runs on the engine's loop, not in the decode RPC's task: the parent comes explicitly.
        with tracing.traced_span("splitserve.kv_pull", parent=h.trace_parent,
                                 kind=SpanKind.CLIENT, attributes={
                                     "splitserve.kv.source": h.handle.worker_address,
                                     "splitserve.kv.blocks_pulled": len(load.block_ids),
                                     "splitserve.kv.blocks_reused": load.first_block,
                                 }) as span:
            result = await self._pull(load, h, tracing.inject_metadata(tracing.span_context(span)))
            span.set_attribute("splitserve.kv.ok", result.ok)
            if result.ok:
                return True
            tracing.record_error(span, f"KV pull failed: {result.reason}")
        logger.warning("KV pull for %s failed: %s", result.request_id, result.reason)
        h.failed = True
        if h.policy == decode_pb2.KV_FAILURE_POLICY_FAIL:
            raise KvLoadAbort(f"KV transfer from {h.handle.worker_address} failed: {result.reason}")
        return False

    async def _pull(self, load: KvLoad, h: RemoteKvHandle,
                    trace_metadata: tuple[tuple[str, str], ...]) -> LoadResult:
        """Fill the load's blocks from the prefill worker; the outcome, failure included.
        trace_metadata: the `kv_pull` span as the parent of the prefill side's `kv_serve`."""
        rid = load.request.request_id
        connector = self._get_connector()
        try:
            handle = KvHandle.from_proto(h.handle)
        except ValueError as e:
            result = LoadResult(rid, False, f"bad handle: {e}")
        else:
            start = time.perf_counter()
            connector.start_load_kv(rid, handle, load.block_ids, load.first_block,
                                    metadata=trace_metadata)
            self.blocks_pulled += len(load.block_ids)
            self.blocks_reused += load.first_block
            try:
                result = await connector.wait_for_load(rid)
            except Exception as exc:  # a bug in a transport: still a failed load, reported
                logger.exception("KV load %s raised", rid)
                result = LoadResult(rid, False, f"internal error: {type(exc).__name__}")
            finally:
                connector.cancel_load(rid)
                connector.get_finished_loads()  # drop the connector's record of this load
            if result.ok:
                stats = self.transport_stats.setdefault(result.transport, TransportStats())
                stats.pulls += 1
                stats.bytes += len(load.block_ids) * self._spec.block_nbytes
                elapsed = time.perf_counter() - start
                stats.seconds += elapsed
                logger.debug("KV pull %s: %.2f ms start to done by %s", rid, elapsed * 1e3,
                             result.transport)
                stats.block_runs += count_runs(load.block_ids)
        return result


async def release_unpulled(h: RemoteKvHandle, metadata: Sequence[tuple[str, str]] = ()) -> None:
    """Drop the prefill lease of a request that will never pull it whole (it ended before its
    load began, or the pull failed): nobody else would release it before the lease expires.
    metadata: sent with the call (the cluster's credential)."""
    try:
        await release(h.handle.worker_address, h.handle.request_id, timeout_s=5.0,
                      metadata=(*metadata, *lease_ticket_metadata(h.handle.lease_ticket)))
    except KvTransferError as e:  # the lease will expire on its own
        logger.info("release of unpulled %s failed: %s", h.handle.request_id, e)
