"""KV block bookkeeping: pure Python, no torch (docs/architecture.md, "Engine internals"). Physical tensors live in the runner."""

from engine.kv.block_pool import Block, BlockPool, FreeBlockQueue, RunKeepingBlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine_api.hashing import block_hash, compute_block_hashes, model_fingerprint, root_hash

__all__ = [
    "Block",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheManager",
    "RunKeepingBlockPool",
    "block_hash",
    "compute_block_hashes",
    "model_fingerprint",
    "root_hash",
]
