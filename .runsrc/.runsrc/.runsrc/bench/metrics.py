"""Serving metrics computed from per-request records, defined as `vllm bench serve` defines them.

Definitions (all latencies per successful request, in seconds internally, reported in ms):
- TTFT  = first_token_time - start_time
- E2EL  = end_time - start_time
- TPOT  = (E2EL - TTFT) / (output_len - 1), only for output_len > 1 (for goodput a request
  with output_len <= 1 counts as TPOT 0, as vLLM does)
- ITL   = gaps between consecutive token (or streamed chunk) arrivals, pooled over requests
- throughput = completed requests / output tokens / input+output tokens per second of the
  benchmark duration (wall time of the whole run, not the sum of request times)
- goodput = requests meeting every given SLO (value <= SLO) per second of the duration
Statistics: mean, median, population std and linear-interpolated percentiles (numpy's
defaults); an empty sample reports 0, as vLLM does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES: tuple[float, ...] = (99.0,)


class MetricsError(ValueError):
    """A bad metrics input (record, SLO spec or percentile); the message names it."""


@dataclass(slots=True)
class RequestRecord:
    """What one request did, timed on one monotonic clock (time.perf_counter).

    `token_times` holds the arrival time of each token (offline) or each streamed chunk that
    carried text (online); `token_times[0]` is the first token's arrival.
    """

    prompt_len: int
    output_len: int
    start_time: float
    first_token_time: float | None
    token_times: list[float]
    end_time: float
    success: bool
    error: str = ""

    @property
    def ttft(self) -> float:
        if self.first_token_time is None:
            raise MetricsError("RequestRecord.first_token_time is None on a successful request")
        return self.first_token_time - self.start_time

    @property
    def e2el(self) -> float:
        return self.end_time - self.start_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when output_len <= 1."""
        if self.output_len <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """One latency metric summarised in milliseconds; `percentiles_ms` keys look like "p99"."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_seconds(cls, values: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
        # vLLM reports 0 for an empty sample (e.g. TPOT when every output has one token).
        arr = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
        return cls(
            mean_ms=float(np.mean(arr)),
            median_ms=float(np.median(arr)),
            std_ms=float(np.std(arr)),
            percentiles_ms={percentile_key(p): float(np.percentile(arr, p)) for p in percentiles},
        )


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """The `vllm bench serve` summary of one run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float       # completed requests / s
    output_throughput: float        # output tokens / s
    total_token_throughput: float   # (input + output) tokens / s
    request_goodput: float | None   # requests meeting all SLOs / s; None without SLOs
    goodput_slos_ms: dict[str, float]
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    errors: list[str] = field(default_factory=list)  # first few failure messages

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile_key(p: float) -> str:
    """99 → "p99", 99.9 → "p99.9" (the key used in dicts and JSON)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def parse_percentiles(spec: str) -> tuple[float, ...]:
    """Parse "50,90,99" (vLLM's --metric-percentiles) into floats in (0, 100]."""
    try:
        values = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError as e:
        raise MetricsError(f"--metric-percentiles: {spec!r} is not a comma list of numbers") from e
    if not values or any(not 0.0 < v <= 100.0 for v in values):
        raise MetricsError(f"--metric-percentiles: each value must be in (0, 100], got {spec!r}")
    return values


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """Parse ["ttft:200", "tpot:50", "e2el:1000"] (milliseconds) into {"ttft": 200.0, ...}."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise MetricsError(
                f"--goodput: {spec!r} must look like NAME:MS with NAME one of "
                f"{', '.join(GOODPUT_METRICS)}"
            )
        try:
            ms = float(value)
        except ValueError as e:
            raise MetricsError(f"--goodput: {spec!r}: {value!r} is not a number of ms") from e
        if ms < 0:
            raise MetricsError(f"--goodput: {spec!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def _is_good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Summarise a run; `duration_s` is the wall time from the first send to the last finish."""
    if duration_s <= 0:
        raise MetricsError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    slos = dict(goodput_slos_ms or {})
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=(sum(_is_good(r, slos) for r in ok) / duration_s) if slos else None,
        goodput_slos_ms=slos,
        ttft=LatencyStats.from_seconds([r.ttft for r in ok], percentiles),
        tpot=LatencyStats.from_seconds(tpots, percentiles),
        itl=LatencyStats.from_seconds([g for r in ok for g in r.itls], percentiles),
        e2el=LatencyStats.from_seconds([r.e2el for r in ok], percentiles),
        errors=[r.error for r in records if not r.success][:10],
    )


_SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def format_summary(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The vLLM-style text table."""
    rows = [f"{f' {title} ':=^50}"]

    def row(label: str, value: float | int) -> None:
        rows.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else
                    f"{label:<40}{value:<10}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total Token throughput (tok/s):", m.total_token_throughput)
    for attr, heading, short in _SECTIONS:
        stats: LatencyStats = getattr(m, attr)
        rows.append(f"{heading:-^50}")
        row(f"Mean {short} (ms):", stats.mean_ms)
        row(f"Median {short} (ms):", stats.median_ms)
        for key, value in stats.percentiles_ms.items():
            row(f"{key.upper()} {short} (ms):", value)
    rows.append("=" * 50)
    return "\n".join(rows)
