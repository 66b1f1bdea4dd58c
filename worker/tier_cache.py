"""Every role: the tiered prefix store (CPU, then Redis) under the engine's GPU prefix cache.

docs/architecture.md, a request's way, step 3: a prefill reuses cached blocks from the GPU,
else from the CPU/Redis tier.

    Prefill(prompt) ── plan ──> GPU prefix hits: blocks 0..g-1
                                tiers (TieredStore.get_many from block g): blocks g..t-1
                     └─> RemoteKv(num_tokens = t * block_size, handle = TierBlocks)
    engine: allocates blocks g..t-1, emits a KvLoad ── load ──> decode + verify + write them
            then computes tokens t*bs.. as usual (chunked prefill), holds the KV under a lease
    after the response ── save ──> pin the prompt's full blocks the CPU tier lacks, read them,
                                   encode, TieredStore.put_many (CPU tier now, Redis queued)

When the CPU tier holds the next block, the blocks are fetched in `plan`, before the request is
queued (the CPU tier's, then Redis's chunk by chunk while the cost model, `worker/tier_cost.py`,
says a chunk arrives sooner than it would be computed); `load` only decodes bytes in memory.
When only Redis holds it, `plan` asks Redis which blocks it holds (EXISTS, no values) and the
cost model splits them: the engine computes the head while the tail is read, both at once

    blocks  g ........ s ............ t ...... end
            computed   fetched (a task started in `plan`, awaited by `load`)   computed after
            (RemoteKv.first_token = s * block_size: engine/scheduler.py runs the head's
             chunks while the load is in flight, then jumps to t)

so a Redis read costs max(compute head, fetch tail) instead of fetch all (or compute all). A
tail that does not arrive whole (evicted since, corrupt, Redis failed) fails the load: the
engine computes on through it. The engine thread never waits on Redis. Every block is verified against the
wire spec (fingerprint, shape, checksum) and against the hash it was looked up by, so a corrupt
or foreign value is a miss, never data. A load that cannot be served (the GPU evicted blocks the
plan counted on) returns False, and the engine recomputes the prompt.

`save` pins the prefix cache's blocks of the hashes it is given (`KvAccess.pin_cached`: held, so
neither evicted nor reused), reads them and unpins them: a prefill worker's (the prompt's, from
its KV handle) even when a decode worker pulled them and the lease ended first, and a colocated
worker's (`save_tokens`: a finished request's prompt and output), so a later prompt sharing that
prefix (the next turn of a chat) finds them in the tiers once the GPU cache has evicted them.

A decode worker does the same (`save_tokens` with `skip_blocks`: the prompt's full blocks were
saved by the prefill worker, so only the blocks its output filled), so the next turn's prefill
finds the answer's KV too; and a decode request that comes without KV (a resumed stream, a
handle that did not match) plans from the tiers like a colocated one (`TierOrPullLoader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch
from opentelemetry.context import Context

from engine.async_engine import AsyncEngine
from engine.handoff import KvLoad
from engine_api.hashing import compute_block_hashes
from engine_api.request_options import RemoteKv
from kv_transfer.tiers import CpuTier, RedisLimits, RedisTier, TieredStore
from kv_transfer.wire import BlockSpec, KvWireError, block_view, encode_block
from worker.kv import GrpcKvLoader, block_spec
from worker.tier_cost import FetchCost

logger = logging.getLogger(__name__)

# A tier load writes this many blocks at a time (256 MB of an 8B model's bf16 KV on a GPU).
LOAD_SLICE_BLOCKS = 128
# Saves run behind the responses, ~0.6 GB/s of encoding each on the H200 host: past this many
# reading and encoding at once a new one is skipped (counted), so a busy worker sheds tier
# writes instead of holding copies of KV without bound. What they hand to Redis waits in its
# write queue, bounded by bytes (kv_transfer/tiers/write_queue.py). A burst of a batch's worth
# of prefills must fit: a skipped save is a miss for the next worker that asks.
MAX_PENDING_SAVES = 16


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The tiers of a worker. `cpu_bytes` 0 and no `redis_url`: none."""

    cpu_bytes: int = 0
    redis_url: str | None = None
    redis_ttl_s: int = 3600
    redis_key_prefix: str = "splitserve:kv"
    # Stop writing to Redis while its used_memory would pass this (0: no bound of our own).
    redis_max_bytes: int = 0
    # Fetch from the tiers only when they hold at least this many blocks beyond the GPU hits:
    # below it, recomputing is about as fast as a Redis round trip.
    min_blocks: int = 1

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0:
            raise ValueError(f"cpu_bytes must be >= 0, got {self.cpu_bytes}")
        if self.min_blocks < 1:
            raise ValueError(f"min_blocks must be >= 1, got {self.min_blocks}")
        if self.redis_max_bytes < 0:
            raise ValueError(f"redis_max_bytes must be >= 0, got {self.redis_max_bytes}")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or bool(self.redis_url)


