"""Block pool: ref-counted KV blocks, an O(1) LRU free queue, and the hash → block map.

    block ids:   0   1   2   3   4   5   6   7
    ref_cnt:     2   1   0   0   1   0   0   0
    free queue (LRU first):  3 ← 2 ← 5 ← 6 ← 7      (evicted from the left)
    cached map:  {h(a): 0, h(a,b): 1, h(c): 2}      block 2 is free but still a cache hit

A block with ref_cnt == 0 sits in the free queue; if it has a hash it stays in the cached map
until the queue hands it out again (eviction). Not thread-safe: owned by the scheduler thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # Links of the free queue; both None when the block is not in it (or is its only member).
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


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
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

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
        measured ~50-100 us behind a busy GPU's kernels (bench/probe_ipc_busy.py)."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        out.sort(key=lambda b: b.block_id)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: list[Block]) -> None:
        """Drop one reference; blocks reaching zero join the free queue (hash kept for reuse)."""
        for b in blocks_in_eviction_order:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

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
