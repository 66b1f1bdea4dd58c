"""KV handoff bound to an engine: the prefill side's block source (over the engine's leases)
and the decode side's loader (pull over gRPC, write into the engine's blocks, acknowledge)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from engine.async_engine import AsyncEngine, KvLoadAbort
from engine.llm_engine import LLMEngine
from engine.scheduler import KvLoad
from kv_transfer.grpc_transport import KvTransferError, LeaseView, pull_all, release
from kv_transfer.wire import BlockSpec
from protos.splitserve.v1 import common_pb2, decode_pb2

logger = logging.getLogger(__name__)


def block_spec(engine: LLMEngine) -> BlockSpec:
    cfg = engine.model_config
    return BlockSpec(fingerprint=engine.fingerprint, num_layers=cfg.num_hidden_layers,
                     block_size=engine.config.cache.block_size,
                     num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                     dtype=engine.runner.dtype)


class EngineBlockSource:
    """`kv_transfer.grpc_transport.KvBlockSource` over an engine's leases (prefill role).

    Leased blocks hold a reference in the engine's KV manager, so they are not reused until
    `release` (or expiry) — reading them from the event loop thread is safe.
    """

    def __init__(self, aengine: AsyncEngine) -> None:
        self._aengine = aengine
        self._engine = aengine.engine
        self._spec = block_spec(aengine.engine)

    @property
    def spec(self) -> BlockSpec:
        return self._spec

    def lookup(self, request_id: str) -> LeaseView | None:
        lease = self._engine.scheduler.leases.get(request_id)  # dict read: atomic under the GIL
        if lease is None or lease.deadline <= _monotonic():
            return None
        return LeaseView(list(lease.block_ids), list(lease.block_hashes), lease.num_tokens)

    async def read_block(self, block_id: int) -> torch.Tensor:
        runner = self._engine.runner
        if runner.device.type == "cpu":
            return runner.read_blocks([block_id])[0]
        return await asyncio.to_thread(lambda: runner.read_blocks([block_id])[0])

    def release(self, request_id: str) -> bool:
        known = request_id in self._engine.scheduler.leases
        self._aengine.submit(self._engine.release_lease, request_id)
        return known


def _monotonic() -> float:
    import time
    return time.monotonic()


@dataclass(slots=True)
class RemoteKvHandle:
    """What the decode servicer attaches to a request whose KV lives on a prefill worker."""

    handle: common_pb2.KvHandle
    policy: int                 # decode_pb2.KvFailurePolicy
    timeout_s: float
    failed: bool = False        # set when the pull failed (the request was recomputed)
    started: bool = False       # set when the loader began pulling (it then releases the lease)


class GrpcKvLoader:
    """Decode role: fills the blocks a KvLoad names from the prefill worker, all or nothing."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._spec = block_spec(engine)

    async def __call__(self, load: KvLoad) -> bool:
        remote = load.request.remote_kv
        assert remote is not None and isinstance(remote.handle, RemoteKvHandle)
        h = remote.handle
        h.started = True
        try:
            blocks = await pull_all(h.handle.worker_address, h.handle.request_id, self._spec,
                                    len(load.block_ids), h.timeout_s, load.num_tokens)
        except KvTransferError as e:
            logger.warning("KV pull for %s failed (%s): %s", load.request.request_id, e.reason, e)
            h.failed = True
            if h.policy == decode_pb2.KV_FAILURE_POLICY_FAIL:
                raise KvLoadAbort(f"KV transfer from {h.handle.worker_address} failed: {e}") from e
            return False
        stacked = torch.stack([b.tensor for b in blocks])
        runner = self._engine.runner
        await asyncio.to_thread(runner.write_blocks, load.block_ids, stacked)
        try:
            await release(h.handle.worker_address, h.handle.request_id, timeout_s=5.0)
        except KvTransferError as e:  # the lease will expire on its own
            logger.info("release of %s failed: %s", h.handle.request_id, e)
        return True



async def release_unpulled(h: RemoteKvHandle) -> None:
    """Drop the prefill lease of a request that ended before its KV load began (cancelled or
    failed while waiting for blocks): nobody else would release it before the lease expires."""
    if h.started:
        return
    try:
        await release(h.handle.worker_address, h.handle.request_id, timeout_s=5.0)
    except KvTransferError as e:  # the lease will expire on its own
        logger.info("release of unpulled %s failed: %s", h.handle.request_id, e)
