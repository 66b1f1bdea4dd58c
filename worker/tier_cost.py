"""Fetch or recompute, by measured cost.

A remote tier can be slower than recomputing (a busy Redis, a slow network, a fast GPU), so
the worker measures both sides live and, per request and per chunk of a tier read, fetches
only blocks that arrive sooner than they would be computed:

    fetch n blocks  = tier latency + n * block bytes / tier bandwidth    (TierCounters.cost:
                                                                          fitted over its reads)
    compute n blocks = n * block_size / prefill tokens per second         (this module: smoothed
                                                                          over the worker's prefills)

Until the worker has timed a prefill it fetches (the tiers exist to be used); a tier whose reads
have not been timed yet is charged its prior (counters.py).
"""

from __future__ import annotations

from kv_transfer.tiers import TierCounters

# Weight of the newest prefill in the smoothed rate.
ALPHA = 0.2
# A prefill shorter than this many computed tokens says more about overheads than the rate.
MIN_TOKENS = 32


class FetchCost:
    """The prefill rate of one worker, and the per-chunk decision against a tier's read cost."""

    def __init__(self, block_size: int, block_bytes: int) -> None:
        self._block_size = block_size
        self._block_bytes = block_bytes
        self.prefill_tokens_per_s: float | None = None
        self.decisions = {"fetch": 0, "compute": 0}

    def observe_prefill(self, computed_tokens: int, seconds: float) -> None:
        """A prefill computed `computed_tokens` in `seconds` (queueing included: under load it
        is what recomputing costs)."""
        if computed_tokens < MIN_TOKENS or seconds <= 0:
            return
        rate = computed_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - ALPHA) * old + ALPHA * rate

    def compute_s(self, blocks: int) -> float | None:
        rate = self.prefill_tokens_per_s
        return None if rate is None else blocks * self._block_size / rate

    def worth(self, tier: TierCounters, blocks: int) -> bool:
        """Whether reading `blocks` from `tier` beats computing them."""
        compute = self.compute_s(blocks)
        fetch = compute is None or tier.cost.seconds(blocks * self._block_bytes) < compute
        self.decisions["fetch" if fetch else "compute"] += 1
        return fetch
