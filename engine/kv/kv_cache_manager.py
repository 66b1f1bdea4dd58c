"""KV cache manager: which blocks each request holds, prefix-cache lookup, two-phase allocation.

Pure Python (no torch). Owned by the scheduler; not thread-safe.

A request's block list covers positions [0, num_tokens) in order:

    tokens:  |a b c d|e f g h|i j . .|      block_size 4, 10 tokens
    blocks:  [  17   ,   3   ,  42   ]      full, full, partial (not hashed)
"""

from __future__ import annotations

from engine.kv.block_pool import Block, BlockPool, RunKeepingBlockPool
from engine.request import Request
from engine_api.hashing import compute_block_hashes


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 root: bytes, keep_runs: bool = False) -> None:
        """`keep_runs`: hand out blocks so that prompts stay in runs of consecutive ids
        (`RunKeepingBlockPool`; for engines whose KV is copied to or from another cache)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = root
        self.pool = (RunKeepingBlockPool if keep_runs else BlockPool)(
            num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # The same lists as block ids, kept in step: the runner reads them every step.
        self._req_to_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the hash map.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0     # tokens found

    # ---- queries (no mutation) -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order. A live list owned by the manager: read, don't keep."""
        return self._req_to_ids.get(request_id, [])

    def update_hashes(self, req: Request) -> list[bytes]:
        """Extend `req.block_hashes` to cover all full blocks of its tokens (mutates req)."""
        root = self.root if req.hash_root is None else req.hash_root
        req.block_hashes = compute_block_hashes(root, req.all_token_ids, self.block_size,
                                                req.block_hashes)
        return req.block_hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute.

        Returns (blocks, num_computed_tokens). Counts the lookup in the hit statistics; takes no
        reference (allocate_slots does).
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cached_prefix_len(self, hashes: list[bytes]) -> int:
        """Number of leading hashes present in the cache (for routing; no statistics)."""
        n = 0
        for h in hashes:
            if self.pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    # ---- mutation --------------------------------------------------------------------------

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[Block] | None = None,
                       cache: bool = True) -> list[Block] | None:
        """Give `req` blocks for `num_new_tokens` more tokens after its computed ones.

        Two-phase: checks capacity first and returns None (changing nothing) when there is not
        enough; otherwise takes references on `new_computed_blocks` (prefix hits, whose tokens are
        counted as computed by the caller), appends fresh blocks, and registers every block that
        will be full after this step in the prefix cache (`cache=False` defers that, for KV that
        arrives from elsewhere: see `cache_computed`). Returns the newly allocated blocks.
        """
        if num_new_tokens == 1 and not new_computed_blocks:
            # Decode fast path: the token usually fits the last held block.
            ids = self._req_to_ids.get(req.request_id)
            if ids is not None and req.num_computed_tokens < len(ids) * self.block_size:
                total = req.num_computed_tokens + 1
                # A block fills when its last token is known, which with async scheduling is one
                # step after its slot was allocated: compare with what is cached, not total % bs.
                if cache and (self._num_cached_blocks[req.request_id]
                              < min(total, req.num_tokens) // self.block_size):
                    self._cache_full_blocks(req, total)
                return []
        computed = new_computed_blocks or []
        held = self.req_to_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(held) - len(computed))
        # Hit blocks that are free must leave the free queue too.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        blocks.extend(computed)
        blocks.extend(new_blocks)
        ids = self._req_to_ids.setdefault(req.request_id, [])
        ids.extend(b.block_id for b in computed)
        ids.extend(b.block_id for b in new_blocks)
        self._num_cached_blocks.setdefault(req.request_id, 0)
        if computed:
            self._num_cached_blocks[req.request_id] = max(
                self._num_cached_blocks[req.request_id], len(blocks) - len(new_blocks))
        if cache:
            self._cache_full_blocks(req, total)
        return new_blocks

    def cache_computed(self, req: Request, num_tokens: int) -> None:
        """Register the full blocks among the first `num_tokens` tokens (after a KV load)."""
        self._cache_full_blocks(req, num_tokens)

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self._num_cached_blocks[req.request_id]
        if num_full <= start:
            return
        hashes = self.update_hashes(req)
        blocks = self.req_to_blocks[req.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release all of `req`'s blocks (tail first, so shared prefixes are evicted last)."""
        self.free_by_id(req.request_id)

    def free_by_id(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self._req_to_ids.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def transfer_to_lease(self, request_id: str, lease_id: str) -> list[int]:
        """Re-key a finished request's blocks under a lease id (prefill role); keeps references."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self._req_to_ids[lease_id] = self._req_to_ids.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self.req_to_blocks[lease_id] = blocks
        self._num_cached_blocks[lease_id] = len(blocks)
        return [b.block_id for b in blocks]

    def hold(self, holder_id: str, blocks: list[Block]) -> None:
        """Take a reference on `blocks` (cached ones, possibly free) under `holder_id`, which
        `free_by_id` drops; for readers that must keep blocks in place (Scheduler.pin_cached)."""
        if holder_id in self.req_to_blocks:
            raise ValueError(f"{holder_id!r} already holds blocks")
        self.pool.touch(blocks)
        self.req_to_blocks[holder_id] = list(blocks)
        self._req_to_ids[holder_id] = [b.block_id for b in blocks]
        self._num_cached_blocks[holder_id] = len(blocks)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: references held by requests == sum of ref counts."""
        self.pool.check_integrity()
        for rid, blocks in self.req_to_blocks.items():
            if self._req_to_ids.get(rid) != [b.block_id for b in blocks]:
                raise AssertionError(f"block id list of {rid} is out of step with its blocks")
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            if refs.get(b.block_id, 0) != b.ref_cnt:
                raise AssertionError(
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs.get(b.block_id, 0)} holders")
