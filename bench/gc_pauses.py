"""Python garbage-collector pauses during a measured region (`gc.callbacks`)."""

from __future__ import annotations

import gc
import time
from types import TracebackType
from typing import Any


class GcPauses:
    """Counts collections and sums their wall time per generation while active."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            gen = int(info.get("generation", 0))
            self.count[gen] += 1
            self.seconds[gen] += time.perf_counter() - self._start
            self._start = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {"collections": list(self.count),
                "ms": [round(s * 1e3, 3) for s in self.seconds],
                "total_ms": round(sum(self.seconds) * 1e3, 3)}
