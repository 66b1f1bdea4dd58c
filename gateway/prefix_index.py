"""Which prefill worker probably holds which KV blocks, for prefix-aware routing.

Approximate by design (as SGLang's cache-aware router): the gateway remembers the block hashes
of the prompts it sent each worker (when it picks the worker) and those the worker reported
back (`KvHandle.block_hashes`), per worker in an LRU of bounded size. A worker may since have
evicted a block; then the request just recomputes it.
Hashes are the engine's chained block hashes (docs/architecture.md, "Shared contracts"), computed with the torch-free
`engine_api.hashing` from the fingerprint and block size the workers report.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine_api.hashing import compute_block_hashes, root_hash


class PrefixIndex:
    """Per-worker LRU sets of block hashes. Mutated on the event loop only."""

    def __init__(self, max_hashes_per_worker: int = 200_000) -> None:
        self._max = max_hashes_per_worker
        self._by_worker: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, address: str, hashes: Sequence[bytes]) -> None:
        lru = self._by_worker.setdefault(address, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self._max:
            lru.popitem(last=False)

    def match(self, address: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the worker is believed to hold."""
        lru = self._by_worker.get(address)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def forget(self, address: str) -> None:
        self._by_worker.pop(address, None)


def prompt_block_hashes(prompt_token_ids: Sequence[int], fingerprint: bytes,
                        block_size: int, root: bytes | None = None) -> list[bytes]:
    """The engine's hashes of the prompt's full blocks (empty when the layout is unknown):
    chained from the model's root, or from `root` when given (a LoRA adapter's, as its
    workers report it)."""
    if len(fingerprint) != 32 or block_size <= 0 or (root is not None and len(root) != 32):
        return []
    return compute_block_hashes(root_hash(fingerprint) if root is None else root,
                                prompt_token_ids, block_size)
