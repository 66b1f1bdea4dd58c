"""Fetch or recompute, by measured cost.

A remote tier can be slower than recomputing (a busy Redis, a slow network, a fast GPU), so
the worker measures both sides live and, per request and per chunk of a tier read, fetches
only blocks that arrive sooner than they would be computed:

    fetch n blocks  = tier latency + n * block bytes / tier bandwidth    (TierCounters.cost:
                                                                          fitted over its reads)
    compute n blocks = n * block_size / prefill tokens per second         (this module: the
                                                                          median of the worker's
                                                                          last RATE_WINDOW prefills)

When the engine may compute while a tier read runs (`split`: the prompt's head computed, its
tail fetched at the same time, engine/scheduler.py), the split is where both end together:

    k = argmin over k of max(compute(k), fetch(n - k))    (0: fetch all; n: compute all)

A split has costs of its own that the two terms do not see (one more engine step after the tail
lands, and above all the read's parsing and verification on the host while the engine's host
thread runs the head's steps): it is taken only when it saves more than SPLIT_MIN_GAIN_S and
SPLIT_MIN_GAIN of the better of fetching all and computing all; otherwise that better one is
done. With a block read r times slower than computed, the best split saves 1 / (1 + r) of
computing all, so SPLIT_MIN_GAIN = 0.25 splits only where a block reads at most 3x slower than it
computes. On the H200 (dummy 8B, 16k tokens) a split predicted to save 13% (r = 6.7) took 612 ms
against 507 ms for computing all.

The prefill rate is the median of the last RATE_WINDOW prefills' rates, not a running mean: a
worker's first prefills of a shape (kernels compiled, graphs captured) run 10-30x slower than
the rest, and a mean with weight 0.2 for the newest still read 9.6k tokens/s on the H200 three
prefills after one of 1.5k tokens/s, against 41k in fact, so a 1k-token Redis hit was split
(145 ms) where computing it all took 24 ms. A median drops such an outlier at once and still
follows a lasting change (load: queueing counts in a prefill's time) within RATE_WINDOW / 2
prefills.

Until the worker has timed a prefill it fetches (the tiers exist to be used); a tier whose reads
have not been timed yet is charged its prior (counters.py).
"""

from __future__ import annotations

import statistics
from collections import deque

from kv_transfer.tiers import TierCounters

# Prefills whose median rate is the estimate.
RATE_WINDOW = 9
# A prefill shorter than this many computed tokens says more about overheads than the rate.
MIN_TOKENS = 32
# A split must beat fetching all by this much (seconds, and fraction of fetching all).
SPLIT_MIN_GAIN_S = 0.005
SPLIT_MIN_GAIN = 0.25


class FetchCost:
    """The prefill rate of one worker, and the per-chunk decision against a tier's read cost."""

    def __init__(self, block_size: int, block_bytes: int) -> None:
        self._block_size = block_size
        self._block_bytes = block_bytes
        self._rates: deque[float] = deque(maxlen=RATE_WINDOW)
        self.decisions = {"fetch": 0, "compute": 0, "overlap": 0}
        # The last `split`: (blocks computed, blocks fetched).
        self.last_split: tuple[int, int] | None = None

    def observe_prefill(self, computed_tokens: int, seconds: float) -> None:
        """A prefill computed `computed_tokens` in `seconds` (queueing included: under load it
        is what recomputing costs)."""
        if computed_tokens < MIN_TOKENS or seconds <= 0:
            return
        self._rates.append(computed_tokens / seconds)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The estimate (None before any prefill was timed)."""
        return statistics.median(self._rates) if self._rates else None

    @prefill_tokens_per_s.setter
    def prefill_tokens_per_s(self, rate: float | None) -> None:
        """Replace what was measured with `rate` (None: as if nothing were)."""
        self._rates.clear()
        if rate is not None:
            self._rates.append(rate)

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