@dataclass(frozen=True, slots=True)
class TierBlocks:
    """`RemoteKv.handle` of a prompt prefix found in the tiers: the encoded full blocks
    `first`, `first + 1`, ... (as fetched), and the hashes of all the prompt's full blocks."""

    first: int
    blocks: tuple[bytes | torch.Tensor, ...]  # CPU-tier entries (pinned) or Redis values
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class TierFetch:
    """`RemoteKv.handle` of a prefix tail being read from Redis (`first` is its first block)
    while the engine computes the blocks before it; `count` blocks are expected."""

    first: int
    fetch: asyncio.Future[list[bytes]]
    count: int
    hashes: tuple[bytes, ...]


@dataclass(slots=True)
class TierStats:
    planned_blocks: int = 0     # blocks found in the tiers by `plan`
    loaded_blocks: int = 0      # of those, written into the engine's cache
    loaded_tokens: int = 0      # prompt tokens they hold (not computed)
    failed_loads: int = 0       # loads refused (engine recomputed the prompt)
    saved_blocks: int = 0       # blocks the CPU tier took (Redis: its own counters)
    skipped_saves: int = 0      # saves not started: MAX_PENDING_SAVES were already running
    overlapped_blocks: int = 0  # blocks Redis held that a split computed instead (beside a read)
    short_fetches: int = 0      # tail reads that brought fewer blocks than Redis said it held


