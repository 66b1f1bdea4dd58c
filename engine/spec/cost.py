"""A decode worker's measured step cost: seconds per step by the step's query rows (a plain
sequence is one row, a verifying one 1 + its drafts), smoothed, for the speculation policy
(engine_api/spec_gain.py) here and at the gateway (LoadReport.spec_step_cost).

Steps are grouped by rows in half-octave buckets (1, 1.4, 2, 2.8, 4, ...); each bucket keeps
its last COST_WINDOW steps, and its point is their mean rows and median seconds, so the points
follow the worker's own hardware, model and load mix within a few steps, and a step slowed once
(a shape's first use: a CUDA graph captured, a kernel compiled; a collection; a stall) is out
of the point at once. With a moving average (weight 0.1 to the newest) one such step held the
H200's 64-row point at 17.6 ms against 6.3 ms measured for dozens of steps after it, and the
policy took four drafts per sequence for nearly free. Start-up calibration (calibrate.py) fills
them before the first request; live steps refresh them. Only pure decode steps count: a prompt
chunk in the step would charge its compute to the rows.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from engine_api.spec_gain import StepCost

# Steps a bucket keeps: its median follows a lasting change within COST_WINDOW / 2 steps.
COST_WINDOW = 16
# A bucket's weight in the monotone fit: its steps, up to about what its median stands on.
MAX_WEIGHT = COST_WINDOW


def monotone(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool adjacent
    violators: a run that decreases is replaced by its weighted mean)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, max(w, 1e-9), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]


@dataclass(slots=True)
class _Bucket:
    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    count: int = 0  # steps ever recorded

    @property
    def rows(self) -> float:
        return sum(r for r, _ in self.steps) / len(self.steps)

    @property
    def seconds(self) -> float:
        return statistics.median(s for _, s in self.steps)


class StepCostModel:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        # The fitted curve, until the next step is recorded: the budget asks for it for each
        # (method, class) every round, and medians of every bucket need not be redone.
        self._cost: StepCost | None = None

    @staticmethod
    def _key(rows: int) -> int:
        return round(2 * math.log2(rows))

    def record(self, rows: int, seconds: float) -> None:
        """One decode step of `rows` query rows took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        b = self._buckets.setdefault(self._key(rows), _Bucket())
        b.steps.append((rows, seconds))
        b.count += 1
        self._cost = None

    def points(self) -> list[tuple[float, float]]:
        """(rows, seconds) per bucket, ascending in both: a step with more rows costs no less
        than one with fewer, so the buckets' medians are fitted to a non-decreasing curve
        (`monotone`). Without the fit a bucket that saw few steps, one of them slow (the
        machine busy, a shape's first use), could read dearer than the buckets above it: on a
        shared 2-core machine 2 and 3 rows read 119 and 151 ms against 94 ms for 4 rows, and
        the policy judged one draft dearer than four."""
        cost = self.cost()
        return list(zip(cost.rows, cost.seconds, strict=True))

    def cost(self) -> StepCost:
        """The fitted points as a curve (kept until the next step is recorded)."""
        if self._cost is None:
            buckets = [b for _, b in sorted(self._buckets.items())]
            fitted = monotone([b.seconds for b in buckets],
                              [min(b.count, MAX_WEIGHT) for b in buckets])
            self._cost = StepCost.of([(b.rows, s) for b, s in zip(buckets, fitted, strict=True)])
        return self._cost

    def __len__(self) -> int:
        return len(self._buckets)
