"""A run's result under `vllm bench serve`'s JSON field names, so tools that read vLLM's result
files read ours: `duration`, `completed`, `mean_ttft_ms`, `p99_itl_ms`, ...,
`max_output_tokens_per_s`, `max_concurrent_requests`, and the per-request lists `input_lens`,
`output_lens`, `ttfts` (seconds), `itls` (seconds, one list per request) and `errors`."""

from __future__ import annotations

import math
from typing import Any

from bench.metrics import BenchmarkMetrics, LatencyStats, RequestRecord

_METRICS = ("ttft", "tpot", "itl", "e2el")


def max_output_tokens_per_s(records: list[RequestRecord]) -> float:
    """The most tokens that arrived within one second of the run (vLLM's peak output rate): each
    streamed chunk counts its request's share of tokens (output tokens over chunks)."""
    ok = [r for r in records if r.success and r.token_times]
    if not ok:
        return 0.0
    start = min(r.start_time for r in ok)
    buckets: dict[int, float] = {}
    for r in ok:
        per_chunk = r.output_len / len(r.token_times)
        for t in r.token_times:
            second = math.floor(t - start)
            buckets[second] = buckets.get(second, 0.0) + per_chunk
    return max(buckets.values())


def max_concurrent_requests(records: list[RequestRecord]) -> int:
    """The most requests in flight at once (from each one's start to its end)."""
    events = sorted([(r.start_time, 1) for r in records] + [(r.end_time, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def vllm_serve_result(metrics: BenchmarkMetrics, records: list[RequestRecord]
                      ) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": max_output_tokens_per_s(records),
        "max_concurrent_requests": max_concurrent_requests(records),
    }
    for name in _METRICS:
        stats: LatencyStats = getattr(metrics, name)
        doc[f"mean_{name}_ms"] = stats.mean_ms
        doc[f"median_{name}_ms"] = stats.median_ms
        doc[f"std_{name}_ms"] = stats.std_ms
        for key, value in stats.percentiles_ms.items():
            doc[f"{key}_{name}_ms"] = value
    doc["input_lens"] = [r.prompt_len for r in records]
    doc["output_lens"] = [r.output_len if r.success else 0 for r in records]
    doc["ttfts"] = [r.ttft if r.success and r.first_token_time is not None else 0.0
                    for r in records]
    doc["itls"] = [r.itls if r.success else [] for r in records]
    doc["errors"] = [r.error for r in records]
    return doc
