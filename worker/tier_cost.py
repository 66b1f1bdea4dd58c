"""Fetch or recompute, by measured cost.

A remote tier can be slower than recomputing (a busy Redis, a slow network, a fast GPU), so
the worker measures both sides live and, per request and per chunk of a tier read, fetches
only blocks that arrive sooner than they would be computed:

    fetch n blocks  = tier latency + n * block bytes / tier bandwidth    (TierCounters.cost:
                                                                          fitted over its reads)
    compute n blocks = n * block_size / prefill tokens per second         (this module: smoothed
                                                                          over the worker's prefills)

When the engine may compute while a tier read runs (`split`: the prompt's head computed, its
tail fetched at the same time, engine/scheduler.py), the split is where both end together:

    k = argmin over k of max(compute(k), fetch(n - k))    (0: fetch all; n: compute all)

A split has costs of its own that the two terms do not see (asking Redis which blocks it holds
first, one more engine step after the tail lands): it is taken only when it saves more than
SPLIT_MIN_GAIN_S and SPLIT_MIN_GAIN of the better of fetching all and computing all; otherwise
that better one is done.

Until the worker has timed a prefill it fetches (the tiers exist to be used); a tier whose reads
have not been timed yet is charged its prior (counters.py).
"""

from __future__ import annotations

from kv_transfer.tiers import TierCounters

# Weight of the newest prefill in the smoothed rate.
ALPHA = 0.2
# A prefill shorter than this many computed tokens says more about overheads than the rate.
MIN_TOKENS = 32
# A split must beat fetching all by this much (seconds, and fraction of fetching all).
SPLIT_MIN_GAIN_S = 0.005
SPLIT_MIN_GAIN = 0.1


class FetchCost:
    """The prefill rate of one worker, and the per-chunk decision against a tier's read cost."""

    def __init__(self, block_size: int, block_bytes: int) -> None:
        self._block_size = block_size
        self._block_bytes = block_bytes
        self.prefill_tokens_per_s: float | None = None
        self.decisions = {"fetch": 0, "compute": 0, "overlap": 0}
        # The last `split`: (blocks computed, blocks fetched).
        self.last_split: tuple[int, int] | None = None

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

    def split(self, tier: TierCounters, blocks: int) -> int:
        """Of `blocks` blocks that `tier` holds right after what the engine has, how many from
        the first to compute while the rest is read (see the module docstring): 0 fetches all
        (also before any prefill was timed), `blocks` computes all."""
        rate = self.prefill_tokens_per_s
        best_k, best = 0, float("inf")
        if rate is not None:
            for k in range(blocks + 1):  # a few thousand at most: no need to be clever
                m = blocks - k
                fetch = tier.cost.seconds(m * self._block_bytes) if m else 0.0
                worst = max(k * self._block_size / rate, fetch)
                if worst < best:
                    best_k, best = k, worst
            fetch_all = tier.cost.seconds(blocks * self._block_bytes)
            compute_all = blocks * self._block_size / rate
            whole = min(fetch_all, compute_all)
            if 0 < best_k < blocks and whole - best < max(SPLIT_MIN_GAIN_S,
                                                          SPLIT_MIN_GAIN * whole):
                # Not worth a split's own costs: the better whole way.
                best_k = 0 if fetch_all <= compute_all else blocks
        self.decisions["fetch" if best_k == 0 else "compute" if best_k == blocks
                       else "overlap"] += 1
        self.last_split = (best_k, blocks - best_k)
        return best_k
