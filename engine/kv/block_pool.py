"""Block pool: ref-counted KV blocks, an O(1) LRU free queue, and the hash → block map.

    block ids:   0   1   2   3   4   5   6   7
    ref_cnt:     2   1   0   0   1   0   0   0
    free queue (LRU first):  3 ← 2 ← 5 ← 6 ← 7      (evicted from the left)
    cached map:  {h(a): 0, h(a,b): 1, h(c): 2}      block 2 is free but still a cache hit

A block with ref_cnt == 0 sits in the free queue; if it has a hash it stays in the cached map
until the queue hands it out again (eviction). Not thread-safe: owned by the scheduler thread.

`RunKeepingBlockPool` chooses which free blocks to hand out so that a prompt's blocks stay in
runs of consecutive ids (for workers whose KV is copied between caches, one copy per run).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # Links of the free queue; both None when the block is not in it (or is its only member).
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)
    # RunKeepingBlockPool: whether the block is free and among the older free blocks, and the
    # number of times it became so (its heap entries carry the count: older ones are stale).
    old: bool = field(default=False, repr=False)
    old_epoch: int = field(default=0, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove from the middle."""

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> Block:
        first = self.first()
        if first is None:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def first(self) -> Block | None:
        """The least recently freed block, or None when the queue is empty."""
        first = self._head.next_free
        return None if first is self._tail else first

    def after(self, block: Block) -> Block | None:
        """The block freed next after `block` (in the queue), or None at the end."""
        nxt = block.next_free
        return None if nxt is self._tail else nxt

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """All KV blocks of one engine. Mutated only by the KV cache manager."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take `n` blocks from the LRU end, evicting their cached hashes; → them in ascending
        id order. Caller checks space.

        Which blocks are taken is LRU's choice; the order they are handed out in is free, and
        ascending ids put a request's consecutive positions in consecutive blocks where they can:
        a freed request's blocks come back reversed (`free_blocks`), and a KV handoff moves one
        run of blocks consecutive on both sides per copy (engine/dma_copy.py), each copy
        measured ~50-100 us behind a busy GPU's kernels (tools/probes/probe_ipc_busy.py)."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.first()
            assert b is not None
            self._take(b)
            out.append(b)
        out.sort(key=lambda b: b.block_id)
        return out

    def _take(self, b: Block) -> None:
        """Hand out free block `b`: out of the free queue, its cached hash evicted."""
        self._dequeue(b)
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
            b.block_hash = None
            self.num_evictions += 1
        b.ref_cnt = 1

    # The free queue changes only through these two (a subclass tracks them).
    def _dequeue(self, b: Block) -> None:
        self.free_queue.remove(b)

    def _enqueue(self, b: Block) -> None:
        self.free_queue.append(b)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self._dequeue(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: list[Block]) -> None:
        """Drop one reference; blocks reaching zero join the free queue (hash kept for reuse)."""
        for b in blocks_in_eviction_order:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._enqueue(b)

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        """Register a full block under its hash (first writer wins for duplicate content)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this one stays anonymous
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        return True

    def check_integrity(self) -> None:
        """free + used == total; free ⇔ ref_cnt == 0; cached map ⇔ block hashes. Raises on breach."""
        in_queue = {b.block_id for b in self.free_queue}
        if len(in_queue) != self.free_queue.num_free:
            raise AssertionError("free queue count does not match its links")
        used = [b for b in self.blocks if b.ref_cnt > 0]
        if len(in_queue) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free ({len(in_queue)}) + used ({len(used)}) != total ({self.num_blocks})")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise AssertionError(f"block {b.block_id} has ref_cnt {b.ref_cnt}")
            if (b.ref_cnt == 0) != (b.block_id in in_queue):
                raise AssertionError(f"block {b.block_id}: ref_cnt {b.ref_cnt} vs free queue")
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise AssertionError(f"cached map entry for block {b.block_id} has a stale hash")


