"""Shared pieces of the H200 probes: garbage-collector pauses during a measured region
(`gc.callbacks`), per-name totals of profiled kernels, the synchronizing CUDA calls of a
region, a cProfile's top functions as text."""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
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


def rank_by_name(samples: Iterable[tuple[str, float]], rows: int, width: int = 90
                 ) -> list[dict[str, Any]]:
    """`(name, ms)` samples (kernel executions) summed per name: the `rows` names with the most
    time, as `{"name", "calls", "ms"}`, names cut to `width` characters."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, ms in samples:
        entry = totals[name]
        entry[0] += 1
        entry[1] += ms
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:rows]
    return [{"name": name[:width], "calls": int(c), "ms": round(ms, 3)}
            for name, (c, ms) in ranked]


def graph_replay_ms(fn: Callable[[], object], timer: Callable[[Callable[[], object]], float],
                    calls: int = 1) -> float:
    """Time (ms, as `timer` reports it) of one call of `fn` replayed from a CUDA graph that
    captured it `calls` times: the kernels alone, as the engine's graphs run them (timing a
    ~10 µs launch from Python measures the host instead). Warmed up on a side stream first."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timer(graph.replay) / calls


def sync_calls(fn: Callable[[], object]) -> list[dict[str, Any]]:
    """Run `fn` under `torch.cuda.set_sync_debug_mode(1)`; → each synchronizing CUDA call it
    made: the warning and the engine frames that led to it (the innermost six)."""
    import torch

    syncs: list[dict[str, Any]] = []

    def record(message: Any, category: Any, filename: str, lineno: int,
               file: Any = None, line: Any = None) -> None:
        stack = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename]
        syncs.append({"message": str(message)[:120], "stack": stack[-6:]})

    old_show = warnings.showwarning
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old_show
    return syncs


def profile_text(prof: cProfile.Profile, sort: str, rows: int) -> str:
    """The `rows` top functions of a profile, sorted by `sort`, as pstats prints them."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(rows)
    return buf.getvalue()
