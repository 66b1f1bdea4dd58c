"""Prefix-cache tiers below the GPU, keyed by block hash (docs/architecture.md, "Where each
concept lives"): the CPU tier (`cpu.py`), the cluster-wide Redis tier (`redis_tier.py`, its
writes queued by `write_queue.py`, its failures paced by `breaker.py`), both together
(`store.py`), and what each counts (`counters.py`).

Values are encoded blocks (`wire.encode_block` bytes), verified on the way in.
"""

from kv_transfer.tiers.breaker import Breaker, Failure
from kv_transfer.tiers.counters import LatencyHistogram, ReadCost, TierCounters
from kv_transfer.tiers.cpu import CpuTier, PinnedSlots
from kv_transfer.tiers.redis_tier import RedisLimits, RedisTier
from kv_transfer.tiers.store import TieredStore, Worth
from kv_transfer.tiers.write_queue import WriteQueue

__all__ = ["Breaker", "CpuTier", "Failure", "LatencyHistogram", "PinnedSlots", "ReadCost",
           "RedisLimits", "RedisTier", "TierCounters", "TieredStore", "Worth", "WriteQueue"]