class RunKeepingBlockPool(BlockPool):
    """A pool that keeps prompts in runs of consecutive block ids, for the prefill and decode
    roles, whose prompts' KV is copied from cache to cache: one copy per run of blocks
    consecutive on both sides (engine/dma_copy.py), and beside busy processes 125 blocks copy
    in 0.8 ms as one run, 3.7 ms as 3 and 14 ms scattered (H200,
    bench/results/h200/block_runs/).

    Plain LRU handing-out fragments a long-lived decode worker: every decode step takes single
    blocks from the front of the free queue, inside the runs that freed prompts left there, so
    after some hundreds of requests a pulled prompt is about one run per block
    (tools/probes/probe_block_runs.py). Here

    - the *older* free blocks (the least recently freed `old_fraction` of the queue) may be
      taken out of LRU order; the younger ones (the likelier prefix-cache hits) are not;
    - a block at a time (decode growth) comes from the highest-numbered older block, so
      growth gathers at the top of the id range, away from the runs that prompts take;
    - several blocks at once (a prompt) start from the least recently freed block and take the
      older free blocks beside it, up then down, before the next seed.

    Costs: O(log n) per single block (a heap of the older blocks' ids), 0.5-1.8 us more host time
    per block handed out; a prefix-cache hit can be lost to a block that LRU would have evicted
    later, but only from the older part (simulated with shared prefixes: LRU's hit rate kept,
    bench/results/cpu_block_runs/).
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 old_fraction: float = 0.5) -> None:
        if not 0.0 < old_fraction <= 1.0:
            raise ValueError(f"old_fraction must be in (0, 1], got {old_fraction}")
        self.old_fraction = old_fraction
        self.num_old = 0
        self._boundary: Block | None = None  # the first younger block in the queue, or None
        self._old_ids: list[tuple[int, int]] = []  # max-heap of (-block_id, old_epoch)
        super().__init__(num_blocks, enable_caching)
        self._boundary = self.free_queue.first()
        self._age()

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[Block] = []
        top = self._pop_highest_old() if n == 1 else None
        if top is not None:
            self._take(top)
            out.append(top)
        while len(out) < n:
            seed = self.free_queue.first()
            assert seed is not None
            self._take(seed)
            out.append(seed)
            for step in (1, -1):
                j = seed.block_id + step
                while len(out) < n and 0 <= j < self.num_blocks and self.blocks[j].old:
                    self._take(self.blocks[j])
                    out.append(self.blocks[j])
                    j += step
        self._age()
        out.sort(key=lambda b: b.block_id)
        return out

    def free_blocks(self, blocks_in_eviction_order: list[Block]) -> None:
        super().free_blocks(blocks_in_eviction_order)
        self._age()

    def touch(self, blocks: list[Block]) -> None:
        super().touch(blocks)
        self._age()

    def _pop_highest_old(self) -> Block | None:
        while self._old_ids:
            neg_id, epoch = heapq.heappop(self._old_ids)
            b = self.blocks[-neg_id]
            if b.old and b.old_epoch == epoch:
                return b
        return None

    def _dequeue(self, b: Block) -> None:
        if b is self._boundary:
            self._boundary = self.free_queue.after(b)
        if b.old:
            b.old = False
            self.num_old -= 1
        super()._dequeue(b)

    def _enqueue(self, b: Block) -> None:
        super()._enqueue(b)
        if self._boundary is None:
            self._boundary = b

    def _age(self) -> None:
        """Mark blocks older, in queue order, until `old_fraction` of the free ones are."""
        want = self.old_fraction * self.num_free_blocks
        while self.num_old < want and self._boundary is not None:
            b = self._boundary
            b.old = True
            b.old_epoch += 1
            self.num_old += 1
            heapq.heappush(self._old_ids, (-b.block_id, b.old_epoch))
            self._boundary = self.free_queue.after(b)
        if len(self._old_ids) > 2 * self.num_old + 64:
            # Entries of blocks taken by other means go stale; a pool that seldom hands out
            # single blocks (a prefill worker) would otherwise grow the heap without end.
            self._old_ids = [(-b.block_id, b.old_epoch) for b in self.blocks if b.old]
            heapq.heapify(self._old_ids)

    def check_integrity(self) -> None:
        super().check_integrity()
        queue = list(self.free_queue)
        flags = [b.old for b in queue]
        if flags != sorted(flags, reverse=True):
            raise AssertionError("an older block sits behind a younger one in the free queue")
        if sum(flags) != self.num_old or any(b.old for b in self.blocks if b.ref_cnt > 0):
            raise AssertionError("older-block count or flags out of step with the queue")
        first_young = next((b for b in queue if not b.old), None)
        if first_young is not self._boundary:
            raise AssertionError("the boundary is not the first younger block")