class TierPrefixCache:
    """The tiered store bound to one engine: `plan` before queueing a prompt, `load` as the
    engine's KV loader, `save` after a prefill's response (prefill role) or `save_tokens` after
    a request finished (colocated role); see the module docstring."""

    def __init__(self, aengine: AsyncEngine, store: TieredStore, min_blocks: int = 1) -> None:
        self._aengine = aengine
        self._kv = aengine.engine.kv_access
        self._store = store
        self._spec: BlockSpec = block_spec(aengine.engine)
        self._scales = self._kv.kv_scales
        self._block_size = aengine.engine.config.cache.block_size
        self._root = aengine.engine.hash_root()
        self._min_blocks = min_blocks
        self._saves: set[asyncio.Task[int]] = set()
        self._pin_ids = itertools.count()
        self.stats = TierStats()
        self.cost = FetchCost(self._block_size, self._spec.encoded_nbytes)

    @classmethod
    def from_config(cls, aengine: AsyncEngine, config: TierConfig) -> TierPrefixCache:
        spec = block_spec(aengine.engine)
        redis = (RedisTier(spec, config.redis_url, ttl_s=config.redis_ttl_s,
                           key_prefix=config.redis_key_prefix,
                           limits=RedisLimits(max_bytes=config.redis_max_bytes))
                 if config.redis_url else None)
        store = TieredStore(spec, CpuTier(config.cpu_bytes), redis)
        return cls(aengine, store, config.min_blocks)

    @property
    def store(self) -> TieredStore:
        return self._store

    # ---- before the request is queued ------------------------------------------------------

    async def plan(self, prompt_token_ids: list[int], root: bytes | None = None,
                   parent: Context | None = None) -> RemoteKv | None:
        """The prompt's prefix to load from the tiers, or None (nothing worth fetching).
        `root`: the root its blocks' hashes chain from when not the engine's (a LoRA adapter's
        prompt: `LLMEngine.hash_root`); the tiers key blocks by those hashes, so an adapter's KV
        and the base model's never answer for each other. parent: the request's span (the
        tier reads' spans go under it)."""
        hashes = compute_block_hashes(root or self._root, prompt_token_ids, self._block_size)
        first = self._kv.cached_prefix_blocks(hashes)
        if len(hashes) - first < self._min_blocks:
            return None
        if self._store.redis is not None and hashes[first] not in self._store.cpu:
            return await self._plan_split(hashes, first, parent)
        found: list[bytes | torch.Tensor] = []
        for data in await self._store.get_entries(hashes[first:], self.cost.worth, parent):
            if data is None:
                break
            found.append(data)
        if len(found) < self._min_blocks:
            return None
        self.stats.planned_blocks += len(found)
        return RemoteKv(num_tokens=(first + len(found)) * self._block_size,
                        handle=TierBlocks(first, tuple(found), tuple(hashes)), cached=True)

    async def _plan_split(self, hashes: list[bytes], first: int, parent: Context | None
                          ) -> RemoteKv | None:
        """Redis's blocks after the GPU's `first`: computed, fetched, or split (the docstring)."""
        store = self._store
        assert store.redis is not None
        held = await store.redis_held(hashes[first:])
        if held < self._min_blocks:
            return None
        head = self.cost.split(store.redis.counters, held)
        if held - head < self._min_blocks:
            store.redis.counters.cost_skips += 1
            return None
        start, end = first + head, first + held
        if head == 0:  # fetch all, before the request is queued (it holds no blocks meanwhile)
            values = await store.fetch_redis(hashes[start:end], parent)
            if len(values) < self._min_blocks:
                return None
            self.stats.planned_blocks += len(values)
            return RemoteKv(num_tokens=(first + len(values)) * self._block_size,
                            handle=TierBlocks(first, tuple(values), tuple(hashes)), cached=True)
        self.stats.planned_blocks += held - head
        self.stats.overlapped_blocks += head
        fetch = asyncio.ensure_future(store.fetch_redis(hashes[start:end], parent))
        return RemoteKv(num_tokens=end * self._block_size,
                        handle=TierFetch(start, fetch, held - head, tuple(hashes)),
                        cached=True, first_token=start * self._block_size)

    async def _arrived(self, handle: TierFetch) -> TierBlocks | None:
        """The fetched tail, or None (counted) if it did not arrive whole."""
        try:
            values = await handle.fetch
        except Exception as e:  # any failure of the read means recompute
            logger.warning("tier read failed: %s", e)
            values = []
        if len(values) < handle.count:
            self.stats.short_fetches += 1
            return None
        return TierBlocks(handle.first, tuple(values), handle.hashes)

    # ---- the engine's KV loader ------------------------------------------------------------

    async def load(self, load: KvLoad) -> bool:
        """Fill `load.block_ids` with the planned blocks; False (recompute) when the plan no
        longer covers them or a block fails verification."""
        remote = load.request.remote_kv
        handle = remote.handle if remote is not None else None
        if isinstance(handle, TierFetch):
            handle = await self._arrived(handle)
            if handle is None:
                self.stats.failed_loads += 1
                return False
        if not isinstance(handle, TierBlocks):
            return False
        start = load.first_block - handle.first
        if start < 0 or start + len(load.block_ids) > len(handle.blocks):
            # The GPU dropped blocks the plan counted on: the tiers hold no copy of them here.
            self.stats.failed_loads += 1
            return False
        try:
            await asyncio.to_thread(self._write, handle, load.first_block, load.block_ids)
        except KvWireError as e:
            logger.warning("tier load for %s refused: %s", load.request.request_id, e)
            self.stats.failed_loads += 1
            return False
        self.stats.loaded_blocks += len(load.block_ids)
        self.stats.loaded_tokens += len(load.block_ids) * self._block_size
        return True

    def _write(self, handle: TierBlocks, first_block: int, block_ids: list[int]) -> None:
        """Into the cache, LOAD_SLICE_BLOCKS at a time (in a thread). Every entry was verified
        (checksum included) when it entered the store, so `block_view` checks the header and
        reads the payload in place. On a GPU the slice goes host to device block by block out
        of the pinned entries (no host copy), then into the cache's blocks there."""
        kv = self._kv
        for start in range(0, len(block_ids), LOAD_SLICE_BLOCKS):
            ids = block_ids[start:start + LOAD_SLICE_BLOCKS]
            tensors, scales = [], None
            for index in range(first_block + start, first_block + start + len(ids)):
                block = block_view(handle.blocks[index - handle.first], self._spec)
                if block.block_hash != handle.hashes[index]:
                    raise KvWireError(f"block {index} holds another block's KV")
                tensors.append(block.tensor)
                scales = block.scales if scales is None else scales
            if kv.device.type == "cuda":
                staged = torch.empty((len(ids), *self._spec.shape), dtype=self._spec.dtype,
                                     device=kv.device)
                for i, tensor in enumerate(tensors):
                    staged[i].copy_(tensor, non_blocking=tensor.is_pinned())
                kv.write_blocks(ids, staged, scales)  # same stream: after the copies
            else:
                kv.write_blocks(ids, torch.stack(tensors), scales)

    # ---- after the response ----------------------------------------------------------------

    def spawn_save(self, block_hashes: list[bytes]) -> None:
        """Save a prefilled prompt's full blocks (its KV handle's hashes) in the background."""
        self._spawn(lambda: self.save(block_hashes))

    def _spawn(self, save: Callable[[], Coroutine[Any, Any, int]]) -> None:
        if len(self._saves) >= MAX_PENDING_SAVES:
            self.stats.skipped_saves += 1
            return
        task = asyncio.ensure_future(save())
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    def spawn_save_tokens(self, token_ids: list[int], root: bytes | None = None,
                          skip_blocks: int = 0) -> None:
        """`save_tokens` in the background."""
        self._spawn(lambda: self.save_tokens(token_ids, root, skip_blocks))

    async def save_tokens(self, token_ids: list[int], root: bytes | None = None,
                          skip_blocks: int = 0) -> int:
        """Write the full blocks of `token_ids` (a finished request's prompt and output, whose
        KV was computed) that the GPU prefix cache holds and the CPU tier lacks, but the first
        `skip_blocks` (saved elsewhere already); returns how many were saved. `root`: as for
        `plan`."""
        hashes = compute_block_hashes(root or self._root, token_ids, self._block_size)
        return await self.save(hashes[skip_blocks:])

    async def save(self, block_hashes: list[bytes]) -> int:
        """Write the blocks of `block_hashes` that the GPU prefix cache holds and the CPU tier
        lacks; returns how many were saved. They are pinned while read, so neither a lease's
        release (a decode worker pulled them first) nor an eviction takes them meanwhile."""
        if not block_hashes:
            return 0
        pin_id = f"tier-save-{next(self._pin_ids)}"
        todo = await self._aengine.call(self._pin_missing, pin_id, block_hashes)
        if not todo:
            return 0
        try:
            blocks = await self._kv.read_held_blocks([block_id for block_id, _ in todo])
        finally:
            with contextlib.suppress(Exception):  # a stopped engine holds nothing any more
                await self._aengine.call(self._kv.unpin, pin_id)
        # In a thread: the event loop also serves the worker's calls (and a colocated
        # worker's gateway streams).
        return await self._put(await asyncio.to_thread(self._encode, todo, blocks))

    async def _put(self, items: list[tuple[bytes, bytes]]) -> int:
        """Store encoded blocks in the CPU tier and queue them for Redis; how many were handed
        over (what lands: the tiers' counters)."""
        self.stats.saved_blocks += await self._store.put_many(items, encoded_here=True)
        return len(items)

    def _encode(self, todo: list[tuple[int, bytes]], blocks: torch.Tensor
                ) -> list[tuple[bytes, bytes]]:
        return [(h, encode_block(self._spec, h, self._block_size, blocks[i], self._scales))
                for i, (_, h) in enumerate(todo)]

    def _pin_missing(self, pin_id: str, hashes: list[bytes]) -> list[tuple[int, bytes]]:
        # Engine thread: hold the cached blocks of the hashes the CPU tier lacks.
        return self._kv.pin_cached(pin_id, [h for h in hashes if h not in self._store.cpu])

    async def wait_for_saves(self) -> None:
        """Await the saves in flight and their queued Redis writes (tests, benchmarks)."""
        if self._saves:
            await asyncio.gather(*self._saves, return_exceptions=True)
        await self._store.flush()

    async def close(self) -> None:
        """Stop the Redis writes (those queued are dropped, counted) and close its clients."""
        await self._store.close()

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A prefill's time, for the cost model: `cached_tokens` (GPU and tier hits) were not
        computed."""
        self.cost.observe_prefill(prompt_tokens - cached_tokens, seconds)


class TierOrPullLoader:
    """A decode worker's KV loader with tiers: a tier plan's blocks come from the tiers, a KV
    handle's from the prefill worker."""

    def __init__(self, tiers: TierPrefixCache, pull: GrpcKvLoader) -> None:
        self.tiers = tiers
        self._pull = pull

    async def __call__(self, load: KvLoad) -> bool:
        remote = load.request.remote_kv
        if remote is not None and isinstance(remote.handle, (TierBlocks, TierFetch)):
            return await self.tiers.load(load)
        return await self._pull(load)


def attach_tiers(aengine: AsyncEngine, config: TierConfig | None,
                 pull: GrpcKvLoader | None = None) -> TierPrefixCache | None:
    """Put CPU/Redis tiers under `aengine`'s cache when `config` enables any (its KV loader
    becomes the tiers', or a decode worker's `pull` loader for KV handles and the tiers' for
    tier plans); None when it enables none. Call before `aengine.start()`."""
    if config is None or not config.enabled:
        return None
    cache = TierPrefixCache.from_config(aengine, config)
    aengine.kv_loader = cache.load if pull is None else TierOrPullLoader(cache, pull)
    return cache
