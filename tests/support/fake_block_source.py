"""Test fake: `CacheBlockSource`, a `KvBlockSource` over a bare KV cache tensor and a
`LeaseTable` (tests/support/fake_lease.py), so the transport is tested without an engine. The services
use the engine's own leases instead (worker/kv.py `EngineBlockSource`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from kv_transfer.servicer import LeaseView
from kv_transfer.wire import BlockSpec
from tests.support.fake_lease import Lease, LeaseTable


class CacheBlockSource:
    """Serves blocks of `kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]` (any device) for the leases in `leases`.

    `release` answers False for an expired lease (as the proto says) but still frees it.
    Mutates: `release` removes the lease from `leases` (under its lock) and calls
    `on_release(lease)`, which must free the blocks in the engine (thread-safe on its side).
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        spec: BlockSpec,
        leases: LeaseTable,
        on_release: Callable[[Lease], None] = lambda lease: None,
    ) -> None:
        expected = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        got = tuple(kv_cache.shape[:2]) + tuple(kv_cache.shape[3:])
        if kv_cache.dim() != 6 or got != expected or kv_cache.dtype != spec.dtype:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match "
                             f"the spec's block {expected} {spec.dtype}")
        self._kv_cache = kv_cache
        self._spec = spec
        self._leases = leases
        self._on_release = on_release

    @property
    def spec(self) -> BlockSpec:
        return self._spec

    def lookup(self, request_id: str) -> LeaseView | None:
        lease = self._leases.get(request_id)
        if lease is None:
            return None
        return LeaseView(list(lease.block_ids), list(lease.block_hashes), lease.num_tokens)

    async def read_block(self, block_id: int) -> torch.Tensor:
        if not 0 <= block_id < self._kv_cache.shape[2]:
            raise IndexError(f"block_id {block_id} outside [0, {self._kv_cache.shape[2]})")
        block = self._kv_cache[:, :, block_id]  # [L, 2, bs, Hkv, D], a strided view
        if block.device.type == "cpu":
            return block.clone()
        # A device->host copy synchronises; keep it off the event loop.
        return await asyncio.to_thread(lambda: block.to("cpu", copy=True))

    async def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return torch.stack([await self.read_block(b) for b in block_ids])

    def release(self, request_id: str) -> bool:
        lease = self._leases.release(request_id)
        if lease is None:
            return False
        self._on_release(lease)  # an expired lease's blocks are freed too
        return not lease.expired(self._leases.now())
