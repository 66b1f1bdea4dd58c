"""What each prefix tier counts: hits, misses and bytes of its reads, why reads failed, how
long reads and writes took, and what became of every block handed to it for saving (queued,
written, or dropped with a reason). `worker/tier_metrics.py` turns these into the LoadReport's
`KvTierStats`; the gateway exports them per worker.

`ReadCost` is the tier's measured read cost (latency and bandwidth, smoothed), which the
fetch-or-recompute decision (`worker/tier_cost.py`) weighs against the worker's prefill rate.

Plain counters, no lock: each tier's counters are updated from one event loop (the CPU tier's
own hit/miss statistics live in `CpuTier.stats`, under its lock).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# Seconds: a CPU-tier read is microseconds, a Redis chunk up to seconds under load.
LATENCY_BOUNDS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                     0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class LatencyHistogram:
    """Observations per bucket (`counts[i]`: at most `bounds[i]`, the last one above them all)."""

    bounds: tuple[float, ...] = LATENCY_BOUNDS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


class ReadCost:
    """A tier's read time as `latency + bytes / bandwidth`, fitted by least squares over recent
    reads (exponential forgetting: each new read weighs as much as the last ~1/(1-DECAY)).

    Until it has seen reads of two different sizes it cannot split the two terms: it then
    charges everything to bandwidth (latency 0), which overstates large reads' speed least.
    """

    DECAY = 0.9

    def __init__(self, prior_latency_s: float, prior_bytes_per_s: float) -> None:
        self._prior = (prior_latency_s, prior_bytes_per_s)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.reads = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        d = self.DECAY
        x, y = float(nbytes), max(0.0, seconds)
        self._w, self._x, self._y = d * self._w + 1, d * self._x + x, d * self._y + y
        self._xx, self._xy = d * self._xx + x * x, d * self._xy + x * y
        self.reads += 1

    @property
    def latency_s(self) -> float:
        return self._fit()[0]

    @property
    def bytes_per_s(self) -> float:
        return self._fit()[1]

    def seconds(self, nbytes: int) -> float:
        """Estimated time to read `nbytes` in one read."""
        latency, bandwidth = self._fit()
        return latency + nbytes / bandwidth

    def _fit(self) -> tuple[float, float]:
        if self.reads == 0 or self._x <= 0:
            return self._prior
        spread = self._w * self._xx - self._x * self._x
        if spread > 1e-9 * self._xx * self._w:  # sizes differ: a line through them
            slope = (self._w * self._xy - self._x * self._y) / spread
            latency = (self._y - slope * self._x) / self._w
            if slope > 0 and latency >= 0:
                return latency, 1.0 / slope
        return 0.0, self._x / max(self._y, 1e-9)


@dataclass(slots=True)
class TierCounters:
    """Cumulative counts of one tier (a worker restart resets them, as Prometheus expects)."""

    tier: str
    hits: int = 0                 # blocks found (and verified)
    hit_bytes: int = 0
    misses: int = 0               # lookups that ended at this tier without the next block
    cost_skips: int = 0           # reads not made: computing the blocks was estimated faster
    read_errors: Counter[str] = field(default_factory=Counter)  # reason -> blocks not read
    reads: LatencyHistogram = field(default_factory=LatencyHistogram)
    saves_queued: int = 0         # blocks handed to the tier for writing
    saves_written: int = 0        # of those, blocks the tier acknowledged
    written_bytes: int = 0
    saves_dropped: Counter[str] = field(default_factory=Counter)  # reason -> blocks dropped
    writes: LatencyHistogram = field(default_factory=LatencyHistogram)
    cost: ReadCost = field(default_factory=lambda: ReadCost(0.001, 500e6))

    def read(self, blocks: int, nbytes: int, seconds: float) -> None:
        """A read that returned `blocks` verified blocks of `nbytes` in `seconds`."""
        self.hits += blocks
        self.hit_bytes += nbytes
        self.reads.observe(seconds)
        if nbytes:
            self.cost.observe(nbytes, seconds)
