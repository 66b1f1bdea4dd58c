"""`KvAccess`: an engine's KV cache as the services use it, beside requests.

Code outside `engine/` (worker/, prefill_service/, decode_service/) reaches the scheduler's
leases and pins and the runner's blocks through this class alone, so that the scheduler, the KV
manager and the runner stay free to change (the import-linter contract in pyproject.toml keeps
it so). `LLMEngine.kv_access` is the engine's.

Threads: the lookups (`lease`, `live_lease`, `cached_prefix_blocks`) are dict reads, atomic
under the GIL, so the event loop makes them; `pin_cached` and `unpin` change the KV manager and
run on the engine thread (`AsyncEngine.call`). Block reads of held blocks (leased or pinned) and
writes into a load's blocks run anywhere: no step touches those blocks meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from engine.handoff import Lease
from engine.runner import ModelRunner
from engine.scheduler import Scheduler


class KvAccess:
    """Leases, pins, prefix lookups and block I/O of one engine's KV cache (see the module)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self._scheduler = scheduler
        self._runner = runner

    # ---- the cache's layout ----------------------------------------------------------------

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype a block is stored (and sent) in: fp8 or int8 for a quantized cache."""
        return self._runner.kv_dtype

    @property
    def kv_scales(self) -> torch.Tensor | None:
        """Per-layer K/V scales `[num_layers, 2]` float32 sent with (and required of) every
        block of a 1-byte KV cache; None for a cache in the model dtype."""
        runner = self._runner
        return runner.kv_scales if runner.kv_is_quantized else None

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def tensor_parallel(self) -> bool:
        """The cache is split over tensor-parallel ranks (each holds a share of every block's
        heads): no one cache can be shared by a CUDA IPC handle."""
        return self._runner.tp is not None

    @property
    def ipc_cache(self) -> torch.Tensor | None:
        """The whole cache, to share with other processes on this GPU by CUDA IPC; None for a
        tensor-parallel engine."""
        return self._runner.kv_cache if self._runner.tp is None else None

    # ---- leases (prefill role) -------------------------------------------------------------

    def lease(self, lease_id: str) -> Lease | None:
        """The lease held under `lease_id`, its deadline passed or not (the engine thread
        releases expired ones between steps)."""
        return self._scheduler.leases.get(lease_id)

    def live_lease(self, lease_id: str) -> Lease | None:
        """`lease`, unless its deadline has passed (or `hide_lease` hid it)."""
        lease = self._scheduler.leases.get(lease_id)
        if lease is None or lease.deadline <= time.monotonic():
            return None
        return lease

    def hide_lease(self, lease_id: str) -> bool:
        """Hide a live lease from lookups at once, before the engine thread releases it
        (`LLMEngine.release_lease`, queued by the caller); False when it is not live."""
        lease = self.live_lease(lease_id)
        if lease is None:
            return False
        lease.deadline = 0.0
        return True

    # ---- the prefix cache ------------------------------------------------------------------

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the prefix cache holds now (a hint read off the
        engine thread; the scheduler makes the binding lookup when it admits a request)."""
        pool = self._scheduler.kv.pool
        n = 0
        while n < len(hashes) and pool.get_cached_block(hashes[n]) is not None:
            n += 1
        return n

    def pin_cached(self, pin_id: str, hashes: Sequence[bytes]) -> list[tuple[int, bytes]]:
        """Engine thread: hold the cached blocks of `hashes` (neither evicted nor reused) under
        `pin_id` until `unpin`; the (block id, hash) of each held one."""
        return self._scheduler.pin_cached(pin_id, hashes)

    def unpin(self, pin_id: str) -> None:
        """Engine thread: let go of the blocks `pin_cached` held under `pin_id`."""
        self._scheduler.unpin(pin_id)

    # ---- block I/O -------------------------------------------------------------------------

    async def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks as a CPU tensor `[n, num_layers, 2, block_size, Hkv, D]` (cache dtype),
        from the event loop: in place on the CPU (a memcpy), in a thread on a GPU (the
        device-to-host copy waits for the engine's queued work)."""
        runner = self._runner
        if runner.device.type == "cpu":
            return runner.read_blocks(block_ids)
        return await asyncio.to_thread(runner.read_blocks, block_ids)

    async def read_held_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`read_blocks` of blocks that no step writes while they are read (leased or pinned
        full blocks): on a GPU the copy runs beside the engine's queued steps, not after them."""
        runner = self._runner
        if runner.device.type == "cpu":
            return runner.read_blocks(block_ids)
        return await asyncio.to_thread(runner.read_leased_blocks, block_ids)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor,
                     scales: torch.Tensor | None = None) -> None:
        """`blocks` `[n, num_layers, 2, block_size, Hkv, D]` into the cache's `block_ids`
        (blocks of a load, which no other request sees until it succeeds)."""
        self._runner.write_blocks(block_ids, blocks, scales)

    def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                         src_block_ids: list[int]) -> None:
        """Blocks `src_block_ids` of another cache of this layout (another process's, mapped
        through CUDA IPC) into this cache's `block_ids`; returns when done."""
        self._runner.copy_blocks_from(block_ids, src_cache, src_block_ids)
