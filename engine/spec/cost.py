"""A decode worker's measured step cost: seconds per step by the step's query rows (a plain
sequence is one row, a verifying one 1 + its drafts), smoothed, for the speculation policy
(engine_api/spec_gain.py) here and at the gateway (LoadReport.spec_step_cost).

Steps are grouped by rows in half-octave buckets (1, 1.4, 2, 2.8, 4, ...); each bucket keeps
a moving average of its steps' rows and seconds, so the points follow the worker's own hardware,
model and load mix. Start-up calibration (calibrate.py) fills them before the first request;
live steps refresh them. Only pure decode steps count: a prompt chunk in the step would
charge its compute to the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_api.spec_gain import StepCost

# Weight of a new step in its bucket's average: a bucket follows a change within ~20 steps.
COST_NEW_WEIGHT = 0.1


@dataclass(slots=True)
class _Bucket:
    rows: float
    seconds: float
    count: int = 1


class StepCostModel:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def _key(rows: int) -> int:
        return round(2 * math.log2(rows))

    def record(self, rows: int, seconds: float) -> None:
        """One decode step of `rows` query rows took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        key = self._key(rows)
        b = self._buckets.get(key)
        if b is None:
            self._buckets[key] = _Bucket(float(rows), seconds)
            return
        w = COST_NEW_WEIGHT
        b.rows += w * (rows - b.rows)
        b.seconds += w * (seconds - b.seconds)
        b.count += 1

    def points(self) -> list[tuple[float, float]]:
        """(rows, seconds) per bucket, ascending."""
        return [(b.rows, b.seconds) for _, b in sorted(self._buckets.items())]

    def cost(self) -> StepCost:
        return StepCost.of(self.points())

    def __len__(self) -> int:
        return len(self._buckets)
